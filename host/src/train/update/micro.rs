//! Step 5 of the update: per micro-batch, the forward with gradient, the loss and the
//! backward, gradients summed into the mini-batch's store.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::layout::{grid, layout, response_stats, rows, Cut, Micro, Span};
use super::metrics::Totals;
use super::old_logp::OldLogps;
use super::phases::Phase;
use super::RolloutCorrection;
use super::{Sequence, UpdateConfig};
use crate::algo::{compute_loss, LossInputs, Normaliser};
use crate::dist::Comm;
use crate::model::{Grad, Qwen3};
use crate::Result;

/// What every seam of one update reads: the ranks, the models, the batch, the settings.
pub(super) struct Ctx<'a> {
    pub comm: &'a dyn Comm,
    pub model: &'a Qwen3,
    pub seqs: &'a [Sequence],
    pub cfg: &'a UpdateConfig,
    pub pad_id: u32,
    pub device: Device,
    /// The optimizer's parameters: the gradients kept (and all-reduced) are theirs.
    pub params: Vec<Var>,
    /// The rollout correction in force (mode resolved), when the rollout's log-probs can be
    /// compared with the old ones (then its metrics are measured, also with mode off).
    pub corr: Option<RolloutCorrection>,
}

/// One rank's part of a global mini-batch, laid out.
pub(super) struct MiniBatch<'a> {
    /// Epoch and index of the mini-batch within it.
    pub epoch: usize,
    pub index: usize,
    /// Indices into `seqs` and the sequences themselves, in layout order (the cut's:
    /// longest first under a token budget).
    pub idx: Vec<usize>,
    pub ss: Vec<&'a Sequence>,
    /// Longest response.
    pub t: usize,
    /// The micro-batches: rows of `idx` and their padded shape.
    pub micros: Vec<Span>,
    /// `(B,)` advantages.
    pub adv: Tensor,
    /// `(B, T)` response mask (`None` when this rank holds none of the mini-batch).
    pub response: Option<Tensor>,
    /// For each layout row, its row in the given order, when the cut reordered them: the
    /// token mask is decided in the given order, so that ties (20-Entropy's top-k keeps
    /// the first of equal entropies) fall as on the padded path.
    pub given: Option<Vec<usize>>,
}

impl<'a> MiniBatch<'a> {
    /// This rank's part (`idx`, in the mini-batch's order) of mini-batch `index` of `epoch`,
    /// laid out and cut into micro-batches by `cut`. The normalisers are the mini-batch's
    /// whatever the cut, so the cut changes float summation order only.
    pub fn new(
        x: &Ctx<'a>,
        (epoch, index): (usize, usize),
        idx: Vec<usize>,
        adv: &[f32],
        cut: Cut,
    ) -> Result<Self> {
        let len_of = |i: usize| (x.seqs[i].prompt_ids.len(), x.seqs[i].response_ids.len());
        let given: Vec<(usize, usize)> = idx.iter().map(|&i| len_of(i)).collect();
        let order = cut.order(&given);
        let idx: Vec<usize> = order.iter().map(|&k| idx[k]).collect();
        let given = order.iter().enumerate().any(|(r, &k)| r != k).then_some(order);
        let lens: Vec<(usize, usize)> = idx.iter().map(|&i| len_of(i)).collect();
        let ss: Vec<&'a Sequence> = idx.iter().map(|&i| &x.seqs[i]).collect();
        let t = lens.iter().map(|l| l.1).max().unwrap_or(1);
        let micros = cut.spans(&lens);
        let adv = Tensor::from_vec(idx.iter().map(|&i| adv[i]).collect::<Vec<f32>>(), idx.len(), &x.device)?;
        let p = lens.iter().map(|l| l.0).max().unwrap_or(1);
        let response =
            if idx.is_empty() { None } else { Some(layout(&ss, p, t, x.pad_id, &x.device)?.resp_mask) };
        Ok(MiniBatch { epoch, index, idx, ss, t, micros, adv, response, given })
    }

    /// Whether this rank holds part of the mini-batch.
    pub fn here(&self) -> bool {
        !self.idx.is_empty()
    }
}

/// The forward (with gradient) of one micro-batch: its layout, log-probs, entropies and,
/// when asked for, collision probabilities.
pub(super) struct Forward {
    pub micro: Micro,
    pub logp: Tensor,
    pub entropy: Tensor,
    pub collision: Option<Tensor>,
}

impl Forward {
    /// The forward with gradient of micro-batch `span` of `mb`.
    pub fn run(x: &Ctx, mb: &MiniBatch, span: Span, collision: bool) -> Result<Self> {
        let micro = layout(&mb.ss[span.start..span.start + span.len], span.p, span.t, x.pad_id, &x.device)?;
        let (logp, entropy, collision) =
            response_stats(x.model, &micro, Grad::Track, x.cfg.temperature, collision)?;
        Ok(Forward { micro, logp, entropy, collision })
    }
}

