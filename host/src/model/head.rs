//! The vocabulary head's per-position statistics — log-prob of the target,
//! entropy, collision probability Σp² — from hidden states, without a
//! `(B, T, V)` logits tensor in the forward or the backward pass.
//!
//! At the paper's scale (151,936-token vocabulary, 8k-token answers) the
//! logits of one sequence and their gradient are 5 GB each in f32. verl
//! (`entropy_from_logits_with_chunking`), TRL/Liger (fused linear
//! cross-entropy) and OpenRLHF all compute these statistics over chunks of
//! positions instead; so does this module. On CPU in f32/f64 the fused op of
//! [`super::fused::vocab`] also recomputes each chunk in its backward, so
//! memory stays at one tile of logits. Every other device and dtype (CUDA,
//! bf16) takes [`token_stats_recomputed`]: the same tiles from composed candle
//! ops, run without a graph in the forward and rerun tile by tile with a graph
//! in the backward, which backpropagates the seed `(stats * upstream).sum()`
//! (the technique of [`super::recompute`]). [`token_stats_composed`], the
//! plain graph over chunks, is the reference both are tested against.

use candle_core::{CpuStorage, CudaStorage, CustomOp2, Layout, MetalStorage, Shape, Tensor, Var, D};

use super::precomputed::Held;
use super::{fused, ops};
use crate::{Error, Result};

/// Logits per tile: about 64 MB in f32 (420 positions of a 151,936-token
/// vocabulary in the forward, 4096 × 4096 tiles in the backward).
pub const TILE_ELEMS: usize = 16 << 20;

/// Per-position statistics of the model's next-token distribution `p`, each
/// shaped like the targets.
#[derive(Debug, Clone)]
pub struct TokenStats {
    /// `log p(target)`.
    pub logp: Tensor,
    /// Shannon entropy `-sum_j p_j log p_j` over the whole vocabulary.
    pub entropy: Tensor,
    /// Collision probability `sum_j p_j^2` (for gradient-norm diagnostics: the
    /// squared norm of a log-prob's gradient w.r.t. the logits is
    /// `1 - 2 p_t + sum p^2`).
    pub collision: Tensor,
}

/// Statistics of `softmax(hidden w^T)` at every position: `hidden` is
/// `(.., H)`, `w` the head weight `(V, H)`, `targets` (u32) shaped like
/// `hidden` without its last dimension. Differentiable w.r.t. `hidden` and `w`.
pub fn token_stats(hidden: &Tensor, w: &Tensor, targets: &Tensor) -> Result<TokenStats> {
    token_stats_tiled(hidden, w, targets, TILE_ELEMS)
}

/// [`token_stats`] with a chosen tile size (logits elements per tile).
pub fn token_stats_tiled(
    hidden: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    tile_elems: usize,
) -> Result<TokenStats> {
    let dims = hidden.dims();
    let hd = *dims.last().ok_or_else(|| Error::invalid("vocabulary head: hidden states are a scalar"))?;
    if dims[..dims.len() - 1] != *targets.dims() {
        return Err(Error::invalid(format!(
            "vocabulary head: hidden states {dims:?} do not match targets {:?}",
            targets.dims()
        )));
    }
    let (v, whd) = w.dims2()?;
    if whd != hd {
        return Err(Error::invalid(format!(
            "vocabulary head: hidden states of width {hd}, head weight (V={v}) of width {whd}"
        )));
    }
    let n = targets.elem_count();
    let h = hidden.reshape((n, hd))?;
    // bf16 weights under f32 activations (CPU, `Qwen3::activation_dtype`): the
    // head in f32, its weight widened once (a tracked cast, so its gradient
    // reaches the bf16 weight).
    let wide;
    let w = if w.dtype() != h.dtype() && fused::supported(&h) {
        wide = w.to_dtype(h.dtype())?;
        &wide
    } else {
        w
    };
    let out = if fused::supported(&h) && h.dtype() == w.dtype() {
        fused::vocab_stats(&h, w, targets, fused::Tiles::for_budget(n, v, tile_elems))?
    } else {
        token_stats_recomputed(&h, w, targets, (tile_elems / v.max(1)).max(1))?
    };
    let col = |i: usize| -> Result<Tensor> { Ok(out.narrow(1, i, 1)?.reshape(targets.shape())?) };
    Ok(TokenStats { logp: col(0)?, entropy: col(1)?, collision: col(2)? })
}

