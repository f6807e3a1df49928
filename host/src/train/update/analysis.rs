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
    /// Probability of the sampled token at each response position.
    pub p: Vec<f32>,
    /// Full-vocabulary entropy (nats) at each response position.
    pub entropy: Vec<f32>,
    /// Collision probability `Σ_j p_j²` at each response position.
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

/// Shares of the summed per-token logit-gradient norm `Σ g` of one update: by the tokens
/// S2T silenced, by its candidates (`A > 0 && p < tau_p`), and by the tokens with the
/// largest `g`: the top 0.01% (the paper's spurious-token fraction, at least one token,
/// so on a small batch it collapses to the single largest), the top 1% and the top 10.
/// All 0 when `Σ g = 0`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GradShares {
    /// Share carried by the silenced tokens.
    pub silenced: f32,
    /// Share carried by the S2T candidates.
    pub candidates: f32,
    /// Share carried by the top 0.01% of tokens.
    pub top_frac: f32,
    /// Share carried by the top 1% of tokens.
    pub top_1pct: f32,
    /// Share carried by the 10 largest tokens.
    pub top_10: f32,
}

/// [`GradShares`] of the norms `g`, with `silenced` and `candidates` flags per token (as
/// long as `g`; missing flags count as false).
pub fn grad_shares(g: &[f32], silenced: &[bool], candidates: &[bool]) -> GradShares {
    let total: f64 = g.iter().map(|&x| x as f64).sum();
    if g.is_empty() || total <= 0.0 {
        return GradShares::default();
    }
    // Folds from +0.0: an empty float `sum()` is -0.0, which logs as "-0".
    let flagged = |flags: &[bool]| {
        g.iter().zip(flags).filter(|(_, &f)| f).fold(0.0f64, |acc, (&x, _)| acc + x as f64) / total
    };
    let mut sorted = g.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let top = |k: usize| sorted[..k.clamp(1, g.len())].iter().fold(0.0f64, |acc, &x| acc + x as f64) / total;
    let frac = |f: f64| (g.len() as f64 * f).ceil() as usize;
    GradShares {
        silenced: flagged(silenced) as f32,
        candidates: flagged(candidates) as f32,
        top_frac: top(frac(TOP_GRAD_FRAC)) as f32,
        top_1pct: top(frac(TOP_1PCT)) as f32,
        top_10: top(TOP_K) as f32,
    }
}

/// The share of the logit-gradient norm the top 0.01% of tokens carry (the paper's
/// spurious-token fraction).
pub const TOP_GRAD_FRAC: f64 = 1e-4;
/// The fixed top 1% of tokens by logit-gradient norm, and the top 10: shares that do not
/// collapse to one token on a batch of a few thousand tokens.
pub const TOP_1PCT: f64 = 0.01;
/// How many of the largest tokens `top_10` counts.
pub const TOP_K: usize = 10;
