//! One RL update from a batch of scored responses, in the seams of verl's
//! `dp_actor.update_policy`:
//!
//! 1. [`score`]: rewards (scaled, overlong-shaped) → group advantages;
//! 2. [`active_sequences`]: which sequences reach the loss (DAPO dynamic sampling);
//! 3. old-policy (and reference) log-probs, before any parameter changes;
//! 4. per mini-batch: the token mask ([`token_mask`]: S2T or top-entropy, decided on the
//!    current policy over the whole mini-batch) and the loss normaliser;
//! 5. per micro-batch: forward, loss, backward, gradients accumulated;
//! 6. the optimizer step (skipped, with a warning in the metrics, on a non-finite loss);
//! 7. metrics, and an [`UpdateRecord`] of what the update used (advantages, kept and
//!    silenced tokens, thresholds, per-token p and H) for the REPL's token table.
//!
//! The loss of every micro-batch is divided by the mini-batch's normaliser (kept
//! tokens, or sequences), so that summed micro-batch gradients equal the full
//! mini-batch gradient — the classic gradient-accumulation normalisation bug is
//! avoided by construction.
//!
//! Sequence layout of a micro-batch: `[left pad | prompt | response | right pad]`
//! with prompts left-padded to the mini-batch's longest prompt `P` and responses
//! right-padded to its longest response `T`. Response token `j` sits at `P + j`
//! and is predicted by the hidden state at `P + j - 1`, so only `T` positions
//! go through the LM head.
//!
//! The library prints nothing: warnings go to [`UpdateMetrics::warnings`].

use std::collections::{BTreeMap, HashMap};

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::algo::{
    self, compute_loss, group_advantages, Advantages, LossInputs, LossMetrics, MaskConfig, Normaliser,
    ObjectiveConfig, S2tStats, TauH,
};
use crate::dist::{self, Comm, Local};
use crate::model::{Grad, Qwen3, TokenBatch};
use crate::rollout::Sample;
use crate::train::optim::AdamW;
use crate::{Error, Result};

/// One sampled response with its prompt and reward, as the update consumes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    /// Log-probs of the response tokens under the sampling policy at T = 1
    /// (used when old log-probs come from the rollout).
    pub rollout_logprobs: Option<Vec<f32>>,
    /// Raw reward (1 correct, 0 wrong) before the objective's reward scale.
    pub reward: f32,
    /// GRPO group (responses to the same prompt share it).
    pub group: usize,
    /// True when generation hit the token limit.
    pub truncated: bool,
}

impl Sequence {
    /// A sampled response with its `reward` (the sample's own reward field is
    /// the caller's to check); the rollout's T = 1 log-probs come along.
    pub fn from_sample(s: &Sample, reward: f32) -> Self {
        Sequence {
            prompt_ids: s.prompt_ids.clone(),
            response_ids: s.response_ids.clone(),
            rollout_logprobs: Some(s.old_logprobs.clone()),
            reward,
            group: s.group,
            truncated: s.truncated,
        }
    }
}

/// Where the old-policy log-probs (the PPO ratio's denominator) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogp {
    /// A no-grad forward of the policy before the update (verl's default).
    Recompute,
    /// The log-probs recorded while sampling.
    Rollout,
}

/// How one update runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateConfig {
    /// The objective, masks and advantages.
    pub objective: ObjectiveConfig,
    /// PPO epochs over the batch.
    pub epochs: usize,
    /// Sequences per optimizer step (0 = the whole batch).
    pub mini_batch: usize,
    /// Sequences per forward/backward (0 = the mini-batch); gradients accumulate.
    pub micro_batch: usize,
    /// Old-policy log-probs.
    pub old_logp: OldLogp,
    /// Shuffle sequences between epochs (seeded).
    pub shuffle: bool,
    pub seed: u64,
    /// The logits are divided by this in every forward of the update (old log-probs and
    /// training), as verl does with the rollout temperature so that the ratio is
    /// on-policy at T != 1; p and H of the S2T rule are then the tempered policy's.
    #[serde(default = "one")]
    pub temperature: f64,
    /// Record each response token's logit-gradient norm (first epoch) and the per-step
    /// shares of silenced and top-0.01% tokens; costs one softmax over the logits.
    #[serde(default)]
    pub token_grad_norms: bool,
}

fn one() -> f64 {
    1.0
}

impl Default for UpdateConfig {
    fn default() -> Self {
        Self {
            objective: ObjectiveConfig::default(),
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            old_logp: OldLogp::Recompute,
            shuffle: false,
            seed: 0,
            temperature: 1.0,
            token_grad_norms: false,
        }
    }
}

impl UpdateConfig {
    /// The one constructor of every entry point (the trainer, `stapo update`, the `update`
    /// script binding): sequences are shuffled between epochs exactly when there are
    /// several epochs.
    pub fn new(
        objective: ObjectiveConfig,
        epochs: usize,
        mini_batch: usize,
        micro_batch: usize,
        old_logp: OldLogp,
        seed: u64,
    ) -> Self {
        UpdateConfig {
            objective,
            epochs,
            mini_batch,
            micro_batch,
            old_logp,
            shuffle: epochs > 1,
            seed,
            temperature: 1.0,
            token_grad_norms: false,
        }
    }

    /// The same, with the logits divided by `temperature` (see [`UpdateConfig::temperature`]).
    pub fn with_temperature(self, temperature: f64) -> Self {
        UpdateConfig { temperature, ..self }
    }
}

/// The options of a single update as a user gives them (the `update` script binding's
/// map, `stapo update`'s flags): a named objective preset with `key = value` overrides.
/// Missing fields take their defaults; unknown fields are an error naming them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpdateOptions {
    /// Objective preset (`algo::PRESETS`: grpo, dapo, gspo, sapo, entropy20, justrl, stapo, drgrpo).
    pub objective: String,
    /// `key = value` overrides of the preset (see `ObjectiveConfig::set`).
    pub set: BTreeMap<String, String>,
    /// Learning rate of the step (paper: 1e-6).
    pub lr: f64,
    /// PPO epochs, sequences per optimizer step (0 = all), per forward (0 = mini-batch).
    pub epochs: usize,
    pub mini_batch: usize,
    pub micro_batch: usize,
    pub old_logp: OldLogp,
    pub seed: u64,
    /// The rollout's sampling temperature: the update divides the logits by it (verl).
    pub temperature: f64,
    /// The rollout's response budget (`max_tokens`): sizes DAPO's overlong buffer and
    /// Dr.GRPO's normaliser when the preset's are in force ([`ObjectiveConfig::fit_to_run`]).
    pub max_tokens: Option<usize>,
}

impl Default for UpdateOptions {
    fn default() -> Self {
        UpdateOptions {
            objective: "stapo".into(),
            set: BTreeMap::new(),
            lr: 1e-6,
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            old_logp: OldLogp::Recompute,
            seed: 0,
            temperature: 1.0,
            max_tokens: None,
        }
    }
}

impl UpdateOptions {
    /// The update configuration: the preset, its overrides (validated), [`UpdateConfig::new`].
    /// With `max_tokens`, also returns the notes of [`ObjectiveConfig::fit_to_run`].
    pub fn to_config(&self) -> Result<(UpdateConfig, Vec<String>)> {
        let mut objective = ObjectiveConfig::with_overrides(&self.objective, &self.set)?;
        let notes = match self.max_tokens {
            Some(n) => objective.fit_to_run(n),
            None => Vec::new(),
        };
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::Config {
                file: "update options".into(),
                field: "temperature".into(),
                msg: format!("expected a number > 0, found {}", self.temperature),
            });
        }
        let cfg = UpdateConfig::new(
            objective,
            self.epochs,
            self.mini_batch,
            self.micro_batch,
            self.old_logp,
            self.seed,
        )
        .with_temperature(self.temperature);
        Ok((cfg, notes))
    }
}

