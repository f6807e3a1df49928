//! Rollout correction: the responses are sampled from the rollout copy of the policy (e.g.
//! bf16 weights, `rollout_dtype`) but trained with the master weights (f32), so the policy
//! that sampled is not the policy whose ratio the objective clips (Yao et al., "Your
//! efficient RL framework secretly brings you off-policy RL training", 2025). Following
//! verl's `rollout_corr` (decoupled PPO: the recomputed old log-probs stay the ratio's
//! anchor), this file measures the mismatch between the old log-probs and the rollout's
//! (recorded while sampling, at temperature 1) and corrects the policy-gradient term:
//!
//! - token-TIS: each token's policy loss times `min(exp(old - rollout), cap)` (constant;
//!   verl `rollout_is = token`, cap `rollout_is_threshold` 2);
//! - seq-MIS: per sequence `rho = exp(sum_t (old - rollout))`; sequences with `rho` outside
//!   `[seq_lower, seq_upper]` are masked out of the loss and its normaliser (rejected),
//!   the others weighted by `rho` (masked importance sampling).
//!
//! Metrics (with verl's names as TensorBoard aliases): the k1 and k3 estimates of
//! KL(rollout ‖ old), mean and max of `|old - rollout|`, the mean token IS weight, the share
//! of tokens whose weight exceeds the cap, and the share of sequences outside the seq-MIS
//! bounds.

use std::collections::HashMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::config::LOG_WEIGHT_CLAMP;
use super::{OldLogp, RolloutCorrMode, RolloutCorrection, Sequence, UpdateConfig};
use crate::dist::{self, Comm};
use crate::{Error, Result};

/// The mismatch between the old log-probs and the rollout's, over the response tokens of
/// the update's active sequences (each counted once, at the first epoch).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutCorrMetrics {
    /// The correction applied (`off`: measured only).
    pub mode: RolloutCorrMode,
    /// k1 estimate of KL(rollout ‖ old): mean of `rollout - old` (verl `rollout_corr/kl`).
    pub kl: f32,
    /// k3 estimate: mean of `exp(d) - 1 - d`, `d = old - rollout` (verl `rollout_corr/k3_kl`).
    pub k3_kl: f32,
    /// Mean and max of `|old - rollout|`.
    pub log_ratio_abs_mean: f32,
    /// Largest `|old - rollout|` over the tokens.
    pub log_ratio_abs_max: f32,
    /// Mean token weight `exp(old - rollout)` before the cap (verl `rollout_is_mean`).
    pub rollout_is_mean: f32,
    /// Share of tokens whose weight exceeds the cap (verl `rollout_is_ratio_fraction_high`).
    pub fraction_high: f32,
    /// Share of sequences whose weight lies outside the seq-MIS bounds (rejected under
    /// seq-MIS; verl `rollout_rs_seq_masked_fraction`).
    pub seq_outside_fraction: f32,
}

/// Running sums of [`RolloutCorrMetrics`] over sequences.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CorrSums {
    tokens: f64,
    k1: f64,
    k3: f64,
    abs: f64,
    abs_max: f64,
    weight: f64,
    high: f64,
    seqs: f64,
    outside: f64,
}

impl CorrSums {
    /// Adds one sequence's old and rollout log-probs.
    pub fn add(&mut self, cfg: &RolloutCorrection, old: &[f32], rollout: &[f32]) {
        for (&o, &r) in old.iter().zip(rollout) {
            let d = (o as f64 - r as f64).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP);
            let w = d.exp();
            self.tokens += 1.0;
            self.k1 -= d;
            self.k3 += w - 1.0 - d;
            self.abs += d.abs();
            self.abs_max = self.abs_max.max(d.abs());
            self.weight += w;
            self.high += f64::from(w > cfg.cap as f64);
        }
        self.seqs += 1.0;
        self.outside += f64::from(!cfg.keeps_sequence(old, rollout));
    }

    /// The metrics over every rank's sequences (`None` when no rank had any).
    pub fn finish(self, comm: &dyn Comm, cfg: &RolloutCorrection) -> Result<Option<RolloutCorrMetrics>> {
        let s = self;
        let [tokens, k1, k3, abs, weight, high, seqs, outside] =
            dist::sum_f64(comm, [s.tokens, s.k1, s.k3, s.abs, s.weight, s.high, s.seqs, s.outside])?;
        let abs_max = dist::max_f64(comm, s.abs_max)?;
        if tokens == 0.0 {
            return Ok(None);
        }
        let per = |x: f64| (x / tokens) as f32;
        Ok(Some(RolloutCorrMetrics {
            mode: cfg.mode,
            kl: per(k1),
            k3_kl: per(k3),
            log_ratio_abs_mean: per(abs),
            log_ratio_abs_max: abs_max as f32,
            rollout_is_mean: per(weight),
            fraction_high: per(high),
            seq_outside_fraction: (outside / seqs.max(1.0)) as f32,
        }))
    }
}

/// The correction of an update (`cfg.actor.rollout_correction`, `auto` counting as off: the
/// trainer resolves it), when the rollout's log-probs are comparable with the old ones:
/// temperature 1, old log-probs recomputed, and every active sequence (on every rank)
/// carrying one rollout log-prob per response token. An explicit mode without them is an
/// error.
pub(super) fn in_force(
    comm: &dyn Comm,
    cfg: &UpdateConfig,
    seqs: &[Sequence],
    active: &[usize],
) -> Result<Option<RolloutCorrection>> {
    let (corr, _) = cfg.actor.rollout_correction.resolve(false, cfg.temperature, cfg.actor.old_logp)?;
    let lacking = |i: &usize| {
        let s = &seqs[*i];
        s.rollout_logprobs.as_ref().is_none_or(|l| l.len() != s.response_ids.len())
    };
    let first = active.iter().find(|i| lacking(i));
    let [missing] = dist::sum_f64(comm, [active.iter().filter(|i| lacking(i)).count() as f64])?;
    if corr.active() && missing > 0.0 {
        let which = first.map_or("a sequence on another rank".to_string(), |i| format!("sequence {i}"));
        return Err(Error::invalid(format!(
            "update: rollout_correction.mode = {} needs the rollout's log-probs, one per response \
             token, but {which} has none or a different number",
            corr.mode.name()
        )));
    }
    let comparable = cfg.temperature == 1.0 && cfg.actor.old_logp == OldLogp::Recompute && missing == 0.0;
    Ok(comparable.then_some(corr))
}

/// seq-MIS: `mask` `(B, T)` with the rows of the sequences outside the bounds zeroed
/// (`old`: the old log-probs by sequence index; rows in the order of `idx`).
pub(super) fn reject_sequences(
    corr: &RolloutCorrection,
    mask: &Tensor,
    (seqs, idx): (&[&Sequence], &[usize]),
    old: &HashMap<usize, Vec<f32>>,
) -> Result<Tensor> {
    let keep: Vec<f32> = seqs
        .iter()
        .zip(idx)
        .map(|(s, i)| {
            let rollout = s.rollout_logprobs.as_deref().unwrap_or_default();
            let old = old.get(i).map(Vec::as_slice).unwrap_or_default();
            f32::from(u8::from(corr.keeps_sequence(old, rollout)))
        })
        .collect();
    let keep = Tensor::from_vec(keep, (seqs.len(), 1), mask.device())?.to_dtype(mask.dtype())?;
    Ok(mask.broadcast_mul(&keep)?)
}
