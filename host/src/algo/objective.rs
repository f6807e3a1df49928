//! Per-token policy objectives and their aggregation into one scalar loss.
//!
//! Follows verl `trainer/ppo/core_algos.py` (`compute_policy_loss_vanilla`,
//! `compute_policy_loss_gspo`, `compute_policy_loss_sapo`, `kl_penalty`, `agg_loss`):
//!
//! - PPO-clip (Schulman et al. 2017) with DAPO clip-higher (arXiv:2503.14476) and
//!   dual-clip (Ye et al. 2020): `pg1 = -A·r`, `pg2 = -A·clip(r, 1-eps_low, 1+eps_high)`,
//!   `c1 = max(pg1, pg2)`; with dual-clip `c`: `pg3 = -A·c`, `c2 = min(pg3, c1)`, and the
//!   loss is `c2` where `A < 0`, `c1` elsewhere. `r = exp(clamp(logp - old, -20, 20))`.
//! - GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence ratio
//!   `s_i = exp(mean_t over kept tokens of (logp - old))` in the token-level straight-through
//!   form `log s_{i,t} = sg[log s_i] + logp_t - sg[logp_t]` (clamped at 10), clipped like
//!   PPO at tiny eps (3e-4 / 4e-4). Each kept token's gradient is `-A_i·s_i` (unclipped).
//! - SAPO (arXiv:2511.20347): soft gate `f(r) = sigmoid(tau·(r-1))·4/tau`, `tau = tau_pos`
//!   where `A > 0` else `tau_neg`; loss `-f(r)·A`. Gradient w.r.t. `logp`:
//!   `d/dlogp [-A·f(r)] = -A·(4/tau)·tau·σ(1-σ)·r = -4·A·σ·(1-σ)·r` with
//!   `σ = sigmoid(tau·(r-1))`, so at `r = 1` it is `-A` (the on-policy PG gradient) and it
//!   decays smoothly instead of being cut off like a hard clip.
//! - REINFORCE (`Pg`): `-A·r`, which equals `-A·logp` in value of the gradient at `old = logp`.
//! - KL to a frozen reference (DeepSeekMath GRPO): k1 `logp - ref`, k2 `½(logp - ref)²`,
//!   k3 `exp(ref - logp) - (ref - logp) - 1` (log-ratio clamped to ±20, k3 to ±10, as verl),
//!   added as `+beta·KL`; entropy bonus `-entropy_coef·H`.
//!
//! Aggregation (verl `agg_loss`) divides by an explicit [`Normaliser`] computed once over the
//! whole mini-batch, so that the losses (and gradients) of its micro-batches *sum* to the
//! mini-batch loss exactly — token-mean over micro-batches is a classic source of bugs.

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::config::ObjectiveConfig;
pub use super::config::{AggMode, KlConfig, KlKind, PolicyLoss};
use super::{dims_bt, expand_advantages, expect_bt};
use crate::{Error, Result};

/// verl clamps the token log-ratio to this range before `exp`.
const LOG_RATIO_CLAMP: f32 = 20.0;
/// verl clamps the GSPO log sequence ratio from above at this value.
const GSPO_LOG_RATIO_MAX: f32 = 10.0;

/// The tensors of one (micro-)batch. All are `(B, T)` f32 except `advantages`.
#[derive(Clone, Copy, Debug)]
pub struct LossInputs<'a> {
    /// Log-prob of each sampled token under the current policy; differentiable.
    pub logp: &'a Tensor,
    /// Log-prob under the policy that sampled (treated as a constant).
    pub old_logp: &'a Tensor,
    /// `(B,)` per sequence or `(B, T)` per token (constant).
    pub advantages: &'a Tensor,
    /// The final kept-token mask (response × S2T/top-entropy × user), 0/1 (values > 0.5
    /// count as kept).
    pub mask: &'a Tensor,
    /// Reference-policy log-probs; required when a KL penalty with `beta != 0` is configured.
    pub ref_logp: Option<&'a Tensor>,
    /// Differentiable per-token entropy; required when `entropy_coef != 0`.
    pub entropy: Option<&'a Tensor>,
    /// The response mask and its normaliser (counted over the whole mini-batch), when the
    /// token mask keeps fewer tokens than the response (S2T, top-entropy): masks limit the
    /// policy-gradient term only, so the KL and entropy terms and GSPO's sequence ratio
    /// use the response (verl; the 20-Entropy authors' code). `None`: `mask` and the
    /// normaliser given to [`compute_loss`].
    pub response: Option<(&'a Tensor, &'a Normaliser)>,
    /// Constant per-token weights of the policy term (the rollout correction's importance
    /// weights: token-TIS, seq-MIS), `(B, T)`; `None`: 1.
    pub pg_weights: Option<&'a Tensor>,
}

impl<'a> LossInputs<'a> {
    /// The four tensors every loss needs; no reference, no entropy, and `mask` as the
    /// response (set the others with struct update syntax).
    pub fn new(logp: &'a Tensor, old_logp: &'a Tensor, advantages: &'a Tensor, mask: &'a Tensor) -> Self {
        Self {
            logp,
            old_logp,
            advantages,
            mask,
            ref_logp: None,
            entropy: None,
            response: None,
            pg_weights: None,
        }
    }
}

/// The denominators of the aggregation, counted once over the whole mini-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normaliser {
    /// Kept tokens in the mini-batch (token-mean).
    pub tokens: f64,
    /// Sequences with at least one kept token in the mini-batch (seq-mean-* modes; verl
    /// excludes fully masked sequences).
    pub seqs: f64,
    /// The constant length of seq-mean-token-sum-norm (Dr.GRPO's generation budget).
    pub norm_len: f64,
}

impl Normaliser {
    /// Counts kept tokens and non-empty sequences over all `masks` (the micro-batches of one
    /// mini-batch, or the mini-batch in one piece). `norm_len` defaults to the largest `T`
    /// among the masks; set it (e.g. to the max response length) so that it does not
    /// depend on padding.
    pub fn from_masks(masks: &[&Tensor], norm_len: Option<usize>) -> Result<Self> {
        let mut tokens = 0f64;
        let mut seqs = 0f64;
        let mut max_t = 0usize;
        for (i, m) in masks.iter().enumerate() {
            let (_, l) = dims_bt(m, &format!("normaliser: mask {i}"))?;
            max_t = max_t.max(l);
            let rows = m.to_dtype(DType::F32)?.gt(0.5f32)?.to_dtype(DType::F32)?.sum(1)?;
            for r in rows.to_vec1::<f32>()? {
                tokens += r as f64;
                if r > 0.0 {
                    seqs += 1.0;
                }
            }
        }
        let norm_len = norm_len.unwrap_or(max_t) as f64;
        Ok(Normaliser { tokens, seqs, norm_len })
    }

    /// The divisor of `mode`, never below 1 (an all-masked batch gives loss 0, not NaN).
    pub fn divisor(&self, mode: AggMode) -> f64 {
        match mode {
            AggMode::TokenMean => self.tokens.max(1.0),
            AggMode::SeqMeanTokenMean | AggMode::SeqMeanTokenSum => self.seqs.max(1.0),
            AggMode::SeqMeanTokenSumNorm => self.seqs.max(1.0) * self.norm_len.max(1.0),
        }
    }
}