/// What one update did: the per-step metrics researchers expect from verl/TRL.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateMetrics {
    pub loss: f32,
    pub reward_mean: f32,
    pub reward_std: f32,
    /// Fraction of responses with raw reward > 0.5.
    pub accuracy: f32,
    /// Mean full-vocabulary entropy over response tokens (current policy).
    pub entropy: f32,
    pub clip_frac_low: f32,
    pub clip_frac_high: f32,
    pub approx_kl: f32,
    pub grad_norm: f32,
    pub response_len_mean: f32,
    pub response_len_max: usize,
    pub truncation_rate: f32,
    pub zero_var_group_frac: f32,
    /// Sequences dropped by dynamic sampling.
    pub dropped_seqs: usize,
    pub response_tokens: usize,
    pub kept_tokens: usize,
    pub silenced_tokens: usize,
    pub silenced_ratio: f32,
    /// The S2T entropy threshold, averaged over the mini-batches that had candidates.
    pub tau_h: Option<f32>,
    /// Optimizer steps taken and skipped (non-finite loss or gradient).
    pub optimizer_steps: usize,
    pub skipped_steps: usize,
    /// Token id → times silenced in this update, most frequent first.
    pub silenced_token_ids: Vec<(u32, usize)>,
    /// Response tokens with `A > 0 && p < tau_p` (S2T candidates), over all mini-batches.
    #[serde(default)]
    pub s2t_candidates: usize,
    /// Shares of the summed per-token logit-gradient norm carried by the silenced tokens
    /// and by the top 0.01% of tokens (first epoch; with `token_grad_norms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silenced_grad_share: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_grad_share: Option<f32>,
    /// What went wrong without stopping the update (a skipped optimizer step, ...), for
    /// the caller to show: the library prints nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The S2T thresholds one mini-batch applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AppliedThresholds {
    /// Epoch and mini-batch index within it.
    pub epoch: usize,
    pub mini_batch: usize,
    pub tau_p: f32,
    /// The entropy threshold used (`None`: a quantile over zero candidates).
    pub tau_h: Option<f32>,
    /// Tokens with `A > 0 && p < tau_p`, and those silenced.
    pub candidates: usize,
    pub silenced: usize,
}

/// What an update used, per input sequence (index = position in the `seqs` given to
/// [`update`]), so that a token table shows exactly what the update did. Token-level
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
    pub entropy: Vec<Vec<f32>>,
    /// Per response token, with `token_grad_norms`: the collision probability `Σ_j p_j²` and
    /// the logit-gradient norm `|A|·sqrt((1 - p_y)² + Σ_{j≠y} p_j²)` (see [`logit_grad_norm`]).
    pub collision: Vec<Vec<f32>>,
    pub grad_norm: Vec<Vec<f32>>,
    /// The S2T thresholds of every mini-batch (empty without S2T).
    pub thresholds: Vec<AppliedThresholds>,
}

/// What [`update`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateOutcome {
    pub metrics: UpdateMetrics,
    pub record: UpdateRecord,
}

/// A micro-batch laid out for the forward pass.
struct Micro {
    tokens: TokenBatch,
    /// Longest prompt `P` and response `T`.
    p: usize,
    t: usize,
    /// `(B, T)` response ids (0 on padding) and response mask.
    targets: Tensor,
    resp_mask: Tensor,
}

fn layout(seqs: &[&Sequence], p: usize, t: usize, pad_id: u32, device: &Device) -> Result<Micro> {
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
fn layout_for(ss: &[&Sequence], pad_id: u32, device: &Device) -> Result<Micro> {
    let p = ss.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(1);
    let t = ss.iter().map(|s| s.response_ids.len()).max().unwrap_or(1).max(1);
    layout(ss, p, t, pad_id, device)
}

/// Log-probs and entropies `(B, T)` of the response tokens of `mb` under `model`, with
/// the logits divided by `temperature`.
fn response_logp(model: &Qwen3, mb: &Micro, grad: Grad, temperature: f64) -> Result<(Tensor, Tensor)> {
    let (lp, h, _) = response_stats(model, mb, grad, temperature, false)?;
    Ok((lp, h))
}

/// [`response_logp`], plus (when `collision`) the collision probability `sum_j p_j^2` of
/// each position's distribution, detached, for the logit-gradient norms of the analysis.
///
/// The collision probability comes from the same tiled pass as the log-probs
/// (`Qwen3::token_stats`), with no `(B, T, V)` logits.
fn response_stats(
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
fn rows(t: &Tensor, seqs: &[&Sequence]) -> Result<Vec<Vec<f32>>> {
    let all = t.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(all.into_iter().zip(seqs).map(|(r, s)| r[..s.response_ids.len()].to_vec()).collect())
}

/// A `(B, T)` tensor from per-sequence vectors, zero-padded.
fn grid(vals: &[&Vec<f32>], t: usize, device: &Device) -> Result<Tensor> {
    let flat: Vec<f32> =
        vals.iter().flat_map(|v| v.iter().copied().chain(std::iter::repeat_n(0.0, t - v.len()))).collect();
    Ok(Tensor::from_vec(flat, (vals.len(), t), device)?)
}

// ---------------------------------------------------------------------------
// 1-2. Rewards, advantages, the sequences that reach the loss
// ---------------------------------------------------------------------------

/// Rewards and advantages of a batch (verl `compute_advantage`).
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Rewards on the objective's scale, overlong-shaped: what the advantages see.
    pub rewards: Vec<f32>,
    /// Rewards on the objective's scale before length shaping: what dynamic sampling sees
    /// (DAPO filters groups on accuracy, before shaping makes equal rewards differ).
    pub unshaped: Vec<f32>,
    /// Group advantages of `rewards`.
    pub advantages: Advantages,
}

/// Scales and shapes the rewards of `seqs` under `obj` and computes group advantages.
pub fn score(seqs: &[Sequence], obj: &ObjectiveConfig) -> Result<Scored> {
    let lens: Vec<usize> = seqs.iter().map(|s| s.response_ids.len()).collect();
    let unshaped: Vec<f32> = seqs.iter().map(|s| obj.reward_scale.apply(s.reward)).collect();
    let mut rewards = unshaped.clone();
    if let Some(ol) = &obj.overlong {
        ol.apply(&mut rewards, &lens)?;
    }
    let groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
    let advantages = group_advantages(&rewards, &groups, obj.adv, obj.std)?;
    Ok(Scored { rewards, unshaped, advantages })
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

/// Settings that a caller left at values that do not fit the run: DAPO's overlong buffer
/// at the preset's L_max while responses stop (truncated) far below it, and
/// seq-mean-token-sum-norm without a constant length (it then divides by the padded length).
fn run_setting_warnings(obj: &ObjectiveConfig, seqs: &[Sequence]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(o) = &obj.overlong {
        let longest_cut = seqs.iter().filter(|s| s.truncated).map(|s| s.response_ids.len()).max();
        if let Some(cut) = longest_cut.filter(|&c| c <= o.max_len.saturating_sub(o.cache_len)) {
            out.push(format!(
                "the overlong penalty can never fire: responses are cut at {cut} tokens but it starts \
                 after {} (L_max {} - L_cache {}); set overlong_max_len to the run's max_tokens",
                o.max_len.saturating_sub(o.cache_len),
                o.max_len,
                o.cache_len
            ));
        }
    }
    if obj.agg == crate::algo::AggMode::SeqMeanTokenSumNorm && obj.norm_len.is_none() {
        out.push(
            "seq-mean-token-sum-norm without norm_len divides by the mini-batch's padded length; \
             set norm_len to the run's max_tokens (Dr.GRPO)"
                .into(),
        );
    }
    out
}

/// Indices of the sequences that reach the loss: non-empty responses, minus the groups
/// DAPO's dynamic sampling drops (all rewards equal) when `obj.dynamic_sampling`.
pub fn active_sequences(seqs: &[Sequence], obj: &ObjectiveConfig, scored: &Scored) -> Result<Vec<usize>> {
    let mut active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].response_ids.is_empty()).collect();
    if obj.dynamic_sampling {
        let groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
        let ds = algo::dynamic_sampling(&scored.unshaped, &groups)?;
        active.retain(|&i| ds.keep[i]);
    }
    Ok(active)
}

// ---------------------------------------------------------------------------
// 3. Old-policy and reference log-probs
// ---------------------------------------------------------------------------

/// The old-policy log-probs of the active sequences.
enum OldLogps {
    /// One epoch over one mini-batch: the policy is still the old one at its forward
    /// pass, so the detached log-probs of that forward are the old log-probs.
    FromForward,
    /// Per sequence index.
    Given(HashMap<usize, Vec<f32>>),
}

