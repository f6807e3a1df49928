//! Step 3 of the update: the old-policy log-probs (the PPO ratio's denominator) and the
//! reference policy's, computed before any parameter changes (verl `compute_log_prob`).

use std::collections::HashMap;

use super::layout::{layout_for, response_logp, rows, Cut};
use super::phases::Phase;
use super::{OldLogp, Sequence, UpdateConfig};
use crate::model::{Grad, Qwen3};
use crate::{Error, Result};

/// The old-policy log-probs of the active sequences.
pub(super) enum OldLogps {
    /// One epoch over one mini-batch: the policy is still the old one at its forward
    /// pass, so the detached log-probs of that forward are the old log-probs.
    FromForward,
    /// Per sequence index.
    Given(HashMap<usize, Vec<f32>>),
}

/// Log-probs of the response tokens of `idx` under `m`, no gradient, in the micro-batches
/// of `cut` (each padded to its own longest prompt and response).
pub(super) fn logps_no_grad(
    m: &Qwen3,
    seqs: &[Sequence],
    idx: &[usize],
    (cut, temperature): (Cut, f64),
    pad_id: u32,
) -> Result<HashMap<usize, Vec<f32>>> {
    let mut out = HashMap::with_capacity(idx.len());
    let len_of = |i: usize| (seqs[i].prompt_ids.len(), seqs[i].response_ids.len());
    let given: Vec<(usize, usize)> = idx.iter().map(|&i| len_of(i)).collect();
    let idx: Vec<usize> = cut.order(&given).into_iter().map(|k| idx[k]).collect();
    let lens: Vec<(usize, usize)> = idx.iter().map(|&i| len_of(i)).collect();
    for span in cut.spans(&lens) {
        let part = &idx[span.start..span.start + span.len];
        let ss: Vec<&Sequence> = part.iter().map(|&i| &seqs[i]).collect();
        let mb = layout_for(&ss, pad_id, m.device())?;
        let (lp, _) = Phase::OldPolicy.time(|| response_logp(m, &mb, Grad::Off, temperature))?;
        out.extend(part.iter().copied().zip(rows(&lp, &ss)?));
    }
    Ok(out)
}

/// Old log-probs as `cfg.actor.old_logp` says (verl `compute_log_prob` before the update).
pub(super) fn old_logprobs(
    model: &Qwen3,
    seqs: &[Sequence],
    active: &[usize],
    cfg: &UpdateConfig,
    whole: bool,
    cut: Cut,
    pad_id: u32,
) -> Result<OldLogps> {
    Ok(match cfg.actor.old_logp {
        OldLogp::Recompute if whole => OldLogps::FromForward,
        OldLogp::Recompute => {
            OldLogps::Given(logps_no_grad(model, seqs, active, (cut, cfg.temperature), pad_id)?)
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
pub(super) fn reference_logprobs(
    reference: Option<&Qwen3>,
    cfg: &UpdateConfig,
    seqs: &[Sequence],
    active: &[usize],
    cut: Cut,
    pad_id: u32,
) -> Result<Option<HashMap<usize, Vec<f32>>>> {
    match (&cfg.actor.objective.kl, reference) {
        (Some(kl), Some(r)) if kl.beta != 0.0 => {
            Ok(Some(logps_no_grad(r, seqs, active, (cut, cfg.temperature), pad_id)?))
        }
        (Some(kl), None) if kl.beta != 0.0 => {
            Err(Error::invalid("update: a KL penalty is configured but no reference model was given"))
        }
        _ => Ok(None),
    }
}