/// Aggregates a `(B, T)` per-token loss over the kept tokens of `mask` (0/1 f32) into a
/// scalar, dividing by `norm` (verl `agg_loss` with global batch info). `x` must be finite
/// at masked positions too (they are multiplied by 0).
pub fn aggregate(x: &Tensor, mask: &Tensor, mode: AggMode, norm: &Normaliser) -> Result<Tensor> {
    let xm = x.mul(mask)?;
    let total = match mode {
        AggMode::SeqMeanTokenMean => {
            let count = mask.sum(1)?.maximum(1f32)?;
            xm.sum(1)?.div(&count)?.sum_all()?
        }
        _ => xm.sum_all()?,
    };
    Ok(total.affine(1.0 / norm.divisor(mode), 0.0)?)
}

/// Scalar metrics of one loss call. Fractions and means are over the kept tokens of this
/// call (merge micro-batches with [`LossMetrics::merge`]); `pg_loss`, `kl_loss` and
/// `entropy_loss` are already divided by the mini-batch normaliser, so they add up.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LossMetrics {
    /// Kept tokens.
    pub n_tokens: usize,
    /// Sequences with at least one kept token.
    pub n_seqs: usize,
    /// The policy term of the loss.
    pub pg_loss: f32,
    /// The KL term, before `beta` (0 without KL).
    pub kl_loss: f32,
    /// The aggregated entropy, before the coefficient (0 without entropy input).
    pub entropy_loss: f32,
    /// Kept tokens with `A < 0` and ratio `< 1 - eps_low` (clipped at the low side).
    pub clip_frac_low: f32,
    /// Kept tokens with `A > 0` and ratio `> 1 + eps_high` (clipped at the high side).
    pub clip_frac_high: f32,
    /// `clip_frac_low + clip_frac_high`: verl's `pg_clipfrac` (`pg2 > pg1`).
    pub clip_frac: f32,
    /// Kept tokens with `A < 0` where the dual-clip bound was active (verl
    /// `pg_clipfrac_lower`).
    pub dual_clip_frac: f32,
    /// KL(old‖new) by the k3 estimator, mean over kept tokens of `r - 1 - log r`,
    /// `r = exp(logp - old)` (non-negative, low variance).
    pub approx_kl: f32,
    /// verl's `ppo_kl`: the k1 estimator `mean(old - logp)` over kept tokens.
    pub ppo_kl: f32,
    /// Mean token ratio `exp(logp - old)` over kept tokens (for GSPO also the token ratio;
    /// the clip fractions of GSPO are about the sequence ratio).
    pub ratio_mean: f32,
}

impl LossMetrics {
    /// Accumulates another micro-batch: counts and loss terms add, per-token means are
    /// weighted by kept tokens.
    pub fn merge(&mut self, o: &LossMetrics) {
        let (n1, n2) = (self.n_tokens as f64, o.n_tokens as f64);
        let w = |a: f32, b: f32| -> f32 {
            if n1 + n2 == 0.0 {
                0.0
            } else {
                ((a as f64 * n1 + b as f64 * n2) / (n1 + n2)) as f32
            }
        };
        self.clip_frac_low = w(self.clip_frac_low, o.clip_frac_low);
        self.clip_frac_high = w(self.clip_frac_high, o.clip_frac_high);
        self.clip_frac = w(self.clip_frac, o.clip_frac);
        self.dual_clip_frac = w(self.dual_clip_frac, o.dual_clip_frac);
        self.approx_kl = w(self.approx_kl, o.approx_kl);
        self.ppo_kl = w(self.ppo_kl, o.ppo_kl);
        self.ratio_mean = w(self.ratio_mean, o.ratio_mean);
        self.n_tokens += o.n_tokens;
        self.n_seqs += o.n_seqs;
        self.pg_loss += o.pg_loss;
        self.kl_loss += o.kl_loss;
        self.entropy_loss += o.entropy_loss;
    }
}

/// The loss of one (micro-)batch and its metrics.
#[derive(Clone, Debug)]
pub struct LossOutput {
    /// Scalar (rank-0) loss to call `backward()` on.
    pub loss: Tensor,
    /// Detached scalar metrics.
    pub metrics: LossMetrics,
}

/// What a policy loss sees: the `(B, T)` tensors of one (micro-)batch, with every
/// position outside `mask` already set to 0 (so padding holding `-inf`/NaN cannot leak).
#[derive(Clone, Copy, Debug)]
pub struct PolicyInputs<'a> {
    /// Log-prob of the sampled token under the current policy (differentiable).
    pub logp: &'a Tensor,
    /// Per-token advantages (constant).
    pub adv: &'a Tensor,
    /// Kept tokens, 0/1 f32.
    pub mask: &'a Tensor,
    /// `logp - old_logp`.
    pub log_ratio: &'a Tensor,
    /// `exp(clamp(log_ratio, -20, 20))`.
    pub ratio: &'a Tensor,
    /// Response tokens, 0/1 f32 (a superset of `mask`), and `logp - old_logp` on them
    /// (0 elsewhere): what sequence-level ratios average over.
    pub response: &'a Tensor,
    /// `logp - old_logp` on response tokens, 0 elsewhere.
    pub response_log_ratio: &'a Tensor,
}

/// A policy loss per token, and where it clipped (0/1 f32 `(B, T)`, `None` = nowhere).
#[derive(Clone, Debug)]
pub struct PolicyTerms {
    /// Per-token loss `(B, T)`.
    pub loss: Tensor,
    /// Tokens with `A < 0` whose ratio was clipped at `1 - eps_low`.
    pub clip_low: Option<Tensor>,
    /// Tokens with `A > 0` whose ratio was clipped at `1 + eps_high`.
    pub clip_high: Option<Tensor>,
    /// Tokens with `A < 0` where the dual-clip bound was active.
    pub dual_clip: Option<Tensor>,
}

impl PolicyLoss {
    /// The per-token loss of this kind with its parameters (verl's `POLICY_LOSS_REGISTRY`
    /// as one exhaustive match: a new variant does not compile until it has its arm).
    pub fn terms(&self, x: &PolicyInputs) -> Result<PolicyTerms> {
        match *self {
            PolicyLoss::Ppo { eps_low, eps_high, dual_clip } => {
                ppo_clip_loss(x, eps_low, eps_high, dual_clip)
            }
            PolicyLoss::Gspo { eps_low, eps_high } => gspo_loss(x, eps_low, eps_high),
            PolicyLoss::Sapo { tau_pos, tau_neg } => sapo_loss(x, tau_pos, tau_neg),
            PolicyLoss::Pg => pg_loss(x),
        }
    }
}

/// The 0/1 tokens whose ratio `r` lies outside `[lo, hi]` on the side that clips: below
/// `lo` with `A < 0`, above `hi` with `A > 0`.
fn clip_sides(r: &Tensor, adv: &Tensor, lo: f32, hi: f32) -> Result<(Tensor, Tensor)> {
    let r = r.detach();
    let low = r.lt(lo)?.to_dtype(DType::F32)?.mul(&adv.lt(0f32)?.to_dtype(DType::F32)?)?;
    let high = r.gt(hi)?.to_dtype(DType::F32)?.mul(&adv.gt(0f32)?.to_dtype(DType::F32)?)?;
    Ok((low, high))
}

/// `max(-A·r, -A·clip(r, lo, hi))` (the PPO surrogate) and its clip sides.
fn clipped_surrogate(r: &Tensor, adv: &Tensor, lo: f32, hi: f32) -> Result<(Tensor, Tensor, Tensor)> {
    let neg_adv = adv.neg()?;
    let pg1 = r.mul(&neg_adv)?;
    let pg2 = r.clamp(lo, hi)?.mul(&neg_adv)?;
    let (low, high) = clip_sides(r, adv, lo, hi)?;
    Ok((pg1.maximum(&pg2)?, low, high))
}

