//! Fused grouped-query attention with an additive mask. The backward follows
//! FlashAttention's (Dao et al., 2022): probabilities are recomputed from q and
//! k instead of being stored.

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{mm, slice, with_host, zero, Real, SendPtr};
use crate::Result;

/// Grouped-query attention with an additive mask (see [`super::ops::attention`]).
/// Inputs q `(B, Hq, L, D)` contiguous; k, v `(B, Hkv, S, D)` with unit stride
/// over D (any other strides, e.g. a narrowed KV cache or a transposed view).
/// `mask` is `(B, L, S)` contiguous, in the inputs' dtype, a constant.
struct Attention {
    mask: Tensor,
    scale: f64,
}

/// Element offsets of a `(B, H, S, D)` view with unit stride over D.
#[derive(Clone, Copy)]
struct View4 {
    start: usize,
    sb: usize,
    sh: usize,
    ss: usize,
}

impl View4 {
    fn of(l: &Layout) -> candle_core::Result<Self> {
        let st = l.stride();
        if st.len() != 4 || (st[3] != 1 && l.dims()[3] > 1) {
            bail!("fused attention: k/v need 4 dims with unit stride over D, found strides {st:?}")
        }
        Ok(Self { start: l.start_offset(), sb: st[0], sh: st[1], ss: st[2] })
    }

    fn at(&self, b: usize, h: usize) -> usize {
        self.start + b * self.sb + h * self.sh
    }
}

