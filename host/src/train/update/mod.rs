//! One RL update from a batch of scored responses, one file per seam of verl's
//! `dp_actor.update_policy`:
//!
//! 1. [`score`]: rewards (scaled, overlong-shaped) → group advantages (`score.rs`);
//! 2. [`active_sequences`]: which sequences reach the loss (DAPO dynamic sampling);
//! 3. old-policy (and reference) log-probs, before any parameter changes (`old_logp.rs`);
//! 4. per mini-batch: the token mask ([`token_mask`]: S2T or top-entropy, decided on the
//!    current policy over the whole mini-batch) and the loss normalisers (`mask.rs`);
//! 5. per micro-batch: forward, loss, backward, gradients accumulated (`micro.rs`);
//! 6. gradients summed over ranks and the optimizer step (skipped, with a warning in the
//!    metrics, on a non-finite loss) (`optimizer.rs`);
//! 7. metrics, and an [`UpdateRecord`] of what the update used (advantages, kept and
//!    silenced tokens, thresholds, per-token p and H) for the REPL's token table
//!    (`metrics.rs`).
//!
//! This file is the driver that calls them in that order. The loss of every micro-batch
//! is divided by the mini-batch's normaliser (kept tokens, or sequences), so that summed
//! micro-batch gradients equal the full mini-batch gradient: the classic
//! gradient-accumulation normalisation bug is avoided by construction.
//!
//! Sequence layout of a micro-batch (`layout.rs`): `[left pad | prompt | response | right
//! pad]` with prompts left-padded to the mini-batch's longest prompt `P` and responses
//! right-padded to its longest response `T`. Response token `j` sits at `P + j` and is
//! predicted by the hidden state at `P + j - 1`, so only `T` positions go through the LM
//! head.
//!
//! The library prints nothing: warnings go to [`UpdateMetrics::warnings`].

mod analysis;
mod config;
mod layout;
mod mask;
mod metrics;
mod micro;
mod old_logp;
mod optimizer;
mod phases;
mod rollout_corr;
mod score;
mod sequence;
#[cfg(test)]
mod tests;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::SeedableRng;

pub use analysis::{
    grad_shares, logit_grad_norm, token_analysis, GradShares, TokenAnalysis, TOP_1PCT, TOP_GRAD_FRAC, TOP_K,
};
pub use config::{under, ActorConfig, OldLogp, UpdateConfig, UpdateOptions};
pub use config::{RolloutCorrMode, RolloutCorrection};
pub use mask::{token_mask, token_mask_on};
pub use metrics::{
    batch_metrics, AppliedThresholds, MiniBatchS2t, UpdateMetrics, UpdateOutcome, UpdateRecord,
};
pub use phases::{cpu_seconds, Phase, PhaseTime, PhaseTimes};
pub use rollout_corr::RolloutCorrMetrics;
pub use score::{active_sequences, score, Scored};
pub use sequence::Sequence;

use crate::algo::{MaskConfig, S2tStats, S2tThresholds};
use crate::dist::{self, Comm, Local};
use crate::model::recompute::activation_bytes;
use crate::model::{Qwen3, Recompute};
use crate::train::optim::{AdamW, Optimizer};
use crate::{Error, Result};
pub use layout::micro_batch_shapes;
use layout::{rows, Cut};
use metrics::{entropy_p99, finish_metrics, record_grad_norms, record_mask, Totals};
use micro::{micro_step, Ctx, Forward, LossTargets, MiniBatch};
use old_logp::{old_logprobs, reference_logprobs, OldLogps};
use optimizer::optimizer_step;
use score::{global_order, run_setting_warnings};

