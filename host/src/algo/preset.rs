//! [`ObjectiveConfig`]: every knob of the update's math, its named presets (the objectives
//! the STAPO paper compares) and `--set key=value` overrides.
//!
//! Presets follow DESIGN.md §1 and the papers: GRPO (DeepSeekMath, arXiv:2402.03300),
//! DAPO (arXiv:2503.14476), GSPO (arXiv:2507.18071), SAPO (arXiv:2511.20347), 20-Entropy
//! (arXiv:2506.01939), JustRL (He et al. 2025) and STAPO (2026: DAPO + the S2T mask,
//! tau_p = 0.002, tau_h = the 0.75-quantile, token-mean). verl `core_algos.py` names the
//! aggregation modes.

use serde::{Deserialize, Serialize};

use super::advantage::{AdvEstimator, OverlongConfig, RewardScale, StdKind};
use super::mask::TauH;
use super::objective::{AggMode, KlConfig, KlKind, ObjectiveKind};
use crate::{Error, Result};

/// Which token mask (beyond the response mask) decides the kept tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskConfig {
    /// Keep every response token.
    None,
    /// STAPO's S2T: silence tokens with `A > 0 && p < tau_p && H < tau_h`.
    S2t {
        /// Probability threshold of the sampled token (paper: 0.002).
        tau_p: f32,
        /// Entropy threshold, absolute or a quantile of the candidates (paper: 0.75-quantile).
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
    /// The per-token objective.
    pub kind: ObjectiveKind,
    /// Lower clip: ratio clipped at `1 - eps_low` (PPO, GSPO).
    pub eps_low: f32,
    /// Upper clip: ratio clipped at `1 + eps_high` (PPO, GSPO).
    pub eps_high: f32,
    /// Dual-clip bound `c > 1` for `A < 0` (PPO only; verl's default is 3.0, the papers use
    /// none).
    pub dual_clip: Option<f32>,
    /// SAPO gate temperature for `A > 0`.
    pub sapo_tau_pos: f32,
    /// SAPO gate temperature for `A <= 0`.
    pub sapo_tau_neg: f32,
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

/// Names accepted by [`ObjectiveConfig::preset`].
pub const PRESETS: [&str; 7] = ["grpo", "dapo", "gspo", "sapo", "entropy20", "justrl", "stapo"];

/// Keys accepted by [`ObjectiveConfig::set`], with the value each expects.
pub const SET_KEYS: [(&str, &str); 25] = [
    ("kind", "ppo|gspo|sapo|pg"),
    ("eps", "number (sets eps_low and eps_high)"),
    ("eps_low", "number in [0, 1)"),
    ("eps_high", "number >= 0"),
    ("dual_clip", "number > 1, or none"),
    ("sapo_tau_pos", "number > 0"),
    ("sapo_tau_neg", "number > 0"),
    ("kl", "none|k1|k2|k3"),
    ("kl_beta", "number >= 0 (turns kl on as k3 if it was off)"),
    ("entropy_coef", "number"),
    ("agg", "token-mean|seq-mean-token-mean|seq-mean-token-sum|seq-mean-token-sum-norm"),
    ("norm_len", "positive integer, or none"),
    ("adv", "grpo|dr_grpo"),
    ("std", "sample|population"),
    ("mask", "none|s2t|top_entropy"),
    ("tau_p", "number > 0 (mask=s2t)"),
    ("tau_h", "absolute entropy threshold (mask=s2t)"),
    ("tau_h_quantile", "number in [0, 1] (mask=s2t)"),
    ("rho", "number in (0, 1] (mask=top_entropy)"),
    ("dynamic_sampling", "true|false"),
    ("overlong", "none|on"),
    (
        "overlong_max_len",
        "positive integer (turns overlong on if it was off; rescales cache_len to keep its fraction)",
    ),
    ("overlong_cache_len", "positive integer (turns overlong on if it was off)"),
    ("overlong_factor", "number >= 0 (turns overlong on if it was off)"),
    ("reward_scale", "zero_one|plus_minus_one"),
];

/// DAPO's overlong buffer: L_max = 20480, L_cache = 4096, factor 1 (set `overlong_max_len`
/// to the run's max response length).
const DAPO_OVERLONG: OverlongConfig = OverlongConfig { max_len: 20480, cache_len: 4096, factor: 1.0 };
/// STAPO's S2T defaults.
const S2T_DEFAULT: MaskConfig = MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::Quantile(0.75) };
/// verl's default `kl_loss_coef`.
const DEFAULT_KL_BETA: f32 = 0.001;

