//! Fused q/k preparation: per-head RMSNorm, rotary embedding and the
//! `(B, L, H, D) -> (B, H, L, D)` transpose in one pass, with its backward.

use candle_core::{Shape, Tensor, D};
use rayon::prelude::*;

use super::norm::inv_rms;
use super::{data, par_zeros, split_like, with_host, zero, Grads, Input, Kernel, Op, Out, Real};
use crate::Result;

/// q/k preparation in one pass: per-head RMSNorm over D with weight `w`, then
/// rotate-half rotary embedding, written in `(B, H, L, D)` order. `cs` holds
/// `[cos | sin]` per position, `(B, L, D)`; it is a constant (no gradient).
struct NormRope {
    eps: f64,
    cs: Tensor,
    dims: (usize, usize, usize, usize),
}

/// Rotates `v` by the angles of `cs = [cos | sin]`: `[a c - b s, b c + a s]`,
/// or by the negative angles when `inverse` (the transpose of the rotation).
#[inline]
fn rotate<T: Real>(v: &[T], cs: &[T], out: &mut [T], inverse: bool) {
    let h = v.len() / 2;
    let (c, s) = cs.split_at(h);
    for j in 0..h {
        let (a, b) = (v[j], v[j + h]);
        let sj = if inverse { -s[j] } else { s[j] };
        out[j] = a * c[j] - b * sj;
        out[j + h] = b * c[j] + a * sj;
    }
}

impl Kernel<2> for NormRope {
    const NAME: &'static str = "fused-norm-rope";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        let (b, l, nh, d) = self.dims;
        let [x, w] = data::<T, 2>(&ins)?;
        let eps = T::from_f64(self.eps);
        let mut y = par_zeros::<T>(x.len());
        with_host::<T, _>(&self.cs, Self::NAME, |cs| {
            // One task per (b, h): output rows (b, h, 0..L) are contiguous.
            y.par_chunks_mut(l * d).enumerate().for_each(|(bh, yc)| {
                let (bi, hi) = (bh / nh, bh % nh);
                let mut tmp = vec![zero::<T>(); d];
                for (li, yr) in yc.chunks_exact_mut(d).enumerate() {
                    let xr = &x[((bi * l + li) * nh + hi) * d..][..d];
                    let r = inv_rms(xr, eps);
                    for j in 0..d {
                        tmp[j] = w[j] * (xr[j] * r);
                    }
                    rotate(&tmp, &cs[(bi * l + li) * d..][..d], yr, false);
                }
            });
            Ok(())
        })?;
        Ok((y, Shape::from((b, nh, l, d))))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Grads<2> {
        let op = NormRopeBwd { eps: self.eps, cs: self.cs.clone(), dims: self.dims };
        split_like(&x.apply_op3_no_bwd(w, &dy.contiguous()?, &Op(op))?, [x, w])
    }
}

/// Backward of [`NormRope`]: un-rotates the gradient, then RMSNorm's backward.
/// Returns a flat buffer: dx in `(B, L, H, D)` order, then dw.
struct NormRopeBwd {
    eps: f64,
    cs: Tensor,
    dims: (usize, usize, usize, usize),
}

