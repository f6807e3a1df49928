//! Named presets of [`ObjectiveConfig`] (the objectives the STAPO paper compares) and
//! `--set key=value` overrides. The types themselves live in `config.rs`.
//!
//! Presets follow DESIGN.md §1 and the papers: GRPO (DeepSeekMath, arXiv:2402.03300),
//! DAPO (arXiv:2503.14476), GSPO (arXiv:2507.18071), SAPO (arXiv:2511.20347), 20-Entropy
//! (arXiv:2506.01939), JustRL (He et al. 2025) and STAPO (2026: DAPO + the S2T mask,
//! tau_p = 0.002, tau_h = the 0.75-quantile, token-mean). verl `core_algos.py` names the
//! aggregation modes.

use super::advantage::{AdvEstimator, OverlongConfig, RewardScale, StdKind};
use super::config::{
    cfg_err, AggMode, KlConfig, KlKind, MaskConfig, ObjectiveConfig, ObjectiveKind, S2tThresholds,
};
use crate::Result;

/// Names accepted by [`ObjectiveConfig::preset`].
pub const PRESETS: [&str; 8] = ["grpo", "dapo", "gspo", "sapo", "entropy20", "justrl", "stapo", "drgrpo"];

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

/// DAPO's overlong buffer: L_max = 20480, L_cache = 4096, factor 1. Entry points size it
/// to the run's response budget with [`ObjectiveConfig::fit_to_run`].
pub const DAPO_OVERLONG: OverlongConfig = OverlongConfig { max_len: 20480, cache_len: 4096, factor: 1.0 };
/// verl's default `kl_loss_coef`.
const DEFAULT_KL_BETA: f32 = 0.001;

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
    /// | drgrpo | grpo with Dr.GRPO advantages (no std) and seq-mean-token-sum-norm over a constant length (the run's max_tokens, see [`ObjectiveConfig::fit_to_run`]) |
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
            "stapo" => ObjectiveConfig { mask: MaskConfig::S2T_DEFAULT, ..dapo },
            "drgrpo" => {
                ObjectiveConfig { adv: AdvEstimator::DrGrpo, agg: AggMode::SeqMeanTokenSumNorm, ..grpo }
            }
            _ => {
                return Err(cfg_err(
                    "preset",
                    format!("unknown preset `{name}`; valid presets: {}", PRESETS.join(", ")),
                ))
            }
        };
        Ok(cfg)
    }

    /// A preset with `key = value` overrides (the form run configs, script maps and
    /// `stapo update --set` give), validated; the error names the preset or the key.
    /// Overrides are applied in a fixed order whatever order they come in: switches
    /// (`mask`, `kl`, `overlong`, ...) before their parameters, and `overlong_max_len`
    /// (which rescales the buffer) before `overlong_cache_len`.
    pub fn with_overrides<K: AsRef<str>, V: AsRef<str>>(
        name: &str,
        overrides: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self> {
        let rank = |k: &str| match k.trim() {
            "kind" | "mask" | "kl" | "overlong" | "eps" => 0,
            "overlong_max_len" => 1,
            _ => 2,
        };
        let mut pairs: Vec<(K, V)> = overrides.into_iter().collect();
        pairs
            .sort_by(|a, b| rank(a.0.as_ref()).cmp(&rank(b.0.as_ref())).then(a.0.as_ref().cmp(b.0.as_ref())));
        let mut o = ObjectiveConfig::preset(name)?;
        for (k, v) in &pairs {
            o.set(k.as_ref(), v.as_ref())?;
        }
        o.validate()?;
        Ok(o)
    }

    /// Sizes the settings that depend on the run's response budget `max_tokens` (every
    /// entry point calls it: the trainer each step, `stapo update --max-tokens`, the
    /// `update` binding's `max_tokens`):
    /// - DAPO's overlong buffer, while it is still the preset's ([`DAPO_OVERLONG`]): L_max =
    ///   `max_tokens`, L_cache the same fraction of it (0.2), as `set overlong_max_len` does;
    /// - seq-mean-token-sum-norm's constant length, when unset: `max_tokens` (Dr.GRPO).
    ///
    /// Returns a note for a setting that cannot take effect: an overlong buffer that starts
    /// at or beyond `max_tokens` never fires.
    pub fn fit_to_run(&mut self, max_tokens: usize) -> Vec<String> {
        let mut notes = Vec::new();
        if max_tokens == 0 {
            return notes;
        }
        if self.overlong == Some(DAPO_OVERLONG) {
            let frac = DAPO_OVERLONG.cache_len as f64 / DAPO_OVERLONG.max_len as f64;
            let cache_len = ((max_tokens as f64 * frac).round() as usize).clamp(1, max_tokens);
            self.overlong = Some(OverlongConfig { max_len: max_tokens, cache_len, ..DAPO_OVERLONG });
        }
        if let Some(o) = &self.overlong {
            let start = o.max_len.saturating_sub(o.cache_len);
            if start >= max_tokens {
                notes.push(format!(
                    "the overlong penalty can never fire: responses stop at max_tokens = {max_tokens} but \
                     it starts after {start} tokens (L_max {} - L_cache {}); set overlong_max_len to \
                     the run's max_tokens",
                    o.max_len, o.cache_len
                ));
            }
        }
        if self.agg == AggMode::SeqMeanTokenSumNorm && self.norm_len.is_none() {
            self.norm_len = Some(max_tokens);
        }
        notes
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
                    ("s2t", _) => MaskConfig::S2T_DEFAULT,
                    ("top_entropy", m @ MaskConfig::TopEntropy { .. }) => m,
                    ("top_entropy", _) => MaskConfig::TopEntropy { rho: 0.2 },
                    _ => return Err(bad(key)),
                }
            }
            "tau_p" | "tau_h" | "tau_h_quantile" => {
                let v = Some(num(key)? as f64);
                let cur = self
                    .mask
                    .s2t()
                    .ok_or_else(|| cfg_err(key, "applies to mask=s2t only; set mask=s2t first"))?;
                let t: S2tThresholds = match key {
                    "tau_p" => cur.with(v, None, None)?,
                    "tau_h" => cur.with(None, v, None)?,
                    _ => cur.with(None, None, v)?,
                };
                self.mask = t.into();
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
    use crate::algo::config::TauH;

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

    #[test]
    fn overrides_apply_in_a_fixed_order() {
        // Given cache first, L_max still comes first: 1024 rescales the DAPO buffer
        // (round(0.2 · 1024) = 205), then the cache is set to 256.
        let pairs = [("overlong_cache_len", "256"), ("overlong_max_len", "1024"), ("tau_p", "0.01")];
        let c = ObjectiveConfig::with_overrides("stapo", pairs).unwrap();
        assert_eq!(c.overlong, Some(OverlongConfig { max_len: 1024, cache_len: 256, factor: 1.0 }));
        // `mask` switches S2T on before its threshold is read, whatever the order.
        let c = ObjectiveConfig::with_overrides("grpo", [("tau_p", "0.01"), ("mask", "s2t")]).unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.01, tau_h: TauH::Quantile(0.75) });
        let e = ObjectiveConfig::with_overrides("grpo", [("tau_q", "1")]).unwrap_err().to_string();
        assert!(e.contains("tau_q"), "{e}");
    }

    #[test]
    fn drgrpo_preset_and_fitting_to_the_run() {
        let mut d = ObjectiveConfig::preset("dr_grpo").unwrap();
        assert_eq!((d.adv, d.agg, d.norm_len), (AdvEstimator::DrGrpo, AggMode::SeqMeanTokenSumNorm, None));
        assert!(d.fit_to_run(512).is_empty());
        assert_eq!(d.norm_len, Some(512));
        // DAPO's preset buffer follows the run: 20480/4096 → 64/13 (round(0.2 · 64)).
        let mut s = ObjectiveConfig::preset("stapo").unwrap();
        assert!(s.fit_to_run(64).is_empty());
        assert_eq!(s.overlong, Some(OverlongConfig { max_len: 64, cache_len: 13, factor: 1.0 }));
        assert_eq!(s.norm_len, None); // token-mean: no constant length
                                      // A buffer the user set is kept, and one that starts beyond the budget is a note.
        let mut u = ObjectiveConfig::with_overrides("dapo", [("overlong_max_len", "1024")]).unwrap();
        let notes = u.fit_to_run(64);
        assert_eq!(u.overlong.unwrap().max_len, 1024);
        assert!(notes.len() == 1 && notes[0].contains("never fire"), "{notes:?}");
    }
}