/// The model side of an update: the policy, its optimizer, and the frozen reference
/// policy of a KL penalty.
pub struct Policy<'a> {
    /// The policy the update trains.
    pub model: &'a Qwen3,
    /// [`AdamW`], or its sharded form (ZeRO-1/2) under several ranks.
    pub opt: &'a mut dyn Optimizer,
    /// The frozen reference policy of a KL penalty (`None` without KL).
    pub reference: Option<&'a Qwen3>,
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
) -> Result<UpdateOutcome> {
    update_on(&Local, Policy { model, opt, reference }, seqs, cfg, lr, pad_id)
}

/// [`update`] as one rank of a data-parallel job (every rank calls it, with the same
/// configuration and learning rate). `seqs` is this rank's share of the global batch:
/// whole GRPO groups, the ranks' shares in the order of the global batch. The batch
/// metrics (rewards, lengths, ...) are those of `seqs`; a caller that sampled more than it
/// trains on computes them itself and calls [`optimize_on`].
///
/// The result equals a one-process update of the global batch up to float summation
/// order: advantages are per group (local); the global active sequences are numbered
/// rank by rank and mini-batches are cut from that global order (shuffled with the
/// same seed on every rank), each rank working on its part of each; the token mask's
/// statistics and the loss normaliser (kept tokens, sequences) are global; gradients
/// are summed over ranks (bucketed all-reduce) before every optimizer step, which then
/// runs identically on every rank; metrics are global. A rank with no part in a
/// mini-batch still joins its collectives.
pub fn update_on(
    comm: &dyn Comm,
    policy: Policy,
    seqs: &[Sequence],
    cfg: &UpdateConfig,
    lr: f64,
    pad_id: u32,
) -> Result<UpdateOutcome> {
    let mut outcome = optimize_on(comm, policy, seqs, cfg, lr, pad_id)?;
    let scored = score(seqs, &cfg.actor.objective)?;
    batch_metrics(comm, seqs, &scored, &mut outcome.metrics)?;
    Ok(outcome)
}

/// Steps 1-7 without the batch metrics (which [`batch_metrics`] computes over whatever the
/// caller sampled): the optimization figures, the dropped sequences and the record.
pub fn optimize_on(
    comm: &dyn Comm,
    policy: Policy,
    seqs: &[Sequence],
    cfg: &UpdateConfig,
    lr: f64,
    pad_id: u32,
) -> Result<UpdateOutcome> {
    let obj = &cfg.actor.objective;
    obj.validate()?;
    // Under several ranks a rank may hold none of the batch (dynamic sampling kept
    // only other ranks' groups); it still joins every collective.
    if seqs.is_empty() && comm.size() == 1 {
        return Err(Error::invalid("update: no sequences"));
    }
    let Policy { model, opt, reference } = policy;
    let params = opt.trainable();

    // 1-2. Rewards, advantages, the sequences that reach the loss, in their global order:
    // (rank, index) sorted by group, then rank and index, which is the order of one process
    // holding the whole batch when group ids are global and ascend along it.
    let scored = score(seqs, obj)?;
    let active = active_sequences(seqs, obj, &scored)?;
    let corr = rollout_corr::in_force(comm, cfg, seqs, &active)?;
    let x = Ctx { comm, model, seqs, cfg, pad_id, device: model.device().clone(), params, corr };
    let mut out = Progress::new(seqs.len(), &scored, &active);
    out.metrics.warnings.extend(run_setting_warnings(obj, seqs));
    let global = global_order(comm, seqs, &active)?;
    let [global_n] = dist::sum_f64(comm, [seqs.len() as f64])?;
    out.metrics.dropped_seqs = global_n as usize - global.len();
    if global.is_empty() {
        return Ok(UpdateOutcome { metrics: out.metrics, record: out.record });
    }
    let mb_size = if cfg.actor.mini_batch == 0 { global.len() } else { cfg.actor.mini_batch };
    let micro_size = if cfg.actor.micro_batch == 0 { mb_size } else { cfg.actor.micro_batch.min(mb_size) };
    let cut = Cut::new(cfg.actor.max_tokens_per_micro, micro_size);

    // 3. Old-policy (and reference) log-probs, before any parameter changes. seq-MIS decides
    // on whole sequences before the loss, so it needs them before the training forward.
    let seq_mis = x.corr.is_some_and(|c| c.mode == RolloutCorrMode::SeqMis);
    let whole = cfg.actor.epochs.max(1) == 1 && global.len() <= mb_size && !seq_mis;
    let old = old_logprobs(model, seqs, &active, cfg, whole, cut, pad_id)?;
    let reference_logp = reference_logprobs(reference, cfg, seqs, &active, cut, pad_id)?;
    let given = Given { old: &old, reference: reference_logp.as_ref() };

    // 4-6. Per epoch and mini-batch: this rank's part of each global mini-batch.
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    for epoch in 0..cfg.actor.epochs.max(1) {
        let mut order: Vec<usize> = (0..global.len()).collect();
        if cfg.shuffle() {
            order.shuffle(&mut rng);
        }
        for (k, chunk) in order.chunks(mb_size).enumerate() {
            let mine = chunk.iter().filter(|&&g| global[g].0 == comm.rank()).map(|&g| global[g].1).collect();
            let mb = MiniBatch::new(&x, (epoch, k), mine, &scored.advantages.values, cut)?;
            mini_batch_step(&x, opt, &mb, &given, lr, &mut out)?;
        }
    }
    // 7. Metrics.
    if let Some(c) = &x.corr {
        out.metrics.rollout_corr = out.totals.corr.finish(comm, c)?;
    }
    finish_metrics(comm, &mut out.metrics, out.totals)?;
    out.metrics.entropy_p99 = entropy_p99(comm, &out.record)?;
    if cfg.token_grad_norms {
        let tau_p = cfg.actor.objective.mask.s2t().map(|t| t.tau_p);
        record_grad_norms(&mut out.record, &mut out.metrics, tau_p);
    }
    Ok(UpdateOutcome { metrics: out.metrics, record: out.record })
}