impl Kernel<3> for NormRopeBwd {
    const NAME: &'static str = "fused-norm-rope-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let (_, l, nh, d) = self.dims;
        let [x, w, dy] = data::<T, 3>(&ins)?;
        let eps = T::from_f64(self.eps);
        let mut out = par_zeros::<T>(x.len() + d);
        let dw = with_host::<T, _>(&self.cs, Self::NAME, |cs| {
            // One task per (b, l): dx rows (b, l, 0..H) are contiguous.
            Ok(out[..x.len()]
                .par_chunks_mut(nh * d)
                .enumerate()
                .map(|(bl, dxc)| {
                    let (bi, li) = (bl / l, bl % l);
                    let csr = &cs[bl * d..][..d];
                    let mut dw = vec![0f64; d];
                    let mut g = vec![zero::<T>(); d];
                    for (hi, dxr) in dxc.chunks_exact_mut(d).enumerate() {
                        let xr = &x[bl * nh * d + hi * d..][..d];
                        let dyr = &dy[((bi * nh + hi) * l + li) * d..][..d];
                        // Gradient w.r.t. the normed, weighted vector.
                        rotate(dyr, csr, &mut g, true);
                        let r = inv_rms(xr, eps);
                        let mut dot = 0f64;
                        for j in 0..d {
                            dot += (w[j] * g[j]).to_f64() * xr[j].to_f64();
                            dw[j] += (g[j] * xr[j] * r).to_f64();
                        }
                        let c = T::from_f64(dot / d as f64) * r * r * r;
                        for j in 0..d {
                            dxr[j] = r * w[j] * g[j] - xr[j] * c;
                        }
                    }
                    dw
                })
                .reduce(
                    || vec![0f64; d],
                    |mut a, b| {
                        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                        a
                    },
                ))
        })?;
        for (o, v) in out[x.len()..].iter_mut().zip(dw) {
            *o = T::from_f64(v);
        }
        let len = out.len();
        Ok((out, Shape::from(len)))
    }
}

/// Per-head RMSNorm then rotary embedding, from `(B, L, H * D)` (heads side by
/// side, as the projection leaves them) to `(B, H, L, D)`; `cos`/`sin` are
/// `(B, 1, L, D/2)`, the rotary table (see [`crate::model::ops::norm_rope`]).
pub fn norm_rope(
    x: &Tensor,
    n_heads: usize,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    let op = NormRope::new(x, n_heads, w, (cos, sin), eps)?;
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(op))?)
}

/// The backward of [`norm_rope`] without a graph: `(dx, dw)`, `dx` shaped as
/// `x`, from the inputs and the output's gradient `dy` `(B, H, L, D)`.
pub fn norm_rope_bwd(
    x: &Tensor,
    n_heads: usize,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let op = NormRope::new(x, n_heads, w, (cos, sin), eps)?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let [dx, dw] = op.bwd([&x, &w], dy, dy)?;
    Ok((dx.expect("split_like gives every gradient"), dw.expect("split_like gives every gradient")))
}

impl NormRope {
    /// The op for `x` `(B, L, n_heads · D)`, checked against `w` and the tables.
    fn new(x: &Tensor, n_heads: usize, w: &Tensor, (cos, sin): (&Tensor, &Tensor), eps: f64) -> Result<Self> {
        let (b, l, hd) = x.dims3()?;
        let dims = (b, l, n_heads, hd / n_heads.max(1));
        if dims.2 * dims.3 != hd || w.elem_count() != dims.3 {
            return Err(crate::Error::invalid(format!(
                "norm_rope: x of shape {:?} does not split into {n_heads} heads of {}",
                x.dims(),
                w.elem_count()
            )));
        }
        let cs = Tensor::cat(&[cos, sin], D::Minus1)?.to_dtype(x.dtype())?.contiguous()?.detach();
        if cs.dims() != [dims.0, 1, dims.1, dims.3] {
            return Err(crate::Error::invalid(format!(
                "norm_rope: cos/sin of shape {:?} do not fit x of shape {:?}",
                cos.dims(),
                x.dims()
            )));
        }
        Ok(NormRope { eps, cs, dims })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::DType;

    #[test]
    fn norm_rope_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let (b, l, h, d) = (2, 5, 3, 8);
            let x = randn(&[b, l, h, d], dtype, 3);
            let w = randn(&[d], dtype, 4);
            let ang = randn(&[b, 1, l, d / 2], dtype, 5).as_tensor().affine(3.0, 0.0).unwrap();
            let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
            check(
                &[&x, &w],
                &|| {
                    norm_rope(
                        &x.as_tensor().reshape((b, l, h * d)).unwrap(),
                        h,
                        w.as_tensor(),
                        (&cos, &sin),
                        1e-6,
                    )
                    .unwrap()
                },
                &|| {
                    let n = ops::rms_norm_composed(x.as_tensor(), w.as_tensor(), 1e-6)
                        .unwrap()
                        .transpose(1, 2)
                        .unwrap();
                    ops::rope(&n, &cos, &sin).unwrap()
                },
                tol(dtype),
                "norm_rope",
            );
        }
    }
}
