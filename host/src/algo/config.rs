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
//!
//! Every type here has one serde form, the one the run configuration (`actor.objective`),
//! `--set`, script maps and hook return maps all use, with defaults per variant: a tagged
//! object that names only its `kind` (`loss: #{kind: "gspo"}`) has that kind's defaults.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
}

/// The entropy threshold of the S2T mask. Its serde form is a number (absolute, nats) or a
/// quantile `{"q": 0.75, "over": "candidates"}` (each field defaults to the paper's), so a
/// script writes `tau_h: 0.3` or `tau_h: #{q: 0.5}` and `--set ...tau_h.q=0.5` keeps `over`.
#[derive(Clone, Copy, Debug, PartialEq)]
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

/// The quantile form of [`TauH`], each field defaulting to the paper's.
#[derive(Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct QuantileForm {
    q: f32,
    over: QuantileOver,
}

impl Default for QuantileForm {
    fn default() -> Self {
        match TauH::PAPER {
            TauH::Quantile { q, over } => QuantileForm { q, over },
            TauH::Abs(_) => QuantileForm { q: TAU_H_QUANTILE_DEFAULT, over: QuantileOver::Candidates },
        }
    }
}

impl Serialize for TauH {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match *self {
            TauH::Abs(h) => s.serialize_f32(h),
            TauH::Quantile { q, over } => QuantileForm { q, over }.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for TauH {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Form;
        impl<'de> serde::de::Visitor<'de> for Form {
            type Value = TauH;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an absolute entropy threshold (a number) or a quantile {q, over}")
            }
            fn visit_f64<E: serde::de::Error>(self, x: f64) -> std::result::Result<TauH, E> {
                Ok(TauH::Abs(x as f32))
            }
            fn visit_i64<E: serde::de::Error>(self, x: i64) -> std::result::Result<TauH, E> {
                Ok(TauH::Abs(x as f32))
            }
            fn visit_u64<E: serde::de::Error>(self, x: u64) -> std::result::Result<TauH, E> {
                Ok(TauH::Abs(x as f32))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> std::result::Result<TauH, A::Error> {
                let f = QuantileForm::deserialize(serde::de::value::MapAccessDeserializer::new(m))?;
                Ok(TauH::Quantile { q: f.q, over: f.over })
            }
        }
        d.deserialize_any(Form)
    }
}

/// The two thresholds of STAPO's S2T mask, in the one serde form the run configuration's
/// S2T mask, `--set`, the `thresholds` hook's map and the `s2t` binding share:
/// `{"tau_p": 0.002, "tau_h": {"q": 0.75, "over": "candidates"}}` or `{"tau_p": 0.002,
/// "tau_h": 0.3}`; a partial map laid over thresholds in force keeps what it does not name
/// ([`S2tThresholds::overlay`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
    /// These thresholds with the partial serde form `over` laid on top (the one parser of
    /// thresholds: a hook's map, the `s2t` binding's, `--set`), validated. An unknown key
    /// or an old flat spelling (`tau_h_quantile`, `tau_h_over`, `tau_h_abs`) is an error
    /// naming it and its replacement; `what` names the source in errors.
    pub fn overlay(&self, what: &str, over: &serde_json::Value) -> Result<Self> {
        if let Some(o) = over.as_object() {
            for (old, new) in [
                ("tau_h_quantile", "tau_h: {q: ..}"),
                ("tau_h_over", "tau_h: {over: ..}"),
                ("tau_h_abs", "tau_h: <number>"),
            ] {
                if o.contains_key(old) {
                    return Err(Error::Config {
                        file: what.into(),
                        field: old.into(),
                        msg: format!("`{old}` is now written `{new}` (one threshold form everywhere)"),
                    });
                }
            }
        }
        let base = serde_json::to_value(self).map_err(|e| cfg_err("thresholds", e.to_string()))?;
        let t: S2tThresholds = crate::overlay::build(what, &base, over)?;
        t.validate()?;
        Ok(t)
    }

    /// Checks `tau_p > 0` (finite), an absolute `tau_h` that is not NaN and a quantile in
    /// `[0, 1]`; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.tau_p.is_finite() && self.tau_p > 0.0) {
            return Err(cfg_err("tau_p", format!("expected a number > 0, found {}", self.tau_p)));
        }
        match self.tau_h {
            TauH::Abs(h) if h.is_nan() => Err(cfg_err("tau_h", "expected a number, found NaN")),
            TauH::Abs(_) => Ok(()),
            TauH::Quantile { q, .. } if !(0.0..=1.0).contains(&q) => {
                Err(cfg_err("tau_h.q", format!("expected a number in [0, 1], found {q}")))
            }
            TauH::Quantile { .. } => Ok(()),
        }
    }
}

