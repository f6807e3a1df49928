//! Fused SwiGLU gating `silu(gate) * up` with its backward.

use candle_core::{Shape, Tensor};
use rayon::prelude::*;

use super::{data, par_zeros, split_like, Grads, Input, Kernel, Op, Out, Real};
use crate::Result;

/// `silu(gate) * up`, elementwise.
struct SwiGlu;

/// `e^-g` for every element of `g`, into `out`.
#[inline]
fn exp_neg<T: Real>(g: &[T], out: &mut [T]) {
    for (o, &g) in out.iter_mut().zip(g) {
        *o = -g;
    }
    T::exp_in_place(out);
}

impl Kernel<2> for SwiGlu {
    const NAME: &'static str = "fused-swiglu";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        let [g, u] = data::<T, 2>(&ins)?;
        let mut y = par_zeros::<T>(g.len());
        y.par_chunks_mut(32 * 1024).zip(g.par_chunks(32 * 1024).zip(u.par_chunks(32 * 1024))).for_each(
            |(y, (g, u))| {
                exp_neg(g, y);
                for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                    *y = g * (T::from_f64(1.0) / (T::from_f64(1.0) + *y)) * u;
                }
            },
        );
        Ok((y, ins[0].layout.shape().clone()))
    }

    fn bwd(&self, [g, u]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Grads<2> {
        split_like(&g.apply_op3_no_bwd(u, &dy.contiguous()?, &Op(SwiGluBwd))?, [g, u])
    }
}

/// Backward of [`SwiGlu`]: `[dgate | dup]` with `dgate = dy u s (1 + g (1 - s))`,
/// `dup = dy g s`, `s = sigmoid(g)`.
struct SwiGluBwd;

impl Kernel<3> for SwiGluBwd {
    const NAME: &'static str = "fused-swiglu-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let [g, u, dy] = data::<T, 3>(&ins)?;
        let n = g.len();
        let mut out = par_zeros::<T>(2 * n);
        let (dg, du) = out.split_at_mut(n);
        let c = 32 * 1024;
        dg.par_chunks_mut(c).zip(du.par_chunks_mut(c)).enumerate().for_each(|(i, (dg, du))| {
            let base = i * c;
            exp_neg(&g[base..base + dg.len()], dg);
            for j in 0..dg.len() {
                let (gv, uv, d) = (g[base + j], u[base + j], dy[base + j]);
                let s = T::from_f64(1.0) / (T::from_f64(1.0) + dg[j]);
                dg[j] = d * uv * s * (T::from_f64(1.0) + gv * (T::from_f64(1.0) - s));
                du[j] = d * gv * s;
            }
        });
        Ok((out, Shape::from(2 * n)))
    }
}

/// Fused `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, Op(SwiGlu))?)
}

/// The backward of [`swiglu`] without a graph: `(dgate, dup)` from the
/// inputs and the output's gradient `dy`.
pub fn swiglu_bwd(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, u) = (gate.contiguous()?, up.contiguous()?);
    let [dg, du] = SwiGlu.bwd([&g, &u], dy, dy)?;
    Ok((dg.expect("split_like gives every gradient"), du.expect("split_like gives every gradient")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use candle_core::DType;

    #[test]
    fn swiglu_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let g = randn(&[4, 6, 10], dtype, 9);
            let u = randn(&[4, 6, 10], dtype, 10);
            check(
                &[&g, &u],
                &|| swiglu(&g.as_tensor().affine(4.0, 0.0).unwrap(), u.as_tensor()).unwrap(),
                &|| (g.as_tensor().affine(4.0, 0.0).unwrap().silu().unwrap() * u.as_tensor()).unwrap(),
                tol(dtype),
                "swiglu",
            );
        }
    }
}
