//! The configuration types of the update's math, in one place: which policy loss
//! ([`PolicyLoss`], with its own parameters), how it aggregates ([`AggMode`]), KL ([`KlConfig`]), the token mask
//! ([`MaskConfig`], [`TauH`], [`S2tThresholds`]) and all of it together
//! ([`ObjectiveConfig`], validated field by field).
//!
//! `objective.rs` (the losses), `mask.rs` (the masks) and `preset.rs` (named presets and
//! `--set` overrides) all read these types; none of them depends on another for a type.
//! STAPO's paper defaults (arXiv 2602.15620 v4, §3 and §4.1: tau_p = 0.002, tau_h = the
//! 0.75-quantile of the entropies of the candidates, the low-probability tokens of correct
//! responses, in each mini-batch) are written once, here: [`TAU_P_DEFAULT`],
//! [`TAU_H_QUANTILE_DEFAULT`], [`TauH::PAPER`].

use serde::{Deserialize, Serialize};

use super::advantage::{AdvEstimator, OverlongConfig, RewardScale, StdKind};
use crate::{Error, Result};

/// STAPO's probability threshold of the sampled token, an absolute probability (paper §3;
/// 0.002 in every experiment, §4.1).
pub const TAU_P_DEFAULT: f32 = 0.002;
/// STAPO's entropy threshold: this quantile `q` of the candidates' entropies in each
/// mini-batch (paper §3, "computed dynamically over the low-probability tokens within
/// correct responses"; q = 75% in every experiment, §4.1; v1 of the paper used 80%).
pub const TAU_H_QUANTILE_DEFAULT: f32 = 0.75;

/// The population whose entropies a quantile `tau_h` is taken over, per (global)
/// mini-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantileOver {
    /// Only the candidates (`A > 0 && p < tau_p`), the paper's rule (§3): the bottom `q`
    /// share of them by entropy is silenced, so with one candidate nothing is, with two
    /// at most one.
    Candidates,
    /// Every response token of the mini-batch. Not the paper's rule: a variant (stapo's
    /// reading before the paper's text was public) that silences a candidate unless it is
    /// among the `1 - q` share of highest-entropy positions of the whole mini-batch.
    Response,
}

impl QuantileOver {
    /// The serde name (`response` / `candidates`), for maps and messages.
    pub fn name(self) -> &'static str {
        match self {
            QuantileOver::Response => "response",
            QuantileOver::Candidates => "candidates",
        }
    }

    /// Parses `response` / `candidates`; the error names the field `tau_h_over`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "response" => Ok(QuantileOver::Response),
            "candidates" => Ok(QuantileOver::Candidates),
            other => Err(cfg_err("tau_h_over", format!("expected response|candidates, found {other:?}"))),
        }
    }
}

/// The entropy threshold of the S2T mask. Serialised externally tagged:
/// `{"abs": 0.3}` or `{"quantile": {"q": 0.8, "over": "response"}}`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TauH {
    /// A fixed entropy threshold (nats).
    Abs(f32),
    /// The `q`-quantile (`0 <= q <= 1`, [`quantile_linear`](super::mask::quantile_linear))
    /// of the entropies of `over`, recomputed for every (global) mini-batch.
    Quantile {
        /// The quantile, in `[0, 1]`.
        q: f32,
        /// Whose entropies.
        over: QuantileOver,
    },
}

impl TauH {
    /// The paper's rule (§3, §4.1): the 0.75-quantile over the candidates.
    pub const PAPER: TauH = TauH::Quantile { q: TAU_H_QUANTILE_DEFAULT, over: QuantileOver::Candidates };
}

/// The two thresholds of STAPO's S2T mask.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct S2tThresholds {
    /// Probability threshold of the sampled token.
    pub tau_p: f32,
    /// Entropy threshold, absolute or a quantile of a named population.
    pub tau_h: TauH,
}

impl Default for S2tThresholds {
    /// The paper's: tau_p = 0.002, tau_h = the 0.75-quantile over the candidates.
    fn default() -> Self {
        S2tThresholds { tau_p: TAU_P_DEFAULT, tau_h: TauH::PAPER }
    }
}

impl S2tThresholds {
    /// The one parser of thresholds given as numbers (a script map, a hook's result, a
    /// `--set` value): `tau_p` replaces the probability threshold; `tau_h` (absolute)
    /// or else `tau_h_quantile` / `tau_h_over` replace the entropy threshold (a quantile
    /// keeps the population it had, or the candidates when it was absolute; a population
    /// alone keeps the quantile's `q`, or the paper's 0.75); what is not given stays.
    /// Validated; the error names the field.
    pub fn with(
        self,
        tau_p: Option<f64>,
        tau_h: Option<f64>,
        tau_h_quantile: Option<f64>,
        tau_h_over: Option<QuantileOver>,
    ) -> Result<Self> {
        let (q0, over0) = match self.tau_h {
            TauH::Quantile { q, over } => (q, over),
            TauH::Abs(_) => (TAU_H_QUANTILE_DEFAULT, QuantileOver::Candidates),
        };
        let out = S2tThresholds {
            tau_p: tau_p.map_or(self.tau_p, |x| x as f32),
            tau_h: match (tau_h, tau_h_quantile, tau_h_over) {
                (Some(h), _, _) => TauH::Abs(h as f32),
                (None, None, None) => self.tau_h,
                (None, q, over) => {
                    TauH::Quantile { q: q.map_or(q0, |q| q as f32), over: over.unwrap_or(over0) }
                }
            },
        };
        out.validate()?;
        Ok(out)
    }