/// Log-probs of the response tokens of `idx` under `m`, no gradient, `chunk` at a time.
fn logps_no_grad(
    m: &Qwen3,
    seqs: &[Sequence],
    idx: &[usize],
    (chunk, temperature): (usize, f64),
    pad_id: u32,
) -> Result<HashMap<usize, Vec<f32>>> {
    let mut out = HashMap::with_capacity(idx.len());
    for part in idx.chunks(chunk.max(1)) {
        let ss: Vec<&Sequence> = part.iter().map(|&i| &seqs[i]).collect();
        let mb = layout_for(&ss, pad_id, m.device())?;
        let (lp, _) = response_logp(m, &mb, Grad::Off, temperature)?;
        out.extend(part.iter().copied().zip(rows(&lp, &ss)?));
    }
    Ok(out)
}

/// Old log-probs as `cfg.old_logp` says (verl `compute_log_prob` before the update).
fn old_logprobs(
    model: &Qwen3,
    seqs: &[Sequence],
    active: &[usize],
    cfg: &UpdateConfig,
    whole: bool,
    micro_size: usize,
    pad_id: u32,
) -> Result<OldLogps> {
    Ok(match cfg.old_logp {
        OldLogp::Recompute if whole => OldLogps::FromForward,
        OldLogp::Recompute => {
            OldLogps::Given(logps_no_grad(model, seqs, active, (micro_size, cfg.temperature), pad_id)?)
        }
        OldLogp::Rollout if cfg.temperature != 1.0 => {
            return Err(Error::invalid(format!(
                "update: old_logp = rollout holds log-probs at temperature 1, but the update divides \
                 the logits by {}; use old_logp = recompute",
                cfg.temperature
            )))
        }
        OldLogp::Rollout => OldLogps::Given(
            active
                .iter()
                .map(|&i| {
                    let lp = seqs[i].rollout_logprobs.clone().ok_or_else(|| {
                        Error::invalid(format!(
                            "update: old_logp = rollout but sequence {i} has no rollout log-probs"
                        ))
                    })?;
                    if lp.len() != seqs[i].response_ids.len() {
                        return Err(Error::invalid(format!(
                            "update: sequence {i} has {} rollout log-probs for {} response tokens",
                            lp.len(),
                            seqs[i].response_ids.len()
                        )));
                    }
                    Ok((i, lp))
                })
                .collect::<Result<_>>()?,
        ),
    })
}

/// Reference-policy log-probs when a KL penalty is configured.
fn reference_logprobs(
    reference: Option<&Qwen3>,
    cfg: &UpdateConfig,
    seqs: &[Sequence],
    active: &[usize],
    micro_size: usize,
    pad_id: u32,
) -> Result<Option<HashMap<usize, Vec<f32>>>> {
    match (&cfg.objective.kl, reference) {
        (Some(kl), Some(r)) if kl.beta != 0.0 => {
            Ok(Some(logps_no_grad(r, seqs, active, (micro_size, cfg.temperature), pad_id)?))
        }
        (Some(kl), None) if kl.beta != 0.0 => {
            Err(Error::invalid("update: a KL penalty is configured but no reference model was given"))
        }
        _ => Ok(None),
    }
}

// ---------------------------------------------------------------------------
// 4. The mini-batch token mask
// ---------------------------------------------------------------------------

/// The kept-token mask of one mini-batch: the response mask times the objective's token
/// mask, decided from the current policy's log-probs and entropies `stats` (required
/// unless the mask is [`MaskConfig::None`]). Returns the S2T statistics when S2T ran.
pub fn token_mask(
    mask: &MaskConfig,
    stats: Option<(&Tensor, &Tensor)>,
    advantages: &Tensor,
    response: &Tensor,
) -> Result<(Tensor, Option<S2tStats>)> {
    let need = || Error::invalid("update: the token mask needs the policy's log-probs and entropies");
    match mask {
        MaskConfig::None => Ok((response.clone(), None)),
        MaskConfig::S2t { tau_p, tau_h } => {
            let (lp, h) = stats.ok_or_else(need)?;
            let (m, st) = algo::s2t_mask(lp, h, advantages, response, *tau_p, *tau_h)?;
            Ok((algo::compose_masks(&[&m, response])?, Some(st)))
        }
        MaskConfig::TopEntropy { rho } => {
            let (_, h) = stats.ok_or_else(need)?;
            let (m, _) = algo::top_entropy_mask(h, response, *rho)?;
            Ok((algo::compose_masks(&[&m, response])?, None))
        }
    }
}

/// [`token_mask`] for one rank's part of a global mini-batch (`local`: this rank's
/// log-probs, entropies, advantages and response mask; `None` when it holds none of
/// the mini-batch). Every rank calls it for every mini-batch. Thresholds that are a
/// statistic of the mini-batch are taken over all ranks: the S2T `tau_h` quantile over
/// every rank's candidates (then applied as an absolute threshold), the 20-Entropy
/// top-k over every rank's response tokens (in rank order, as the one-process row
/// order). One rank: exactly [`token_mask`].
pub fn token_mask_on(
    comm: &dyn Comm,
    mask: &MaskConfig,
    local: Option<(&Tensor, &Tensor, &Tensor, &Tensor)>,
) -> Result<Option<(Tensor, Option<S2tStats>)>> {
    let plain = |cfg: &MaskConfig| -> Result<Option<(Tensor, Option<S2tStats>)>> {
        local.map(|(lp, h, adv, resp)| token_mask(cfg, Some((lp, h)), adv, resp)).transpose()
    };
    if comm.size() == 1 {
        return plain(mask);
    }
    match *mask {
        MaskConfig::S2t { tau_p, tau_h: TauH::Quantile(q) } => {
            let mine = match local {
                Some((lp, h, adv, resp)) => algo::s2t_candidate_entropies(lp, h, adv, resp, tau_p)?,
                None => Vec::new(),
            };
            let all = comm.all_gather_f32(&mine)?;
            let tau_h = algo::quantile_linear(&all, q).map_or(TauH::Quantile(q), TauH::Abs);
            plain(&MaskConfig::S2t { tau_p, tau_h })
        }
        MaskConfig::TopEntropy { rho } => {
            // This rank's response-token entropies, row-major.
            let (mine, resp) = match local {
                Some((_, h, _, resp)) => {
                    let hv = h.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let rv = resp.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    (
                        hv.iter().zip(&rv).filter(|(_, &r)| r > 0.5).map(|(&h, _)| h).collect(),
                        Some((rv, resp)),
                    )
                }
                None => (Vec::new(), None),
            };
            let (offset, _) = dist::offset_and_total(comm, mine.len())?;
            let all = comm.all_gather_f32(&mine)?;
            let Some((rv, resp)) = resp else { return Ok(None) };
            if all.is_empty() {
                return Ok(Some((resp.zeros_like()?, None)));
            }
            let n = all.len();
            let device = resp.device();
            let (keep, _) = algo::top_entropy_mask(
                &Tensor::from_vec(all, (1, n), device)?,
                &Tensor::ones((1, n), DType::F32, device)?,
                rho,
            )?;
            let keep = keep.flatten_all()?.to_vec1::<f32>()?;
            let mut k = offset;
            let local_mask: Vec<f32> = rv
                .iter()
                .map(|&r| {
                    if r > 0.5 {
                        k += 1;
                        keep[k - 1]
                    } else {
                        0.0
                    }
                })
                .collect();
            Ok(Some((Tensor::from_vec(local_mask, resp.shape(), device)?, None)))
        }
        _ => plain(mask),
    }
}

// ---------------------------------------------------------------------------
// 5-6. Micro-batch forward + loss accumulation, the optimizer step
// ---------------------------------------------------------------------------

/// Running sums over the micro-batches of an update.
#[derive(Default)]
struct Totals {
    loss_metrics: LossMetrics,
    entropy_sum: f64,
    entropy_count: usize,
    tau_h_sum: f64,
    tau_h_count: usize,
    loss_sum: f64,
    grad_norm_sum: f64,
    silenced: HashMap<u32, usize>,
}

/// One mini-batch, laid out and masked.
struct MiniBatch<'a> {
    /// Indices into `seqs` and the sequences themselves.
    idx: &'a [usize],
    ss: Vec<&'a Sequence>,
    /// Longest prompt and response.
    p: usize,
    t: usize,
    /// `(start, len)` of each micro-batch within it.
    micros: Vec<(usize, usize)>,
    /// `(B,)` advantages.
    adv: Tensor,
}

/// The forward (with gradient) of one micro-batch: its layout, log-probs, entropies and,
/// when asked for, collision probabilities.
type Forward = (Micro, Tensor, Tensor, Option<Tensor>);

