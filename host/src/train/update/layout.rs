//! How sequences become tensors: a micro-batch's `[left pad | prompt | response | right
//! pad]` layout ([`Micro`]), the training forward's per-token log-probs, entropies and
//! collision probabilities over the response positions, and the conversions between
//! `(B, T)` tensors and per-sequence vectors.

use candle_core::{DType, Device, Tensor};

use super::Sequence;
use crate::model::{Grad, Qwen3, TokenBatch};
use crate::{Error, Result};

/// A micro-batch laid out for the forward pass.
pub(super) struct Micro {
    pub(super) tokens: TokenBatch,
    /// Longest prompt `P` and response `T`.
    pub(super) p: usize,
    pub(super) t: usize,
    /// `(B, T)` response ids (0 on padding) and response mask.
    pub(super) targets: Tensor,
    pub(super) resp_mask: Tensor,
}

pub(super) fn layout(seqs: &[&Sequence], p: usize, t: usize, pad_id: u32, device: &Device) -> Result<Micro> {
    let b = seqs.len();
    let mut ids = Vec::with_capacity(b * (p + t));
    let mut mask = Vec::with_capacity(b);
    let mut targets = Vec::with_capacity(b * t);
    let mut resp = Vec::with_capacity(b * t);
    for s in seqs {
        let (pl, rl) = (s.prompt_ids.len(), s.response_ids.len());
        if pl == 0 {
            return Err(Error::invalid("update: a sequence has an empty prompt"));
        }
        let mut row_mask = vec![0u8; p - pl];
        ids.extend(std::iter::repeat_n(pad_id, p - pl));
        ids.extend(&s.prompt_ids);
        ids.extend(&s.response_ids);
        ids.extend(std::iter::repeat_n(pad_id, t - rl));
        row_mask.extend(std::iter::repeat_n(1u8, pl + rl));
        row_mask.extend(std::iter::repeat_n(0u8, t - rl));
        mask.push(row_mask);
        targets.extend(&s.response_ids);
        targets.extend(std::iter::repeat_n(0u32, t - rl));
        resp.extend(std::iter::repeat_n(1f32, rl));
        resp.extend(std::iter::repeat_n(0f32, t - rl));
    }
    Ok(Micro {
        tokens: TokenBatch::from_parts(ids, mask, device)?,
        p,
        t,
        targets: Tensor::from_vec(targets, (b, t), device)?,
        resp_mask: Tensor::from_vec(resp, (b, t), device)?,
    })
}

/// Layout of a chunk padded to its own longest prompt and response.
pub(super) fn layout_for(ss: &[&Sequence], pad_id: u32, device: &Device) -> Result<Micro> {
    let p = ss.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(1);
    let t = ss.iter().map(|s| s.response_ids.len()).max().unwrap_or(1).max(1);
    layout(ss, p, t, pad_id, device)
}

/// Log-probs and entropies `(B, T)` of the response tokens of `mb` under `model`, with
/// the logits divided by `temperature`.
pub(super) fn response_logp(
    model: &Qwen3,
    mb: &Micro,
    grad: Grad,
    temperature: f64,
) -> Result<(Tensor, Tensor)> {
    let (lp, h, _) = response_stats(model, mb, grad, temperature, false)?;
    Ok((lp, h))
}

/// [`response_logp`], plus (when `collision`) the collision probability `sum_j p_j^2` of
/// each position's distribution, detached, for the logit-gradient norms of the analysis.
///
/// The collision probability comes from the same tiled pass as the log-probs
/// (`Qwen3::token_stats`), with no `(B, T, V)` logits.
pub(super) fn response_stats(
    model: &Qwen3,
    mb: &Micro,
    grad: Grad,
    temperature: f64,
    collision: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let hidden = model.forward_hidden(&mb.tokens, grad)?;
    let h = hidden.narrow(1, mb.p - 1, mb.t)?;
    // Through the head in tiles: no (B, T, V) logits (model::head). logits / T
    // = (h / T) w^T, so the temperature scales the hidden states.
    let h = if temperature != 1.0 { h.affine(1.0 / temperature, 0.0)? } else { h };
    let s = model.token_stats(&h, &mb.targets, grad)?;
    let c = if collision { Some(s.collision.detach().to_dtype(DType::F32)?) } else { None };
    Ok((s.logp, s.entropy, c))
}

/// Per-sequence vectors of a `(B, T)` tensor, cut to each response's length.
pub(super) fn rows(t: &Tensor, seqs: &[&Sequence]) -> Result<Vec<Vec<f32>>> {
    let all = t.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(all.into_iter().zip(seqs).map(|(r, s)| r[..s.response_ids.len()].to_vec()).collect())
}

/// A `(B, T)` tensor from per-sequence vectors, zero-padded.
pub(super) fn grid(vals: &[&Vec<f32>], t: usize, device: &Device) -> Result<Tensor> {
    let flat: Vec<f32> =
        vals.iter().flat_map(|v| v.iter().copied().chain(std::iter::repeat_n(0.0, t - v.len()))).collect();
    Ok(Tensor::from_vec(flat, (vals.len(), t), device)?)
}
