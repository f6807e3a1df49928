//! The vocabulary head in tiles: hidden states and the head weight in, per-position
//! log-prob of the target, entropy and collision probability out, with no
//! `(N, V)` logits tensor in the forward or the backward pass.
//!
//! The forward computes the logits of a few rows at a time (whole rows, for the
//! log-sum-exp), reduces each row to `[logp, H, sum p^2, lse]` and drops them.
//! The backward recomputes the logits tile by tile (rows × a block of the
//! vocabulary: the row statistics are known from the forward, so a tile needs
//! no other column), turns each tile into the gradient of the logits in place
//! and feeds it to two products: `dh += g w_b` and `dw_b += g^T h`. This is the
//! scheme of Liger-Kernel's fused linear cross-entropy and verl's
//! `entropy_from_logits_with_chunking`, extended to the entropy and Σp².

use candle_core::{bail, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::head::row_stats;
use super::{
    all_threads, data, mm_par, par_zeros, split_like, with_host, zero, Grads, Input, Kernel, Op, Out, Real,
};
use crate::Result;

/// Columns of the op's output per position.
pub const STATS: usize = 4;

/// How the work is cut: rows per forward chunk (whole vocabulary rows), and
/// rows × vocabulary columns per backward tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiles {
    /// Rows per forward chunk.
    pub fwd_rows: usize,
    /// Rows per backward tile.
    pub bwd_rows: usize,
    /// Vocabulary columns per backward tile.
    pub bwd_cols: usize,
}

impl Tiles {
    /// Tiles of about `elems` logits each for `n` rows over a vocabulary of `v`.
    pub fn for_budget(n: usize, v: usize, elems: usize) -> Self {
        let bwd_cols = v.clamp(1, 4096);
        Self {
            fwd_rows: (elems / v.max(1)).clamp(1, n.max(1)),
            bwd_rows: (elems / bwd_cols).clamp(1, n.max(1)),
            bwd_cols,
        }
    }
}

/// `(h (N, H), w (V, H))` -> `(N, 4)`: `[log p_t, H, sum_j p_j^2, lse]` per row,
/// with the targets `t` (u32, N) held by the op as a constant.
struct VocabStats {
    targets: Tensor,
    tiles: Tiles,
}

/// Checks shapes and targets; returns `(n, hidden, vocab)`.
fn dims(l1: &Layout, l2: &Layout, targets: &[u32]) -> candle_core::Result<(usize, usize, usize)> {
    let (n, hd) = l1.shape().dims2()?;
    let (v, hd2) = l2.shape().dims2()?;
    if hd != hd2 {
        bail!("vocabulary head: hidden states of width {hd}, head weight of width {hd2}")
    }
    if targets.len() != n {
        bail!("vocabulary head: {} targets for {n} positions", targets.len())
    }
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= v) {
        bail!("vocabulary head: target {t} outside a vocabulary of {v}")
    }
    Ok((n, hd, v))
}

impl Kernel<2> for VocabStats {
    const NAME: &'static str = "fused-vocab-stats";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        with_host::<u32, _>(&self.targets, Self::NAME, |targets| {
            let (n, hd, v) = dims(ins[0].layout, ins[1].layout, targets)?;
            let [h, w] = data::<T, 2>(&ins)?;
            let mut out = par_zeros::<T>(STATS * n);
            let c = self.tiles.fwd_rows.clamp(1, n.max(1));
            let mut buf = vec![zero::<T>(); c * v];
            for r0 in (0..n).step_by(c) {
                let m = c.min(n - r0);
                // SAFETY: h rows r0..r0+m are m×hd contiguous, w is v×hd read as
                // its transpose, buf holds m×v; all owned here and disjoint.
                unsafe {
                    mm_par(
                        (m, v, hd),
                        buf.as_mut_ptr(),
                        v,
                        false,
                        h.as_ptr().add(r0 * hd),
                        (hd, 1),
                        w.as_ptr(),
                        (1, hd),
                        T::from_f64(1.0),
                        all_threads(),
                    );
                }
                out[STATS * r0..STATS * (r0 + m)]
                    .par_chunks_mut(STATS)
                    .zip(buf[..m * v].par_chunks(v))
                    .zip(targets[r0..r0 + m].par_iter())
                    .for_each(|((o, row), &t)| {
                        let (lse, mean, coll) = row_stats(row);
                        o[0] = T::from_f64(row[t as usize].to_f64() - lse);
                        o[1] = T::from_f64(lse - mean);
                        o[2] = T::from_f64(coll);
                        o[3] = T::from_f64(lse);
                    });
            }
            Ok((out, Shape::from((n, STATS))))
        })
    }

    fn bwd(&self, [h, w]: [&Tensor; 2], res: &Tensor, dres: &Tensor) -> Grads<2> {
        // A frozen head (LoRA's base weight, detached) needs no (V, H) gradient.
        let need_dw = w.track_op();
        let op =
            VocabStatsBwd { targets: self.targets.clone(), res: res.clone(), tiles: self.tiles, need_dw };
        let flat = h.apply_op3_no_bwd(w, &dres.contiguous()?, &Op(op))?;
        if need_dw {
            split_like(&flat, [h, w])
        } else {
            let [dh] = split_like(&flat, [h])?;
            Ok([dh, None])
        }
    }
}

