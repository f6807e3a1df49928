//! STAPO's gradient analysis: the logit-gradient norm of each token (it grows as p and the
//! entropy fall: the paper's argument for silencing spurious tokens), its shares, and the
//! per-token statistics of a rollout no update has seen ([`token_analysis`]).

use super::layout::{layout_for, response_stats, rows};
use super::Sequence;
use crate::model::{Grad, Qwen3};
use crate::{Error, Result};

/// The norm of the gradient of `-A·log p_y` with respect to the logits: `-A·(e_y - p)`, so
/// `|A|·sqrt((1 - p_y)² + Σ_{j≠y} p_j²)` with `Σ_{j≠y} p_j² = collision - p_y²` (STAPO's
/// argument: it grows as p_y and the entropy fall).
pub fn logit_grad_norm(advantage: f32, p: f32, collision: f32) -> f32 {
    let (p, c) = (p as f64, collision as f64);
    (advantage.abs() as f64 * ((1.0 - p).powi(2) + (c - p * p).max(0.0)).sqrt()) as f32
}

/// Per response token of a sequence under a model: the probability of the sampled
/// token, the entropy and the collision probability `Σ_j p_j²` at its position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenAnalysis {
    pub p: Vec<f32>,
    pub entropy: Vec<f32>,
    pub collision: Vec<f32>,
}

/// [`TokenAnalysis`] of every sequence under `model` (no gradient; logits divided by
/// `temperature`), in chunks of `chunk` sequences, with the same tiled pass as the
/// update's: the analysis of a rollout that no update has seen (the REPL's
/// `spurious_plot(model, rollout, path)`).
pub fn token_analysis(
    model: &Qwen3,
    seqs: &[Sequence],
    pad_id: u32,
    temperature: f64,
    chunk: usize,
) -> Result<Vec<TokenAnalysis>> {
    let mut out = vec![TokenAnalysis::default(); seqs.len()];
    let live: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].response_ids.is_empty()).collect();
    for idx in live.chunks(chunk.max(1)) {
        let ss: Vec<&Sequence> = idx.iter().map(|&i| &seqs[i]).collect();
        let mb = layout_for(&ss, pad_id, model.device())?;
        let (lp, h, c) = response_stats(model, &mb, Grad::Off, temperature, true)?;
        let c = c.ok_or_else(|| Error::invalid("token_analysis: no collision probabilities"))?;
        let (lp, h, c) = (rows(&lp, &ss)?, rows(&h, &ss)?, rows(&c, &ss)?);
        for (k, &i) in idx.iter().enumerate() {
            out[i] = TokenAnalysis {
                p: lp[k].iter().map(|l| l.exp()).collect(),
                entropy: h[k].clone(),
                collision: c[k].clone(),
            };
        }
    }
    Ok(out)
}

/// Shares of `Σ g` carried by the `silenced` tokens and by the top `top_frac` of tokens by
/// `g` (at least one token); `(0, 0)` when `Σ g = 0`.
pub fn grad_shares(g: &[f32], silenced: &[bool], top_frac: f64) -> (f32, f32) {
    let total: f64 = g.iter().map(|&x| x as f64).sum();
    if g.is_empty() || total <= 0.0 {
        return (0.0, 0.0);
    }
    // A fold from +0.0: an empty float `sum()` is -0.0, which logs as "-0".
    let sil = g.iter().zip(silenced).filter(|(_, &s)| s).fold(0.0f64, |acc, (&x, _)| acc + x as f64);
    let mut sorted = g.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = ((g.len() as f64 * top_frac).ceil() as usize).clamp(1, g.len());
    let top: f64 = sorted[..k].iter().map(|&x| x as f64).sum();
    ((sil / total) as f32, (top / total) as f32)
}

/// The share of the logit-gradient norm the top 0.01% of tokens carry (the paper's
/// spurious-token fraction).
pub const TOP_GRAD_FRAC: f64 = 1e-4;
