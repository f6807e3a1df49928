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

use super::preset::ObjectiveConfig;
use super::{dims_bt, expand_advantages, expect_bt};
use crate::{Error, Result};

/// verl clamps the token log-ratio to this range before `exp`.
const LOG_RATIO_CLAMP: f32 = 20.0;
/// verl clamps the GSPO log sequence ratio from above at this value.
const GSPO_LOG_RATIO_MAX: f32 = 10.0;

/// Which per-token policy objective to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveKind {
    /// PPO-clip (GRPO, DAPO, JustRL, STAPO), optionally dual-clipped.
    Ppo,
    /// GSPO: the sequence-level ratio, clipped.
    Gspo,
    /// SAPO: the soft-gated ratio, no hard clip.
    Sapo,
    /// Plain policy gradient `-A·r` (no clip).
    Pg,
}

/// How per-token losses become one scalar (verl `loss_agg_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AggMode {
    /// Sum over all kept tokens / kept tokens of the mini-batch (DAPO).
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Per sequence: mean over its kept tokens; then sum / sequences of the mini-batch (GRPO).
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// Per sequence: sum over its kept tokens; then sum / sequences of the mini-batch.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Per sequence: sum over kept tokens / a constant length; then mean over sequences
    /// (Dr.GRPO).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

impl AggMode {
    /// All modes, in documentation order.
    pub const ALL: [AggMode; 4] = [
        AggMode::TokenMean,
        AggMode::SeqMeanTokenMean,
        AggMode::SeqMeanTokenSum,
        AggMode::SeqMeanTokenSumNorm,
    ];

    /// The verl name (`token-mean`, ...).
    pub fn name(self) -> &'static str {
        match self {
            AggMode::TokenMean => "token-mean",
            AggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            AggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            AggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }

    /// Parses a verl name; `_` is accepted for `-`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim().to_ascii_lowercase().replace('_', "-");
        AggMode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Which KL estimator to the reference policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlKind {
    /// `logp - ref`.
    K1,
    /// `½ (logp - ref)²`.
    K2,
    /// `exp(ref - logp) - (ref - logp) - 1` (verl `low_var_kl`, DeepSeekMath).
    K3,
}

/// A KL penalty to a frozen reference policy: `+beta · agg(KL)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlConfig {
    /// The estimator.
    pub kind: KlKind,
    /// The coefficient (verl `kl_loss_coef`, default 0.001; DeepSeekMath 0.04).
    pub beta: f32,
}

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