/// Backward of [`VocabStats`] over `(h, w, dres)`: returns `[dh | dw]` flat
/// (`dh` alone without `need_dw`).
/// With `p = exp(x - lse)` and `C = sum p^2`, the gradient of the logits is
/// `dx_j = gl (1[j = t] - p_j) - ge p_j (x_j - lse + H) + 2 gc p_j (p_j - C)`.
struct VocabStatsBwd {
    targets: Tensor,
    res: Tensor,
    tiles: Tiles,
    need_dw: bool,
}

impl Kernel<3> for VocabStatsBwd {
    const NAME: &'static str = "fused-vocab-stats-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        with_host::<u32, _>(&self.targets, Self::NAME, |targets| {
            let (n, hd, v) = dims(ins[0].layout, ins[1].layout, targets)?;
            let [h, w, dres] = data::<T, 3>(&ins)?;
            let mut out = vec![zero::<T>(); n * hd + if self.need_dw { v * hd } else { 0 }];
            let (dh, dw) = out.split_at_mut(n * hd);
            let (rc, vc) = (self.tiles.bwd_rows.clamp(1, n.max(1)), self.tiles.bwd_cols.clamp(1, v));
            let mut buf = vec![zero::<T>(); rc * vc];
            let one = T::from_f64(1.0);
            with_host::<T, _>(&self.res, Self::NAME, |res| {
                for r0 in (0..n).step_by(rc) {
                    let m = rc.min(n - r0);
                    for c0 in (0..v).step_by(vc) {
                        let k = vc.min(v - c0);
                        let tile = &mut buf[..m * k];
                        // SAFETY: h rows r0..r0+m (m×hd), w rows c0..c0+k (k×hd)
                        // read as their transpose into the m×k tile; owned, disjoint.
                        unsafe {
                            mm_par(
                                (m, k, hd),
                                tile.as_mut_ptr(),
                                k,
                                false,
                                h.as_ptr().add(r0 * hd),
                                (hd, 1),
                                w.as_ptr().add(c0 * hd),
                                (1, hd),
                                one,
                                all_threads(),
                            );
                        }
                        tile.par_chunks_mut(k).enumerate().for_each(|(i, row)| {
                            let r = r0 + i;
                            let s = &res[STATS * r..STATS * (r + 1)];
                            let g = &dres[STATS * r..STATS * (r + 1)];
                            let (ent, coll, lse) = (s[1], s[2], s[3]);
                            let (gl, ge, gc) = (g[0], g[1], g[2] + g[2]);
                            let shift = ent - lse;
                            for x in row.iter_mut() {
                                let p = (*x - lse).exp();
                                *x = if p > zero() {
                                    gc * p * (p - coll) - p * (gl + ge * (*x + shift))
                                } else {
                                    zero()
                                };
                            }
                            let t = targets[r] as usize;
                            if (c0..c0 + k).contains(&t) {
                                row[t - c0] += gl;
                            }
                        });
                        // SAFETY: the tile is m×k, w block k×hd, dh rows m×hd,
                        // dw rows k×hd, h rows m×hd: in bounds and disjoint.
                        unsafe {
                            // dh[r0..] += g · w[c0..]
                            mm_par(
                                (m, hd, k),
                                dh.as_mut_ptr().add(r0 * hd),
                                hd,
                                true,
                                tile.as_ptr(),
                                (k, 1),
                                w.as_ptr().add(c0 * hd),
                                (hd, 1),
                                one,
                                all_threads(),
                            );
                            if !self.need_dw {
                                continue;
                            }
                            // dw[c0..] += g^T · h[r0..]
                            mm_par(
                                (k, hd, m),
                                dw.as_mut_ptr().add(c0 * hd),
                                hd,
                                true,
                                tile.as_ptr(),
                                (1, k),
                                h.as_ptr().add(r0 * hd),
                                (hd, 1),
                                one,
                                all_threads(),
                            );
                        }
                    }
                }
                Ok(())
            })?;
            let len = out.len();
            Ok((out, Shape::from(len)))
        })
    }
}

