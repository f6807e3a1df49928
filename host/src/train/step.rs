//! One RL update from a batch of scored responses: rewards → advantages →
//! old-policy log-probs → PPO epochs over mini-batches, each accumulated over
//! micro-batches, with the token mask (S2T or top-entropy) computed on the
//! current policy for the whole mini-batch.
//!
//! Follows verl's `dp_actor.update_policy`: the loss of every micro-batch is
//! divided by the mini-batch's normaliser (kept tokens, or sequences), so that
//! summed micro-batch gradients equal the full mini-batch gradient — the
//! classic gradient-accumulation normalisation bug is avoided by construction.
//!
//! Sequence layout of a micro-batch: `[left pad | prompt | response | right pad]`
//! with prompts left-padded to the mini-batch's longest prompt `P` and responses
//! right-padded to its longest response `T`. Response token `j` sits at `P + j`
//! and is predicted by the hidden state at `P + j - 1`, so only `T` positions
//! go through the LM head.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::algo::{
    self, compute_loss, group_advantages, LossInputs, LossMetrics, MaskConfig, Normaliser, ObjectiveConfig,
};
use crate::model::{self, Grad, Qwen3, TokenBatch};
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
        }
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

/// Log-probs and entropies `(B, T)` of the response tokens of `mb` under `model`.
fn response_logp(model: &Qwen3, mb: &Micro, grad: Grad) -> Result<(Tensor, Tensor)> {
    let hidden = model.forward_hidden(&mb.tokens, grad)?;
    let h = hidden.narrow(1, mb.p - 1, mb.t)?;
    let logits = model.lm_head(&h, grad)?;
    model::logprob_entropy(&logits, &mb.targets)
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
) -> Result<UpdateMetrics> {
    let obj = &cfg.objective;
    obj.validate()?;
    if seqs.is_empty() {
        return Err(Error::invalid("update: no sequences"));
    }
    let device = model.device().clone();
    let mut metrics = UpdateMetrics::default();

    // Rewards (scaled, overlong-shaped) and group advantages.
    let lens: Vec<usize> = seqs.iter().map(|s| s.response_ids.len()).collect();
    let mut rewards: Vec<f32> = seqs.iter().map(|s| obj.reward_scale.apply(s.reward)).collect();
    // DAPO filters groups on accuracy, before length shaping makes equal rewards differ.
    let unshaped = rewards.clone();
    if let Some(ol) = &obj.overlong {
        ol.apply(&mut rewards, &lens)?;
    }
    let groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
    let adv = group_advantages(&rewards, &groups, obj.adv, obj.std)?;
    let n = seqs.len() as f32;
    metrics.reward_mean = rewards.iter().sum::<f32>() / n;
    metrics.reward_std = (rewards.iter().map(|r| (r - metrics.reward_mean).powi(2)).sum::<f32>() / n).sqrt();
    metrics.accuracy = seqs.iter().filter(|s| s.reward > 0.5).count() as f32 / n;
    metrics.response_len_mean = lens.iter().sum::<usize>() as f32 / n;
    metrics.response_len_max = lens.iter().copied().max().unwrap_or(0);
    metrics.truncation_rate = seqs.iter().filter(|s| s.truncated).count() as f32 / n;
    metrics.zero_var_group_frac = adv.zero_variance_fraction();

    // DAPO dynamic sampling: drop groups whose rewards are all equal.
    let mut active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].response_ids.is_empty()).collect();
    if obj.dynamic_sampling {
        let ds = algo::dynamic_sampling(&unshaped, &groups)?;
        active.retain(|&i| ds.keep[i]);
    }
    metrics.dropped_seqs = seqs.len() - active.len();
    if active.is_empty() {
        return Ok(metrics);
    }

    let mb_size = if cfg.mini_batch == 0 { active.len() } else { cfg.mini_batch };
    let micro_size = if cfg.micro_batch == 0 { mb_size } else { cfg.micro_batch.min(mb_size) };

    // Old-policy (and reference) log-probs, before any parameter changes.
    let by_micro = |idx: &[usize], m: &Qwen3| -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(idx.len());
        for chunk in idx.chunks(micro_size) {
            let ss: Vec<&Sequence> = chunk.iter().map(|&i| &seqs[i]).collect();
            let mb = layout_for(&ss, pad_id, &device)?;
            let (lp, _) = response_logp(m, &mb, Grad::Off)?;
            out.extend(rows(&lp, &ss)?);
        }
        Ok(out)
    };
    // With one epoch over one mini-batch the policy is still the old one at
    // its forward pass: its detached log-probs are the old log-probs, and the
    // separate no-grad pass would only repeat them.
    let reuse_old = cfg.old_logp == OldLogp::Recompute && cfg.epochs.max(1) == 1 && active.len() <= mb_size;
    let old: HashMap<usize, Vec<f32>> = match cfg.old_logp {
        OldLogp::Recompute if reuse_old => HashMap::new(),
        OldLogp::Recompute => active.iter().copied().zip(by_micro(&active, model)?).collect(),
        OldLogp::Rollout => active
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
    };
    let reference_logp: Option<HashMap<usize, Vec<f32>>> = match (&obj.kl, reference) {
        (Some(kl), Some(r)) if kl.beta != 0.0 => {
            Some(active.iter().copied().zip(by_micro(&active, r)?).collect())
        }
        (Some(kl), None) if kl.beta != 0.0 => {
            return Err(Error::invalid("update: a KL penalty is configured but no reference model was given"))
        }
        _ => None,
    };

    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut silenced: HashMap<u32, usize> = HashMap::new();
    let (mut entropy_sum, mut entropy_count) = (0f64, 0usize);
    let mut loss_metrics = LossMetrics::default();
    let (mut tau_h_sum, mut tau_h_count) = (0f64, 0usize);
    let (mut loss_sum, mut grad_norm_sum) = (0f64, 0f64);
    for _epoch in 0..cfg.epochs.max(1) {
        let mut order = active.clone();
        if cfg.shuffle {
            order.shuffle(&mut rng);
        }
        for mini in order.chunks(mb_size) {
            let ss: Vec<&Sequence> = mini.iter().map(|&i| &seqs[i]).collect();
            let p = ss.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(1);
            let t = ss.iter().map(|s| s.response_ids.len()).max().unwrap_or(1);
            let micros: Vec<(usize, usize)> =
                (0..mini.len()).step_by(micro_size).map(|s| (s, micro_size.min(mini.len() - s))).collect();
            let adv_all = Tensor::from_vec(
                mini.iter().map(|&i| adv.values[i]).collect::<Vec<f32>>(),
                mini.len(),
                &device,
            )?;
            let resp_all = layout(&ss, p, t, pad_id, &device)?.resp_mask;

            // The token mask needs the current policy's p and H over the whole
            // mini-batch: from the gradient forward when the mini-batch is one
            // micro-batch, else from one no-grad pass over its micro-batches.
            let needs_stats = !matches!(obj.mask, MaskConfig::None);
            let mut single = if micros.len() == 1 {
                let mb = layout(&ss, p, t, pad_id, &device)?;
                let (lp, h) = response_logp(model, &mb, Grad::Track)?;
                Some((mb, lp, h))
            } else {
                None
            };
            let stats = if let (true, Some((_, lp, h))) = (needs_stats, &single) {
                Some((lp.detach(), h.detach()))
            } else if needs_stats {
                let mut lps = Vec::new();
                let mut hs = Vec::new();
                for &(s, len) in &micros {
                    let mb = layout(&ss[s..s + len], p, t, pad_id, &device)?;
                    let (lp, h) = response_logp(model, &mb, Grad::Off)?;
                    lps.push(lp);
                    hs.push(h);
                }
                Some((Tensor::cat(&lps, 0)?, Tensor::cat(&hs, 0)?))
            } else {
                None
            };
            let token_mask = match (&obj.mask, &stats) {
                (MaskConfig::S2t { tau_p, tau_h }, Some((lp, h))) => {
                    let (m, st) = algo::s2t_mask(lp, h, &adv_all, &resp_all, *tau_p, *tau_h)?;
                    metrics.silenced_tokens += st.n_silenced;
                    if let Some(th) = st.tau_h {
                        tau_h_sum += th as f64;
                        tau_h_count += 1;
                    }
                    for (b, j) in st.positions {
                        *silenced.entry(ss[b].response_ids[j]).or_default() += 1;
                    }
                    algo::compose_masks(&[&m, &resp_all])?
                }
                (MaskConfig::TopEntropy { rho }, Some((_, h))) => {
                    let (m, _) = algo::top_entropy_mask(h, &resp_all, *rho)?;
                    algo::compose_masks(&[&m, &resp_all])?
                }
                _ => resp_all.clone(),
            };
            let norm = Normaliser::from_masks(&[&token_mask], obj.norm_len)?;

            // Forward + backward per micro-batch, gradients summed.
            let mut acc = GradStore::default();
            let mut step_loss = 0f64;
            let mut finite = true;
            for &(s, len) in &micros {
                let part = &ss[s..s + len];
                let (mb, logp, entropy) = match single.take() {
                    Some(fwd) => fwd,
                    None => {
                        let mb = layout(part, p, t, pad_id, &device)?;
                        let (lp, h) = response_logp(model, &mb, Grad::Track)?;
                        (mb, lp, h)
                    }
                };
                let old_t = if reuse_old {
                    logp.detach()
                } else {
                    grid(&mini[s..s + len].iter().map(|i| &old[i]).collect::<Vec<_>>(), t, &device)?
                };
                let ref_t = match &reference_logp {
                    Some(r) => {
                        Some(grid(&mini[s..s + len].iter().map(|i| &r[i]).collect::<Vec<_>>(), t, &device)?)
                    }
                    None => None,
                };
                let mask = token_mask.narrow(0, s, len)?;
                let adv_t = adv_all.narrow(0, s, len)?;
                let ent_for_loss = (obj.entropy_coef != 0.0).then_some(&entropy);
                let out = compute_loss(
                    obj,
                    &LossInputs {
                        logp: &logp,
                        old_logp: &old_t,
                        advantages: &adv_t,
                        mask: &mask,
                        ref_logp: ref_t.as_ref(),
                        entropy: ent_for_loss,
                    },
                    &norm,
                )?;
                let l = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                // Entropy metric over response tokens of this micro-batch.
                let em = entropy
                    .detach()
                    .to_dtype(DType::F32)?
                    .mul(&mb.resp_mask)?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                entropy_sum += em as f64;
                entropy_count += part.iter().map(|s| s.response_ids.len()).sum::<usize>();
                loss_metrics.merge(&out.metrics);
                if !l.is_finite() {
                    finite = false;
                    break;
                }
                step_loss += l as f64;
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
            }
            metrics.response_tokens += resp_all.sum_all()?.to_scalar::<f32>()? as usize;
            metrics.kept_tokens += norm.tokens as usize;
            if !finite {
                eprintln!("warning: non-finite loss; optimizer step skipped, weights unchanged");
                metrics.skipped_steps += 1;
                continue;
            }
            let report = opt.step(&acc, lr)?;
            if report.skipped {
                metrics.skipped_steps += 1;
            } else {
                metrics.optimizer_steps += 1;
                loss_sum += step_loss;
                grad_norm_sum += report.grad_norm;
            }
        }
    }
    let steps = metrics.optimizer_steps.max(1) as f64;
    metrics.loss = (loss_sum / steps) as f32;
    metrics.grad_norm = (grad_norm_sum / steps) as f32;
    metrics.entropy = if entropy_count == 0 { 0.0 } else { (entropy_sum / entropy_count as f64) as f32 };
    metrics.tau_h = (tau_h_count > 0).then(|| (tau_h_sum / tau_h_count as f64) as f32);
    metrics.clip_frac_low = loss_metrics.clip_frac_low;
    metrics.clip_frac_high = loss_metrics.clip_frac_high;
    metrics.approx_kl = loss_metrics.approx_kl;
    metrics.silenced_ratio = if metrics.response_tokens == 0 {
        0.0
    } else {
        metrics.silenced_tokens as f32 / metrics.response_tokens as f32
    };
    let mut top: Vec<(u32, usize)> = silenced.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(20);
    metrics.silenced_token_ids = top;
    Ok(metrics)
}

/// Layout of a chunk padded to its own longest prompt and response.
fn layout_for(ss: &[&Sequence], pad_id: u32, device: &Device) -> Result<Micro> {
    let p = ss.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(1);
    let t = ss.iter().map(|s| s.response_ids.len()).max().unwrap_or(1).max(1);
    layout(ss, p, t, pad_id, device)
}
