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
//! memory stays at one tile of logits. Every other device and dtype takes the
//! composed candle ops chunk by chunk ([`token_stats_composed`]), which is also
//! the reference the fused op is tested against.

use candle_core::{Tensor, D};

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
    let out = if fused::supported(&h) && h.dtype() == w.dtype() {
        fused::vocab_stats(&h, w, targets, fused::Tiles::for_budget(n, v, tile_elems))?
    } else {
        token_stats_composed(&h, w, targets, (tile_elems / v.max(1)).max(1))?
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::{check, randn, tol};
    use candle_core::{DType, Device};

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