    /// Checks `tau_p > 0` (finite), an absolute `tau_h` that is not NaN and a quantile in
    /// `[0, 1]`; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.tau_p.is_finite() && self.tau_p > 0.0) {
            return Err(cfg_err("tau_p", format!("expected a number > 0, found {}", self.tau_p)));
        }
        match self.tau_h {
            TauH::Abs(h) if h.is_nan() => Err(cfg_err("tau_h", "expected a number, found NaN")),
            TauH::Quantile { q, .. } if !(0.0..=1.0).contains(&q) => {
                Err(cfg_err("tau_h_quantile", format!("expected a number in [0, 1], found {q}")))
            }
            _ => Ok(()),
        }
    }
}

/// The per-token policy loss and its own parameters (verl `policy_loss.loss_mode` with the
/// settings that belong to it). Serialised with its `kind` as the tag:
/// `{"kind": "ppo", "eps_low": 0.2, "eps_high": 0.28, "dual_clip": null}`.
///
/// Adding a loss: one variant here, one arm in [`PolicyLoss::terms`] (in `objective.rs`)
/// and in [`PolicyLoss::name`], one default in [`PolicyLoss::default_of`] and one preset
/// line in `preset.rs`; the exhaustive matches make the compiler find the rest.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyLoss {
    /// PPO-clip (GRPO, DAPO, JustRL, STAPO): ratio clipped to `[1 - eps_low, 1 + eps_high]`,
    /// optionally dual-clipped at `c > 1` for `A < 0` (verl's default is 3.0, the papers use
    /// none).
    Ppo {
        eps_low: f32,
        eps_high: f32,
        #[serde(default)]
        dual_clip: Option<f32>,
    },
    /// GSPO: the sequence-level ratio, clipped at tiny eps.
    Gspo { eps_low: f32, eps_high: f32 },
    /// SAPO: the soft-gated ratio, no hard clip; gate temperature `tau_pos` for `A > 0`,
    /// `tau_neg` otherwise.
    Sapo { tau_pos: f32, tau_neg: f32 },
    /// Plain policy gradient `-A·r` (no clip).
    Pg,
}