/// Computes `agg(pg + beta·KL - entropy_coef·H)` for one (micro-)batch under `cfg`, dividing
/// by `norm` (count it over the whole mini-batch with [`Normaliser::from_masks`]).
///
/// Masked positions are replaced by 0 in every input before any arithmetic, so padding
/// holding `-inf`/NaN log-probs yields neither NaN loss nor NaN gradients. An all-masked
/// batch gives loss 0 and zero gradients. `cfg.dual_clip` applies to [`ObjectiveKind::Ppo`]
/// only (as in verl).
pub fn compute_loss(cfg: &ObjectiveConfig, inp: &LossInputs, norm: &Normaliser) -> Result<LossOutput> {
    cfg.validate()?;
    let (b, l) = dims_bt(inp.logp, "loss: logp")?;
    expect_bt(inp.old_logp, "loss: old_logp", b, l)?;
    expect_bt(inp.mask, "loss: mask", b, l)?;
    let dev = inp.logp.device();
    let f32_ = DType::F32;
    let zeros = Tensor::zeros((b, l), f32_, dev)?;
    let keep = inp.mask.to_dtype(f32_)?.gt(0.5f32)?; // u8 predicate
    let m = keep.to_dtype(f32_)?;
    let clean = |t: &Tensor| -> Result<Tensor> { Ok(keep.where_cond(&t.to_dtype(f32_)?, &zeros)?) };

    let logp = clean(inp.logp)?;
    let old = clean(&inp.old_logp.detach())?;
    let adv = clean(&expand_advantages(inp.advantages, b, l)?)?;
    let neg_adv = adv.neg()?;
    let a_neg = adv.lt(0f32)?;
    let a_neg_f = a_neg.to_dtype(f32_)?;
    let a_pos_f = adv.gt(0f32)?.to_dtype(f32_)?;

    let log_ratio = (&logp - &old)?;
    let ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?.exp()?;
    let (lo, hi) = (1.0 - cfg.eps_low, 1.0 + cfg.eps_high);
    let clip_counts = |r: &Tensor| -> Result<(Tensor, Tensor)> {
        let r = r.detach();
        let low = r.lt(lo)?.to_dtype(f32_)?.mul(&a_neg_f)?;
        let high = r.gt(hi)?.to_dtype(f32_)?.mul(&a_pos_f)?;
        Ok((low, high))
    };
    let mut clip_low = zeros.clone();
    let mut clip_high = zeros.clone();
    let mut dual = zeros.clone();

    let pg = match cfg.kind {
        ObjectiveKind::Ppo => {
            let pg1 = ratio.mul(&neg_adv)?;
            let pg2 = ratio.clamp(lo, hi)?.mul(&neg_adv)?;
            let c1 = pg1.maximum(&pg2)?;
            (clip_low, clip_high) = clip_counts(&ratio)?;
            match cfg.dual_clip {
                Some(c) => {
                    let pg3 = neg_adv.affine(c as f64, 0.0)?;
                    let c2 = c1.minimum(&pg3)?;
                    dual = c1.detach().gt(&pg3)?.to_dtype(f32_)?.mul(&a_neg_f)?;
                    a_neg.where_cond(&c2, &c1)?
                }
                None => c1,
            }
        }
        ObjectiveKind::Gspo => {
            // sg[log s_i]: mean of the token log-ratios over the kept tokens of row i.
            let count = m.sum_keepdim(1)?.maximum(1f32)?; // (B, 1)
            let seq_log_ratio = log_ratio.detach().sum_keepdim(1)?.div(&count)?; // (B, 1)
            let log_s = (&logp - logp.detach())?
                .broadcast_add(&seq_log_ratio)?
                .minimum(GSPO_LOG_RATIO_MAX)?;
            let s = log_s.exp()?;
            let pg1 = s.mul(&neg_adv)?;
            let pg2 = s.clamp(lo, hi)?.mul(&neg_adv)?;
            (clip_low, clip_high) = clip_counts(&s)?;
            pg1.maximum(&pg2)?
        }
        ObjectiveKind::Sapo => {
            let pos = Tensor::full(cfg.sapo_tau_pos, (b, l), dev)?;
            let neg = Tensor::full(cfg.sapo_tau_neg, (b, l), dev)?;
            let tau = adv.gt(0f32)?.where_cond(&pos, &neg)?;
            let x = ratio.affine(1.0, -1.0)?.mul(&tau)?;
            let sig = x.neg()?.exp()?.affine(1.0, 1.0)?.recip()?; // sigmoid without overflow: |x| is bounded
            let gate = sig.mul(&tau.recip()?.affine(4.0, 0.0)?)?;
            gate.mul(&neg_adv)?
        }
        ObjectiveKind::Pg => ratio.mul(&neg_adv)?,
    };

    let kl = match (&cfg.kl, inp.ref_logp) {
        (Some(k), _) if k.beta == 0.0 => None,
        (Some(k), Some(r)) => {
            expect_bt(r, "loss: ref_logp", b, l)?;
            let d = (&logp - clean(&r.detach())?)?;
            let v = match k.kind {
                KlKind::K1 => d,
                KlKind::K2 => d.sqr()?.affine(0.5, 0.0)?,
                KlKind::K3 => {
                    let x = d.neg()?.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?; // ref - logp
                    (x.exp()? - &x)?.affine(1.0, -1.0)?.clamp(-10f32, 10f32)?
                }
            };
            Some((v, k.beta))
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
            Some(clean(h)?)
        }
        None if cfg.entropy_coef != 0.0 => {
            return Err(Error::invalid(
                "loss: entropy_coef != 0 but no differentiable entropy tensor was given",
            ))
        }
        None => None,
    };

    let mut total = pg.clone();
    if let Some((v, beta)) = &kl {
        total = (total + v.affine(*beta as f64, 0.0)?)?;
    }
    if let Some(h) = &ent {
        if cfg.entropy_coef != 0.0 {
            total = (total - h.affine(cfg.entropy_coef as f64, 0.0)?)?;
        }
    }
    let loss = aggregate(&total, &m, cfg.agg, norm)?;

    // Metrics: one stacked vector, one device→host copy.
    let masked_sum = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().mul(&m)?.sum_all()?) };
    let lr = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)?;
    let k3_old_new = (lr.exp()? - &lr)?.affine(1.0, -1.0)?;
    let zero = Tensor::zeros((), f32_, dev)?;
    let agg_detached = |t: Option<&Tensor>| -> Result<Tensor> {
        match t {
            Some(t) => aggregate(&t.detach(), &m, cfg.agg, norm),
            None => Ok(zero.clone()),
        }
    };
    let n_seqs = m.sum(1)?.gt(0f32)?.to_dtype(f32_)?.sum_all()?;
    let stats = Tensor::stack(
        &[
            m.sum_all()?,
            n_seqs,
            agg_detached(Some(&pg))?,
            agg_detached(kl.as_ref().map(|(v, _)| v))?,
            agg_detached(ent.as_ref())?,
            masked_sum(&clip_low)?,
            masked_sum(&clip_high)?,
            masked_sum(&dual)?,
            masked_sum(&k3_old_new)?,
            masked_sum(&log_ratio.neg()?)?,
            masked_sum(&ratio)?,
        ],
        0,
    )?
    .to_vec1::<f32>()?;
    let n = stats[0];
    let mean = |s: f32| if n > 0.0 { s / n } else { 0.0 };
    let metrics = LossMetrics {
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
    };
    Ok(LossOutput { loss, metrics })
}