/// `(N, 4)` statistics `[log p_t, H, sum p^2, lse]` of the distributions
/// `softmax(h w^T)` for hidden states `h (N, H)` and head weight `w (V, H)`,
/// f32/f64 CPU tensors, with a backward into both; `targets` is `(N)`.
pub fn vocab_stats(h: &Tensor, w: &Tensor, targets: &Tensor, tiles: Tiles) -> Result<Tensor> {
    let t = targets.flatten_all()?.to_dtype(candle_core::DType::U32)?.contiguous()?.detach();
    Ok(h.contiguous()?.apply_op2(&w.contiguous()?, Op(VocabStats { targets: t, tiles }))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::{DType, Device};

    /// The composed path: full logits, log_softmax, gather, entropy, sum p^2.
    fn composed(h: &Tensor, w: &Tensor, t: &Tensor) -> Tensor {
        let logits = h.broadcast_matmul(&w.t().unwrap()).unwrap();
        let (lp, ent) = ops::logprob_entropy_composed(&logits, t).unwrap();
        let coll = ops::softmax(&logits).unwrap().sqr().unwrap().sum(1).unwrap();
        Tensor::stack(&[lp, ent, coll], 1).unwrap()
    }

    #[test]
    fn matches_composed_on_values_and_gradients() {
        let (n, hd, v) = (13, 8, 50);
        let t =
            Tensor::from_vec((0..n as u32).map(|i| (i * 7) % v as u32).collect(), n, &Device::Cpu).unwrap();
        for dtype in [DType::F64, DType::F32] {
            let h = randn(&[n, hd], dtype, 21);
            let w = randn(&[v, hd], dtype, 22);
            let scaled = || h.as_tensor().affine(3.0, 0.0).unwrap();
            // Ragged tiles (13 rows in 4s and 5s, 50 columns in 16s) and one tile for all.
            for tiles in [
                Tiles { fwd_rows: 4, bwd_rows: 5, bwd_cols: 16 },
                Tiles { fwd_rows: 100, bwd_rows: 100, bwd_cols: 100 },
                Tiles::for_budget(n, v, 64),
            ] {
                check(
                    &[&h, &w],
                    &|| vocab_stats(&scaled(), w.as_tensor(), &t, tiles).unwrap().narrow(1, 0, 3).unwrap(),
                    &|| composed(&scaled(), w.as_tensor(), &t),
                    tol(dtype),
                    "vocab_stats",
                );
            }
        }
    }

    #[test]
    fn bad_target_and_width_are_errors() {
        let h = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap();
        let tiles = Tiles::for_budget(2, 5, 1 << 20);
        let t = Tensor::from_vec(vec![1u32, 5], 2, &Device::Cpu).unwrap();
        let err = vocab_stats(&h, &w, &t, tiles).unwrap_err().to_string();
        assert!(err.contains("target 5 outside a vocabulary of 5"), "{err}");
        let w3 = Tensor::zeros((5, 3), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![1u32, 2], 2, &Device::Cpu).unwrap();
        let err = vocab_stats(&h, &w3, &t, tiles).unwrap_err().to_string();
        assert!(err.contains("width 4") && err.contains("width 3"), "{err}");
    }
}