/// Scaled, masked scores of one query head then softmax in place: `p (L×S)`.
///
/// # Safety
/// `q` must address `L×D` contiguous elements, `k` an `S×D` matrix with row stride `ss`.
#[allow(clippy::too_many_arguments)]
unsafe fn probs<T: Real>(
    p: &mut [T],
    q: *const T,
    k: *const T,
    ss: usize,
    mask: &[T],
    (l, s, d): (usize, usize, usize),
    scale: T,
) {
    mm((l, s, d), p.as_mut_ptr(), s, false, q, (d, 1), k, (1, ss), scale);
    for (row, mrow) in p.chunks_exact_mut(s).zip(mask.chunks_exact(s)) {
        let mut mx = T::from_f64(f64::NEG_INFINITY);
        for (v, &m) in row.iter_mut().zip(mrow) {
            *v += m;
            mx = mx.fmax(*v);
        }
        let mut sum = zero::<T>();
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        let inv = T::from_f64(1.0) / sum;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
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
        let (b, nq, l, d) = l1.shape().dims4()?;
        let (nkv, s) = (l2.dims()[1], l2.dims()[2]);
        let g = nq / nkv;
        let (kv, vv) = (View4::of(l2)?, View4::of(l3)?);
        by_dtype!(s1, "attention", |T| {
            let q = slice::<T>(s1, l1, "attention")?;
            let (k, v) = (s2.as_slice::<T>()?, s3.as_slice::<T>()?);
            let scale = T::from_f64(self.scale);
            let mut out = vec![zero::<T>(); b * l * nq * d];
            let optr = SendPtr(out.as_mut_ptr());
            with_host::<T, _>(&self.mask, "attention", |mask| {
                (0..b * nq).into_par_iter().for_each(|bh| {
                    let (bi, hi) = (bh / nq, bh % nq);
                    let hk = hi / g;
                    let mut p = vec![zero::<T>(); l * s];
                    let o = optr;
                    // SAFETY: q/k/v offsets stay inside their storages (shapes and
                    // strides come from their layouts). Task (b, h) writes only the
                    // D columns of head h in rows (b, 0..L) of `out`, disjoint from
                    // every other task; `out` outlives the loop.
                    unsafe {
                        probs(
                            &mut p,
                            q.as_ptr().add(bh * l * d),
                            k.as_ptr().add(kv.at(bi, hk)),
                            kv.ss,
                            &mask[bi * l * s..][..l * s],
                            (l, s, d),
                            scale,
                        );
                        let dst = o.0.add(bi * l * nq * d + hi * d);
                        mm(
                            (l, d, s),
                            dst,
                            nq * d,
                            false,
                            p.as_ptr(),
                            (s, 1),
                            v.as_ptr().add(vv.at(bi, hk)),
                            (vv.ss, 1),
                            T::from_f64(1.0),
                        );
                    }
                });
                Ok(())
            })?;
            Ok((T::to_cpu_storage_owned(out), Shape::from((b, l, nq * d))))
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _ctx: &Tensor,
        dctx: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = AttentionBwd { mask: self.mask.clone(), scale: self.scale, k: k.clone(), v: v.clone() };
        let all = q.apply_op2_no_bwd(&dctx.contiguous()?, &op)?;
        let (nqe, nke) = (q.elem_count(), k.elem_count());
        let dq = all.narrow(0, 0, nqe)?.reshape(q.shape())?;
        let dk = all.narrow(0, nqe, nke)?.reshape(k.shape())?;
        let dv = all.narrow(0, nqe + nke, nke)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Backward of [`Attention`] over `(q, dctx)`, with k, v and the mask held by
/// the op. Returns a flat buffer `[dq | dk | dv]`, dk and dv contiguous
/// `(B, Hkv, S, D)`. One task per (batch, kv head), looping over its query
/// heads, so dk/dv accumulate without races.
struct AttentionBwd {
    mask: Tensor,
    scale: f64,
    k: Tensor,
    v: Tensor,
}

impl candle_core::CustomOp2 for AttentionBwd {
    fn name(&self) -> &'static str {
        "fused-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, nq, l, d) = l1.shape().dims4()?;
        let (_, nkv, s, _) = self.k.dims4()?;
        let g = nq / nkv;
        let (ks, kl) = self.k.storage_and_layout();
        let (vs, vl) = self.v.storage_and_layout();
        let (Storage::Cpu(ks), Storage::Cpu(vs)) = (&*ks, &*vs) else {
            bail!("fused attention: expected CPU k/v")
        };
        let (kv, vv) = (View4::of(kl)?, View4::of(vl)?);
        by_dtype!(s1, "attention", |T| {
            let q = slice::<T>(s1, l1, "attention")?;
            let dctx = slice::<T>(s2, l2, "attention")?;
            let (k, v) = (ks.as_slice::<T>()?, vs.as_slice::<T>()?);
            let scale = T::from_f64(self.scale);
            let (nqe, nke) = (q.len(), b * nkv * s * d);
            let mut out = vec![zero::<T>(); nqe + 2 * nke];
            let optr = SendPtr(out.as_mut_ptr());
            let one = T::from_f64(1.0);
            with_host::<T, _>(&self.mask, "attention", |mask| {
                (0..b * nkv).into_par_iter().for_each(|bk| {
                    let (bi, hk) = (bk / nkv, bk % nkv);
                    let o = optr;
                    let mut p = vec![zero::<T>(); l * s];
                    let mut dp = vec![zero::<T>(); l * s];
                    // SAFETY: reads stay inside q, dctx, k, v (shapes and strides
                    // from their layouts). Task (b, hk) writes dq of its g query
                    // heads and its own dk, dv blocks: disjoint from other tasks.
                    unsafe {
                        let kp = k.as_ptr().add(kv.at(bi, hk));
                        let vp = v.as_ptr().add(vv.at(bi, hk));
                        let dk = o.0.add(nqe + bk * s * d);
                        let dv = o.0.add(nqe + nke + bk * s * d);
                        for hi in hk * g..(hk + 1) * g {
                            let qp = q.as_ptr().add((bi * nq + hi) * l * d);
                            let dcp = dctx.as_ptr().add(bi * l * nq * d + hi * d);
                            probs(&mut p, qp, kp, kv.ss, &mask[bi * l * s..][..l * s], (l, s, d), scale);
                            // dv += p^T dctx
                            mm((s, d, l), dv, d, true, p.as_ptr(), (1, s), dcp, (nq * d, 1), one);
                            // dp = dctx v^T
                            mm((l, s, d), dp.as_mut_ptr(), s, false, dcp, (nq * d, 1), vp, (1, vv.ss), one);
                            // ds = p * (dp - rowsum(p * dp)) * scale, stored in dp.
                            for (pr, dr) in p.chunks_exact(s).zip(dp.chunks_exact_mut(s)) {
                                let dot = pr.iter().zip(dr.iter()).fold(zero::<T>(), |a, (&x, &y)| a + x * y);
                                for (&pv, dv) in pr.iter().zip(dr.iter_mut()) {
                                    *dv = pv * (*dv - dot) * scale;
                                }
                            }
                            // dq = ds k ; dk += ds^T q
                            mm(
                                (l, d, s),
                                o.0.add((bi * nq + hi) * l * d),
                                d,
                                false,
                                dp.as_ptr(),
                                (s, 1),
                                kp,
                                (kv.ss, 1),
                                one,
                            );
                            mm((s, d, l), dk, d, true, dp.as_ptr(), (1, s), qp, (d, 1), one);
                        }
                    }
                });
                Ok(())
            })?;
            let len = out.len();
            Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
        })
    }
}

/// Fused grouped-query attention (see [`super::ops::attention`]): q `(B, Hq, L, D)`,
/// k/v `(B, Hkv, S, D)`, additive mask broadcastable to `(B, 1, L, S)`.
/// Returns `(B, L, Hq * D)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (b, _, l, d) = q.dims4()?;
    let s = k.dim(2)?;
    let unit_d =
        |t: &Tensor| -> Result<Tensor> { Ok(if t.stride()[3] == 1 { t.clone() } else { t.contiguous()? }) };
    let mask =
        mask.broadcast_as((b, 1, l, s))?.to_dtype(q.dtype())?.contiguous()?.reshape((b, l, s))?.detach();
    let op = Attention { mask, scale: 1.0 / (d as f64).sqrt() };
    Ok(q.contiguous()?.apply_op3(&unit_d(k)?, &unit_d(v)?, op)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::{DType, Device, Var};

    #[test]
    fn attention_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let (b, nq, nkv, l, d) = (2, 4, 2, 5, 8);
            for (s, offset) in [(5, 0), (7, 2)] {
                let q = randn(&[b, nq, l, d], dtype, 6);
                let k = randn(&[b, nkv, s, d], dtype, 7);
                let v = randn(&[b, l, nkv, d], dtype, 8); // transposed view below
                let v_bhsd = |v: &Var| -> Tensor {
                    let v = v.as_tensor();
                    if s == l {
                        v.transpose(1, 2).unwrap()
                    } else {
                        Tensor::cat(&[v, &v.narrow(1, 0, s - l).unwrap()], 1)
                            .unwrap()
                            .transpose(1, 2)
                            .unwrap()
                    }
                };
                // Causal plus left padding of 2 keys in row 1 (a fully masked query too).
                let pad: Vec<f32> =
                    (0..b * s).map(|i| if i / s == 1 && i % s < 2 { ops::MASKED } else { 0.0 }).collect();
                let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
                let mask = ops::causal_bias(l, s, offset, &Device::Cpu)
                    .unwrap()
                    .broadcast_add(&pad)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                check(
                    &[&q, &k, &v],
                    &|| attention(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask).unwrap(),
                    &|| {
                        ops::attention_composed(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask, nkv)
                            .unwrap()
                    },
                    tol(dtype),
                    "attention",
                );
            }
        }
    }
}