/// What one micro-batch step returns: its loss (`None` when not finite) and the detached
/// log-probs, entropies and collision probabilities of its forward.
type MicroOut = (Option<f32>, Tensor, Tensor, Option<Tensor>);

/// Forward, loss and backward of micro-batch `(s, len)` of `mb`; adds its gradients to
/// `acc`. Returns the loss value, or `None` (no backward) when it is not finite.
#[allow(clippy::too_many_arguments)]
fn micro_step(
    model: &Qwen3,
    opt: &AdamW,
    mb: &MiniBatch,
    (s, len): (usize, usize),
    fwd: Option<Forward>,
    losses: (&UpdateConfig, &Tensor, &Normaliser, &Tensor, &Normaliser),
    old: &OldLogps,
    reference: Option<&HashMap<usize, Vec<f32>>>,
    (pad_id, collision): (u32, bool),
    totals: &mut Totals,
    acc: &mut GradStore,
) -> Result<MicroOut> {
    let (cfg, token_mask, norm, response, response_norm) = losses;
    let obj = &cfg.objective;
    let device = model.device();
    let part = &mb.ss[s..s + len];
    let ids = &mb.idx[s..s + len];
    let (micro, logp, entropy, coll) = match fwd {
        Some(f) => f,
        None => {
            let micro = layout(part, mb.p, mb.t, pad_id, device)?;
            let (lp, h, c) = response_stats(model, &micro, Grad::Track, cfg.temperature, collision)?;
            (micro, lp, h, c)
        }
    };
    let old_t = match old {
        OldLogps::FromForward => logp.detach(),
        OldLogps::Given(o) => grid(&ids.iter().map(|i| &o[i]).collect::<Vec<_>>(), mb.t, device)?,
    };
    let ref_t = match reference {
        Some(r) => Some(grid(&ids.iter().map(|i| &r[i]).collect::<Vec<_>>(), mb.t, device)?),
        None => None,
    };
    let mask = token_mask.narrow(0, s, len)?;
    let resp = response.narrow(0, s, len)?;
    let adv = mb.adv.narrow(0, s, len)?;
    let out = compute_loss(
        obj,
        &LossInputs {
            logp: &logp,
            old_logp: &old_t,
            advantages: &adv,
            mask: &mask,
            ref_logp: ref_t.as_ref(),
            entropy: (obj.entropy_coef != 0.0).then_some(&entropy),
            response: Some((&resp, response_norm)),
        },
        norm,
    )?;
    let l = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    // Entropy metric over the response tokens of this micro-batch.
    let em = entropy.detach().to_dtype(DType::F32)?.mul(&micro.resp_mask)?.sum_all()?.to_scalar::<f32>()?;
    totals.entropy_sum += em as f64;
    totals.entropy_count += part.iter().map(|s| s.response_ids.len()).sum::<usize>();
    totals.loss_metrics.merge(&out.metrics);
    let (lp, h) = (logp.detach(), entropy.detach());
    if !l.is_finite() {
        return Ok((None, lp, h, coll));
    }
    let mut grads = out.loss.backward()?;
    for (_, var) in opt.params() {
        if let Some(g) = grads.remove(var.as_tensor()) {
            let g = match acc.remove(var.as_tensor()) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            acc.insert(var.as_tensor(), g);
        }
    }
    Ok((Some(l), lp, h, coll))
}