impl PolicyLoss {
    /// Every kind's name, in documentation order; [`PolicyLoss::default_of`] knows each.
    pub const KINDS: [&'static str; 4] = ["ppo", "gspo", "sapo", "pg"];

    /// The `kind` tag of this loss.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyLoss::Ppo { .. } => "ppo",
            PolicyLoss::Gspo { .. } => "gspo",
            PolicyLoss::Sapo { .. } => "sapo",
            PolicyLoss::Pg => "pg",
        }
    }

    /// The loss `kind` with its papers' defaults: PPO eps 0.2/0.2 without dual clip, GSPO
    /// eps 3e-4/4e-4, SAPO tau 1.0/1.05.
    pub fn default_of(kind: &str) -> Option<Self> {
        Some(match kind {
            "ppo" => PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.2, dual_clip: None },
            "gspo" => PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 4e-4 },
            "sapo" => PolicyLoss::Sapo { tau_pos: 1.0, tau_neg: 1.05 },
            "pg" => PolicyLoss::Pg,
            _ => return None,
        })
    }

    /// The clip range `(eps_low, eps_high)` of the clipped losses.
    pub fn clip_range(&self) -> Option<(f32, f32)> {
        match *self {
            PolicyLoss::Ppo { eps_low, eps_high, .. } | PolicyLoss::Gspo { eps_low, eps_high } => {
                Some((eps_low, eps_high))
            }
            PolicyLoss::Sapo { .. } | PolicyLoss::Pg => None,
        }
    }

    /// Checks every parameter's range; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if let Some((eps_low, eps_high)) = self.clip_range() {
            if !(eps_low.is_finite() && (0.0..1.0).contains(&eps_low)) {
                return Err(cfg_err("eps_low", format!("expected a number in [0, 1), found {eps_low}")));
            }
            if !(eps_high.is_finite() && eps_high >= 0.0) {
                return Err(cfg_err("eps_high", format!("expected a number >= 0, found {eps_high}")));
            }
        }
        match *self {
            PolicyLoss::Ppo { dual_clip: Some(c), .. } if !(c.is_finite() && c > 1.0) => {
                Err(cfg_err("dual_clip", format!("expected a number > 1, found {c}")))
            }
            PolicyLoss::Sapo { tau_pos, tau_neg } => {
                for (f, v) in [("sapo_tau_pos", tau_pos), ("sapo_tau_neg", tau_neg)] {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(cfg_err(f, format!("expected a number > 0, found {v}")));
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
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

/// Which token mask (beyond the response mask) decides the kept tokens. Serialised with its
/// `kind` as the tag: `{"kind": "s2t", "tau_p": 0.002, "tau_h": {"quantile": {"q": 0.8, "over":
/// "response"}}}`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MaskConfig {
    /// Keep every response token.
    None,
    /// STAPO's S2T: silence tokens with `A > 0 && p < tau_p && H < tau_h`, both
    /// comparisons strict (a token exactly at `tau_h`, such as the quantile's own
    /// order statistic, is kept).
    S2t {
        /// Probability threshold of the sampled token (paper: 0.002).
        tau_p: f32,
        /// Entropy threshold, absolute or a quantile of a named population (paper's
        /// reading: the 0.8-quantile over the response tokens).
        tau_h: TauH,
    },
    /// 20-Entropy: keep the top `rho` fraction of response tokens by entropy (paper: 0.2).
    TopEntropy {
        /// Fraction kept, in (0, 1].
        rho: f32,
    },
}

/// Every knob of the loss, advantages and masks. Build one with [`ObjectiveConfig::preset`]
/// and adjust with [`ObjectiveConfig::set`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveConfig {
    /// The per-token policy loss and its parameters.
    pub loss: PolicyLoss,
    /// KL penalty to a frozen reference policy.
    pub kl: Option<KlConfig>,
    /// Entropy bonus coefficient (the loss gets `-entropy_coef · agg(H)`).
    pub entropy_coef: f32,
    /// Loss aggregation mode.
    pub agg: AggMode,
    /// The constant length of `seq-mean-token-sum-norm`; `None` = the padded length.
    pub norm_len: Option<usize>,
    /// Advantage estimator.
    pub adv: AdvEstimator,
    /// Which std GRPO divides by (sample, as verl / torch.std).
    pub std: StdKind,
    /// The token mask.
    pub mask: MaskConfig,
    /// DAPO dynamic sampling: drop groups whose rewards are all equal.
    pub dynamic_sampling: bool,
    /// DAPO soft overlong punishment.
    pub overlong: Option<OverlongConfig>,
    /// 0/1 or -1/+1 rewards.
    pub reward_scale: RewardScale,
}

impl MaskConfig {
    /// STAPO's S2T mask with the paper's thresholds.
    pub const S2T_DEFAULT: MaskConfig = MaskConfig::S2t { tau_p: TAU_P_DEFAULT, tau_h: TauH::PAPER };

    /// The S2T thresholds, when this is the S2T mask.
    pub fn s2t(&self) -> Option<S2tThresholds> {
        match *self {
            MaskConfig::S2t { tau_p, tau_h } => Some(S2tThresholds { tau_p, tau_h }),
            _ => None,
        }
    }
}

impl From<S2tThresholds> for MaskConfig {
    fn from(t: S2tThresholds) -> Self {
        MaskConfig::S2t { tau_p: t.tau_p, tau_h: t.tau_h }
    }
}

/// A configuration error naming the field.
pub(crate) fn cfg_err(field: &str, msg: impl Into<String>) -> Error {
    Error::Config { file: "objective config".into(), field: field.into(), msg: msg.into() }
}

impl Default for ObjectiveConfig {
    /// The `grpo` preset.
    fn default() -> Self {
        ObjectiveConfig {
            loss: PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.2, dual_clip: None },
            kl: None,
            entropy_coef: 0.0,
            agg: AggMode::SeqMeanTokenMean,
            norm_len: None,
            adv: AdvEstimator::Grpo,
            std: StdKind::Sample,
            mask: MaskConfig::None,
            dynamic_sampling: false,
            overlong: None,
            reward_scale: RewardScale::ZeroOne,
        }
    }
}

impl ObjectiveConfig {
    /// Checks every value's range; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let finite = |f: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(cfg_err(f, format!("expected a finite number, found {v}")))
            }
        };
        self.loss.validate()?;
        if let Some(k) = &self.kl {
            if !(k.beta.is_finite() && k.beta >= 0.0) {
                return Err(cfg_err("kl_beta", format!("expected a number >= 0, found {}", k.beta)));
            }
        }
        finite("entropy_coef", self.entropy_coef)?;
        if self.norm_len == Some(0) {
            return Err(cfg_err("norm_len", "expected a positive integer, found 0"));
        }
        match self.mask {
            MaskConfig::None => {}
            MaskConfig::S2t { tau_p, tau_h } => S2tThresholds { tau_p, tau_h }.validate()?,
            MaskConfig::TopEntropy { rho } => {
                if !(rho > 0.0 && rho <= 1.0) {
                    return Err(cfg_err("rho", format!("expected a number in (0, 1], found {rho}")));
                }
            }
        }
        if let Some(o) = &self.overlong {
            o.validate().map_err(|e| cfg_err("overlong", e.to_string()))?;
        }
        Ok(())
    }
}