/// The per-token policy loss and its own parameters (verl `policy_loss.loss_mode` with the
/// settings that belong to it). Serialised with its `kind` as the tag:
/// `{"kind": "ppo", "eps_low": 0.2, "eps_high": 0.28, "dual_clip": null}`; a field left out
/// takes that kind's default, so `{"kind": "gspo"}` is GSPO with eps 3e-4/4e-4.
///
/// The registry of losses (verl's `@register_policy_loss`) is this enum: adding a loss is
/// one variant here (its fields with their serde defaults), its function in `objective.rs`
/// (an arm of [`PolicyLoss::terms`]), its range checks (an arm of [`PolicyLoss::validate`])
/// and one preset line in `preset.rs`. Every match over the kinds is exhaustive and the
/// kind names are serde's, so the compiler finds each place and no list of names exists.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicyLoss {
    /// PPO-clip (GRPO, DAPO, JustRL, STAPO): ratio clipped to `[1 - eps_low, 1 + eps_high]`,
    /// optionally dual-clipped at `c > 1` for `A < 0` (verl's default is 3.0, the papers use
    /// none). Defaults 0.2/0.2, no dual clip.
    Ppo {
        /// The ratio's lower clip: `1 - eps_low`.
        #[serde(default = "defaults::ppo_eps")]
        eps_low: f32,
        /// The ratio's upper clip: `1 + eps_high` (DAPO's clip-higher raises it).
        #[serde(default = "defaults::ppo_eps")]
        eps_high: f32,
        /// The dual-clip bound `c > 1` on the loss of `A < 0` tokens (`None`: off).
        #[serde(default)]
        dual_clip: Option<f32>,
    },
    /// GSPO: the sequence-level ratio, clipped at tiny eps (defaults 3e-4/4e-4).
    Gspo {
        /// The sequence ratio's lower clip: `1 - eps_low`.
        #[serde(default = "defaults::gspo_eps_low")]
        eps_low: f32,
        /// The sequence ratio's upper clip: `1 + eps_high`.
        #[serde(default = "defaults::gspo_eps_high")]
        eps_high: f32,
    },
    /// SAPO: the soft-gated ratio, no hard clip; gate temperature `tau_pos` for `A > 0`,
    /// `tau_neg` otherwise (defaults 1.0/1.05).
    Sapo {
        /// Gate temperature for tokens with `A > 0`.
        #[serde(default = "defaults::sapo_tau_pos")]
        tau_pos: f32,
        /// Gate temperature for tokens with `A <= 0`.
        #[serde(default = "defaults::sapo_tau_neg")]
        tau_neg: f32,
    },
    /// Plain policy gradient `-A·r` (no clip).
    Pg,
}

/// The losses' defaults (papers: PPO/GRPO eps 0.2, GSPO 3e-4/4e-4, SAPO 1.0/1.05).
mod defaults {
    pub fn ppo_eps() -> f32 {
        0.2
    }
    pub fn gspo_eps_low() -> f32 {
        3e-4
    }
    pub fn gspo_eps_high() -> f32 {
        4e-4
    }
    pub fn sapo_tau_pos() -> f32 {
        1.0
    }
    pub fn sapo_tau_neg() -> f32 {
        1.05
    }
}

impl PolicyLoss {
    /// The `kind` tag of this loss.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyLoss::Ppo { .. } => "ppo",
            PolicyLoss::Gspo { .. } => "gspo",
            PolicyLoss::Sapo { .. } => "sapo",
            PolicyLoss::Pg => "pg",
        }
    }

    /// The loss `kind` with its defaults (what `{"kind": kind}` deserialises to), or `None`
    /// for a name that is no kind.
    pub fn default_of(kind: &str) -> Option<Self> {
        serde_json::from_value(serde_json::json!({ "kind": kind })).ok()
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

    /// Checks every parameter's range; the error names the field (`loss.eps_low`).
    pub fn validate(&self) -> Result<()> {
        match *self {
            PolicyLoss::Ppo { eps_low, eps_high, dual_clip } => {
                check_clip(eps_low, eps_high)?;
                match dual_clip {
                    Some(c) if !(c.is_finite() && c > 1.0) => {
                        Err(cfg_err("loss.dual_clip", format!("expected a number > 1, found {c}")))
                    }
                    Some(_) | None => Ok(()),
                }
            }
            PolicyLoss::Gspo { eps_low, eps_high } => check_clip(eps_low, eps_high),
            PolicyLoss::Sapo { tau_pos, tau_neg } => {
                for (f, v) in [("loss.tau_pos", tau_pos), ("loss.tau_neg", tau_neg)] {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(cfg_err(f, format!("expected a number > 0, found {v}")));
                    }
                }
                Ok(())
            }
            PolicyLoss::Pg => Ok(()),
        }
    }
}

