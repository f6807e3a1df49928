//! Fused RMSNorm over the last dimension with its backward.

use candle_core::{bail, Shape, Tensor};
use rayon::prelude::*;

use super::{data, par_zeros, rows_per_task, split_like, Grads, Host, Input, Kernel, Op, Out, Real};
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
        let mut y = par_zeros::<T>(x.len());
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
        split_like(
            &x.apply_op3_no_bwd(w, &dy.contiguous()?, &Op(RmsNormBwd { eps: self.eps, res: None }))?,
            [x, w],
        )
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
    /// Added to `dx` in the same pass when given (a residual's gradient), shaped as `x`.
    res: Option<Tensor>,
}

impl Kernel<3> for RmsNormBwd {
    const NAME: &'static str = "fused-rms-norm-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let [x, w, dy] = data::<T, 3>(&ins)?;
        let n = w.len();
        let eps = T::from_f64(self.eps);
        let res = self.res.as_ref().map(|r| Host::of(r, Self::NAME)).transpose()?;
        let res = res.as_ref().map(|h| h.input().data::<T>()).transpose()?;
        if res.is_some_and(|r| r.len() != x.len()) || dy.len() != x.len() {
            bail!("{}: x, dy and the residual's gradient differ in size", Self::NAME)
        }
        let mut out = par_zeros::<T>(x.len() + n);
        let chunk = rows_per_task(n) * n;
        let dw = out[..x.len()]
            .par_chunks_mut(chunk)
            .enumerate()
            .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
            .map(|((ci, dxc), (xc, dyc))| {
                let mut dw = vec![0f64; n];
                let resc = res.map(|r| &r[ci * chunk..ci * chunk + dxc.len()]);
                for (ri, ((dxr, xr), dyr)) in
                    dxc.chunks_exact_mut(n).zip(xc.chunks_exact(n)).zip(dyc.chunks_exact(n)).enumerate()
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
                    if let Some(rc) = resc {
                        for (d, &g) in dxr.iter_mut().zip(&rc[ri * n..(ri + 1) * n]) {
                            *d += g;
                        }
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

/// [`rms_norm_bwd`] with `res` (shaped as `x`) added to `dx` in the same
/// pass: the gradient of a residual stream `x + f(rms_norm(x))` from the
/// stream's gradient `res` and `f`'s input gradient `dy`.
pub fn rms_norm_bwd_add(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    dy: &Tensor,
    res: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let op = RmsNormBwd { eps, res: Some(res.contiguous()?) };
    let [dx, dw] = split_like(&x.apply_op3_no_bwd(&w, &dy.contiguous()?, &Op(op))?, [&x, &w])?;
    Ok((dx.expect("split_like gives every gradient"), dw.expect("split_like gives every gradient")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::DType;

    /// The residual's gradient added inside the backward equals the plain
    /// backward plus the residual, over rows that span several tasks.
    #[test]
    fn rms_norm_backward_adds_the_residual() {
        for dtype in [DType::F64, DType::F32] {
            let n = 48;
            let rows = 2 * rows_per_task(n) + 3;
            let x = randn(&[rows, n], dtype, 3);
            let w = randn(&[n], dtype, 4);
            let dy = randn(&[rows, n], dtype, 5);
            let res = randn(&[rows, n], dtype, 6);
            let (x, w, dy, res) = (x.as_tensor(), w.as_tensor(), dy.as_tensor(), res.as_tensor());
            let (dx, dw) = rms_norm_bwd(x, w, 1e-6, dy).unwrap();
            let (dxa, dwa) = rms_norm_bwd_add(x, w, 1e-6, dy, res).unwrap();
            assert!(rel_err(&dxa, &(dx + res).unwrap()) < tol(dtype), "{dtype:?} dx");
            assert_eq!(rel_err(&dwa, &dw), 0.0, "{dtype:?} dw");
        }
    }

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
