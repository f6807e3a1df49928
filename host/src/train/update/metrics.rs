//! Step 7 of the update: what it reports. [`UpdateMetrics`] (the per-step figures verl and
//! TRL users expect), [`UpdateRecord`] (what the update used, per sequence and token, for
//! the REPL's token table), the running [`Totals`] over micro-batches and their reduction
//! over ranks into the final metrics.

use std::collections::HashMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::analysis::{grad_shares, logit_grad_norm};
use super::layout::rows;
use super::rollout_corr::{CorrSums, RolloutCorrMetrics};
use super::score::Scored;
use super::Sequence;
use crate::algo::{LossMetrics, S2tStats};
use crate::dist::{self, Comm};
use crate::Result;

/// What one update did: the per-step metrics researchers expect from verl/TRL.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateMetrics {
    /// The objective's loss of each optimizer step taken (its mini-batch's), averaged over those steps.
    pub loss: f32,
    /// Mean raw reward of the batch's responses.
    pub reward_mean: f32,
    /// Standard deviation of the raw rewards over the batch.
    pub reward_std: f32,
    /// Fraction of responses with raw reward > 0.5.
    pub accuracy: f32,
    /// Mean full-vocabulary entropy over response tokens (current policy).
    pub entropy: f32,
    /// Share of kept tokens whose ratio was clipped below `1 - eps_low` (negative advantage).
    pub clip_frac_low: f32,
    /// Share of kept tokens whose ratio was clipped above `1 + eps_high` (positive advantage).
    pub clip_frac_high: f32,
    /// KL(old‖new) by the k3 estimator, mean over kept tokens.
    pub approx_kl: f32,
    /// Global gradient norm before clipping, averaged over the optimizer steps taken.
    pub grad_norm: f32,
    /// Mean response length in tokens.
    pub response_len_mean: f32,
    /// Longest response in tokens.
    pub response_len_max: usize,
    /// Share of responses that hit the token limit without stopping.
    pub truncation_rate: f32,
    /// Share of groups whose rewards are all equal (no learning signal under GRPO).
    pub zero_var_group_frac: f32,
    /// Sequences dropped by dynamic sampling.
    pub dropped_seqs: usize,
    /// Response tokens of the sequences that reached the loss.
    pub response_tokens: usize,
    /// Response tokens the token mask kept in the loss.
    pub kept_tokens: usize,
    /// Response tokens the S2T mask silenced.
    pub silenced_tokens: usize,
    /// `silenced_tokens / response_tokens` (0 without response tokens).
    pub silenced_ratio: f32,
    /// The S2T entropy threshold, averaged over the mini-batches that had candidates.
    pub tau_h: Option<f32>,
    /// Optimizer steps taken and skipped (non-finite loss or gradient).
    pub optimizer_steps: usize,
    /// Optimizer steps skipped for a non-finite loss or gradient.
    pub skipped_steps: usize,
    /// Why each skipped optimizer step was skipped, naming the quantity that was not
    /// finite (`loss is NaN`, `gradient norm is inf`, `updated weights of <param>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skip_reasons: Vec<String>,
    /// Bytes of optimizer state (AdamW moments, and f32 master weights when sharded with
    /// weights in another dtype) held by this rank (rank 0's in a run's metrics); with
    /// `shard` it falls by the number of ranks.
    #[serde(default)]
    pub optimizer_bytes: u64,
    /// Token id → times silenced in this update, most frequent first.
    pub silenced_token_ids: Vec<(u32, usize)>,
    /// Response tokens with `A > 0 && p < tau_p` (S2T candidates), over all mini-batches.
    #[serde(default)]
    pub s2t_candidates: usize,
    /// Response tokens with `A < 0 && p < tau_p`, over all mini-batches (S2T on).
    #[serde(default)]
    pub low_p_negative: usize,
    /// Candidates per 10k response tokens, and the shares of response tokens with
    /// `p < tau_p` and `A > 0` / `A < 0`: rates that do not collapse to a handful of
    /// silenced tokens (S2T on; 0 without response tokens).
    #[serde(default)]
    pub candidates_per_10k: f32,
    /// Silenced tokens per 10k response tokens (the paper's figure of the silenced share,
    /// drawn on a log scale; 0 without response tokens).
    #[serde(default)]
    pub silenced_per_10k: f32,
    /// Mini-batches (over all epochs) the S2T mask was decided on, and how many of them had
    /// at least two candidates over the whole global mini-batch: with `tau_h` the
    /// 0.75-quantile of the candidates (the paper's rule) only those can silence anything.
    #[serde(default)]
    pub s2t_mini_batches: usize,
    /// See [`s2t_mini_batches`](Self::s2t_mini_batches).
    #[serde(default)]
    pub s2t_mini_batches_2plus: usize,
    /// Candidates per S2T mini-batch, over the global mini-batch (S2T on; 0 otherwise).
    #[serde(default)]
    pub candidates_per_mini_batch: f32,
    /// Each S2T mini-batch of the update (every epoch, in order), over the global
    /// mini-batch: its response tokens, candidates and silenced tokens, so that the share
    /// of mini-batches the paper's rule can act on is read per mini-batch (S2T on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub s2t_by_mini_batch: Vec<MiniBatchS2t>,
    /// Share of response tokens with `p < tau_p` and `A > 0` (S2T on).
    #[serde(default)]
    pub low_p_positive_share: f32,
    /// Share of response tokens with `p < tau_p` and `A < 0` (S2T on).
    #[serde(default)]
    pub low_p_negative_share: f32,
    /// The size of the population the quantile `tau_h` was taken over (response tokens
    /// or candidates of the global mini-batch), summed over the mini-batches; `None`
    /// without S2T or with an absolute `tau_h`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tau_h_population: Option<usize>,
    /// Shares of the summed per-token logit-gradient norm carried by the silenced tokens
    /// and by the top 0.01% of tokens (first epoch; with `token_grad_norms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silenced_grad_share: Option<f32>,
    /// Share carried by the top 0.01% of tokens by logit-gradient norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_grad_share: Option<f32>,
    /// The mismatch between the rollout's log-probs (the sampling copy's) and the old
    /// log-probs, when they are comparable (temperature 1, old log-probs recomputed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_corr: Option<RolloutCorrMetrics>,
    /// Shares carried by the top 1% and the top 10 tokens by logit-gradient norm, and by
    /// the S2T candidates (`A > 0 && p < tau_p`, with S2T on), on the same terms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_1pct_grad_share: Option<f32>,
    /// Share carried by the 10 tokens of largest logit-gradient norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_10_grad_share: Option<f32>,
    /// Share carried by the S2T candidates (`A > 0 && p < tau_p`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_grad_share: Option<f32>,
    /// The 0.99-quantile of the response tokens' entropies (current policy, first epoch,
    /// every rank): the low-entropy collapse shows in the tail before the mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy_p99: Option<f32>,
    /// What went wrong without stopping the update (a skipped optimizer step, ...), for
    /// the caller to show: the library prints nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// What the S2T mask saw in one mini-batch, summed over the ranks holding part of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MiniBatchS2t {
    /// Response tokens of the mini-batch.
    pub tokens: usize,
    /// Tokens with `A > 0 && p < tau_p`.
    pub candidates: usize,
    /// Candidates the mask silenced.
    pub silenced: usize,
}

