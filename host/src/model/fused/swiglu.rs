//! Fused SwiGLU gating `silu(gate) * up` with its backward.

use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::{slice, zero, Real};
use crate::Result;

/// `silu(gate) * up`, elementwise.
struct SwiGlu;

#[inline]
fn sigmoid<T: Real>(x: T) -> T {
    T::from_f64(1.0) / (T::from_f64(1.0) + (-x).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu", |T| {
            let g = slice::<T>(s1, l1, "swiglu")?;
            let u = slice::<T>(s2, l2, "swiglu")?;
            let mut y = vec![zero::<T>(); g.len()];
            y.par_chunks_mut(32 * 1024).zip(g.par_chunks(32 * 1024).zip(u.par_chunks(32 * 1024))).for_each(
                |(y, (g, u))| {
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = g * sigmoid(g) * u;
                    }
                },
            );
            Ok((T::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &SwiGluBwd)?;
        let n = g.elem_count();
        Ok((Some(both.narrow(0, 0, n)?.reshape(g.shape())?), Some(both.narrow(0, n, n)?.reshape(u.shape())?)))
    }
}

/// Backward of [`SwiGlu`]: `[dgate | dup]` with `dgate = dy u s (1 + g (1 - s))`,
/// `dup = dy g s`, `s = sigmoid(g)`.
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "fused-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu", |T| {
            let g = slice::<T>(s1, l1, "swiglu")?;
            let u = slice::<T>(s2, l2, "swiglu")?;
            let dy = slice::<T>(s3, l3, "swiglu")?;
            let n = g.len();
            let mut out = vec![zero::<T>(); 2 * n];
            let (dg, du) = out.split_at_mut(n);
            let c = 32 * 1024;
            dg.par_chunks_mut(c).zip(du.par_chunks_mut(c)).enumerate().for_each(|(i, (dg, du))| {
                let base = i * c;
                for j in 0..dg.len() {
                    let (gv, uv, d) = (g[base + j], u[base + j], dy[base + j]);
                    let s = sigmoid(gv);
                    dg[j] = d * uv * s * (T::from_f64(1.0) + gv * (T::from_f64(1.0) - s));
                    du[j] = d * gv * s;
                }
            });
            Ok((T::to_cpu_storage_owned(out), Shape::from(2 * n)))
        })
    }
}

/// Fused `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)?)
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
