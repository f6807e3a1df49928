//! Fused RMSNorm over the last dimension with its backward.

use candle_core::{Shape, Tensor};
use rayon::prelude::*;

use super::{data, rows_per_task, split_like, zero, Grads, Input, Kernel, Op, Out, Real};
use crate::Result;

/// `y = w * x / sqrt(mean(x^2) + eps)` over the last dimension of a contiguous `x`.
struct RmsNorm {
    eps: f64,
}

impl Kernel<2> for RmsNorm {
    const NAME: &'static str = "fused-rms-norm";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        let [x, w] = data::<T, 2>(&ins)?;
        let n = w.len();
        let eps = T::from_f64(self.eps);
        let mut y = vec![zero::<T>(); x.len()];
        let chunk = rows_per_task(n) * n;
        y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(yc, xc)| {
            for (yr, xr) in yc.chunks_exact_mut(n).zip(xc.chunks_exact(n)) {
                let r = inv_rms(xr, eps);
                for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                    *y = w * (x * r);
                }
            }
        });
        Ok((y, ins[0].layout.shape().clone()))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Grads<2> {
        split_like(&x.apply_op3_no_bwd(w, &dy.contiguous()?, &Op(RmsNormBwd { eps: self.eps }))?, [x, w])
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64.
#[inline]
pub(super) fn inv_rms<T: Real>(x: &[T], eps: T) -> T {
    let ss: f64 = x.iter().map(|&v| v.to_f64() * v.to_f64()).sum();
    T::from_f64(1.0) / (T::from_f64(ss / x.len() as f64) + eps).sqrt()
}

/// Backward of [`RmsNorm`] over `(x, w, dy)`: `[dx | dw]`, flat.
/// With `r = 1/rms(x)` and `g = w * dy`: `dx = r g - x r^3 sum(g x) / n`,
/// `dw = sum_rows(dy * x * r)`.
struct RmsNormBwd {
    eps: f64,
}

impl Kernel<3> for RmsNormBwd {
    const NAME: &'static str = "fused-rms-norm-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let [x, w, dy] = data::<T, 3>(&ins)?;
        let n = w.len();
        let eps = T::from_f64(self.eps);
        let mut out = vec![zero::<T>(); x.len() + n];
        let chunk = rows_per_task(n) * n;
        let dw = out[..x.len()]
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
            .map(|(dxc, (xc, dyc))| {
                let mut dw = vec![0f64; n];
                for ((dxr, xr), dyr) in
                    dxc.chunks_exact_mut(n).zip(xc.chunks_exact(n)).zip(dyc.chunks_exact(n))
                {
                    let r = inv_rms(xr, eps);
                    let mut dot = 0f64;
                    for i in 0..n {
                        dot += (w[i] * dyr[i]).to_f64() * xr[i].to_f64();
                        dw[i] += (dyr[i] * xr[i] * r).to_f64();
                    }
                    let c = T::from_f64(dot / n as f64) * r * r * r;
                    for i in 0..n {
                        dxr[i] = r * w[i] * dyr[i] - xr[i] * c;
                    }
                }
                dw
            })
            .reduce(
                || vec![0f64; n],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        for (o, v) in out[x.len()..].iter_mut().zip(dw) {
            *o = T::from_f64(v);
        }
        let len = out.len();
        Ok((out, Shape::from(len)))
    }
}

/// Fused RMSNorm over the last dimension (see [`crate::model::ops::rms_norm`]).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(RmsNorm { eps }))?)
}

/// The backward of [`rms_norm`] without a graph: `(dx, dw)` from `x`, `w` and
/// the output's gradient `dy`.
pub fn rms_norm_bwd(x: &Tensor, w: &Tensor, eps: f64, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let [dx, dw] = RmsNorm { eps }.bwd([&x, &w], dy, dy)?;
    Ok((dx.expect("split_like gives every gradient"), dw.expect("split_like gives every gradient")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::DType;

    #[test]
    fn rms_norm_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let x = randn(&[3, 5, 16], dtype, 1);
            let w = randn(&[16], dtype, 2);
            check(
                &[&x, &w],
                &|| rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap(),
                &|| ops::rms_norm_composed(x.as_tensor(), w.as_tensor(), 1e-6).unwrap(),
                tol(dtype),
                "rms_norm",
            );
        }
    }
}