/// The composed path: for `rows` positions at a time, logits by a matmul, then
/// log_softmax, gather, entropy and Σp² by candle ops. `h` is `(N, H)`,
/// `targets` `(N)`; returns `(N, 3)` `[logp, H, sum p^2]` in the compute dtype.
/// With a gradient recorded, candle keeps each chunk's logits for its backward.
pub fn token_stats_composed(h: &Tensor, w: &Tensor, targets: &Tensor, rows: usize) -> Result<Tensor> {
    let n = h.dim(0)?;
    let targets = targets.flatten_all()?;
    let mut parts = Vec::with_capacity(n.div_ceil(rows.max(1)));
    for r0 in (0..n).step_by(rows.max(1)) {
        let m = rows.min(n - r0);
        let logits = ops::linear(&h.narrow(0, r0, m)?, w, None)?;
        let logits = logits.to_dtype(ops::compute_dtype(logits.dtype()))?;
        let (lp, ent) = ops::logprob_entropy_composed(&logits, &targets.narrow(0, r0, m)?)?;
        let coll = ops::softmax(&logits)?.sqr()?.sum(D::Minus1)?;
        parts.push(Tensor::stack(&[lp, ent, coll], 1)?);
    }
    if parts.is_empty() {
        return Ok(Tensor::zeros((0, 3), ops::compute_dtype(h.dtype()), h.device())?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// The statistics of one tile from candle ops: `h` `(M, H)`, `w` `(V, H)`,
/// `targets` `(M)`; returns `(M, 3)` in the compute dtype. The logits are
/// cast to f32 (f64 for f64) before the softmax, so bf16 inputs get f32
/// statistics. `log p_t = z_t - lse` and `H = lse - sum p z` with `z` the
/// logits less their (detached) maximum, which keeps the graph to a few
/// `(M, V)` tensors.
fn tile_stats(h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = h.matmul(&w.t()?)?;
    let logits = logits.to_dtype(ops::compute_dtype(logits.dtype()))?;
    let z = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?.detach())?;
    let e = z.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    let lse = sum.log()?;
    let p = e.broadcast_div(&sum)?;
    let lse = lse.squeeze(D::Minus1)?;
    // CUDA's gather wants both operands contiguous (targets are often a narrowed view).
    let ids = targets.unsqueeze(D::Minus1)?.contiguous()?;
    let logp = (z.contiguous()?.gather(&ids, D::Minus1)?.squeeze(D::Minus1)? - &lse)?;
    let entropy = (lse - (&p * &z)?.sum(D::Minus1)?)?;
    let coll = p.sqr()?.sum(D::Minus1)?;
    Ok(Tensor::stack(&[logp, entropy, coll], 1)?)
}

/// The device-generic memory-bounded head: `h` `(N, H)`, `targets` `(N)`, in
/// tiles of `rows` positions; returns `(N, 3)` `[logp, H, sum p^2]` in the
/// compute dtype, differentiable w.r.t. `h` and `w`. The forward keeps no
/// graph; the backward reruns each tile with one and backpropagates
/// `(stats * upstream).sum()`, so at most one tile's logits (and their
/// graph) are alive at any time.
pub fn token_stats_recomputed(h: &Tensor, w: &Tensor, targets: &Tensor, rows: usize) -> Result<Tensor> {
    let (n, rows) = (h.dim(0)?, rows.max(1));
    let targets = targets.flatten_all()?;
    let (hd, wd) = (h.detach(), w.detach());
    let mut parts = Vec::with_capacity(n.div_ceil(rows));
    for r0 in (0..n).step_by(rows) {
        let m = rows.min(n - r0);
        parts.push(tile_stats(&hd.narrow(0, r0, m)?, &wd, &targets.narrow(0, r0, m)?)?);
    }
    let y = match parts.len() {
        0 => return Ok(Tensor::zeros((0, 3), ops::compute_dtype(h.dtype()), h.device())?),
        _ => Tensor::cat(&parts, 0)?,
    };
    if !(h.track_op() || w.track_op()) {
        return Ok(y);
    }
    let op = HeadTiles { targets, rows, held: Held::new(y, "recomputed head") };
    Ok(h.apply_op2(w, op)?)
}

/// The op of [`token_stats_recomputed`] over `(h, w)`.
struct HeadTiles {
    targets: Tensor,
    rows: usize,
    held: Held,
}

fn head_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("recomputed head: {e}"))
}