/// The S2T thresholds one mini-batch applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AppliedThresholds {
    /// Epoch and mini-batch index within it.
    pub epoch: usize,
    /// Index of the mini-batch within its epoch.
    pub mini_batch: usize,
    /// The probability threshold used.
    pub tau_p: f32,
    /// The entropy threshold used (`None`: a quantile over an empty population).
    pub tau_h: Option<f32>,
    /// How many entropies (of the whole global mini-batch) the quantile was taken
    /// over; `None` for an absolute `tau_h`.
    #[serde(default)]
    pub population: Option<usize>,
    /// Tokens with `A > 0 && p < tau_p`, and those silenced.
    pub candidates: usize,
    /// Candidates the mask silenced (entropy below `tau_h`).
    pub silenced: usize,
}

/// What an update used, per input sequence (index = position in the `seqs` given to
/// [`update`](super::update)), so that a token table shows exactly what the update did. Token-level
/// fields are those of the first epoch (the policy that sampled, for `old_logp =
/// recompute`); the metrics count every epoch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateRecord {
    /// Rewards after the objective's scale and overlong shaping.
    pub rewards: Vec<f32>,
    /// One advantage per sequence.
    pub advantages: Vec<f32>,
    /// False for sequences that never reached the loss (dropped by dynamic sampling, or
    /// an empty response).
    pub active: Vec<bool>,
    /// Per response token: kept by the token mask (empty for inactive sequences).
    pub kept: Vec<Vec<bool>>,
    /// Per response token: silenced by S2T (empty when S2T was off or inactive).
    pub silenced: Vec<Vec<bool>>,
    /// Per response token: probability and entropy of the current policy at the first
    /// epoch's training forward (empty for inactive sequences).
    pub p: Vec<Vec<f32>>,
    /// Per response token: the current policy's entropy (nats) at the same forward.
    pub entropy: Vec<Vec<f32>>,
    /// Per response token, with `token_grad_norms`: the collision probability `Σ_j p_j²` and
    /// the logit-gradient norm `|A|·sqrt((1 - p_y)² + Σ_{j≠y} p_j²)` (see [`logit_grad_norm`]).
    pub collision: Vec<Vec<f32>>,
    /// Per response token: the logit-gradient norm (with `token_grad_norms`).
    pub grad_norm: Vec<Vec<f32>>,
    /// The S2T thresholds of every mini-batch (empty without S2T).
    pub thresholds: Vec<AppliedThresholds>,
}