/// What an update accumulates as it goes: metrics, running sums and the record.
struct Progress {
    metrics: UpdateMetrics,
    totals: Totals,
    record: UpdateRecord,
}

impl Progress {
    fn new(n: usize, scored: &Scored, active: &[usize]) -> Self {
        let record = UpdateRecord {
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
        Progress { metrics: UpdateMetrics::default(), totals: Totals::default(), record }
    }
}

/// The old-policy and reference log-probs of step 3, by sequence index.
struct Given<'a> {
    old: &'a OldLogps,
    reference: Option<&'a std::collections::HashMap<usize, Vec<f32>>>,
}

/// Steps 4-6 for one mini-batch: mask and normalisers, micro-batches, sync and step.
fn mini_batch_step(
    x: &Ctx,
    opt: &mut dyn Optimizer,
    mb: &MiniBatch,
    given: &Given,
    lr: f64,
    out: &mut Progress,
) -> Result<()> {
    // 4. The token mask needs the current policy's p and H over the whole mini-batch:
    // from the gradient forwards of its micro-batches, run ahead of their losses while
    // their kept activations fit (always for one micro-batch), else from one no-grad pass
    // over them.
    let collision = x.cfg.token_grad_norms && mb.epoch == 0;
    let ahead: Vec<Forward> = if mb.micros.len() == 1 || (mask::needs_stats(x, mb) && forwards_fit(x, mb)) {
        mb.micros.iter().map(|&span| Forward::run(x, mb, span, collision)).collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let mut masked = mask::mini_batch_mask(x, mb, (!ahead.is_empty()).then_some(&ahead[..]))?;
    if let (Some((m, _)), Some(c), OldLogps::Given(old)) = (&mut masked, &x.corr, given.old) {
        if c.mode == RolloutCorrMode::SeqMis {
            *m = rollout_corr::reject_sequences(c, m, (&mb.ss, &mb.idx), old)?;
        }
    }
    record_s2t(x, mb, masked.as_ref(), out)?;
    if let (0, Some((mask, s2t))) = (mb.epoch, &masked) {
        record_mask(&mut out.record, (&mb.idx, &mb.ss), mask, s2t.as_ref())?;
    }
    let (norm, response_norm) = mask::normalisers(x, mb, masked.as_ref().map(|(m, _)| m))?;

    // 5. Forward + backward per micro-batch, gradients summed.
    let mut acc = GradStore::default();
    let mut loss = Some(0f64);
    if let (Some((mask, _)), Some(response)) = (&masked, &mb.response) {
        let targets = LossTargets {
            mask,
            norm: &norm,
            response,
            response_norm: &response_norm,
            old: given.old,
            reference: given.reference,
        };
        loss = accumulate(x, mb, &targets, ahead, collision, out, &mut acc)?;
    }
    if let Some(resp) = &mb.response {
        out.metrics.response_tokens += resp.sum_all()?.to_scalar::<f32>()? as usize;
    }
    out.metrics.kept_tokens += norm.tokens as usize;

    // 6. Every rank skips when any rank's loss was not finite; otherwise the loss is summed
    // over ranks and the optimizer steps, summing the gradients over ranks as it needs them
    // (all-reduced, or reduce-scattered when sharded).
    let loss = sync_over_ranks(x, loss)?;
    optimizer_step(x.comm, opt, &mut acc, lr, loss, &mut out.metrics, &mut out.totals)
}

/// Whether the gradient forwards of every micro-batch of `mb` may be held at once, until
/// the token mask is decided: while their kept activations ([`activation_bytes`], padding
/// counted) stay under the size from which one forward recomputes its layers
/// ([`Recompute::AUTO_BYTES`]). The bundled model's quickstart batch keeps about 1.5 GB.
fn forwards_fit(x: &Ctx, mb: &MiniBatch) -> bool {
    let tokens: usize = mb.micros.iter().map(|s| s.tokens()).sum();
    activation_bytes(x.model.config(), x.model.dtype().size_in_bytes()).saturating_mul(tokens)
        < forward_budget()
}

#[cfg(not(test))]
fn forward_budget() -> usize {
    Recompute::AUTO_BYTES
}

#[cfg(test)]
thread_local! {
    /// [`forwards_fit`]'s budget on this thread: tests set 0 to take the no-grad pass.
    static FORWARD_BUDGET: std::cell::Cell<usize> = const { std::cell::Cell::new(Recompute::AUTO_BYTES) };
}

#[cfg(test)]
fn forward_budget() -> usize {
    FORWARD_BUDGET.with(|b| b.get())
}

/// Step 5: the micro-batches of `mb` (with their forwards already run when `ahead` holds
/// them, in order), their gradients summed into `acc`; the first epoch's p, H and
/// collision probabilities go to the record. Returns the summed loss, or `None` as soon as
/// one is not finite.
fn accumulate(
    x: &Ctx,
    mb: &MiniBatch,
    targets: &LossTargets,
    ahead: Vec<Forward>,
    collision: bool,
    out: &mut Progress,
    acc: &mut GradStore,
) -> Result<Option<f64>> {
    let mut loss = 0f64;
    let mut ahead = ahead.into_iter();
    for &span in &mb.micros {
        let fwd = match ahead.next() {
            Some(f) => f,
            None => Forward::run(x, mb, span, collision)?,
        };
        let m = micro_step(x, mb, span, fwd, targets, &mut out.totals, acc)?;
        if mb.epoch == 0 {
            let rows_of = span.start..span.start + span.len;
            let (part, idx) = (&mb.ss[rows_of.clone()], &mb.idx[rows_of]);
            for ((&i, lp), h) in idx.iter().zip(rows(&m.logp, part)?).zip(rows(&m.entropy, part)?) {
                out.record.p[i] = lp.iter().map(|x| x.exp()).collect();
                out.record.entropy[i] = h;
            }
            if let Some(c) = &m.collision {
                for (&i, c) in idx.iter().zip(rows(c, part)?) {
                    out.record.collision[i] = c;
                }
            }
        }
        match m.loss {
            Some(l) => loss += l as f64,
            None => return Ok(None),
        }
    }
    Ok(Some(loss))
}

/// The S2T bookkeeping of a mini-batch: silenced token ids, candidates, the entropy
/// threshold (global: a rank without part of the mini-batch learns it from the others,
/// and every rank counts it once) and the thresholds applied, for the record.
fn record_s2t(
    x: &Ctx,
    mb: &MiniBatch,
    masked: Option<&(Tensor, Option<S2tStats>)>,
    out: &mut Progress,
) -> Result<()> {
    let stats = masked.and_then(|(_, s)| s.as_ref());
    if let Some(st) = stats {
        out.metrics.silenced_tokens += st.n_silenced;
        out.metrics.s2t_candidates += st.n_candidates;
        out.metrics.low_p_negative += st.n_low_p_negative;
        for &(b, j) in &st.positions {
            *out.totals.silenced.entry(mb.ss[b].response_ids[j]).or_default() += 1;
        }
    }
    let MaskConfig::S2t(S2tThresholds { tau_p, .. }) = x.cfg.actor.objective.mask else { return Ok(()) };
    // The mini-batch's tokens, candidates and silenced tokens over every rank (each rank
    // holds part of it, or none).
    let tokens: usize = mb.ss.iter().map(|s| s.response_ids.len()).sum();
    let mut seen = MiniBatchS2t {
        tokens,
        candidates: stats.map_or(0, |st| st.n_candidates),
        silenced: stats.map_or(0, |st| st.n_silenced),
    };
    if x.comm.size() > 1 {
        let [t, c, s] =
            dist::sum_f64(x.comm, [seen.tokens as f64, seen.candidates as f64, seen.silenced as f64])?;
        seen = MiniBatchS2t { tokens: t as usize, candidates: c as usize, silenced: s as usize };
    }
    out.metrics.s2t_mini_batches += 1;
    out.metrics.s2t_mini_batches_2plus += usize::from(seen.candidates >= 2);
    out.metrics.s2t_by_mini_batch.push(seen);
    let mut tau_h = stats.and_then(|st| st.tau_h);
    let mut population = stats.and_then(|st| st.tau_h_population);
    if x.comm.size() > 1 {
        let v = dist::max_f64(x.comm, tau_h.map_or(f64::NEG_INFINITY, |t| t as f64))?;
        tau_h = (v > f64::NEG_INFINITY).then_some(v as f32);
        // Every rank holding part of the mini-batch has the same global size.
        let n = dist::max_f64(x.comm, population.map_or(-1.0, |n| n as f64))?;
        population = (n >= 0.0).then_some(n as usize);
    }
    if let Some(t) = tau_h {
        out.totals.tau_h_sum += t as f64;
        out.totals.tau_h_count += 1;
    }
    if let Some(n) = population {
        *out.metrics.tau_h_population.get_or_insert(0) += n;
    }
    if let Some(st) = stats {
        out.record.thresholds.push(AppliedThresholds {
            epoch: mb.epoch,
            mini_batch: mb.index,
            tau_p,
            tau_h,
            population,
            candidates: st.n_candidates,
            silenced: st.n_silenced,
        });
    }
    Ok(())
}

/// Step 6's collective: `None` on every rank when any rank's loss was not finite;
/// otherwise the loss summed over ranks (the optimizer sums the gradients).
fn sync_over_ranks(x: &Ctx, loss: Option<f64>) -> Result<Option<f64>> {
    if x.comm.size() == 1 {
        return Ok(loss);
    }
    let [sum, bad] = dist::sum_f64(x.comm, [loss.unwrap_or(0.0), f64::from(loss.is_none())])?;
    if bad > 0.0 {
        return Ok(None);
    }
    Ok(Some(sum))
}