/// What the loss of every micro-batch of a mini-batch divides by and keeps: the kept-token
/// mask and its normaliser, the response mask and its normaliser (for KL, entropy and
/// GSPO's sequence ratio), all over the whole mini-batch.
/// Also the constant inputs by sequence index: old-policy and reference log-probs.
pub(super) struct LossTargets<'a> {
    pub mask: &'a Tensor,
    pub norm: &'a Normaliser,
    pub response: &'a Tensor,
    pub response_norm: &'a Normaliser,
    pub old: &'a OldLogps,
    pub reference: Option<&'a HashMap<usize, Vec<f32>>>,
}

/// What one micro-batch step returns: its loss (`None` when not finite) and its forward,
/// detached.
pub(super) struct MicroOut {
    pub loss: Option<f32>,
    pub logp: Tensor,
    pub entropy: Tensor,
    pub collision: Option<Tensor>,
}

/// The rollout correction of micro-batch `span`: its mismatch metrics (first epoch) into
/// `totals`, and the policy-term weights of its mode (`None` when off).
fn correction(
    x: &Ctx,
    corr: &RolloutCorrection,
    (mb, span): (&MiniBatch, Span),
    (old_t, resp): (&Tensor, &Tensor),
    totals: &mut Totals,
) -> Result<Option<Tensor>> {
    let part = &mb.ss[span.start..span.start + span.len];
    let rollout: Vec<&Vec<f32>> = part
        .iter()
        .map(|s| s.rollout_logprobs.as_ref())
        .collect::<Option<_>>()
        .ok_or_else(|| crate::Error::invalid("update: rollout correction without rollout log-probs"))?;
    if mb.epoch == 0 {
        for (old, r) in rows(old_t, part)?.iter().zip(&rollout) {
            totals.corr.add(corr, old, r);
        }
    }
    let d = old_t.sub(&grid(&rollout, span.t, &x.device)?)?.mul(resp)?;
    corr.weights(&d)
}

/// Forward (or the given one), loss and backward of micro-batch `span` of `mb`; adds its
/// gradients to `acc`. Returns the loss value, or `None` (no backward) when it is not finite.
/// The mini-batch's `(B, T)` masks are cut to the span's rows and its `t` columns (responses
/// start at column 0, so the columns past `t` are padding).
pub(super) fn micro_step(
    x: &Ctx,
    mb: &MiniBatch,
    span: Span,
    fwd: Forward,
    targets: &LossTargets,
    totals: &mut Totals,
    acc: &mut GradStore,
) -> Result<MicroOut> {
    let obj = &x.cfg.actor.objective;
    let device = &x.device;
    let Span { start: s, len, t, .. } = span;
    let part = &mb.ss[s..s + len];
    let ids = &mb.idx[s..s + len];
    let Forward { micro, logp, entropy, collision } = fwd;
    let old_t = match targets.old {
        OldLogps::FromForward => logp.detach(),
        OldLogps::Given(o) => grid(&ids.iter().map(|i| &o[i]).collect::<Vec<_>>(), t, device)?,
    };
    let ref_t = match targets.reference {
        Some(r) => Some(grid(&ids.iter().map(|i| &r[i]).collect::<Vec<_>>(), t, device)?),
        None => None,
    };
    let mask = targets.mask.narrow(0, s, len)?.narrow(1, 0, t)?;
    let resp = targets.response.narrow(0, s, len)?.narrow(1, 0, t)?;
    let adv = mb.adv.narrow(0, s, len)?;
    let pg_weights = match &x.corr {
        Some(corr) => correction(x, corr, (mb, span), (&old_t, &resp), totals)?,
        None => None,
    };
    let out = Phase::Loss.time(|| {
        compute_loss(
            obj,
            &LossInputs {
                logp: &logp,
                old_logp: &old_t,
                advantages: &adv,
                mask: &mask,
                ref_logp: ref_t.as_ref(),
                entropy: (obj.entropy_coef != 0.0).then_some(&entropy),
                response: Some((&resp, targets.response_norm)),
                pg_weights: pg_weights.as_ref(),
            },
            targets.norm,
        )
    })?;
    let l = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    // Entropy metric over the response tokens of this micro-batch.
    let em = entropy.detach().to_dtype(DType::F32)?.mul(&micro.resp_mask)?.sum_all()?.to_scalar::<f32>()?;
    totals.entropy_sum += em as f64;
    totals.entropy_count += part.iter().map(|s| s.response_ids.len()).sum::<usize>();
    totals.loss_metrics.merge(&out.metrics);
    let done = |loss| MicroOut {
        loss,
        logp: logp.detach(),
        entropy: entropy.detach(),
        collision: collision.clone(),
    };
    if !l.is_finite() {
        return Ok(done(None));
    }
    Phase::Backward.time(|| -> Result<()> {
        let mut grads = out.loss.backward()?;
        for var in &x.params {
            if let Some(g) = grads.remove(var.as_tensor()) {
                let g = match acc.remove(var.as_tensor()) {
                    Some(prev) => (prev + g)?,
                    None => g,
                };
                acc.insert(var.as_tensor(), g);
            }
        }
        Ok(())
    })?;
    Ok(done(Some(l)))
}