/// The optimizer step of one mini-batch (skipped, with a warning, when its loss was not
/// finite or AdamW finds a non-finite gradient norm).
fn optimizer_step(
    opt: &mut AdamW,
    acc: &GradStore,
    lr: f64,
    loss: Option<f64>,
    metrics: &mut UpdateMetrics,
    totals: &mut Totals,
) -> Result<()> {
    let Some(loss) = loss else {
        metrics.warnings.push("non-finite loss; optimizer step skipped, weights unchanged".into());
        metrics.skipped_steps += 1;
        return Ok(());
    };
    let report = opt.step(acc, lr)?;
    if report.skipped {
        metrics.warnings.push(format!(
            "gradient norm is {}; optimizer step skipped (weights and moments unchanged)",
            report.grad_norm
        ));
        metrics.skipped_steps += 1;
    } else {
        metrics.optimizer_steps += 1;
        totals.loss_sum += loss;
        totals.grad_norm_sum += report.grad_norm;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The update
// ---------------------------------------------------------------------------

/// Runs one update of `model` on `seqs` (see the module docs). `lr` is this
/// step's learning rate (after any schedule). `reference` is the frozen model
/// for a KL penalty.
pub fn update(
    model: &Qwen3,
    opt: &mut AdamW,
    reference: Option<&Qwen3>,
    seqs: &[Sequence],
    cfg: &UpdateConfig,
    lr: f64,
    pad_id: u32,
) -> Result<UpdateOutcome> {
    update_on(&Local, model, opt, reference, seqs, cfg, lr, pad_id)
}

/// [`update`] as one rank of a data-parallel job (every rank calls it, with the same
/// configuration and learning rate). `seqs` is this rank's share of the global batch:
/// whole GRPO groups, the ranks' shares in the order of the global batch.
///
/// The result equals a one-process update of the global batch up to float summation
/// order: advantages are per group (local); the global active sequences are numbered
/// rank by rank and mini-batches are cut from that global order (shuffled with the
/// same seed on every rank), each rank working on its part of each; the token mask's
/// statistics and the loss normaliser (kept tokens, sequences) are global; gradients
/// are summed over ranks (bucketed all-reduce) before every optimizer step, which then
/// runs identically on every rank; metrics are global. A rank with no part in a
/// mini-batch still joins its collectives.
#[allow(clippy::too_many_arguments)]
pub fn update_on(
    comm: &dyn Comm,
    model: &Qwen3,
    opt: &mut AdamW,
    reference: Option<&Qwen3>,
    seqs: &[Sequence],
    cfg: &UpdateConfig,
    lr: f64,
    pad_id: u32,
) -> Result<UpdateOutcome> {
    let obj = &cfg.objective;
    obj.validate()?;
    // Under several ranks a rank may hold none of the batch (dynamic sampling kept
    // only other ranks' groups); it still joins every collective.
    if seqs.is_empty() && comm.size() == 1 {
        return Err(Error::invalid("update: no sequences"));
    }
    let device = model.device().clone();
    let mut metrics = UpdateMetrics::default();

    // 1-2. Rewards, advantages, the sequences that reach the loss.
    let scored = score(seqs, obj)?;
    let global_n = batch_metrics(comm, seqs, &scored, &mut metrics)?;
    let active = active_sequences(seqs, obj, &scored)?;
    metrics.warnings.extend(run_setting_warnings(obj, seqs));
    let n = seqs.len();
    let mut record = UpdateRecord {
        rewards: scored.rewards.clone(),
        advantages: scored.advantages.values.clone(),
        active: (0..n).map(|i| active.contains(&i)).collect(),
        kept: vec![Vec::new(); n],
        silenced: vec![Vec::new(); n],
        p: vec![Vec::new(); n],
        entropy: vec![Vec::new(); n],
        collision: vec![Vec::new(); n],
        grad_norm: vec![Vec::new(); n],
        thresholds: Vec::new(),
    };
    // The global order of the active sequences: (rank, index) sorted by group, then
    // rank and index: the order of one process holding the whole batch when group ids
    // are global and ascend along it (as the trainer numbers them).
    let global = global_order(comm, seqs, &active)?;
    let global_active = global.len();
    metrics.dropped_seqs = global_n - global_active;
    if global_active == 0 {
        return Ok(UpdateOutcome { metrics, record });
    }
    let mb_size = if cfg.mini_batch == 0 { global_active } else { cfg.mini_batch };
    let micro_size = if cfg.micro_batch == 0 { mb_size } else { cfg.micro_batch.min(mb_size) };

    // 3. Old-policy (and reference) log-probs, before any parameter changes.
    let whole = cfg.epochs.max(1) == 1 && global_active <= mb_size;
    let old = old_logprobs(model, seqs, &active, cfg, whole, micro_size, pad_id)?;
    let reference_logp = reference_logprobs(reference, cfg, seqs, &active, micro_size, pad_id)?;

    let params: Vec<candle_core::Var> = opt.params().map(|(_, v)| v.clone()).collect();
    let params: Vec<&candle_core::Var> = params.iter().collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut totals = Totals::default();
    for epoch in 0..cfg.epochs.max(1) {
        let mut order: Vec<usize> = (0..global_active).collect();
        if cfg.shuffle {
            order.shuffle(&mut rng);
        }
        for (k, chunk) in order.chunks(mb_size).enumerate() {
            // This rank's part of the global mini-batch, in the mini-batch's order.
            let me = comm.rank();
            let mini: Vec<usize> =
                chunk.iter().filter(|&&g| global[g].0 == me).map(|&g| global[g].1).collect();
            let ss: Vec<&Sequence> = mini.iter().map(|&i| &seqs[i]).collect();
            let mb = MiniBatch {
                p: ss.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(1),
                t: ss.iter().map(|s| s.response_ids.len()).max().unwrap_or(1),
                micros: (0..mini.len())
                    .step_by(micro_size)
                    .map(|s| (s, micro_size.min(mini.len() - s)))
                    .collect(),
                adv: Tensor::from_vec(
                    mini.iter().map(|&i| scored.advantages.values[i]).collect::<Vec<f32>>(),
                    mini.len(),
                    &device,
                )?,
                idx: &mini,
                ss,
            };
            let here = !mini.is_empty();
            let resp_all =
                if here { Some(layout(&mb.ss, mb.p, mb.t, pad_id, &device)?.resp_mask) } else { None };

            // 4. The token mask needs the current policy's p and H over the whole
            // mini-batch: from the gradient forward when the mini-batch is one
            // micro-batch, else from one no-grad pass over its micro-batches.
            let needs_stats = !matches!(obj.mask, MaskConfig::None);
            let collision = cfg.token_grad_norms && epoch == 0;
            let mut single: Option<Forward> = if mb.micros.len() == 1 {
                let micro = layout(&mb.ss, mb.p, mb.t, pad_id, &device)?;
                let (lp, h, c) = response_stats(model, &micro, Grad::Track, cfg.temperature, collision)?;
                Some((micro, lp, h, c))
            } else {
                None
            };
            let stats = match (&single, needs_stats && here) {
                (_, false) => None,
                (Some((_, lp, h, _)), true) => Some((lp.detach(), h.detach())),
                (None, true) => {
                    let (mut lps, mut hs) = (Vec::new(), Vec::new());
                    for &(s, len) in &mb.micros {
                        let micro = layout(&mb.ss[s..s + len], mb.p, mb.t, pad_id, &device)?;
                        let (lp, h) = response_logp(model, &micro, Grad::Off, cfg.temperature)?;
                        lps.push(lp);
                        hs.push(h);
                    }
                    Some((Tensor::cat(&lps, 0)?, Tensor::cat(&hs, 0)?))
                }
            };
            let local = match (&resp_all, &stats) {
                (Some(resp), Some((lp, h))) => Some((lp, h, &mb.adv, resp)),
                // No token mask: only the response mask is used.
                (Some(resp), None) => Some((resp, resp, &mb.adv, resp)),
                _ => None,
            };
            let masked = token_mask_on(comm, &obj.mask, local)?;
            if let Some((_, Some(st))) = &masked {
                metrics.silenced_tokens += st.n_silenced;
                metrics.s2t_candidates += st.n_candidates;
                for &(b, j) in &st.positions {
                    *totals.silenced.entry(mb.ss[b].response_ids[j]).or_default() += 1;
                }
            }
            if let MaskConfig::S2t { tau_p, .. } = obj.mask {
                // The threshold is global; a rank without part of the mini-batch
                // learns it from the others, and every rank counts it once.
                let mut tau_h = match &masked {
                    Some((_, Some(st))) => st.tau_h,
                    _ => None,
                };
                if comm.size() > 1 {
                    let v = dist::max_f64(comm, tau_h.map_or(f64::NEG_INFINITY, |t| t as f64))?;
                    tau_h = (v > f64::NEG_INFINITY).then_some(v as f32);
                }
                if let Some(t) = tau_h {
                    totals.tau_h_sum += t as f64;
                    totals.tau_h_count += 1;
                }
                if let Some((_, Some(st))) = &masked {
                    record.thresholds.push(AppliedThresholds {
                        epoch,
                        mini_batch: k,
                        tau_p,
                        tau_h,
                        candidates: st.n_candidates,
                        silenced: st.n_silenced,
                    });
                }
            }
            if let (0, Some((mask, s2t))) = (epoch, &masked) {
                record_mask(&mut record, &mb, mask, s2t.as_ref())?;
            }
            let zero = Normaliser { tokens: 0.0, seqs: 0.0, norm_len: obj.norm_len.unwrap_or(0) as f64 };
            let (local_norm, local_resp_norm) = match (&masked, &resp_all) {
                (Some((mask, _)), Some(resp)) => (
                    Normaliser::from_masks(&[mask], obj.norm_len)?,
                    Normaliser::from_masks(&[resp], obj.norm_len)?,
                ),
                _ => (zero, zero),
            };
            let fixed = obj.norm_len.is_some();
            let norm = global_normaliser(comm, local_norm, fixed)?;
            let resp_norm = global_normaliser(comm, local_resp_norm, fixed)?;

            // 5. Forward + backward per micro-batch, gradients summed.
            let mut acc = GradStore::default();
            let mut step_loss = Some(0f64);
            if let (Some((mask, _)), Some(resp)) = (&masked, &resp_all) {
                for &micro in &mb.micros {
                    let (l, lp, h, coll) = micro_step(
                        model,
                        opt,
                        &mb,
                        micro,
                        single.take(),
                        (cfg, mask, &norm, resp, &resp_norm),
                        &old,
                        reference_logp.as_ref(),
                        (pad_id, collision),
                        &mut totals,
                        &mut acc,
                    )?;
                    if epoch == 0 {
                        let (s, len) = micro;
                        let part = &mb.ss[s..s + len];
                        for ((&i, lp), h) in
                            mb.idx[s..s + len].iter().zip(rows(&lp, part)?).zip(rows(&h, part)?)
                        {
                            record.p[i] = lp.iter().map(|x| x.exp()).collect();
                            record.entropy[i] = h;
                        }
                        if let Some(c) = &coll {
                            for (&i, c) in mb.idx[s..s + len].iter().zip(rows(c, part)?) {
                                record.collision[i] = c;
                            }
                        }
                    }
                    match l {
                        Some(l) => step_loss = step_loss.map(|s| s + l as f64),
                        None => {
                            step_loss = None;
                            break;
                        }
                    }
                }
            }
            if let Some(resp) = &resp_all {
                metrics.response_tokens += resp.sum_all()?.to_scalar::<f32>()? as usize;
            }
            metrics.kept_tokens += norm.tokens as usize;

            // Every rank skips when any rank's loss was not finite; otherwise the
            // gradients and the loss are summed over ranks.
            if comm.size() > 1 {
                let [loss, bad] =
                    dist::sum_f64(comm, [step_loss.unwrap_or(0.0), f64::from(step_loss.is_none())])?;
                step_loss = if bad > 0.0 { None } else { Some(loss) };
                if step_loss.is_some() {
                    dist::all_reduce_grads(comm, &params, &mut acc)?;
                }
            }

            // 6. The optimizer step.
            optimizer_step(opt, &acc, lr, step_loss, &mut metrics, &mut totals)?;
        }
    }
    finish_metrics(comm, &mut metrics, totals)?;
    if cfg.token_grad_norms {
        record_grad_norms(&mut record, &mut metrics);
    }
    Ok(UpdateOutcome { metrics, record })
}

/// Every rank's active sequences as `(rank, index into its seqs)`, in global order:
/// one rank keeps its own order; several sort by `(group, rank, index)`.
fn global_order(comm: &dyn Comm, seqs: &[Sequence], active: &[usize]) -> Result<Vec<(usize, usize)>> {
    if comm.size() == 1 {
        return Ok(active.iter().map(|&i| (0, i)).collect());
    }
    let mine: Vec<(usize, usize)> = active.iter().map(|&i| (seqs[i].group, i)).collect();
    let mut all: Vec<(usize, usize, usize)> = dist::all_gather_json(comm, &mine)?
        .into_iter()
        .enumerate()
        .flat_map(|(r, v)| v.into_iter().map(move |(g, i)| (g, r, i)))
        .collect();
    all.sort_unstable();
    Ok(all.into_iter().map(|(_, r, i)| (r, i)).collect())
}

/// The normaliser of a global mini-batch from each rank's part: kept tokens and
/// sequences summed, the default length (`norm_len` not `fixed`) the longest over ranks.
fn global_normaliser(comm: &dyn Comm, local: Normaliser, fixed: bool) -> Result<Normaliser> {
    if comm.size() == 1 {
        return Ok(local);
    }
    let [tokens, seqs] = dist::sum_f64(comm, [local.tokens, local.seqs])?;
    let norm_len = if fixed { local.norm_len } else { dist::max_f64(comm, local.norm_len)? };
    Ok(Normaliser { tokens, seqs, norm_len })
}

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

/// Per-token logit-gradient norms of the first epoch (active sequences) and their shares.
fn record_grad_norms(record: &mut UpdateRecord, metrics: &mut UpdateMetrics) {
    let (mut all, mut sil) = (Vec::new(), Vec::new());
    for i in 0..record.p.len() {
        let (p, c) = (&record.p[i], &record.collision[i]);
        if p.len() != c.len() {
            continue;
        }
        let a = record.advantages[i];
        let g: Vec<f32> = p.iter().zip(c).map(|(&p, &c)| logit_grad_norm(a, p, c)).collect();
        let s = &record.silenced[i];
        sil.extend((0..g.len()).map(|j| s.get(j).copied().unwrap_or(false)));
        all.extend_from_slice(&g);
        record.grad_norm[i] = g;
    }
    if !all.is_empty() {
        let (s, t) = grad_shares(&all, &sil, TOP_GRAD_FRAC);
        metrics.silenced_grad_share = Some(s);
        metrics.top_grad_share = Some(t);
    }
}

/// Stores the first epoch's kept and silenced tokens of a mini-batch in the record.
fn record_mask(
    record: &mut UpdateRecord,
    mb: &MiniBatch,
    mask: &Tensor,
    s2t: Option<&S2tStats>,
) -> Result<()> {
    for (&i, row) in mb.idx.iter().zip(rows(mask, &mb.ss)?) {
        record.kept[i] = row.iter().map(|&x| x > 0.5).collect();
        if s2t.is_some() {
            record.silenced[i] = vec![false; row.len()];
        }
    }
    if let Some(st) = s2t {
        for &(b, j) in &st.positions {
            record.silenced[mb.idx[b]][j] = true;
        }
    }
    Ok(())
}

/// 7. Means over optimizer steps and tokens; the most silenced token ids. Sums and
/// token-weighted means over ranks first (the optimizer-step figures are already global).
fn finish_metrics(comm: &dyn Comm, metrics: &mut UpdateMetrics, mut totals: Totals) -> Result<()> {
    if comm.size() > 1 {
        let lm = &mut totals.loss_metrics;
        let w = lm.n_tokens as f64;
        let [resp, silenced, candidates, ent_sum, ent_count, n, low, high, kl] = dist::sum_f64(
            comm,
            [
                metrics.response_tokens as f64,
                metrics.silenced_tokens as f64,
                metrics.s2t_candidates as f64,
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
    let mut top: Vec<(u32, usize)> = totals.silenced.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(20);
    metrics.silenced_token_ids = top;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{OverlongConfig, TauH};
    use crate::model::Config;

    const TOL: f32 = 1e-6;

    fn seq(group: usize, reward: f32, prompt: &[u32], response: &[u32]) -> Sequence {
        Sequence {
            prompt_ids: prompt.to_vec(),
            response_ids: response.to_vec(),
            rollout_logprobs: None,
            reward,
            group,
            truncated: false,
        }
    }

    fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
        }
    }

    fn t2(v: &[f32], b: usize, l: usize) -> Tensor {
        Tensor::from_slice(v, (b, l), &Device::Cpu).unwrap()
    }

    #[test]
    fn score_shapes_then_advantages_and_filters_unshaped() {
        // Overlong L_max 4, L_cache 2: penalty 0 up to 2 tokens, -0.5 at 3, -1 at 4 and beyond.
        // Group 0: R = [1, 0, 0, 0], lengths [1, 3, 4, 5] → shaped [1, -0.5, -1, -1];
        //   mean -0.375, sample std sqrt(2.6875 / 3) = 0.9464847,
        //   A = [1.4527425, -0.1320675, -0.6603375, -0.6603375].
        // Group 1: R = [1, 1], lengths [1, 4] → shaped [1, 0]: A = ±0.5 / (0.7071068 + 1e-6)
        //   = ±0.7071058, yet dynamic sampling drops it: its *unshaped* rewards are equal.
        let r = |n: usize| vec![3u32; n];
        let seqs = vec![
            seq(0, 1., &[1], &r(1)),
            seq(0, 0., &[1], &r(3)),
            seq(0, 0., &[1], &r(4)),
            seq(0, 0., &[1], &r(5)),
            seq(1, 1., &[1], &r(1)),
            seq(1, 1., &[1], &r(4)),
        ];
        let mut obj = ObjectiveConfig::preset("dapo").unwrap();
        obj.overlong = Some(OverlongConfig { max_len: 4, cache_len: 2, factor: 1.0 });
        let s = score(&seqs, &obj).unwrap();
        close(&s.unshaped, &[1., 0., 0., 0., 1., 1.], 0.0, "unshaped");
        close(&s.rewards, &[1., -0.5, -1., -1., 1., 0.], TOL, "shaped");
        let want = [1.4527425, -0.1320675, -0.6603375, -0.6603375, 0.7071058, -0.7071058];
        close(&s.advantages.values, &want, 2e-6, "advantages");
        assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 1, 2, 3]);
        obj.dynamic_sampling = false;
        assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 1, 2, 3, 4, 5]);

        // Batch metrics over the shaped rewards: mean -1/12, population std 0.8374896;
        // accuracy 3/6; lengths mean 18/6 = 3, max 5.
        let mut m = UpdateMetrics::default();
        assert_eq!(batch_metrics(&Local, &seqs, &s, &mut m).unwrap(), 6);
        assert!((m.reward_mean + 1. / 12.).abs() < TOL && (m.reward_std - 0.8374896).abs() < 1e-5, "{m:?}");
        assert!((m.accuracy - 0.5).abs() < TOL && (m.response_len_mean - 3.).abs() < TOL);
        assert_eq!(m.response_len_max, 5);
        assert_eq!(m.zero_var_group_frac, 0.0);

        // The same batch on two ranks, one group each: the same global figures on both.
        let comms = crate::dist::ThreadComm::group(2);
        let parts = [seqs[..4].to_vec(), seqs[4..].to_vec()];
        let ms: Vec<(usize, UpdateMetrics)> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&parts)
                .map(|(c, part)| {
                    let obj = &obj;
                    sc.spawn(move || {
                        let mut m = UpdateMetrics::default();
                        let n = batch_metrics(c, part, &score(part, obj).unwrap(), &mut m).unwrap();
                        (n, m)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (n, mr) in ms {
            assert_eq!(n, 6);
            assert!(
                (mr.reward_mean - m.reward_mean).abs() < TOL && (mr.reward_std - m.reward_std).abs() < TOL
            );
            assert_eq!((mr.accuracy, mr.response_len_mean, mr.response_len_max), (0.5, 3.0, 5));
        }
    }

    #[test]
    fn empty_responses_never_reach_the_loss() {
        let seqs = vec![seq(0, 1., &[1], &[2, 3]), seq(0, 0., &[1], &[]), seq(0, 0., &[1], &[4])];
        let mut obj = ObjectiveConfig::preset("grpo").unwrap();
        obj.dynamic_sampling = false;
        let s = score(&seqs, &obj).unwrap();
        assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 2]);
    }

    #[test]
    fn layout_pads_prompts_left_and_responses_right() {
        // Prompts [5, 6] and [8] → P = 2; responses [7] and [9, 10] → T = 2.
        let (a, b) = (seq(0, 0., &[5, 6], &[7]), seq(0, 0., &[8], &[9, 10]));
        let mb = layout(&[&a, &b], 2, 2, 0, &Device::Cpu).unwrap();
        assert_eq!(mb.tokens.ids.to_vec2::<u32>().unwrap(), vec![vec![5, 6, 7, 0], vec![0, 8, 9, 10]]);
        assert_eq!(mb.tokens.mask, vec![vec![1, 1, 1, 0], vec![0, 1, 1, 1]]);
        assert_eq!(mb.targets.to_vec2::<u32>().unwrap(), vec![vec![7, 0], vec![9, 10]]);
        assert_eq!(mb.resp_mask.to_vec2::<f32>().unwrap(), vec![vec![1., 0.], vec![1., 1.]]);
        let empty_prompt = seq(0, 0., &[], &[1]);
        assert!(layout(&[&empty_prompt], 1, 1, 0, &Device::Cpu).is_err());
    }

    #[test]
    fn token_mask_by_hand() {
        // Row 0 (A = +1): p [0.001, 0.5, 0.001, 0.001], H [0.2, 0.1, 0.9, 0.3], last position padding.
        // Row 1 (A = -1): p [0.001, 0.001, 0.2, 0.2], H 0.1 everywhere, two response tokens.
        let ln = |p: f32| p.ln();
        let lp =
            t2(&[ln(0.001), ln(0.5), ln(0.001), ln(0.001), ln(0.001), ln(0.001), ln(0.2), ln(0.2)], 2, 4);
        let h = t2(&[0.2, 0.1, 0.9, 0.3, 0.1, 0.1, 0.1, 0.1], 2, 4);
        let adv = Tensor::from_slice(&[1f32, -1.], 2, &Device::Cpu).unwrap();
        let resp = t2(&[1., 1., 1., 0., 1., 1., 0., 0.], 2, 4);
        // S2T, tau_p 0.002, tau_h 0.5: candidates (0,0) H 0.2 and (0,2) H 0.9 (padding and A < 0
        // never are); only (0,0) is below tau_h.
        let s2t = MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::Abs(0.5) };
        let (m, st) = token_mask(&s2t, Some((&lp, &h)), &adv, &resp).unwrap();
        assert_eq!(m.to_vec2::<f32>().unwrap(), vec![vec![0., 1., 1., 0.], vec![1., 1., 0., 0.]]);
        let st = st.unwrap();
        assert_eq!((st.n_candidates, st.n_silenced, st.positions.clone()), (2, 1, vec![(0, 0)]));
        // Top-entropy rho 0.5 over 5 response tokens: k = ceil(2.5) = 3: H 0.9, 0.2, then the
        // first of the 0.1 ties in row-major order, (0, 1).
        let top = MaskConfig::TopEntropy { rho: 0.5 };
        let (m, st) = token_mask(&top, Some((&lp, &h)), &adv, &resp).unwrap();
        assert_eq!(m.to_vec2::<f32>().unwrap(), vec![vec![1., 1., 1., 0.], vec![0., 0., 0., 0.]]);
        assert!(st.is_none());
        // No mask: the response mask; no statistics needed.
        let (m, _) = token_mask(&MaskConfig::None, None, &adv, &resp).unwrap();
        assert_eq!(m.to_vec2::<f32>().unwrap(), resp.to_vec2::<f32>().unwrap());
        assert!(token_mask(&s2t, None, &adv, &resp).is_err());
    }

    #[test]
    fn skipped_steps_become_warnings_not_prints() {
        let w = candle_core::Var::from_slice(&[1f32, 2.], 2, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), w.clone())], Default::default()).unwrap();
        let (mut m, mut totals) = (UpdateMetrics::default(), Totals::default());
        optimizer_step(&mut opt, &GradStore::default(), 0.1, None, &mut m, &mut totals).unwrap();
        assert_eq!((m.skipped_steps, m.optimizer_steps, opt.step_count()), (1, 0, 0));
        assert!(m.warnings[0].contains("non-finite loss"), "{:?}", m.warnings);
        let mut g = GradStore::default();
        g.insert(w.as_tensor(), Tensor::from_slice(&[f32::NAN, 1.], 2, &Device::Cpu).unwrap());
        optimizer_step(&mut opt, &g, 0.1, Some(1.0), &mut m, &mut totals).unwrap();
        assert_eq!((m.skipped_steps, opt.step_count()), (2, 0));
        assert!(m.warnings[1].contains("gradient norm is NaN"), "{:?}", m.warnings);
        assert_eq!(w.to_vec1::<f32>().unwrap(), vec![1., 2.]);
        // A finite gradient steps and counts its loss.
        g.insert(w.as_tensor(), Tensor::from_slice(&[0.5f32, 1.], 2, &Device::Cpu).unwrap());
        optimizer_step(&mut opt, &g, 0.1, Some(2.5), &mut m, &mut totals).unwrap();
        assert_eq!((m.optimizer_steps, opt.step_count(), m.warnings.len()), (1, 1, 2));
        assert_eq!(totals.loss_sum, 2.5);
    }

    #[test]
    fn finish_metrics_by_hand() {
        let mut m = UpdateMetrics {
            optimizer_steps: 2,
            silenced_tokens: 3,
            response_tokens: 12,
            ..Default::default()
        };
        let totals = Totals {
            loss_sum: 3.0,
            grad_norm_sum: 1.5,
            entropy_sum: 6.0,
            entropy_count: 4,
            tau_h_sum: 1.2,
            tau_h_count: 2,
            silenced: [(5, 2), (3, 2), (9, 1)].into_iter().collect(),
            ..Default::default()
        };
        finish_metrics(&Local, &mut m, totals).unwrap();
        assert_eq!((m.loss, m.grad_norm, m.entropy, m.silenced_ratio), (1.5, 0.75, 1.5, 0.25));
        assert!((m.tau_h.unwrap() - 0.6).abs() < TOL);
        assert_eq!(m.silenced_token_ids, vec![(3, 2), (5, 2), (9, 1)]);
    }

    #[test]
    fn options_build_the_config_and_reject_unknown_fields() {
        let o: UpdateOptions =
            serde_json::from_str(r#"{"objective": "grpo", "set": {"eps_high": "0.28"}, "epochs": 2}"#)
                .unwrap();
        let (c, notes) = o.to_config().unwrap();
        assert!(notes.is_empty());
        assert_eq!(c.objective.loss.clip_range(), Some((0.2, 0.28)));
        assert!(c.shuffle && c.epochs == 2 && o.lr == 1e-6);
        let e = serde_json::from_str::<UpdateOptions>(r#"{"epoch": 2}"#).unwrap_err().to_string();
        assert!(e.contains("epoch"), "{e}");
        assert!(serde_json::from_str::<UpdateOptions>(r#"{"epochs": -1}"#).is_err());
        // max_tokens sizes the preset's overlong buffer (stapo: 20480/4096 → 64/13).
        let o = UpdateOptions { max_tokens: Some(64), temperature: 0.7, ..Default::default() };
        let (c, _) = o.to_config().unwrap();
        assert_eq!(c.objective.overlong.map(|o| (o.max_len, o.cache_len)), Some((64, 13)));
        assert_eq!(c.temperature, 0.7);
        assert!(UpdateOptions { temperature: 0.0, ..Default::default() }.to_config().is_err());
        let bad = UpdateOptions { set: [("tau_p".into(), "-1".into())].into(), ..Default::default() };
        assert!(bad.to_config().unwrap_err().to_string().contains("tau_p"));
    }

    /// A random 2-layer, 64-wide Qwen3 over 97 tokens.
    fn tiny() -> Qwen3 {
        let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": true,
            "eos_token_id": 1, "torch_dtype": "float32"}"#;
        let cfg = Config::from_json_str(text, "tiny").unwrap();
        crate::model::init(&cfg, 5, 0.2, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_record_is_what_the_update_used() {
        // Groups 0-2 mixed (rewards [0, 1, 0, 1] → A = ±0.5 / (sqrt(1/3) + 1e-6) = ±0.8660239);
        // group 3 all correct, dropped by dynamic sampling.
        let mut seqs = Vec::new();
        for g in 0..4u32 {
            for i in 0..4u32 {
                let prompt: Vec<u32> = (0..3 + g).map(|t| (t * 13 + g * 7 + 2) % 97).collect();
                let response: Vec<u32> = (0..4 + i + g).map(|t| (t * 29 + i * 5 + g + 3) % 97).collect();
                let reward = if g == 3 { 1.0 } else { (i % 2) as f32 };
                seqs.push(seq(g as usize, reward, &prompt, &response));
            }
        }
        let m = tiny();
        let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
        let mut obj = ObjectiveConfig::preset("stapo").unwrap();
        obj.set("tau_p", "0.03").unwrap();
        let cfg = UpdateConfig { objective: obj, micro_batch: 5, ..Default::default() };
        let out = update(&m, &mut opt, None, &seqs, &cfg, 1e-3, 0).unwrap();
        let (rec, met) = (&out.record, &out.metrics);
        let a = 0.8660239f32;
        for (i, s) in seqs.iter().enumerate() {
            let g = s.group;
            let want = if g == 3 {
                0.0
            } else if i % 2 == 1 {
                a
            } else {
                -a
            };
            assert!((rec.advantages[i] - want).abs() < 2e-6, "A[{i}] = {}", rec.advantages[i]);
            assert_eq!(rec.active[i], g != 3, "active[{i}]");
            let n = if g == 3 { 0 } else { s.response_ids.len() };
            assert_eq!((rec.kept[i].len(), rec.silenced[i].len(), rec.p[i].len()), (n, n, n), "{i}");
        }
        assert_eq!(met.dropped_seqs, 4);
        // One mini-batch: one set of thresholds, and the S2T rule holds token by token.
        assert_eq!(rec.thresholds.len(), 1);
        let th = rec.thresholds[0];
        assert_eq!(th.tau_p, 0.03);
        let tau_h = th.tau_h.expect("candidates exist at tau_p 0.03");
        let mut silenced = 0;
        for i in (0..seqs.len()).filter(|&i| rec.active[i]) {
            for j in 0..rec.p[i].len() {
                let spurious = rec.advantages[i] > 0.0 && rec.p[i][j] < 0.03 && rec.entropy[i][j] < tau_h;
                assert_eq!(
                    rec.silenced[i][j], spurious,
                    "({i}, {j}): p {} H {}",
                    rec.p[i][j], rec.entropy[i][j]
                );
                assert_eq!(rec.kept[i][j], !spurious);
                silenced += spurious as usize;
            }
        }
        assert!(silenced > 0);
        assert_eq!((silenced, th.silenced), (met.silenced_tokens, met.silenced_tokens));
        let kept: usize = rec.kept.iter().flatten().filter(|&&k| k).count();
        assert_eq!(kept, met.kept_tokens);
    }

    /// The tiny model, one group of two sequences (prompt [5, 6, 7], response [8, 9],
    /// rewards 1 and 0) and the model's full logits of that sequence in f64.
    fn tiny_pair() -> (Qwen3, Vec<Sequence>, Vec<Vec<Vec<f64>>>) {
        let m = tiny();
        let seqs = vec![seq(0, 1., &[5, 6, 7], &[8, 9]), seq(0, 0., &[5, 6, 7], &[8, 9])];
        let batch = TokenBatch::left_padded(&[vec![5, 6, 7, 8, 9]], 0, &Device::Cpu).unwrap();
        let logits = m.forward(&batch).unwrap().to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
        (m, seqs, logits)
    }

    /// `softmax(z / t)` of one row of logits, on the host in f64.
    fn host_softmax(z: &[f64], t: f64) -> Vec<f64> {
        let z: Vec<f64> = z.iter().map(|x| x / t).collect();
        let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - mx).exp()).collect();
        let sum: f64 = e.iter().sum();
        e.iter().map(|x| x / sum).collect()
    }

    #[test]
    fn the_update_sees_the_tempered_policy() {
        // One sequence, prompt [5, 6, 7], response [8, 9]; T = 2. The record's p must be the
        // sampled token's probability under softmax(logits / 2), computed here on the host
        // from the model's full logits; its H the entropy of that distribution.
        let (m, seqs, logits) = tiny_pair();
        let (mut want_p, mut want_h) = (Vec::new(), Vec::new());
        for (pos, target) in [(2usize, 8usize), (3, 9)] {
            let p = host_softmax(&logits[0][pos], 2.0);
            want_p.push(p[target] as f32);
            want_h.push(-p.iter().map(|q| q * q.ln()).sum::<f64>() as f32);
        }
        let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
        let cfg = UpdateConfig::new(ObjectiveConfig::preset("grpo").unwrap(), 1, 0, 0, OldLogp::Recompute, 0)
            .with_temperature(2.0);
        let out = update(&m, &mut opt, None, &seqs, &cfg, 0.0, 0).unwrap();
        close(&out.record.p[0], &want_p, 1e-5, "p at T = 2");
        close(&out.record.entropy[0], &want_h, 1e-4, "H at T = 2");
        // Log-probs recorded at T = 1 cannot serve as old log-probs of a tempered update.
        let cfg = UpdateConfig { old_logp: OldLogp::Rollout, ..cfg };
        let mut with_lp = seqs.clone();
        for s in &mut with_lp {
            s.rollout_logprobs = Some(vec![-1.0; 2]);
        }
        let e = update(&m, &mut opt, None, &with_lp, &cfg, 0.0, 0).unwrap_err().to_string();
        assert!(e.contains("temperature 1"), "{e}");
    }

    #[test]
    fn settings_that_cannot_fire_are_warned() {
        // DAPO's preset buffer starts after 20480 - 4096 tokens; responses cut at 3 tokens.
        let mut s = seq(0, 1., &[1], &[2, 3, 4]);
        s.truncated = true;
        let w = run_setting_warnings(&ObjectiveConfig::preset("dapo").unwrap(), &[s.clone()]);
        assert!(w.len() == 1 && w[0].contains("never fire") && w[0].contains("16384"), "{w:?}");
        let mut fitted = ObjectiveConfig::preset("dapo").unwrap();
        assert!(fitted.fit_to_run(3).is_empty());
        assert!(run_setting_warnings(&fitted, &[s.clone()]).is_empty());
        let dr = ObjectiveConfig::preset("drgrpo").unwrap();
        assert!(run_setting_warnings(&dr, &[s])[0].contains("norm_len"));
    }

    #[test]
    fn logit_grad_norm_and_shares_by_hand() {
        // p = [1/6, 2/6, 3/6], y = 2, A = 2: the gradient -A·(e_y - p) = [1/3, 2/3, -1] has norm
        // sqrt(1/9 + 4/9 + 1) = sqrt(14/9) = 1.2472191; collision = 14/36.
        let g = logit_grad_norm(2.0, 0.5, 14.0 / 36.0);
        assert!((g - 1.2472191).abs() < 1e-6, "{g}");
        assert_eq!(logit_grad_norm(0.0, 0.5, 0.4), 0.0);
        // g = [5, 1, 0, 3, 1] (sum 10), silenced 1 and 3 → 0.4; top 0.01% of 5 tokens → 1 token, 5 → 0.5.
        let (s, t) = grad_shares(&[5., 1., 0., 3., 1.], &[false, true, false, true, false], 1e-4);
        assert!((s - 0.4).abs() < 1e-7 && (t - 0.5).abs() < 1e-7, "{s} {t}");
        assert_eq!(grad_shares(&[0., 0.], &[true, false], 1e-4), (0.0, 0.0));
    }

    #[test]
    fn grad_norms_are_recorded_from_the_collision_probability() {
        // One group of two, prompt [5, 6, 7]; the record's collision probability must be
        // Σ p² of softmax(logits), computed on the host from the model's full logits.
        let (m, seqs, logits) = tiny_pair();
        let want_c: Vec<f32> = [2usize, 3]
            .iter()
            .map(|&pos| host_softmax(&logits[0][pos], 1.0).iter().map(|q| q.powi(2)).sum::<f64>() as f32)
            .collect();
        let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
        let mut cfg =
            UpdateConfig::new(ObjectiveConfig::preset("grpo").unwrap(), 1, 0, 0, OldLogp::Recompute, 0);
        cfg.token_grad_norms = true;
        let out = update(&m, &mut opt, None, &seqs, &cfg, 0.0, 0).unwrap();
        let rec = &out.record;
        close(&rec.collision[0], &want_c, 1e-6, "collision");
        for i in 0..2 {
            for j in 0..2 {
                let want = logit_grad_norm(rec.advantages[i], rec.p[i][j], rec.collision[i][j]);
                assert_eq!(rec.grad_norm[i][j], want);
                assert!(want > 0.0);
            }
        }
        // The analysis of the same sequences without an update agrees with the record.
        let an = token_analysis(&m, &seqs, 0, 1.0, 1).unwrap();
        for i in 0..2 {
            close(&an[i].p, &rec.p[i], 1e-6, "p");
            close(&an[i].entropy, &rec.entropy[i], 1e-5, "H");
            close(&an[i].collision, &rec.collision[i], 1e-6, "collision");
        }
        assert_eq!(out.metrics.silenced_grad_share, Some(0.0));
        // The largest of 4 tokens, which come in equal pairs (the two responses are the same).
        let top = out.metrics.top_grad_share.unwrap();
        assert!((0.25..=0.5).contains(&top), "{top}");
    }
}