/// What [`update`](super::update) returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateOutcome {
    /// The update's metrics.
    pub metrics: UpdateMetrics,
    /// What the update used, per input sequence.
    pub record: UpdateRecord,
}

/// Running sums over the micro-batches of an update.
#[derive(Default)]
pub(super) struct Totals {
    pub(super) loss_metrics: LossMetrics,
    pub(super) entropy_sum: f64,
    pub(super) entropy_count: usize,
    pub(super) tau_h_sum: f64,
    pub(super) tau_h_count: usize,
    pub(super) loss_sum: f64,
    pub(super) grad_norm_sum: f64,
    pub(super) silenced: HashMap<u32, usize>,
    pub(super) corr: CorrSums,
}

/// The batch-level metrics: rewards, accuracy, lengths, truncation, zero-variance groups,
/// over the global batch (every rank's `seqs`; groups never span ranks). Returns the
/// global number of sequences.
pub fn batch_metrics(
    comm: &dyn Comm,
    seqs: &[Sequence],
    scored: &Scored,
    m: &mut UpdateMetrics,
) -> Result<usize> {
    let rewards = &scored.rewards;
    let [n, reward_sum, correct, len_sum, truncated, groups, zero_var] = dist::sum_f64(
        comm,
        [
            seqs.len() as f64,
            rewards.iter().map(|&r| r as f64).sum(),
            seqs.iter().filter(|s| s.reward > 0.5).count() as f64,
            seqs.iter().map(|s| s.response_ids.len()).sum::<usize>() as f64,
            seqs.iter().filter(|s| s.truncated).count() as f64,
            scored.advantages.n_groups as f64,
            scored.advantages.zero_variance_groups.len() as f64,
        ],
    )?;
    let n1 = n.max(1.0);
    let mean = reward_sum / n1;
    let [sq] = dist::sum_f64(comm, [rewards.iter().map(|&r| (r as f64 - mean).powi(2)).sum()])?;
    m.reward_mean = mean as f32;
    m.reward_std = (sq / n1).sqrt() as f32;
    m.accuracy = (correct / n1) as f32;
    m.response_len_mean = (len_sum / n1) as f32;
    let longest = seqs.iter().map(|s| s.response_ids.len()).max().unwrap_or(0);
    m.response_len_max = dist::max_f64(comm, longest as f64)? as usize;
    m.truncation_rate = (truncated / n1) as f32;
    m.zero_var_group_frac = if groups == 0.0 { 0.0 } else { (zero_var / groups) as f32 };
    Ok(n as usize)
}

/// Per-token logit-gradient norms of the first epoch (active sequences) and their shares
/// ([`GradShares`](super::GradShares)); candidates are the tokens with `A > 0 && p <
/// tau_p` under the update's S2T `tau_p` (no candidate share without S2T).
pub(super) fn record_grad_norms(record: &mut UpdateRecord, metrics: &mut UpdateMetrics, tau_p: Option<f32>) {
    let (mut all, mut sil, mut cand) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..record.p.len() {
        let (p, c) = (&record.p[i], &record.collision[i]);
        if p.len() != c.len() {
            continue;
        }
        let a = record.advantages[i];
        let g: Vec<f32> = p.iter().zip(c).map(|(&p, &c)| logit_grad_norm(a, p, c)).collect();
        let s = &record.silenced[i];
        sil.extend((0..g.len()).map(|j| s.get(j).copied().unwrap_or(false)));
        cand.extend(p.iter().map(|&p| tau_p.is_some_and(|t| a > 0.0 && p < t)));
        all.extend_from_slice(&g);
        record.grad_norm[i] = g;
    }
    if !all.is_empty() {
        let sh = grad_shares(&all, &sil, &cand);
        metrics.silenced_grad_share = Some(sh.silenced);
        metrics.top_grad_share = Some(sh.top_frac);
        metrics.top_1pct_grad_share = Some(sh.top_1pct);
        metrics.top_10_grad_share = Some(sh.top_10);
        metrics.candidate_grad_share = tau_p.map(|_| sh.candidates);
    }
}

