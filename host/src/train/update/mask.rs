//! Step 4 of the update: the kept-token mask of a mini-batch (S2T or top-entropy, decided
//! on the current policy over the whole global mini-batch, on every rank alike).

use candle_core::{DType, Tensor};

use super::layout::{layout, response_logp};
use super::micro::{Ctx, Forward, MiniBatch};
use crate::algo::{self, MaskConfig, Normaliser, S2tStats, S2tThresholds, TauH};
use crate::dist::{self, Comm};
use crate::model::Grad;
use crate::{Error, Result};

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
        MaskConfig::S2t(t) => {
            let (lp, h) = stats.ok_or_else(need)?;
            let (m, st) = algo::s2t_mask(lp, h, advantages, response, t.tau_p, t.tau_h)?;
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
/// every rank's population (candidates or response tokens; then applied as an absolute
/// threshold, with the global population size in the statistics), the 20-Entropy
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
        MaskConfig::S2t(S2tThresholds { tau_p, tau_h: TauH::Quantile { q, over } }) => {
            let mine = match local {
                Some((lp, h, adv, resp)) => algo::s2t_population_entropies(lp, h, adv, resp, tau_p, over)?,
                None => Vec::new(),
            };
            let all = comm.all_gather_f32(&mine)?;
            let tau_h = algo::quantile_linear(&all, q).map_or(TauH::Quantile { q, over }, TauH::Abs);
            let mut out = plain(&MaskConfig::S2t(S2tThresholds { tau_p, tau_h }))?;
            if let Some((_, Some(st))) = out.as_mut() {
                st.tau_h_population = Some(all.len());
            }
            Ok(out)
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

/// Whether the token mask of `mb` reads the current policy's p and H (a mask other than
/// none, over a mini-batch this rank holds part of).
pub(super) fn needs_stats(x: &Ctx, mb: &MiniBatch) -> bool {
    !matches!(x.cfg.actor.objective.mask, MaskConfig::None) && mb.here()
}

/// Step 4 for one rank's part of a global mini-batch: the current policy's log-probs and
/// entropies where the token mask needs them (from `ahead`, the gradient forwards of its
/// micro-batches in order, else one no-grad pass over its micro-batches), then
/// [`token_mask_on`]. `None` when this rank holds none of the mini-batch.
pub(super) fn mini_batch_mask(
    x: &Ctx,
    mb: &MiniBatch,
    ahead: Option<&[Forward]>,
) -> Result<Option<(Tensor, Option<S2tStats>)>> {
    let stats = match (ahead, needs_stats(x, mb)) {
        (_, false) => None,
        (Some([f]), true) => Some((f.logp.detach(), f.entropy.detach())),
        (ahead, true) => {
            let (mut lps, mut hs) = (Vec::new(), Vec::new());
            for (k, sp) in mb.micros.iter().enumerate() {
                let (lp, h) = match ahead.and_then(|a| a.get(k)) {
                    Some(f) => (f.logp.detach(), f.entropy.detach()),
                    None => {
                        let micro =
                            layout(&mb.ss[sp.start..sp.start + sp.len], sp.p, sp.t, x.pad_id, &x.device)?;
                        response_logp(x.model, &micro, Grad::Off, x.cfg.temperature)?
                    }
                };
                // A micro-batch of a token budget is padded to its own longest response.
                lps.push(lp.pad_with_zeros(1, 0, mb.t - sp.t)?);
                hs.push(h.pad_with_zeros(1, 0, mb.t - sp.t)?);
            }
            Some((Tensor::cat(&lps, 0)?, Tensor::cat(&hs, 0)?))
        }
    };
    let local = match (&mb.response, &stats) {
        (Some(resp), Some((lp, h))) => Some([lp.clone(), h.clone(), mb.adv.clone(), resp.clone()]),
        // No token mask: only the response mask is used.
        (Some(resp), None) => Some([resp.clone(), resp.clone(), mb.adv.clone(), resp.clone()]),
        _ => None,
    };
    match &mb.given {
        None => token_mask_on(
            x.comm,
            &x.cfg.actor.objective.mask,
            local.as_ref().map(|[lp, h, a, r]| (lp, h, a, r)),
        ),
        Some(given) => mask_in_given_order(x, given, local),
    }
}

/// [`token_mask_on`] over rows laid out in another order than the mini-batch's given one
/// (`given[r]`: the given row of layout row `r`): decided in the given order, so that ties
/// fall as on the padded path, then the mask and the silenced positions back in layout order.
fn mask_in_given_order(
    x: &Ctx,
    given: &[usize],
    local: Option<[Tensor; 4]>,
) -> Result<Option<(Tensor, Option<S2tStats>)>> {
    let mut layout_of = vec![0u32; given.len()];
    for (r, &g) in given.iter().enumerate() {
        layout_of[g] = r as u32;
    }
    let to_given = Tensor::from_slice(&layout_of, given.len(), &x.device)?;
    let to_layout = Tensor::from_vec(given.iter().map(|&g| g as u32).collect(), given.len(), &x.device)?;
    let local = match local {
        Some(ts) => {
            let [lp, h, a, r] = ts;
            // CUDA's index_select wants a contiguous source.
            let pick = |t: Tensor| t.contiguous()?.index_select(&to_given, 0);
            Some([pick(lp)?, pick(h)?, pick(a)?, pick(r)?])
        }
        None => None,
    };
    let out = token_mask_on(
        x.comm,
        &x.cfg.actor.objective.mask,
        local.as_ref().map(|[lp, h, a, r]| (lp, h, a, r)),
    )?;
    let Some((m, mut st)) = out else { return Ok(None) };
    if let Some(st) = st.as_mut() {
        st.positions.iter_mut().for_each(|(b, _)| *b = layout_of[*b] as usize);
    }
    Ok(Some((m.index_select(&to_layout, 0)?, st)))
}

/// The loss normalisers of a global mini-batch: over its kept tokens (`mask`, this rank's
/// part) and over its response tokens, each summed over ranks.
pub(super) fn normalisers(
    x: &Ctx,
    mb: &MiniBatch,
    mask: Option<&Tensor>,
) -> Result<(Normaliser, Normaliser)> {
    let norm_len = x.cfg.actor.objective.norm_len;
    let zero = Normaliser { tokens: 0.0, seqs: 0.0, norm_len: norm_len.unwrap_or(0) as f64 };
    let (local, local_resp) = match (mask, &mb.response) {
        (Some(mask), Some(resp)) => {
            (Normaliser::from_masks(&[mask], norm_len)?, Normaliser::from_masks(&[resp], norm_len)?)
        }
        _ => (zero, zero),
    };
    let fixed = norm_len.is_some();
    Ok((global_normaliser(x.comm, local, fixed)?, global_normaliser(x.comm, local_resp, fixed)?))
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