impl CustomOp2 for HeadTiles {
    fn name(&self) -> &'static str {
        "recomputed-head"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.held.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.held.cuda()
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        self.held.metal()
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dres: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = h.dim(0)?;
        // The weight as a leaf of the nested graphs: the parameter itself when
        // it is one (no copy), else a copy, so the nested backward never walks
        // into the outer graph; a frozen weight (LoRA's base, detached) stays
        // detached and gets no (V, H) gradient.
        let need_dw = w.track_op();
        let wv = match (need_dw, w.is_variable()) {
            (false, _) => w.detach(),
            (true, true) => w.clone(),
            (true, false) => Var::from_tensor(&w.detach())?.into_inner(),
        };
        let dh = Tensor::zeros(h.shape(), h.dtype(), h.device())?;
        let mut dw: Option<Tensor> = None;
        for r0 in (0..n).step_by(self.rows) {
            let m = self.rows.min(n - r0);
            let hv = Var::from_tensor(&h.narrow(0, r0, m)?.detach())?;
            let s = tile_stats(hv.as_tensor(), &wv, &self.targets.narrow(0, r0, m)?).map_err(head_err)?;
            let grads = (s * dres.narrow(0, r0, m)?)?.sum_all()?.backward()?;
            let g = grads.get(hv.as_tensor()).ok_or_else(|| head_err("no gradient for a tile"))?;
            dh.slice_set(g, 0, r0)?;
            if let Some(g) = grads.get(&wv) {
                dw = Some(match dw.take() {
                    None => g.clone(),
                    Some(s) => (s + g)?,
                });
            }
        }
        let dw = if need_dw { Some(dw.map_or_else(|| w.zeros_like(), Ok)?) } else { None };
        Ok((Some(dh), dw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::{check, randn, tol};
    use candle_core::{DType, Device, Var};

    /// The fused tiles and the composed chunks agree with the composed path on
    /// one chunk (full logits), on values and gradients, for (B, T) targets.
    #[test]
    fn tiled_and_chunked_match_full_logits() {
        let (b, t, hd, v) = (2, 7, 8, 40);
        let targets = Tensor::from_vec(
            (0..(b * t) as u32).map(|i| (i * 11) % v as u32).collect(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap();
        for dtype in [DType::F64, DType::F32] {
            let h = randn(&[b, t, hd], dtype, 31);
            let w = randn(&[v, hd], dtype, 32);
            let full = || {
                let n = b * t;
                let hs = h.as_tensor().affine(2.0, 0.0).unwrap().reshape((n, hd)).unwrap();
                token_stats_composed(&hs, w.as_tensor(), &targets, n).unwrap().reshape((b, t, 3)).unwrap()
            };
            let stacked = |s: TokenStats| Tensor::stack(&[s.logp, s.entropy, s.collision], 2).unwrap();
            let hs = || h.as_tensor().affine(2.0, 0.0).unwrap();
            check(
                &[&h, &w],
                &|| stacked(token_stats_tiled(&hs(), w.as_tensor(), &targets, 90).unwrap()),
                &full,
                tol(dtype),
                "fused tiles",
            );
            check(
                &[&h, &w],
                &|| {
                    let hs = hs().reshape((b * t, hd)).unwrap();
                    token_stats_composed(&hs, w.as_tensor(), &targets, 3).unwrap().reshape((b, t, 3)).unwrap()
                },
                &full,
                tol(dtype),
                "composed chunks",
            );
            // Ragged tiles (14 positions in tiles of 3), a head weight that is
            // a parameter and one that is computed (not a leaf).
            check(
                &[&h, &w],
                &|| {
                    let hs = hs().reshape((b * t, hd)).unwrap();
                    token_stats_recomputed(&hs, w.as_tensor(), &targets, 3)
                        .unwrap()
                        .reshape((b, t, 3))
                        .unwrap()
                },
                &full,
                tol(dtype),
                "recomputed tiles",
            );
            let full_w2 = || {
                let hs = hs().reshape((b * t, hd)).unwrap();
                let w2 = w.as_tensor().affine(0.5, 0.0).unwrap();
                token_stats_composed(&hs, &w2, &targets, b * t).unwrap().reshape((b, t, 3)).unwrap()
            };
            check(
                &[&h, &w],
                &|| {
                    let hs = hs().reshape((b * t, hd)).unwrap();
                    let w2 = w.as_tensor().affine(0.5, 0.0).unwrap();
                    token_stats_recomputed(&hs, &w2, &targets, 4).unwrap().reshape((b, t, 3)).unwrap()
                },
                &full_w2,
                tol(dtype),
                "recomputed tiles, computed weight",
            );
        }
    }

    /// bf16 hidden states and weight: the recomputed tiles give f32
    /// statistics and bf16 gradients that match an f64 reference on the same
    /// (bf16-rounded) values to bf16 accuracy.
    #[test]
    fn bf16_tiles_match_an_f64_reference() {
        let (n, hd, v) = (13, 16, 50);
        let targets =
            Tensor::from_vec((0..n as u32).map(|i| (i * 7) % v as u32).collect(), n, &Device::Cpu).unwrap();
        let h = randn(&[n, hd], DType::BF16, 41);
        let w = randn(&[v, hd], DType::BF16, 42);
        let h64 = Var::from_tensor(&h.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let w64 = Var::from_tensor(&w.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
        let y = token_stats_recomputed(h.as_tensor(), w.as_tensor(), &targets, 5).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let r = token_stats_composed(h64.as_tensor(), w64.as_tensor(), &targets, n).unwrap();
        let e = crate::model::fused::test_util::rel_err(&y, &r);
        assert!(e < 2e-2, "values: {e:e}");
        let probe = randn(&[n, 3], DType::F64, 43);
        let g = (y.to_dtype(DType::F64).unwrap() * probe.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gr = (r * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        for (a, b, what) in [(&h, &h64, "hidden"), (&w, &w64, "weight")] {
            let ga = g.get(a.as_tensor()).unwrap();
            assert_eq!(ga.dtype(), DType::BF16);
            let e = crate::model::fused::test_util::rel_err(ga, gr.get(b.as_tensor()).unwrap());
            assert!(e < 3e-2, "{what} gradient: {e:e}");
        }
    }

    /// Σp² by hand: logits [0, ln 3] give p = [1/4, 3/4], Σp² = 10/16.
    #[test]
    fn collision_probability_by_hand() {
        let h = Tensor::new(&[[1.0f64]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[[0.0f64], [3f64.ln()]], &Device::Cpu).unwrap();
        let t = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        let s = token_stats(&h, &w, &t).unwrap();
        let get = |x: &Tensor| x.to_vec1::<f64>().unwrap()[0];
        assert!((get(&s.collision) - 10.0 / 16.0).abs() < 1e-12);
        assert!((get(&s.logp) - 0.75f64.ln()).abs() < 1e-12);
        let ent = -(0.25 * 0.25f64.ln() + 0.75 * 0.75f64.ln());
        assert!((get(&s.entropy) - ent).abs() < 1e-12);
    }

    #[test]
    fn mismatched_shapes_are_named() {
        let h = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::zeros((2, 2), DType::U32, &Device::Cpu).unwrap();
        let err = token_stats(&h, &w, &t).unwrap_err().to_string();
        assert!(err.contains("do not match targets"), "{err}");
    }
}