/// The 0.99-quantile of the first epoch's response-token entropies over every rank
/// (`None` without response tokens).
pub(super) fn entropy_p99(comm: &dyn Comm, record: &UpdateRecord) -> Result<Option<f32>> {
    let mine: Vec<f32> = record.entropy.iter().flatten().copied().collect();
    let all = if comm.size() > 1 { comm.all_gather_f32(&mine)? } else { mine };
    Ok(crate::algo::quantile_linear(&all, 0.99))
}

/// Stores the first epoch's kept and silenced tokens of a mini-batch in the record:
/// `idx` and `ss` are the mini-batch's sequence indices and sequences, in its layout
/// order (the rows of `mask`).
pub(super) fn record_mask(
    record: &mut UpdateRecord,
    (idx, ss): (&[usize], &[&Sequence]),
    mask: &Tensor,
    s2t: Option<&S2tStats>,
) -> Result<()> {
    for (&i, row) in idx.iter().zip(rows(mask, ss)?) {
        record.kept[i] = row.iter().map(|&x| x > 0.5).collect();
        if s2t.is_some() {
            record.silenced[i] = vec![false; row.len()];
        }
    }
    if let Some(st) = s2t {
        for &(b, j) in &st.positions {
            record.silenced[idx[b]][j] = true;
        }
    }
    Ok(())
}

/// Step 7: means over optimizer steps and tokens; the most silenced token ids. Sums and
/// token-weighted means over ranks first (the optimizer-step figures are already global).
pub(super) fn finish_metrics(comm: &dyn Comm, metrics: &mut UpdateMetrics, mut totals: Totals) -> Result<()> {
    if comm.size() > 1 {
        let lm = &mut totals.loss_metrics;
        let w = lm.n_tokens as f64;
        let [resp, silenced, candidates, low_neg, ent_sum, ent_count, n, low, high, kl] = dist::sum_f64(
            comm,
            [
                metrics.response_tokens as f64,
                metrics.silenced_tokens as f64,
                metrics.s2t_candidates as f64,
                metrics.low_p_negative as f64,
                totals.entropy_sum,
                totals.entropy_count as f64,
                w,
                lm.clip_frac_low as f64 * w,
                lm.clip_frac_high as f64 * w,
                lm.approx_kl as f64 * w,
            ],
        )?;
        metrics.response_tokens = resp as usize;
        metrics.silenced_tokens = silenced as usize;
        metrics.s2t_candidates = candidates as usize;
        metrics.low_p_negative = low_neg as usize;
        totals.entropy_sum = ent_sum;
        totals.entropy_count = ent_count as usize;
        let mean = |x: f64| if n > 0.0 { (x / n) as f32 } else { 0.0 };
        (lm.clip_frac_low, lm.clip_frac_high, lm.approx_kl) = (mean(low), mean(high), mean(kl));
        lm.n_tokens = n as usize;
        let mine: Vec<(u32, usize)> = totals.silenced.iter().map(|(&t, &c)| (t, c)).collect();
        totals.silenced.clear();
        for part in dist::all_gather_json(comm, &mine)? {
            for (t, c) in part {
                *totals.silenced.entry(t).or_default() += c;
            }
        }
    }
    let steps = metrics.optimizer_steps.max(1) as f64;
    metrics.loss = (totals.loss_sum / steps) as f32;
    metrics.grad_norm = (totals.grad_norm_sum / steps) as f32;
    metrics.entropy = if totals.entropy_count == 0 {
        0.0
    } else {
        (totals.entropy_sum / totals.entropy_count as f64) as f32
    };
    metrics.tau_h = (totals.tau_h_count > 0).then(|| (totals.tau_h_sum / totals.tau_h_count as f64) as f32);
    metrics.clip_frac_low = totals.loss_metrics.clip_frac_low;
    metrics.clip_frac_high = totals.loss_metrics.clip_frac_high;
    metrics.approx_kl = totals.loss_metrics.approx_kl;
    metrics.silenced_ratio = if metrics.response_tokens == 0 {
        0.0
    } else {
        metrics.silenced_tokens as f32 / metrics.response_tokens as f32
    };
    if metrics.response_tokens > 0 {
        let per = |n: usize| n as f64 / metrics.response_tokens as f64;
        metrics.candidates_per_10k = (per(metrics.s2t_candidates) * 1e4) as f32;
        metrics.silenced_per_10k = (per(metrics.silenced_tokens) * 1e4) as f32;
        metrics.low_p_positive_share = per(metrics.s2t_candidates) as f32;
        metrics.low_p_negative_share = per(metrics.low_p_negative) as f32;
    }
    if metrics.s2t_mini_batches > 0 {
        metrics.candidates_per_mini_batch = metrics.s2t_candidates as f32 / metrics.s2t_mini_batches as f32;
    }
    let mut top: Vec<(u32, usize)> = totals.silenced.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(20);
    metrics.silenced_token_ids = top;
    Ok(())
}
