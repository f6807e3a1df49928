//! How sequences become tensors: how a mini-batch is cut into micro-batches ([`Cut`],
//! [`Span`]: a fixed number of sequences, or a token budget as verl's `use_dynamic_bsz`
//! with `ppo_max_token_len_per_gpu`), a micro-batch's `[left pad | prompt | response | right
//! pad]` layout ([`Micro`]), the training forward's per-token log-probs, entropies and
//! collision probabilities over the response positions, and the conversions between
//! `(B, T)` tensors and per-sequence vectors.

use candle_core::{DType, Device, Tensor};

use super::phases::Phase;
use super::Sequence;
use crate::model::{Grad, Qwen3, TokenBatch};
use crate::{Error, Result};

/// One micro-batch of a mini-batch: rows `start..start + len` of the mini-batch (in its
/// layout order), padded to prompt length `p` and response length `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub start: usize,
    pub len: usize,
    pub p: usize,
    pub t: usize,
}

impl Span {
    /// Tokens the forward runs over, padding counted.
    pub fn tokens(&self) -> usize {
        self.len * (self.p + self.t)
    }
}

/// How a mini-batch is cut into micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cut {
    /// `n` sequences at a time in the mini-batch's order, each padded to the mini-batch's
    /// longest prompt and response.
    Count(usize),
    /// Sequences sorted by length (longest first), then cut greedily into micro-batches
    /// of at most `budget` tokens (prompt + response, padding counted: rows times the
    /// micro-batch's longest prompt plus its longest response) and at most `max_seqs`
    /// sequences, each padded to its own longest prompt and response. A sequence longer
    /// than the budget goes alone.
    Tokens { budget: usize, max_seqs: usize },
}

impl Cut {
    /// The cut of `cfg` for mini-batches of up to `micro_size` sequences per micro-batch.
    pub fn new(max_tokens_per_micro: usize, micro_size: usize) -> Self {
        match max_tokens_per_micro {
            0 => Cut::Count(micro_size.max(1)),
            budget => Cut::Tokens { budget, max_seqs: micro_size.max(1) },
        }
    }

    /// The order in which the rows `lens` (prompt, response lengths) are laid out: as
    /// given for [`Cut::Count`], longest first (prompt + response, then response; ties
    /// in the given order) for [`Cut::Tokens`].
    pub fn order(&self, lens: &[(usize, usize)]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..lens.len()).collect();
        if let Cut::Tokens { .. } = self {
            order.sort_by_key(|&i| std::cmp::Reverse((lens[i].0 + lens[i].1, lens[i].1)));
        }
        order
    }

    /// The micro-batches of rows `lens` (already in [`Cut::order`]).
    pub fn spans(&self, lens: &[(usize, usize)]) -> Vec<Span> {
        let longest = |rows: &[(usize, usize)]| {
            (rows.iter().map(|l| l.0).max().unwrap_or(1), rows.iter().map(|l| l.1).max().unwrap_or(1).max(1))
        };
        match *self {
            Cut::Count(n) => {
                let (p, t) = longest(lens);
                (0..lens.len())
                    .step_by(n)
                    .map(|start| Span { start, len: n.min(lens.len() - start), p, t })
                    .collect()
            }
            Cut::Tokens { budget, max_seqs } => {
                let mut out: Vec<Span> = Vec::new();
                for (i, &(pl, rl)) in lens.iter().enumerate() {
                    let alone = Span { start: i, len: 1, p: pl.max(1), t: rl.max(1) };
                    match out.last_mut() {
                        Some(s) => {
                            let grown = Span { len: s.len + 1, p: s.p.max(pl), t: s.t.max(rl), ..*s };
                            if grown.len <= max_seqs && grown.tokens() <= budget {
                                *s = grown;
                            } else {
                                out.push(alone);
                            }
                        }
                        None => out.push(alone),
                    }
                }
                out
            }
        }
    }
}

/// The micro-batches an update runs over one mini-batch of sequences with these
/// `(prompt, response)` lengths: `(rows, padded length)` of each, for micro-batches of
/// `micro_batch` sequences (0: the whole mini-batch) or, with `max_tokens_per_micro > 0`,
/// cut by that token budget. What `stapo bench train --lengths` reports padding from.
pub fn micro_batch_shapes(
    lens: &[(usize, usize)],
    micro_batch: usize,
    max_tokens_per_micro: usize,
) -> Vec<(usize, usize)> {
    let micro = if micro_batch == 0 { lens.len() } else { micro_batch };
    let cut = Cut::new(max_tokens_per_micro, micro);
    let sorted: Vec<(usize, usize)> = cut.order(lens).into_iter().map(|i| lens[i]).collect();
    cut.spans(&sorted).into_iter().map(|s| (s.len, s.p + s.t)).collect()
}

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
    // Timed as the forward and the loss's statistics with a gradient; the
    // forward without one is timed by its caller (the old policy's).
    let phase = |p: Phase| if grad == Grad::Track { Some(p) } else { None };
    // From the last prompt position on: the T positions that predict the
    // response's tokens (and the last, which predicts none).
    let hidden =
        Phase::time_if(phase(Phase::Forward), || model.forward_hidden_from(&mb.tokens, mb.p - 1, grad))?;
    let h = hidden.narrow(1, 0, mb.t)?;
    // Through the head in tiles: no (B, T, V) logits (model::head). logits / T
    // = (h / T) w^T, so the temperature scales the hidden states.
    let h = if temperature != 1.0 { h.affine(1.0 / temperature, 0.0)? } else { h };
    let s = Phase::time_if(phase(Phase::Loss), || model.token_stats(&h, &mb.targets, grad))?;
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