/// A clip range: `eps_low` in `[0, 1)`, `eps_high >= 0`.
fn check_clip(eps_low: f32, eps_high: f32) -> Result<()> {
    if !(eps_low.is_finite() && (0.0..1.0).contains(&eps_low)) {
        return Err(cfg_err("loss.eps_low", format!("expected a number in [0, 1), found {eps_low}")));
    }
    if !(eps_high.is_finite() && eps_high >= 0.0) {
        return Err(cfg_err("loss.eps_high", format!("expected a number >= 0, found {eps_high}")));
    }
    Ok(())
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

/// A KL penalty to a frozen reference policy: `+beta · agg(KL)`. Fields left out take
/// verl's defaults (k3, `kl_loss_coef` 0.001), so `kl: #{beta: 0.04}` switches it on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlConfig {
    /// The estimator.
    pub kind: KlKind,
    /// The coefficient (verl `kl_loss_coef`, default 0.001; DeepSeekMath 0.04).
    pub beta: f32,
}

impl Default for KlConfig {
    fn default() -> Self {
        KlConfig { kind: KlKind::K3, beta: 0.001 }
    }
}

/// Which token mask (beyond the response mask) decides the kept tokens. Serialised with its
/// `kind` as the tag: `{"kind": "s2t", "tau_p": 0.002, "tau_h": {"q": 0.75, "over":
/// "candidates"}}` (the S2T fields are [`S2tThresholds`]' own form; left out, the paper's).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MaskConfig {
    /// Keep every response token.
    None,
    /// STAPO's S2T: silence tokens with `A > 0 && p < tau_p && H < tau_h`, both
    /// comparisons strict (a token exactly at `tau_h`, such as the quantile's own
    /// order statistic, is kept).
    S2t(S2tThresholds),
    /// 20-Entropy: keep the top `rho` fraction of response tokens by entropy (paper: 0.2).
    TopEntropy {
        /// Fraction kept, in (0, 1].
        #[serde(default = "top_entropy_rho")]
        rho: f32,
    },
}

/// Every knob of the loss, advantages and masks. Build one with [`ObjectiveConfig::preset`]
/// and adjust with [`ObjectiveConfig::overlay`] (a partial serde form laid on top).
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

/// 20-Entropy's kept fraction (Wang et al. 2025).
fn top_entropy_rho() -> f32 {
    0.2
}

impl MaskConfig {
    /// STAPO's S2T mask with the paper's thresholds.
    pub const S2T_DEFAULT: MaskConfig =
        MaskConfig::S2t(S2tThresholds { tau_p: TAU_P_DEFAULT, tau_h: TauH::PAPER });

    /// The S2T thresholds, when this is the S2T mask.
    pub fn s2t(&self) -> Option<S2tThresholds> {
        match *self {
            MaskConfig::S2t(t) => Some(t),
            MaskConfig::None | MaskConfig::TopEntropy { .. } => None,
        }
    }

    /// The `kind` tag of this mask.
    pub fn name(&self) -> &'static str {
        match self {
            MaskConfig::None => "none",
            MaskConfig::S2t(_) => "s2t",
            MaskConfig::TopEntropy { .. } => "top_entropy",
        }
    }
}

impl From<S2tThresholds> for MaskConfig {
    fn from(t: S2tThresholds) -> Self {
        MaskConfig::S2t(t)
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
                return Err(cfg_err("kl.beta", format!("expected a number >= 0, found {}", k.beta)));
            }
        }
        finite("entropy_coef", self.entropy_coef)?;
        if self.norm_len == Some(0) {
            return Err(cfg_err("norm_len", "expected a positive integer, found 0"));
        }
        match self.mask {
            MaskConfig::None => {}
            MaskConfig::S2t(t) => t.validate().map_err(|e| prefixed("mask", e))?,
            MaskConfig::TopEntropy { rho } => {
                if !(rho > 0.0 && rho <= 1.0) {
                    return Err(cfg_err("mask.rho", format!("expected a number in (0, 1], found {rho}")));
                }
            }
        }
        if let Some(o) = &self.overlong {
            o.validate().map_err(|e| cfg_err("overlong", e.to_string()))?;
        }
        Ok(())
    }

    /// This configuration with the partial serde form `over` laid on top (a tagged object
    /// that names another `kind` takes that kind's defaults), validated; errors name the
    /// dotted path below `what` (`actor.objective`).
    pub fn overlay(&self, what: &str, over: &serde_json::Value) -> Result<Self> {
        let base = serde_json::to_value(self).map_err(|e| cfg_err("<root>", e.to_string()))?;
        let o: ObjectiveConfig = crate::overlay::build(what, &base, over)?;
        o.validate()?;
        Ok(o)
    }
}

/// `e` with its field put under `section` (`tau_p` -> `mask.tau_p`).
fn prefixed(section: &str, e: Error) -> Error {
    match e {
        Error::Config { file, field, msg } => {
            Error::Config { file, field: format!("{section}.{field}"), msg }
        }
        other => other,
    }
}