fn cfg_err(field: &str, msg: impl Into<String>) -> Error {
    Error::Config { file: "objective config".into(), field: field.into(), msg: msg.into() }
}

impl Default for ObjectiveConfig {
    /// The `grpo` preset.
    fn default() -> Self {
        ObjectiveConfig {
            kind: ObjectiveKind::Ppo,
            eps_low: 0.2,
            eps_high: 0.2,
            dual_clip: None,
            sapo_tau_pos: 1.0,
            sapo_tau_neg: 1.05,
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
    /// A named preset (case-insensitive, `-` and `_` ignored; `20entropy` is an alias of
    /// `entropy20`):
    ///
    /// | name | settings |
    /// |---|---|
    /// | grpo | PPO clip eps 0.2/0.2, seq-mean-token-mean, GRPO advantages (sample std), no KL (`--set kl=k3 --set kl_beta=0.04` for DeepSeekMath's) |
    /// | dapo | eps 0.2/0.28, token-mean, dynamic sampling, overlong 20480/4096/1.0 |
    /// | gspo | GSPO, eps 3e-4/4e-4, seq-mean-token-mean |
    /// | sapo | SAPO, tau_pos 1.0, tau_neg 1.05, seq-mean-token-mean |
    /// | entropy20 | dapo + top-entropy mask rho 0.2 |
    /// | justrl | eps 0.2/0.28, token-mean, no KL, no dynamic sampling, no overlong |
    /// | stapo | dapo + S2T mask (tau_p 0.002, tau_h = 0.75-quantile), token-mean |
    pub fn preset(name: &str) -> Result<Self> {
        let key: String =
            name.trim().to_ascii_lowercase().chars().filter(|c| *c != '-' && *c != '_').collect();
        let grpo = ObjectiveConfig::default();
        let dapo = ObjectiveConfig {
            eps_high: 0.28,
            agg: AggMode::TokenMean,
            dynamic_sampling: true,
            overlong: Some(DAPO_OVERLONG),
            ..grpo.clone()
        };
        let cfg = match key.as_str() {
            "grpo" => grpo,
            "dapo" => dapo,
            "gspo" => ObjectiveConfig { kind: ObjectiveKind::Gspo, eps_low: 3e-4, eps_high: 4e-4, ..grpo },
            "sapo" => ObjectiveConfig { kind: ObjectiveKind::Sapo, ..grpo },
            "entropy20" | "20entropy" => {
                ObjectiveConfig { mask: MaskConfig::TopEntropy { rho: 0.2 }, ..dapo }
            }
            "justrl" => ObjectiveConfig { eps_high: 0.28, agg: AggMode::TokenMean, ..grpo },
            "stapo" => ObjectiveConfig { mask: S2T_DEFAULT, ..dapo },
            _ => {
                return Err(cfg_err(
                    "preset",
                    format!("unknown preset `{name}`; valid presets: {}", PRESETS.join(", ")),
                ))
            }
        };
        Ok(cfg)
    }

    /// Checks every value's range; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let finite = |f: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(cfg_err(f, format!("expected a finite number, found {v}")))
            }
        };
        finite("eps_low", self.eps_low)?;
        finite("eps_high", self.eps_high)?;
        if !(0.0..1.0).contains(&self.eps_low) {
            return Err(cfg_err("eps_low", format!("expected a number in [0, 1), found {}", self.eps_low)));
        }
        if self.eps_high < 0.0 {
            return Err(cfg_err("eps_high", format!("expected a number >= 0, found {}", self.eps_high)));
        }
        if let Some(c) = self.dual_clip {
            if !(c.is_finite() && c > 1.0) {
                return Err(cfg_err("dual_clip", format!("expected a number > 1, found {c}")));
            }
        }
        for (f, v) in [("sapo_tau_pos", self.sapo_tau_pos), ("sapo_tau_neg", self.sapo_tau_neg)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(cfg_err(f, format!("expected a number > 0, found {v}")));
            }
        }
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
            MaskConfig::S2t { tau_p, tau_h } => {
                if !(tau_p.is_finite() && tau_p > 0.0) {
                    return Err(cfg_err("tau_p", format!("expected a number > 0, found {tau_p}")));
                }
                match tau_h {
                    TauH::Abs(h) if h.is_nan() => {
                        return Err(cfg_err("tau_h", "expected a number, found NaN"))
                    }
                    TauH::Quantile(q) if !(0.0..=1.0).contains(&q) => {
                        return Err(cfg_err(
                            "tau_h_quantile",
                            format!("expected a number in [0, 1], found {q}"),
                        ))
                    }
                    _ => {}
                }
            }
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

    /// Applies one `--set key=value` override, then validates; on error the config is left
    /// unchanged and the error names the key and what it expects (or lists the valid keys).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let before = self.clone();
        let r = self.set_unchecked(key.trim(), value.trim()).and_then(|_| self.validate());
        if r.is_err() {
            *self = before;
        }
        r
    }

    fn set_unchecked(&mut self, key: &str, value: &str) -> Result<()> {
        let expects = |k: &str| SET_KEYS.iter().find(|(n, _)| *n == k).map(|(_, e)| *e).unwrap_or("");
        let bad = |k: &str| cfg_err(k, format!("expected {}, found `{value}`", expects(k)));
        let num = |k: &str| -> Result<f32> {
            value.parse::<f32>().ok().filter(|v| v.is_finite()).ok_or_else(|| bad(k))
        };
        let int = |k: &str| -> Result<usize> { value.parse::<usize>().map_err(|_| bad(k)) };
        let is_none = matches!(value.to_ascii_lowercase().as_str(), "none" | "off" | "null");
        let lower = value.to_ascii_lowercase().replace('-', "_");
        match key {
            "kind" => {
                self.kind = match lower.as_str() {
                    "ppo" => ObjectiveKind::Ppo,
                    "gspo" => ObjectiveKind::Gspo,
                    "sapo" => ObjectiveKind::Sapo,
                    "pg" => ObjectiveKind::Pg,
                    _ => return Err(bad(key)),
                }
            }
            "eps" => {
                let v = num(key)?;
                self.eps_low = v;
                self.eps_high = v;
            }
            "eps_low" => self.eps_low = num(key)?,
            "eps_high" => self.eps_high = num(key)?,
            "dual_clip" => self.dual_clip = if is_none { None } else { Some(num(key)?) },
            "sapo_tau_pos" => self.sapo_tau_pos = num(key)?,
            "sapo_tau_neg" => self.sapo_tau_neg = num(key)?,
            "kl" => {
                let beta = self.kl.map(|k| k.beta).unwrap_or(DEFAULT_KL_BETA);
                self.kl = match lower.as_str() {
                    "none" | "off" | "null" => None,
                    "k1" => Some(KlConfig { kind: KlKind::K1, beta }),
                    "k2" => Some(KlConfig { kind: KlKind::K2, beta }),
                    "k3" | "low_var_kl" => Some(KlConfig { kind: KlKind::K3, beta }),
                    _ => return Err(bad(key)),
                }
            }
            "kl_beta" => {
                let beta = num(key)?;
                let kind = self.kl.map(|k| k.kind).unwrap_or(KlKind::K3);
                self.kl = Some(KlConfig { kind, beta });
            }
            "entropy_coef" => self.entropy_coef = num(key)?,
            "agg" => self.agg = AggMode::parse(value).ok_or_else(|| bad(key))?,
            "norm_len" => self.norm_len = if is_none { None } else { Some(int(key)?) },
            "adv" => {
                self.adv = match lower.as_str() {
                    "grpo" => AdvEstimator::Grpo,
                    "dr_grpo" | "drgrpo" => AdvEstimator::DrGrpo,
                    _ => return Err(bad(key)),
                }
            }
            "std" => {
                self.std = match lower.as_str() {
                    "sample" | "unbiased" => StdKind::Sample,
                    "population" | "biased" => StdKind::Population,
                    _ => return Err(bad(key)),
                }
            }
            "mask" => {
                self.mask = match (lower.as_str(), self.mask) {
                    ("none" | "off", _) => MaskConfig::None,
                    ("s2t", m @ MaskConfig::S2t { .. }) => m,
                    ("s2t", _) => S2T_DEFAULT,
                    ("top_entropy", m @ MaskConfig::TopEntropy { .. }) => m,
                    ("top_entropy", _) => MaskConfig::TopEntropy { rho: 0.2 },
                    _ => return Err(bad(key)),
                }
            }
            "tau_p" | "tau_h" | "tau_h_quantile" => {
                let v = num(key)?;
                match &mut self.mask {
                    MaskConfig::S2t { tau_p, tau_h } => match key {
                        "tau_p" => *tau_p = v,
                        "tau_h" => *tau_h = TauH::Abs(v),
                        _ => *tau_h = TauH::Quantile(v),
                    },
                    _ => return Err(cfg_err(key, "applies to mask=s2t only; set mask=s2t first")),
                }
            }
            "rho" => {
                let v = num(key)?;
                match &mut self.mask {
                    MaskConfig::TopEntropy { rho } => *rho = v,
                    _ => {
                        return Err(cfg_err(
                            key,
                            "applies to mask=top_entropy only; set mask=top_entropy first",
                        ))
                    }
                }
            }
            "dynamic_sampling" => {
                self.dynamic_sampling = match lower.as_str() {
                    "true" | "on" | "1" | "yes" => true,
                    "false" | "off" | "0" | "no" => false,
                    _ => return Err(bad(key)),
                }
            }
            "overlong" => {
                self.overlong = match lower.as_str() {
                    "none" | "off" | "null" | "false" => None,
                    "on" | "true" => Some(self.overlong.unwrap_or(DAPO_OVERLONG)),
                    _ => return Err(bad(key)),
                }
            }
            "overlong_max_len" | "overlong_cache_len" | "overlong_factor" => {
                let mut o = self.overlong.unwrap_or(DAPO_OVERLONG);
                match key {
                    "overlong_max_len" => {
                        // Keep the buffer's fraction of L_max (DAPO: 4096 / 20480), so that
                        // shrinking L_max for a small run stays valid; set the cache after.
                        let new_max = int(key)?;
                        let frac = o.cache_len as f64 / o.max_len.max(1) as f64;
                        o.cache_len = ((new_max as f64 * frac).round() as usize).max(1);
                        o.max_len = new_max;
                    }
                    "overlong_cache_len" => o.cache_len = int(key)?,
                    _ => o.factor = num(key)?,
                }
                self.overlong = Some(o);
            }
            "reward_scale" => {
                self.reward_scale = match lower.as_str() {
                    "zero_one" | "01" => RewardScale::ZeroOne,
                    "plus_minus_one" | "pm1" => RewardScale::PlusMinusOne,
                    _ => return Err(bad(key)),
                }
            }
            _ => {
                let keys: Vec<&str> = SET_KEYS.iter().map(|(k, _)| *k).collect();
                return Err(cfg_err(key, format!("unknown key; valid keys: {}", keys.join(", "))));
            }
        }
        Ok(())
    }

    /// Applies `key=value` (the CLI's `--set` form).
    pub fn set_pair(&mut self, pair: &str) -> Result<()> {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| cfg_err("--set", format!("expected key=value, found `{pair}`")))?;
        self.set(k, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_design_defaults() {
        let s = ObjectiveConfig::preset("stapo").unwrap();
        assert_eq!(s.kind, ObjectiveKind::Ppo);
        assert_eq!((s.eps_low, s.eps_high), (0.2, 0.28));
        assert_eq!(s.agg, AggMode::TokenMean);
        assert_eq!(s.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::Quantile(0.75) });
        assert_eq!(s.kl, None);
        assert_eq!(s.entropy_coef, 0.0);
        let g = ObjectiveConfig::preset("GSPO").unwrap();
        assert_eq!(
            (g.kind, g.eps_low, g.eps_high, g.agg),
            (ObjectiveKind::Gspo, 3e-4, 4e-4, AggMode::SeqMeanTokenMean)
        );
        let sa = ObjectiveConfig::preset("sapo").unwrap();
        assert_eq!((sa.kind, sa.sapo_tau_pos, sa.sapo_tau_neg), (ObjectiveKind::Sapo, 1.0, 1.05));
        let d = ObjectiveConfig::preset("dapo").unwrap();
        assert!(d.dynamic_sampling && d.overlong.is_some());
        let e = ObjectiveConfig::preset("entropy-20").unwrap();
        assert_eq!(e.mask, MaskConfig::TopEntropy { rho: 0.2 });
        let j = ObjectiveConfig::preset("justrl").unwrap();
        assert!(!j.dynamic_sampling && j.kl.is_none() && j.overlong.is_none() && j.eps_high == 0.28);
        assert_eq!(ObjectiveConfig::preset("grpo").unwrap(), ObjectiveConfig::default());
    }

    #[test]
    fn presets_round_trip_and_validate() {
        for name in PRESETS {
            let c = ObjectiveConfig::preset(name).unwrap();
            c.validate().unwrap();
            let j = serde_json::to_string(&c).unwrap();
            let back: ObjectiveConfig = serde_json::from_str(&j).unwrap();
            assert_eq!(back, c, "{name}: {j}");
        }
        let mut c = ObjectiveConfig::preset("stapo").unwrap();
        c.set("kl", "k2").unwrap();
        c.set("tau_h", "0.5").unwrap();
        let back: ObjectiveConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn unknown_preset_lists_valid_ones() {
        let e = ObjectiveConfig::preset("ppo2").unwrap_err().to_string();
        assert!(e.contains("ppo2") && e.contains("grpo") && e.contains("stapo"), "{e}");
    }

    #[test]
    fn set_overrides() {
        let mut c = ObjectiveConfig::preset("grpo").unwrap();
        c.set("eps_high", "0.28").unwrap();
        c.set("agg", "token-mean").unwrap();
        c.set("dual_clip", "3").unwrap();
        c.set("kl_beta", "0.04").unwrap(); // turns on k3
        c.set("adv", "dr_grpo").unwrap();
        c.set("mask", "s2t").unwrap();
        c.set("tau_h_quantile", "0.5").unwrap();
        c.set_pair("overlong_max_len=1024").unwrap();
        // DAPO buffer 4096/20480 = 0.2 of L_max → round(0.2 · 1024) = 205.
        assert_eq!(c.overlong, Some(OverlongConfig { max_len: 1024, cache_len: 205, factor: 1.0 }));
        c.set("overlong_cache_len", "256").unwrap();
        assert_eq!(c.eps_high, 0.28);
        assert_eq!(c.agg, AggMode::TokenMean);
        assert_eq!(c.dual_clip, Some(3.0));
        assert_eq!(c.kl, Some(KlConfig { kind: KlKind::K3, beta: 0.04 }));
        assert_eq!(c.adv, AdvEstimator::DrGrpo);
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::Quantile(0.5) });
        assert_eq!(c.overlong, Some(OverlongConfig { max_len: 1024, cache_len: 256, factor: 1.0 }));
        c.set("dual_clip", "none").unwrap();
        assert_eq!(c.dual_clip, None);
    }

    #[test]
    fn set_errors_name_key_and_expectation() {
        let mut c = ObjectiveConfig::preset("stapo").unwrap();
        let before = c.clone();
        let e = c.set("eps_lo", "0.1").unwrap_err().to_string();
        assert!(e.contains("eps_lo") && e.contains("valid keys") && e.contains("eps_low"), "{e}");
        let e = c.set("eps_low", "abc").unwrap_err().to_string();
        assert!(e.contains("eps_low") && e.contains("number") && e.contains("abc"), "{e}");
        let e = c.set("eps_low", "1.5").unwrap_err().to_string(); // parses, fails validation
        assert!(e.contains("eps_low") && e.contains("[0, 1)"), "{e}");
        let e = c.set("dual_clip", "0.5").unwrap_err().to_string();
        assert!(e.contains("dual_clip") && e.contains("> 1"), "{e}");
        let e = c.set("rho", "0.2").unwrap_err().to_string();
        assert!(e.contains("rho") && e.contains("top_entropy"), "{e}");
        let e = c.set("agg", "mean").unwrap_err().to_string();
        assert!(e.contains("agg") && e.contains("token-mean"), "{e}");
        assert!(c.set("tau_h_quantile", "1.5").is_err());
        assert!(c.set("overlong_cache_len", "99999").is_err()); // cache > max_len
        assert!(c.set_pair("eps_low").is_err());
        assert_eq!(c, before, "failed sets leave the config unchanged");
    }
}