/// PPO-clip with DAPO clip-higher and optional dual-clip (verl `compute_policy_loss_vanilla`).
pub fn ppo_clip_loss(
    x: &PolicyInputs,
    eps_low: f32,
    eps_high: f32,
    dual_clip: Option<f32>,
) -> Result<PolicyTerms> {
    let (lo, hi) = (1.0 - eps_low, 1.0 + eps_high);
    let (c1, low, high) = clipped_surrogate(x.ratio, x.adv, lo, hi)?;
    let (loss, dual) = match dual_clip {
        Some(c) => {
            let a_neg = x.adv.lt(0f32)?;
            let pg3 = x.adv.neg()?.affine(c as f64, 0.0)?;
            let c2 = c1.minimum(&pg3)?;
            let dual = c1.detach().gt(&pg3)?.to_dtype(DType::F32)?.mul(&a_neg.to_dtype(DType::F32)?)?;
            (a_neg.where_cond(&c2, &c1)?, Some(dual))
        }
        None => (c1, None),
    };
    Ok(PolicyTerms { loss, clip_low: Some(low), clip_high: Some(high), dual_clip: dual })
}

/// GSPO (verl `compute_policy_loss_gspo`): the sequence ratio `s_i = exp(mean_t log r)` over
/// the response tokens of row `i` (all of them, also those a token mask drops from the
/// policy-gradient term), in the straight-through form
/// `log s_{i,t} = sg[log s_i] + logp_t - sg[logp_t]` (capped at 10), clipped like PPO.
pub fn gspo_loss(x: &PolicyInputs, eps_low: f32, eps_high: f32) -> Result<PolicyTerms> {
    let (lo, hi) = (1.0 - eps_low, 1.0 + eps_high);
    let count = x.response.sum_keepdim(1)?.maximum(1f32)?; // (B, 1)
    let seq_log_ratio = x.response_log_ratio.detach().sum_keepdim(1)?.div(&count)?; // (B, 1)
    let log_s = (x.logp - x.logp.detach())?.broadcast_add(&seq_log_ratio)?.minimum(GSPO_LOG_RATIO_MAX)?;
    let (loss, low, high) = clipped_surrogate(&log_s.exp()?, x.adv, lo, hi)?;
    Ok(PolicyTerms { loss, clip_low: Some(low), clip_high: Some(high), dual_clip: None })
}

/// SAPO (verl `compute_policy_loss_sapo`): `-A·f(r)`, `f(r) = sigmoid(tau·(r - 1))·4/tau`,
/// `tau = tau_pos` where `A > 0`, else `tau_neg`. No hard clip.
pub fn sapo_loss(x: &PolicyInputs, tau_pos: f32, tau_neg: f32) -> Result<PolicyTerms> {
    let (dims, dev) = (x.adv.dims(), x.adv.device());
    let pos = Tensor::full(tau_pos, dims, dev)?;
    let neg = Tensor::full(tau_neg, dims, dev)?;
    let tau = x.adv.gt(0f32)?.where_cond(&pos, &neg)?;
    let z = x.ratio.affine(1.0, -1.0)?.mul(&tau)?;
    let sig = z.neg()?.exp()?.affine(1.0, 1.0)?.recip()?; // sigmoid without overflow: |z| is bounded
    let gate = sig.mul(&tau.recip()?.affine(4.0, 0.0)?)?;
    Ok(PolicyTerms { loss: gate.mul(&x.adv.neg()?)?, clip_low: None, clip_high: None, dual_clip: None })
}

/// Plain policy gradient (REINFORCE with the importance ratio): `-A·r`.
pub fn pg_loss(x: &PolicyInputs) -> Result<PolicyTerms> {
    Ok(PolicyTerms { loss: x.ratio.mul(&x.adv.neg()?)?, clip_low: None, clip_high: None, dual_clip: None })
}

/// The per-token KL estimator to the reference policy (verl `kl_penalty`): `d = logp - ref`,
/// k1 `d`, k2 `d²/2`, k3 `exp(-d) + d - 1` (log-ratio clamped to ±20, k3 to ±10).
pub fn kl_penalty(kind: KlKind, logp: &Tensor, ref_logp: &Tensor) -> Result<Tensor> {
    let d = (logp - ref_logp)?;
    Ok(match kind {
        KlKind::K1 => d,
        KlKind::K2 => d.sqr()?.affine(0.5, 0.0)?,
        KlKind::K3 => {
            let x = d.neg()?.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?; // ref - logp
            (x.exp()? - &x)?.affine(1.0, -1.0)?.clamp(-10f32, 10f32)?
        }
    })
}

/// Computes `agg(pg + beta·KL - entropy_coef·H)` for one (micro-)batch under `cfg`, dividing
/// by `norm` (count it over the whole mini-batch with [`Normaliser::from_masks`]). The
/// policy term is [`PolicyLoss::terms`] of `cfg.loss`.
///
/// Masked positions are replaced by 0 in every input before any arithmetic, so padding
/// holding `-inf`/NaN log-probs yields neither NaN loss nor NaN gradients. An all-masked
/// batch gives loss 0 and zero gradients.
pub fn compute_loss(cfg: &ObjectiveConfig, inp: &LossInputs, norm: &Normaliser) -> Result<LossOutput> {
    cfg.validate()?;
    let (b, l) = checked_dims(inp)?;
    let dev = inp.logp.device();
    let f32_ = DType::F32;
    let zeros = Tensor::zeros((b, l), f32_, dev)?;
    let keep = inp.mask.to_dtype(f32_)?.gt(0.5f32)?; // u8 predicate
    let m = keep.to_dtype(f32_)?;
    let clean = |t: &Tensor| -> Result<Tensor> { Ok(keep.where_cond(&t.to_dtype(f32_)?, &zeros)?) };

    let (resp_in, resp_norm) = inp.response.unwrap_or((inp.mask, norm));
    expect_bt(resp_in, "loss: response mask", b, l)?;
    let keep_r = resp_in.to_dtype(f32_)?.gt(0.5f32)?;
    let r = keep_r.to_dtype(f32_)?;
    let clean_r = |t: &Tensor| -> Result<Tensor> { Ok(keep_r.where_cond(&t.to_dtype(f32_)?, &zeros)?) };

    let logp = clean(inp.logp)?;
    let old = clean(&inp.old_logp.detach())?;
    let adv = clean(&expand_advantages(inp.advantages, b, l)?)?;
    let log_ratio = (&logp - &old)?;
    let ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?.exp()?;
    let logp_r = clean_r(inp.logp)?;
    let resp_log_ratio = (&logp_r - clean_r(&inp.old_logp.detach())?)?;
    let x = PolicyInputs {
        logp: &logp,
        adv: &adv,
        mask: &m,
        log_ratio: &log_ratio,
        ratio: &ratio,
        response: &r,
        response_log_ratio: &resp_log_ratio,
    };
    let terms = weighted(cfg.loss.terms(&x)?, inp.pg_weights.map(|w| (w, &keep, &zeros)))?;

    // KL and entropy over the response tokens.
    let kl = match (&cfg.kl, inp.ref_logp) {
        (Some(k), _) if k.beta == 0.0 => None,
        (Some(k), Some(rf)) => {
            expect_bt(rf, "loss: ref_logp", b, l)?;
            Some((kl_penalty(k.kind, &logp_r, &clean_r(&rf.detach())?)?, k.beta))
        }
        (Some(_), None) => {
            return Err(Error::invalid(
                "loss: a KL penalty is configured (kl.beta != 0) but no ref_logp was given",
            ))
        }
        (None, _) => None,
    };
    let ent = match inp.entropy {
        Some(h) => {
            expect_bt(h, "loss: entropy", b, l)?;
            Some(clean_r(h)?)
        }
        None if cfg.entropy_coef != 0.0 => {
            return Err(Error::invalid(
                "loss: entropy_coef != 0 but no differentiable entropy tensor was given",
            ))
        }
        None => None,
    };

    let mut loss = aggregate(&terms.loss, &m, cfg.agg, norm)?;
    if let Some((v, beta)) = &kl {
        loss = (loss + aggregate(v, &r, cfg.agg, resp_norm)?.affine(*beta as f64, 0.0)?)?;
    }
    if let Some(h) = &ent {
        if cfg.entropy_coef != 0.0 {
            loss = (loss - aggregate(h, &r, cfg.agg, resp_norm)?.affine(cfg.entropy_coef as f64, 0.0)?)?;
        }
    }
    let extra = Terms {
        kl: kl.as_ref().map(|(v, _)| v),
        entropy: ent.as_ref(),
        response: &r,
        response_norm: resp_norm,
    };
    let metrics = loss_metrics(cfg, &m, &terms, &extra, &log_ratio, &ratio, norm)?;
    Ok(LossOutput { loss, metrics })
}

/// The policy terms with their per-token loss times the constant `weights` (the rollout
/// correction's; 0 outside `keep`), when given.
fn weighted(mut terms: PolicyTerms, weights: Option<(&Tensor, &Tensor, &Tensor)>) -> Result<PolicyTerms> {
    if let Some((w, keep, zeros)) = weights {
        let (b, l) = zeros.dims2()?;
        expect_bt(w, "loss: pg_weights", b, l)?;
        terms.loss = terms.loss.mul(&keep.where_cond(&w.detach().to_dtype(DType::F32)?, zeros)?)?;
    }
    Ok(terms)
}

/// The `(B, T)` of `logp`, after checking that `old_logp` and `mask` have it too.
fn checked_dims(inp: &LossInputs) -> Result<(usize, usize)> {
    let (b, l) = dims_bt(inp.logp, "loss: logp")?;
    expect_bt(inp.old_logp, "loss: old_logp", b, l)?;
    expect_bt(inp.mask, "loss: mask", b, l)?;
    Ok((b, l))
}

/// The KL and entropy terms and what they aggregate over.
struct Terms<'a> {
    kl: Option<&'a Tensor>,
    entropy: Option<&'a Tensor>,
    response: &'a Tensor,
    response_norm: &'a Normaliser,
}

/// The detached metrics of one loss call: one stacked vector, one device→host copy.
fn loss_metrics(
    cfg: &ObjectiveConfig,
    m: &Tensor,
    terms: &PolicyTerms,
    extra: &Terms,
    log_ratio: &Tensor,
    ratio: &Tensor,
    norm: &Normaliser,
) -> Result<LossMetrics> {
    let zero = Tensor::zeros((), DType::F32, m.device())?;
    let masked_sum = |t: Option<&Tensor>| -> Result<Tensor> {
        match t {
            Some(t) => Ok(t.detach().mul(m)?.sum_all()?),
            None => Ok(zero.clone()),
        }
    };
    let agg_detached = |t: Option<&Tensor>, mask: &Tensor, norm: &Normaliser| -> Result<Tensor> {
        match t {
            Some(t) => aggregate(&t.detach(), mask, cfg.agg, norm),
            None => Ok(zero.clone()),
        }
    };
    let lr = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?;
    let k3_old_new = (lr.exp()? - &lr)?.affine(1.0, -1.0)?;
    let n_seqs = m.sum(1)?.gt(0f32)?.to_dtype(DType::F32)?.sum_all()?;
    let stats = Tensor::stack(
        &[
            m.sum_all()?,
            n_seqs,
            agg_detached(Some(&terms.loss), m, norm)?,
            agg_detached(extra.kl, extra.response, extra.response_norm)?,
            agg_detached(extra.entropy, extra.response, extra.response_norm)?,
            masked_sum(terms.clip_low.as_ref())?,
            masked_sum(terms.clip_high.as_ref())?,
            masked_sum(terms.dual_clip.as_ref())?,
            masked_sum(Some(&k3_old_new))?,
            masked_sum(Some(&log_ratio.neg()?))?,
            masked_sum(Some(ratio))?,
        ],
        0,
    )?
    .to_vec1::<f32>()?;
    let n = stats[0];
    let mean = |s: f32| if n > 0.0 { s / n } else { 0.0 };
    Ok(LossMetrics {
        n_tokens: n.round() as usize,
        n_seqs: stats[1].round() as usize,
        pg_loss: stats[2],
        kl_loss: stats[3],
        entropy_loss: stats[4],
        clip_frac_low: mean(stats[5]),
        clip_frac_high: mean(stats[6]),
        clip_frac: mean(stats[5] + stats[6]),
        dual_clip_frac: mean(stats[7]),
        approx_kl: mean(stats[8]),
        ppo_kl: mean(stats[9]),
        ratio_mean: mean(stats[10]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    const TOL: f32 = 1e-6;

    fn t2(v: &[f32], b: usize, l: usize) -> Tensor {
        Tensor::from_slice(v, (b, l), &Device::Cpu).unwrap()
    }
    fn t1(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }
    fn var(v: &[f32], b: usize, l: usize) -> Var {
        Var::from_tensor(&t2(v, b, l)).unwrap()
    }
    fn vec(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }
    fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
        }
    }
    /// The loss `kind` with eps 0.2 / 0.28 where it clips, aggregated by `agg`.
    fn cfg(kind: &str, agg: AggMode) -> ObjectiveConfig {
        let loss = match PolicyLoss::default_of(kind).unwrap() {
            PolicyLoss::Ppo { dual_clip, .. } => PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip },
            PolicyLoss::Gspo { .. } => PolicyLoss::Gspo { eps_low: 0.2, eps_high: 0.28 },
            other => other,
        };
        ObjectiveConfig { loss, agg, ..ObjectiveConfig::default() }
    }
    fn ln(x: f32) -> f32 {
        x.ln()
    }
    /// Loss value and d loss / d logp for `logp` given as a Var.
    fn run(
        c: &ObjectiveConfig,
        logp: &Var,
        old: &Tensor,
        adv: &Tensor,
        mask: &Tensor,
    ) -> (f32, Vec<f32>, LossMetrics) {
        let inp = LossInputs::new(logp.as_tensor(), old, adv, mask);
        let norm = Normaliser::from_masks(&[mask], None).unwrap();
        let out = compute_loss(c, &inp, &norm).unwrap();
        let g = out.loss.backward().unwrap();
        let grad = g.get(logp.as_tensor()).map(vec).unwrap_or_else(|| vec![0.0; logp.elem_count()]);
        (out.loss.to_scalar::<f32>().unwrap(), grad, out.metrics)
    }

    #[test]
    fn ppo_clip_higher_by_hand() {
        // old = 0, logp = ln r. A = [+1, -1] per sequence, eps 0.2 / 0.28 → clip range [0.8, 1.28].
        // (0,0) A=+1 r=1.5: pg1=-1.5, pg2=-1.28, max=-1.28 (clipped high), grad 0.
        // (0,1) A=+1 r=0.9: pg1=pg2=-0.9, grad -r = -0.9.
        // (1,0) A=-1 r=0.5: pg1=0.5, pg2=0.8, max=0.8 (clipped low), grad 0.
        // (1,1) A=-1 r=1.2: pg1=pg2=1.2, grad +r = 1.2.
        // token-mean over 4: loss = (-1.28 - 0.9 + 0.8 + 1.2)/4 = -0.045,
        // grads = [0, -0.9/4, 0, 1.2/4] = [0, -0.225, 0, 0.3].
        let logp = var(&[ln(1.5), ln(0.9), ln(0.5), ln(1.2)], 2, 2);
        let old = t2(&[0.; 4], 2, 2);
        let adv = t1(&[1., -1.]);
        let mask = t2(&[1.; 4], 2, 2);
        let c = cfg("ppo", AggMode::TokenMean);
        let (loss, g, m) = run(&c, &logp, &old, &adv, &mask);
        assert!((loss + 0.045).abs() < TOL, "{loss}");
        close(&g, &[0., -0.225, 0., 0.3], TOL, "grad");
        assert_eq!(m.n_tokens, 4);
        assert_eq!(m.n_seqs, 2);
        assert!((m.clip_frac_low - 0.25).abs() < TOL && (m.clip_frac_high - 0.25).abs() < TOL);
        assert!((m.clip_frac - 0.5).abs() < TOL && m.dual_clip_frac == 0.0);
        // approx_kl (k3) = mean(r - 1 - ln r):
        // 0.0945349 + 0.0053605 + 0.1931472 + 0.0176784 = 0.3107211 → /4 = 0.0776803.
        assert!((m.approx_kl - 0.0776803).abs() < 1e-5, "{}", m.approx_kl);
        // ppo_kl (k1) = mean(-ln r) = (-0.4054651 + 0.1053605 + 0.6931472 - 0.1823216)/4 = 0.0526803.
        assert!((m.ppo_kl - 0.0526803).abs() < 1e-5, "{}", m.ppo_kl);
        assert!((m.ratio_mean - 1.025).abs() < TOL); // (1.5 + 0.9 + 0.5 + 1.2)/4
        assert!((m.pg_loss + 0.045).abs() < TOL);
    }

    #[test]
    fn ppo_dual_clip_by_hand() {
        // c = 3. A = [-1, -1, +1], r = [5, 2, 5], token-mean over 3.
        // t0: pg1 = 5, pg2 = 1.28, c1 = 5; pg3 = 3 → min(3, 5) = 3 (dual clip), grad 0.
        // t1: pg1 = 2, pg2 = 1.28, c1 = 2; min(3, 2) = 2, grad +r = 2.
        // t2: A > 0: c1 = max(-5, -1.28) = -1.28 (clipped high), grad 0.
        // loss = (3 + 2 - 1.28)/3 = 1.24; grads = [0, 2/3, 0].
        let logp = var(&[ln(5.), ln(2.), ln(5.)], 3, 1);
        let old = t2(&[0.; 3], 3, 1);
        let adv = t1(&[-1., -1., 1.]);
        let mask = t2(&[1.; 3], 3, 1);
        let mut c = cfg("ppo", AggMode::TokenMean);
        c.loss = PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: Some(3.0) };
        let (loss, g, m) = run(&c, &logp, &old, &adv, &mask);
        assert!((loss - 1.24).abs() < 1e-5, "{loss}");
        close(&g, &[0., 2. / 3., 0.], 1e-5, "grad");
        assert!((m.dual_clip_frac - 1. / 3.).abs() < TOL);
        assert!((m.clip_frac_high - 1. / 3.).abs() < TOL && m.clip_frac_low == 0.0);
        // Without dual clip t0 keeps c1 = 5 and its gradient r = 5:
        // loss = (5 + 2 - 1.28)/3 = 1.9066667, grads [5/3, 2/3, 0].
        c.loss = PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None };
        let (loss, g, _) = run(&c, &logp, &old, &adv, &mask);
        assert!((loss - 1.9066667).abs() < 1e-5, "{loss}");
        close(&g, &[5. / 3., 2. / 3., 0.], 1e-5, "grad");
    }

    #[test]
    fn gspo_by_hand() {
        // eps 3e-4 / 4e-4 → clip range [0.9997, 1.0004]; old = 0; third token of each row masked
        // (its logp 5.0 must not enter the sequence ratio). seq-mean-token-mean over 3 sequences.
        // row 0: A = 2,  logp [0.0002, 0]: log s = 0.0001, s = 1.0001000 (inside): loss -2s;
        //        grad per kept token = -A·s / 2 tokens / 3 seqs = -s/3 = -0.3333667.
        // row 1: A = -1, logp [0.002, 0]: s = e^0.001 = 1.0010005 > 1.0004, but A < 0 so
        //        max(pg1 = s, pg2 = 1.0004) = s (unclipped): loss +s, grad +s/6 = 0.1668334.
        // row 2: A = 1,  logp [0.002, 0]: s = 1.0010005 → max(-s, -1.0004) = -1.0004 (clipped), grad 0.
        // loss = (-2·1.0001 + 1.0010005 - 1.0004)/3 = -0.6665332.
        let logp = var(&[0.0002, 0., 5.0, 0.002, 0., 5.0, 0.002, 0., 5.0], 3, 3);
        let old = t2(&[0.; 9], 3, 3);
        let adv = t1(&[2., -1., 1.]);
        let mask = t2(&[1., 1., 0., 1., 1., 0., 1., 1., 0.], 3, 3);
        let mut c = ObjectiveConfig::preset("gspo").unwrap();
        c.agg = AggMode::SeqMeanTokenMean;
        let (loss, g, m) = run(&c, &logp, &old, &adv, &mask);
        assert!((loss + 0.6665332).abs() < 2e-6, "{loss}");
        close(&g, &[-0.3333667, -0.3333667, 0., 0.1668334, 0.1668334, 0., 0., 0., 0.], 2e-6, "grad");
        // Clip metrics use the sequence ratio: row 2's two tokens are clipped high (2 of 6).
        assert!((m.clip_frac_high - 2. / 6.).abs() < TOL && m.clip_frac_low == 0.0);
    }

    #[test]
    fn sapo_by_hand() {
        // old = 0, A = [+1, -1], logp = [0, 0.5], token-mean over 2.
        // t0: r = 1, tau_pos = 1: σ(0) = 0.5, f = 0.5·4/1 = 2, loss -A·f = -2;
        //     grad = -4·A·σ(1-σ)·r = -4·0.25 = -1 (= on-policy PG).
        // t1: r = e^0.5 = 1.6487213, tau_neg = 1.05: x = 1.05·0.6487213 = 0.6811573,
        //     σ = 0.6639970, f = σ·4/1.05 = 2.5295122, loss = +f;
        //     grad = -4·A·σ(1-σ)·r = 4·0.6639970·0.3360030·1.6487213 = 1.4713518.
        // loss = (-2 + 2.5295122)/2 = 0.2647561; grads = [-0.5, 0.7356759].
        let logp = var(&[0., 0.5], 2, 1);
        let old = t2(&[0.; 2], 2, 1);
        let adv = t1(&[1., -1.]);
        let mask = t2(&[1.; 2], 2, 1);
        let c = ObjectiveConfig { agg: AggMode::TokenMean, ..ObjectiveConfig::preset("sapo").unwrap() };
        let (loss, g, m) = run(&c, &logp, &old, &adv, &mask);
        assert!((loss - 0.2647561).abs() < 2e-6, "{loss}");
        close(&g, &[-0.5, 0.7356759], 2e-6, "grad");
        assert_eq!(m.clip_frac, 0.0);
    }

    #[test]
    fn pg_and_renormalisation_by_hand() {
        // Per-token A = [1, 4, 3]; logp = [0.1, 0.2, -0.3], old = [0.1, 0, 0] → r = [1, e^0.2, e^-0.3].
        // Mask [1, 0, 1], token-mean over 2: loss = (-1·1 - 3·e^-0.3)/2 = -1.6112273;
        // grads = [-A·r/2] = [-0.5, 0 (masked), -1.5·e^-0.3 = -1.1112273].
        let logp = var(&[0.1, 0.2, -0.3], 1, 3);
        let old = t2(&[0.1, 0., 0.], 1, 3);
        let adv = t2(&[1., 4., 3.], 1, 3);
        let c = cfg("pg", AggMode::TokenMean);
        let (loss, g, _) = run(&c, &logp, &old, &adv, &t2(&[1., 0., 1.], 1, 3));
        assert!((loss + 1.6112273).abs() < 2e-6, "{loss}");
        close(&g, &[-0.5, 0., -1.1112273], 2e-6, "grad");

        // Renormalisation: at old = logp (r = 1) the loss is -mean(A) over kept tokens.
        // All kept: -(1 + 4 + 3)/3 = -8/3, grads -A/3 = [-1/3, -4/3, -1].
        // Middle masked: the denominator drops to 2: -(1 + 3)/2 = -2, grads [-0.5, 0, -1.5].
        let logp = var(&[0.; 3], 1, 3);
        let old = t2(&[0.; 3], 1, 3);
        let (loss, g, _) = run(&c, &logp, &old, &adv, &t2(&[1.; 3], 1, 3));
        assert!((loss + 8. / 3.).abs() < TOL);
        close(&g, &[-1. / 3., -4. / 3., -1.], TOL, "grad all kept");
        let (loss, g, m) = run(&c, &logp, &old, &adv, &t2(&[1., 0., 1.], 1, 3));
        assert!((loss + 2.).abs() < TOL);
        close(&g, &[-0.5, 0., -1.5], TOL, "grad renormalised");
        assert_eq!(m.n_tokens, 2);
    }

    #[test]
    fn kl_estimators_by_hand() {
        // A = 0 so only beta·KL remains; d = logp - ref = [0.5, -0.2]; beta 0.1; token-mean over 2.
        // k1: loss = 0.1·(0.5 - 0.2)/2 = 0.015; grads 0.1/2 = 0.05.
        // k2: loss = 0.1·(0.125 + 0.02)/2 = 0.00725; grads 0.1·d/2 = [0.025, -0.01].
        // k3: e^-d + d - 1 = [0.6065307 - 0.5, 1.2214028 - 1.2] = [0.1065307, 0.0214028];
        //     loss = 0.1·0.1279335/2 = 0.0063967; grads 0.05·(1 - e^-d) = [0.0196735, -0.0110701].
        let cases = [
            (KlKind::K1, 0.015, [0.05, 0.05]),
            (KlKind::K2, 0.00725, [0.025, -0.01]),
            (KlKind::K3, 0.0063967, [0.0196735, -0.0110701]),
        ];
        for (kind, want_loss, want_g) in cases {
            let logp = var(&[0.5, -0.2], 1, 2);
            let zeros = t2(&[0., 0.], 1, 2);
            let mask = t2(&[1., 1.], 1, 2);
            let adv = t1(&[0.]);
            let mut c = cfg("pg", AggMode::TokenMean);
            c.kl = Some(KlConfig { kind, beta: 0.1 });
            let old = logp.as_tensor().detach();
            let inp =
                LossInputs { ref_logp: Some(&zeros), ..LossInputs::new(logp.as_tensor(), &old, &adv, &mask) };
            let norm = Normaliser::from_masks(&[&mask], None).unwrap();
            let out = compute_loss(&c, &inp, &norm).unwrap();
            let loss = out.loss.to_scalar::<f32>().unwrap();
            assert!((loss - want_loss).abs() < 1e-6, "{kind:?}: {loss}");
            assert!((out.metrics.kl_loss * 0.1 - want_loss).abs() < 1e-6);
            let g = out.loss.backward().unwrap();
            close(&vec(g.get(logp.as_tensor()).unwrap()), &want_g, 1e-6, "kl grad");
            // KL configured without a reference is an error.
            let inp = LossInputs { ref_logp: None, ..inp };
            assert!(compute_loss(&c, &inp, &norm).is_err());
        }
    }

    #[test]
    fn entropy_bonus_by_hand() {
        // coef 0.01, H = [1, 2], A = 0, token-mean over 2: loss = -0.01·1.5 = -0.015;
        // d loss / dH = -0.01/2 = -0.005 each; logp gets no gradient from it.
        let logp = var(&[0., 0.], 1, 2);
        let h = var(&[1., 2.], 1, 2);
        let old = t2(&[0., 0.], 1, 2);
        let mask = t2(&[1., 1.], 1, 2);
        let adv = t1(&[0.]);
        let mut c = cfg("ppo", AggMode::TokenMean);
        c.entropy_coef = 0.01;
        let inp = LossInputs {
            entropy: Some(h.as_tensor()),
            ..LossInputs::new(logp.as_tensor(), &old, &adv, &mask)
        };
        let norm = Normaliser::from_masks(&[&mask], None).unwrap();
        let out = compute_loss(&c, &inp, &norm).unwrap();
        assert!((out.loss.to_scalar::<f32>().unwrap() + 0.015).abs() < TOL);
        assert!((out.metrics.entropy_loss - 1.5).abs() < TOL);
        let g = out.loss.backward().unwrap();
        close(&vec(g.get(h.as_tensor()).unwrap()), &[-0.005, -0.005], TOL, "dH");
        let gl = g.get(logp.as_tensor()).map(vec).unwrap_or(vec![0., 0.]);
        close(&gl, &[0., 0.], TOL, "dlogp");
        let inp = LossInputs { entropy: None, ..inp };
        assert!(compute_loss(&c, &inp, &norm).is_err());
    }

    #[test]
    fn aggregation_modes_by_hand() {
        // x = [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]]; 3 tokens, 2 seqs, norm_len 4.
        // token-mean: (1 + 2 + 4)/3 = 7/3. seq-mean-token-mean: ((1+2)/2 + 4/1)/2 = 2.75.
        // seq-mean-token-sum: (3 + 4)/2 = 3.5. seq-mean-token-sum-norm: (3 + 4)/(2·4) = 0.875.
        let x = t2(&[1., 2., 3., 4., 5., 6.], 2, 3);
        let m = t2(&[1., 1., 0., 1., 0., 0.], 2, 3);
        let n = Normaliser::from_masks(&[&m], Some(4)).unwrap();
        assert_eq!(n, Normaliser { tokens: 3., seqs: 2., norm_len: 4. });
        let want = [7. / 3., 2.75, 3.5, 0.875];
        for (mode, w) in AggMode::ALL.into_iter().zip(want) {
            let v = aggregate(&x, &m, mode, &n).unwrap().to_scalar::<f32>().unwrap();
            assert!((v - w).abs() < TOL, "{}: {v} vs {w}", mode.name());
        }
        // norm_len defaults to the widest mask.
        assert_eq!(Normaliser::from_masks(&[&m], None).unwrap().norm_len, 3.);
        assert_eq!(AggMode::parse("seq_mean_token_sum_norm"), Some(AggMode::SeqMeanTokenSumNorm));
    }

    /// (logp, old, ref, entropy, advantages, mask) as flat vectors.
    type Batch = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    /// A deterministic mini-batch: B = 4, T = 5, one fully masked row, varied ratios.
    fn batch() -> Batch {
        let n = 20;
        let logp: Vec<f32> = (0..n).map(|i| -0.5 - 0.3 * (i as f32).sin()).collect();
        let old: Vec<f32> = (0..n).map(|i| logp[i] + 0.25 * (1.7 * i as f32).cos()).collect();
        let rf: Vec<f32> = (0..n).map(|i| logp[i] + 0.1 * (2.3 * i as f32).sin()).collect();
        let h: Vec<f32> = (0..n).map(|i| 1.0 + 0.5 * (0.7 * i as f32).sin()).collect();
        let adv = vec![1.0, -0.5, 0.7, -1.2];
        let mask = vec![
            1., 1., 1., 1., 1., //
            1., 1., 1., 0., 0., //
            0., 0., 0., 0., 0., //
            1., 0., 1., 1., 0.,
        ];
        (logp, old, rf, h, adv, mask)
    }

    fn all_configs() -> Vec<ObjectiveConfig> {
        let mut out = Vec::new();
        for kind in KINDS {
            for agg in AggMode::ALL {
                let mut c = cfg(kind, agg);
                c.loss = match c.loss {
                    PolicyLoss::Gspo { .. } => PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 4e-4 },
                    PolicyLoss::Ppo { eps_low, eps_high, .. } => {
                        PolicyLoss::Ppo { eps_low, eps_high, dual_clip: Some(1.5) }
                    }
                    other => other,
                };
                c.kl = Some(KlConfig { kind: KlKind::K3, beta: 0.1 });
                c.entropy_coef = 0.01;
                c.norm_len = Some(8);
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn micro_batches_sum_to_the_mini_batch() {
        let (logp, old, rf, h, adv, mask) = batch();
        let splits = [(0usize, 1usize), (1, 3), (3, 4)];
        let t = 5;
        for c in all_configs() {
            let what = format!("{}/{}", c.loss.name(), c.agg.name());
            // Full mini-batch.
            let lv = var(&logp, 4, t);
            let hv = var(&h, 4, t);
            let (o, r, m, a) = (t2(&old, 4, t), t2(&rf, 4, t), t2(&mask, 4, t), t1(&adv));
            let norm = Normaliser::from_masks(&[&m], c.norm_len).unwrap();
            let inp = LossInputs {
                ref_logp: Some(&r),
                entropy: Some(hv.as_tensor()),
                ..LossInputs::new(lv.as_tensor(), &o, &a, &m)
            };
            let full = compute_loss(&c, &inp, &norm).unwrap();
            let g = full.loss.backward().unwrap();
            let full_loss = full.loss.to_scalar::<f32>().unwrap();
            let full_gl = vec(g.get(lv.as_tensor()).unwrap());
            let full_gh = vec(g.get(hv.as_tensor()).unwrap());
            assert!(full_loss.is_finite() && full_loss != 0.0, "{what}");
            // Micro-batches, the normaliser counted over all of them.
            let sl = |v: &[f32], (s, e): (usize, usize)| v[s * t..e * t].to_vec();
            let masks: Vec<Tensor> = splits.iter().map(|&p| t2(&sl(&mask, p), p.1 - p.0, t)).collect();
            let mrefs: Vec<&Tensor> = masks.iter().collect();
            let mnorm = Normaliser::from_masks(&mrefs, c.norm_len).unwrap();
            assert_eq!(mnorm, norm, "{what}");
            let (mut loss_sum, mut gl, mut gh) = (0f32, Vec::new(), Vec::new());
            let mut metrics = LossMetrics::default();
            for (k, &p) in splits.iter().enumerate() {
                let b = p.1 - p.0;
                let lv = var(&sl(&logp, p), b, t);
                let hv = var(&sl(&h, p), b, t);
                let (o, r, a) = (t2(&sl(&old, p), b, t), t2(&sl(&rf, p), b, t), t1(&adv[p.0..p.1]));
                let inp = LossInputs {
                    ref_logp: Some(&r),
                    entropy: Some(hv.as_tensor()),
                    ..LossInputs::new(lv.as_tensor(), &o, &a, &masks[k])
                };
                let out = compute_loss(&c, &inp, &mnorm).unwrap();
                let g = out.loss.backward().unwrap();
                loss_sum += out.loss.to_scalar::<f32>().unwrap();
                gl.extend(g.get(lv.as_tensor()).map(vec).unwrap_or(vec![0.; b * t]));
                gh.extend(g.get(hv.as_tensor()).map(vec).unwrap_or(vec![0.; b * t]));
                metrics.merge(&out.metrics);
            }
            assert!((loss_sum - full_loss).abs() < 1e-6, "{what}: {loss_sum} vs {full_loss}");
            close(&gl, &full_gl, 1e-6, &format!("{what} dlogp"));
            close(&gh, &full_gh, 1e-6, &format!("{what} dH"));
            // Merged metrics equal the full batch's.
            let f = &full.metrics;
            assert_eq!((metrics.n_tokens, metrics.n_seqs), (f.n_tokens, f.n_seqs), "{what}");
            assert_eq!((f.n_tokens, f.n_seqs), (11, 3));
            for (x, y) in [
                (metrics.pg_loss, f.pg_loss),
                (metrics.kl_loss, f.kl_loss),
                (metrics.entropy_loss, f.entropy_loss),
                (metrics.clip_frac_low, f.clip_frac_low),
                (metrics.clip_frac_high, f.clip_frac_high),
                (metrics.dual_clip_frac, f.dual_clip_frac),
                (metrics.approx_kl, f.approx_kl),
                (metrics.ratio_mean, f.ratio_mean),
            ] {
                assert!((x - y).abs() < 1e-5, "{what}: metric {x} vs {y}");
            }
        }
    }

    #[test]
    fn local_normalisers_would_be_wrong() {
        // The bug the global normaliser prevents: token-mean per micro-batch, then summed.
        // r = 1, A = 1, PG: per-token loss -1. Micro-batch 1 keeps 1 token, micro-batch 2
        // keeps 3. Global: -(1 + 3)/4 = -1. Local: -1/1 + -3/3 = -2.
        let c = cfg("pg", AggMode::TokenMean);
        let m1 = t2(&[1., 0., 0.], 1, 3);
        let m2 = t2(&[1., 1., 1.], 1, 3);
        let global = Normaliser::from_masks(&[&m1, &m2], None).unwrap();
        let z = t2(&[0.; 3], 1, 3);
        let a = t1(&[1.]);
        let loss = |m: &Tensor, n: &Normaliser| {
            let inp = LossInputs::new(&z, &z, &a, m);
            compute_loss(&c, &inp, n).unwrap().loss.to_scalar::<f32>().unwrap()
        };
        assert_eq!(loss(&m1, &global) + loss(&m2, &global), -1.0);
        let local = |m: &Tensor| Normaliser::from_masks(&[m], None).unwrap();
        assert_eq!(loss(&m1, &local(&m1)) + loss(&m2, &local(&m2)), -2.0);
    }

    #[test]
    fn all_masked_batch_is_zero_and_finite() {
        // Padding holds -inf / NaN log-probs: masked positions must not leak into loss or grads.
        for c in all_configs() {
            let lv = var(&[f32::NEG_INFINITY, 0.0, -1.0, f32::NAN], 2, 2);
            let hv = var(&[f32::NAN, 1.0, 2.0, 3.0], 2, 2);
            let old = t2(&[f32::NEG_INFINITY, f32::NAN, 0.0, 1.0], 2, 2);
            let rf = t2(&[f32::NAN; 4], 2, 2);
            let mask = t2(&[0.; 4], 2, 2);
            let adv = t1(&[1., -1.]);
            let inp = LossInputs {
                ref_logp: Some(&rf),
                entropy: Some(hv.as_tensor()),
                ..LossInputs::new(lv.as_tensor(), &old, &adv, &mask)
            };
            let norm = Normaliser::from_masks(&[&mask], c.norm_len).unwrap();
            let out = compute_loss(&c, &inp, &norm).unwrap();
            assert_eq!(out.loss.to_scalar::<f32>().unwrap(), 0.0);
            let g = out.loss.backward().unwrap();
            for v in [&lv, &hv] {
                let gv = g.get(v.as_tensor()).map(vec).unwrap_or(vec![0.; 4]);
                assert!(gv.iter().all(|x| *x == 0.0), "{}: {gv:?}", c.loss.name());
            }
            let m = out.metrics;
            assert_eq!((m.n_tokens, m.n_seqs), (0, 0));
            assert!(m.approx_kl == 0.0 && m.ratio_mean == 0.0 && m.pg_loss == 0.0);
        }
        // Partly masked with -inf padding: finite loss, zero grads at the padding.
        let c = ObjectiveConfig::preset("stapo").unwrap();
        let lv = var(&[-0.5, f32::NEG_INFINITY], 1, 2);
        let old = t2(&[-0.4, f32::NEG_INFINITY], 1, 2);
        let (loss, g, _) = run(&c, &lv, &old, &t1(&[1.]), &t2(&[1., 0.], 1, 2));
        assert!(loss.is_finite());
        assert!(g[0].is_finite() && g[1] == 0.0, "{g:?}");
    }

    #[test]
    fn shape_errors_name_the_tensor() {
        let c = ObjectiveConfig::default();
        let lv = var(&[0.; 4], 2, 2);
        let old = t2(&[0.; 3], 1, 3);
        let mask = t2(&[1.; 4], 2, 2);
        let adv = t1(&[1., 1.]);
        let inp = LossInputs::new(lv.as_tensor(), &old, &adv, &mask);
        let norm = Normaliser::from_masks(&[&mask], None).unwrap();
        let e = compute_loss(&c, &inp, &norm).unwrap_err().to_string();
        assert!(e.contains("old_logp") && e.contains("[1, 3]"), "{e}");
        let bad_adv = t1(&[1., 1., 1.]);
        let inp = LossInputs { old_logp: &mask, advantages: &bad_adv, ..inp };
        let e = compute_loss(&c, &inp, &norm).unwrap_err().to_string();
        assert!(e.contains("advantages"), "{e}");
    }

    /// Every loss kind's serde name (the test below checks it covers every variant).
    const KINDS: [&str; 4] = ["ppo", "gspo", "sapo", "pg"];

    #[test]
    fn every_kind_has_a_default_that_round_trips() {
        // An exhaustive match: a new variant fails to compile here until KINDS has it.
        let index = |l: PolicyLoss| match l {
            PolicyLoss::Ppo { .. } => 0,
            PolicyLoss::Gspo { .. } => 1,
            PolicyLoss::Sapo { .. } => 2,
            PolicyLoss::Pg => 3,
        };
        let seen: Vec<usize> = KINDS.iter().map(|k| index(PolicyLoss::default_of(k).unwrap())).collect();
        assert_eq!(seen, [0, 1, 2, 3]);
        for kind in KINDS {
            let l = PolicyLoss::default_of(kind).unwrap();
            assert_eq!(l.name(), kind);
            l.validate().unwrap();
            let j = serde_json::to_value(l).unwrap();
            assert_eq!(j["kind"], kind, "{j}");
            assert_eq!(serde_json::from_value::<PolicyLoss>(j).unwrap(), l);
        }
        assert!(PolicyLoss::default_of("ppo2").is_none());
        let e = serde_json::from_str::<PolicyLoss>(
            r#"{"kind": "gspo", "eps_low": 0.1, "eps_high": 0.1, "dual_clip": 3}"#,
        );
        assert!(e.is_err(), "unknown fields of a variant are refused");
    }

    #[test]
    fn kl_and_entropy_use_the_response_not_the_token_mask() {
        // A = 0, so only the KL and entropy terms remain. The token mask drops the middle token
        // (as S2T would); the response keeps all three. token-mean.
        // KL k1, beta 1, d = logp - ref = [0.5, -0.2, 0.3]: (0.5 - 0.2 + 0.3)/3 = 0.2 and
        // d loss / d logp = 1/3 everywhere (over the kept tokens only it would be 0.4, [0.5, 0, 0.5]).
        let mask = t2(&[1., 0., 1.], 1, 3);
        let resp = t2(&[1., 1., 1.], 1, 3);
        let norm = Normaliser::from_masks(&[&mask], None).unwrap();
        let rnorm = Normaliser::from_masks(&[&resp], None).unwrap();
        let logp = var(&[0.5, -0.2, 0.3], 1, 3);
        let old = logp.as_tensor().detach();
        let zeros = t2(&[0.; 3], 1, 3);
        let adv = t1(&[0.]);
        let mut c = cfg("pg", AggMode::TokenMean);
        c.kl = Some(KlConfig { kind: KlKind::K1, beta: 1.0 });
        let inp = LossInputs {
            ref_logp: Some(&zeros),
            response: Some((&resp, &rnorm)),
            ..LossInputs::new(logp.as_tensor(), &old, &adv, &mask)
        };
        let out = compute_loss(&c, &inp, &norm).unwrap();
        assert!((out.loss.to_scalar::<f32>().unwrap() - 0.2).abs() < TOL);
        assert!((out.metrics.kl_loss - 0.2).abs() < TOL);
        let g = out.loss.backward().unwrap();
        close(&vec(g.get(logp.as_tensor()).unwrap()), &[1. / 3.; 3], TOL, "dKL");

        // Entropy bonus 0.1, H = [1, 5, 3]: -0.1·9/3 = -0.3, dH = -0.1/3 each
        // (over the kept tokens it would be -0.2 and [-0.05, 0, -0.05]).
        let h = var(&[1., 5., 3.], 1, 3);
        let mut c = cfg("pg", AggMode::TokenMean);
        c.entropy_coef = 0.1;
        let inp = LossInputs { ref_logp: None, entropy: Some(h.as_tensor()), ..inp };
        let out = compute_loss(&c, &inp, &norm).unwrap();
        assert!((out.loss.to_scalar::<f32>().unwrap() + 0.3).abs() < TOL);
        let g = out.loss.backward().unwrap();
        close(&vec(g.get(h.as_tensor()).unwrap()), &[-0.1 / 3.; 3], TOL, "dH");
    }

    #[test]
    fn gspo_sequence_ratio_averages_over_the_whole_response() {
        // A = 1, old = 0, logp = [1e-4, 2e-4, 0], token mask [1, 0, 1], response all three.
        // log s = (1e-4 + 2e-4 + 0)/3 = 1e-4 → s = 1.0001000 (inside [0.9997, 1.0004]);
        // over the kept tokens only it would be 5e-5 → 1.0000500.
        // seq-mean-token-mean over the 2 kept tokens: loss -s; grads -s/2 at kept tokens.
        let logp = var(&[1e-4, 2e-4, 0.], 1, 3);
        let old = t2(&[0.; 3], 1, 3);
        let adv = t1(&[1.]);
        let mask = t2(&[1., 0., 1.], 1, 3);
        let resp = t2(&[1., 1., 1.], 1, 3);
        let norm = Normaliser::from_masks(&[&mask], None).unwrap();
        let rnorm = Normaliser::from_masks(&[&resp], None).unwrap();
        let c = ObjectiveConfig::preset("gspo").unwrap();
        let inp = LossInputs {
            response: Some((&resp, &rnorm)),
            ..LossInputs::new(logp.as_tensor(), &old, &adv, &mask)
        };
        let out = compute_loss(&c, &inp, &norm).unwrap();
        let s = (1e-4f64).exp() as f32;
        assert!((out.loss.to_scalar::<f32>().unwrap() + s).abs() < 1e-6, "{}", out.loss);
        let g = out.loss.backward().unwrap();
        close(&vec(g.get(logp.as_tensor()).unwrap()), &[-s / 2., 0., -s / 2.], 1e-6, "grad");
    }
}
