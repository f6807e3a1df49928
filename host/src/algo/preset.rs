//! Named presets of [`ObjectiveConfig`]: the objectives the STAPO paper compares, one
//! line each in [`PRESETS`] (name, summary, builder). The types live in `config.rs`,
//! `--set key=value` overrides in `overrides.rs`.
//!
//! Presets follow DESIGN.md §1 and the papers: GRPO (DeepSeekMath, arXiv:2402.03300),
//! DAPO (arXiv:2503.14476), GSPO (arXiv:2507.18071), SAPO (arXiv:2511.20347), 20-Entropy
//! (arXiv:2506.01939), JustRL (He et al. 2025), Dr.GRPO (arXiv:2503.20783) and STAPO
//! (arXiv 2602.15620: JustRL's settings + the S2T mask with tau_p = 0.002, tau_h = the
//! 0.75-quantile of the candidates' entropies per mini-batch, §3 and §4.1; `dapo_s2t` is
//! DAPO + the same S2T mask).
//! verl `core_algos.py` names the aggregation modes.

use super::advantage::{AdvEstimator, OverlongConfig};
use super::config::{cfg_err, AggMode, MaskConfig, ObjectiveConfig, PolicyLoss};
use crate::Result;

/// One named preset: what `--objective NAME` (or `objective: "NAME"`) starts from.
pub struct Preset {
    /// The name (matched case-insensitively, `-` and `_` ignored).
    pub name: &'static str,
    /// Other names it answers to.
    pub aliases: &'static [&'static str],
    /// One line for help texts and the README's table.
    pub summary: &'static str,
    build: fn() -> ObjectiveConfig,
}

impl Preset {
    /// The preset's configuration.
    pub fn config(&self) -> ObjectiveConfig {
        (self.build)()
    }
}

/// DAPO's overlong buffer: L_max = 20480, L_cache = 4096, factor 1. Entry points size it
/// to the run's response budget with [`ObjectiveConfig::fit_to_run`].
pub const DAPO_OVERLONG: OverlongConfig = OverlongConfig { max_len: 20480, cache_len: 4096, factor: 1.0 };

fn grpo() -> ObjectiveConfig {
    ObjectiveConfig::default()
}

/// JustRL: DAPO's clip range and token-mean, nothing else of DAPO's.
fn justrl() -> ObjectiveConfig {
    ObjectiveConfig {
        loss: PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None },
        agg: AggMode::TokenMean,
        ..grpo()
    }
}

fn dapo() -> ObjectiveConfig {
    ObjectiveConfig {
        loss: PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None },
        agg: AggMode::TokenMean,
        dynamic_sampling: true,
        overlong: Some(DAPO_OVERLONG),
        ..grpo()
    }
}

/// Every preset, in documentation order. A new objective is one line here.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "grpo",
        aliases: &[],
        summary: "PPO clip eps 0.2/0.2, seq-mean-token-mean, GRPO advantages (sample std), no KL",
        build: grpo,
    },
    Preset {
        name: "dapo",
        aliases: &[],
        summary: "eps 0.2/0.28, token-mean, dynamic sampling, overlong penalty 20480/4096/1.0",
        build: dapo,
    },
    Preset {
        name: "gspo",
        aliases: &[],
        summary: "GSPO sequence ratio, eps 3e-4/4e-4, seq-mean-token-mean",
        build: || ObjectiveConfig { loss: PolicyLoss::default_of("gspo").expect("gspo"), ..grpo() },
    },
    Preset {
        name: "sapo",
        aliases: &[],
        summary: "SAPO soft gate, tau_pos 1.0, tau_neg 1.05, seq-mean-token-mean",
        build: || ObjectiveConfig { loss: PolicyLoss::default_of("sapo").expect("sapo"), ..grpo() },
    },
    Preset {
        name: "entropy20",
        aliases: &["20entropy"],
        summary: "dapo + top-entropy mask rho 0.2 (20-Entropy)",
        build: || ObjectiveConfig { mask: MaskConfig::TopEntropy { rho: 0.2 }, ..dapo() },
    },
    Preset {
        name: "justrl",
        aliases: &[],
        summary: "eps 0.2/0.28, token-mean, no KL, no dynamic sampling, no overlong penalty",
        build: justrl,
    },
    Preset {
        name: "stapo",
        aliases: &[],
        summary: "justrl + S2T mask (tau_p 0.002, tau_h = 0.75-quantile over the candidates, paper §3)",
        build: || ObjectiveConfig { mask: MaskConfig::S2T_DEFAULT, ..justrl() },
    },
    Preset {
        name: "dapo_s2t",
        aliases: &[],
        summary: "dapo + S2T mask (tau_p 0.002, tau_h = 0.75-quantile over the candidates)",
        build: || ObjectiveConfig { mask: MaskConfig::S2T_DEFAULT, ..dapo() },
    },
    Preset {
        name: "drgrpo",
        aliases: &[],
        summary: "grpo with Dr.GRPO advantages (no std), seq-mean-token-sum-norm over the run's max_tokens",
        build: || ObjectiveConfig { adv: AdvEstimator::DrGrpo, agg: AggMode::SeqMeanTokenSumNorm, ..grpo() },
    },
];

/// The preset names, in documentation order.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name).collect()
}

/// `name: summary` lines of every preset, for help texts.
pub fn presets_help() -> String {
    PRESETS.iter().map(|p| format!("  {:<10} {}", p.name, p.summary)).collect::<Vec<_>>().join("\n")
}

impl ObjectiveConfig {
    /// A named preset from [`PRESETS`] (case-insensitive, `-` and `_` ignored, aliases
    /// accepted); the error lists the valid names.
    pub fn preset(name: &str) -> Result<Self> {
        let norm = |s: &str| -> String {
            s.trim().to_ascii_lowercase().chars().filter(|c| *c != '-' && *c != '_').collect()
        };
        let key = norm(name);
        PRESETS
            .iter()
            .find(|p| norm(p.name) == key || p.aliases.iter().any(|a| norm(a) == key))
            .map(Preset::config)
            .ok_or_else(|| {
                cfg_err(
                    "preset",
                    format!("unknown preset `{name}`; valid presets: {}", preset_names().join(", ")),
                )
            })
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::advantage::OverlongConfig;
    use crate::algo::config::{KlConfig, KlKind, QuantileOver, TauH};

    #[test]
    fn presets_have_design_defaults() {
        // stapo: JustRL's settings + S2T, tau_h the 0.75-quantile over the candidates (§3, §4.1).
        let s = ObjectiveConfig::preset("stapo").unwrap();
        assert_eq!(s.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None });
        assert_eq!(s.agg, AggMode::TokenMean);
        let paper = TauH::Quantile { q: 0.75, over: QuantileOver::Candidates };
        assert_eq!(s.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: paper });
        assert_eq!(s.kl, None);
        assert_eq!(s.entropy_coef, 0.0);
        assert!(!s.dynamic_sampling && s.overlong.is_none());
        assert_eq!(
            ObjectiveConfig { mask: MaskConfig::None, ..s },
            ObjectiveConfig::preset("justrl").unwrap()
        );
        // dapo_s2t: DAPO + the same S2T mask.
        let ds = ObjectiveConfig::preset("dapo_s2t").unwrap();
        assert_eq!(ds.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: paper });
        assert_eq!(
            ObjectiveConfig { mask: MaskConfig::None, ..ds },
            ObjectiveConfig::preset("dapo").unwrap()
        );
        let g = ObjectiveConfig::preset("GSPO").unwrap();
        assert_eq!(
            (g.loss, g.agg),
            (PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 4e-4 }, AggMode::SeqMeanTokenMean)
        );
        let sa = ObjectiveConfig::preset("sapo").unwrap();
        assert_eq!(sa.loss, PolicyLoss::Sapo { tau_pos: 1.0, tau_neg: 1.05 });
        let d = ObjectiveConfig::preset("dapo").unwrap();
        assert!(d.dynamic_sampling && d.overlong.is_some());
        let e = ObjectiveConfig::preset("entropy-20").unwrap();
        assert_eq!(e.mask, MaskConfig::TopEntropy { rho: 0.2 });
        let j = ObjectiveConfig::preset("justrl").unwrap();
        assert!(!j.dynamic_sampling && j.kl.is_none() && j.overlong.is_none());
        assert_eq!(j.loss.clip_range(), Some((0.2, 0.28)));
        assert_eq!(ObjectiveConfig::preset("grpo").unwrap(), ObjectiveConfig::default());
    }

    #[test]
    fn presets_round_trip_and_validate() {
        for name in preset_names() {
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
        // The JSON form of tau_h names q and the population.
        let s2t = serde_json::to_value(MaskConfig::S2T_DEFAULT).unwrap();
        let want = serde_json::json!({"kind": "s2t", "tau_p": 0.002f32,
            "tau_h": {"quantile": {"q": 0.75f32, "over": "candidates"}}});
        assert_eq!(s2t, want);
        for j in [
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": {"quantile": {"q": 0.75, "over": "candidates"}}}"#,
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": {"abs": 0.3}}"#,
        ] {
            let m: MaskConfig = serde_json::from_str(j).unwrap();
            let back: MaskConfig = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
            assert_eq!(back, m, "{j}");
        }
        let m: MaskConfig = serde_json::from_str(
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": {"quantile": {"q": 0.75, "over": "candidates"}}}"#,
        )
        .unwrap();
        assert_eq!(m, MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::PAPER });
        // A population that is not one of the two is an error naming the choices.
        let e = serde_json::from_str::<MaskConfig>(
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": {"quantile": {"q": 0.8, "over": "all"}}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("response") && e.contains("candidates"), "{e}");
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
        assert_eq!(c.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: Some(3.0) });
        assert_eq!(c.agg, AggMode::TokenMean);
        assert_eq!(c.kl, Some(KlConfig { kind: KlKind::K3, beta: 0.04 }));
        assert_eq!(c.adv, AdvEstimator::DrGrpo);
        let q = |q, over| TauH::Quantile { q, over };
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: q(0.5, QuantileOver::Candidates) });
        assert_eq!(c.overlong, Some(OverlongConfig { max_len: 1024, cache_len: 256, factor: 1.0 }));
        c.set("dual_clip", "none").unwrap();
        assert_eq!(c.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None });
        c.set("kl", "none").unwrap();
        assert_eq!(c.kl, None);
        c.set("kl", "k1").unwrap();
        assert_eq!(c.kl, Some(KlConfig { kind: KlKind::K1, beta: 0.001 }));
        // tau_h_over keeps q; tau_h_quantile keeps the population.
        c.set("tau_h_over", "response").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: q(0.5, QuantileOver::Response) });
        c.set("tau_h_quantile", "0.9").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: q(0.9, QuantileOver::Response) });
        c.set("tau_h", "0.3").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::Abs(0.3) });
        // From an absolute tau_h, a population alone starts from the paper's q = 0.75.
        c.set("tau_h_over", "response").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: q(0.75, QuantileOver::Response) });
        c.set("tau_h", "0.3").unwrap();
        c.set("tau_h_over", "candidates").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: TauH::PAPER });
        c.set("tau_h", "0.3").unwrap();
        c.set("tau_h_quantile", "0.6").unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.002, tau_h: q(0.6, QuantileOver::Candidates) });
        c.set("dynamic_sampling", "on").unwrap();
        assert!(c.dynamic_sampling);
        c.set("overlong", "off").unwrap();
        assert_eq!(c.overlong, None);
        c.set("overlong", "on").unwrap();
        assert_eq!(c.overlong, Some(DAPO_OVERLONG));
        c.set("agg", "seq_mean_token_sum").unwrap();
        assert_eq!(c.agg, AggMode::SeqMeanTokenSum);
    }

    #[test]
    fn switching_the_loss_kind_takes_that_kinds_defaults() {
        let mut c = ObjectiveConfig::preset("dapo").unwrap();
        c.set("kind", "gspo").unwrap();
        assert_eq!(c.loss, PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 4e-4 });
        c.set("eps_high", "5e-4").unwrap();
        c.set("kind", "gspo").unwrap(); // same kind: kept as it is
        assert_eq!(c.loss, PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 5e-4 });
        let e = c.set("dual_clip", "3").unwrap_err().to_string();
        assert!(e.contains("dual_clip") && e.contains("loss=ppo"), "{e}");
        c.set("kind", "sapo").unwrap();
        c.set("sapo_tau_neg", "2").unwrap();
        assert_eq!(c.loss, PolicyLoss::Sapo { tau_pos: 1.0, tau_neg: 2.0 });
        let e = c.set("eps_low", "0.1").unwrap_err().to_string();
        assert!(e.contains("eps_low") && e.contains("loss=ppo|gspo"), "{e}");
        c.set("kind", "pg").unwrap();
        assert_eq!(c.loss, PolicyLoss::Pg);
    }

    #[test]
    fn help_lists_come_from_the_registries() {
        let h = presets_help();
        for p in PRESETS {
            assert!(h.contains(p.name) && h.contains(p.summary), "{h}");
        }
        assert!(h.contains("drgrpo"));
        let k = crate::algo::set_keys_help();
        for a in crate::algo::ALIASES {
            assert!(k.contains(a.key), "{k}");
        }
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
        let e = c.set("tau_h_over", "tokens").unwrap_err().to_string();
        assert!(e.contains("tau_h_over") && e.contains("response|candidates"), "{e}");
        assert!(c.set("overlong_cache_len", "99999").is_err()); // cache > max_len
        assert!(c.set_pair("eps_low").is_err());
        assert_eq!(c, before, "failed sets leave the config unchanged");
    }

    #[test]
    fn overrides_apply_in_a_fixed_order() {
        // Given cache first, L_max still comes first: 1024 rescales the DAPO buffer
        // (round(0.2 · 1024) = 205), then the cache is set to 256.
        let pairs = [("overlong_cache_len", "256"), ("overlong_max_len", "1024"), ("tau_p", "0.01")];
        let c = ObjectiveConfig::with_overrides("dapo_s2t", pairs).unwrap();
        assert_eq!(c.overlong, Some(OverlongConfig { max_len: 1024, cache_len: 256, factor: 1.0 }));
        // `mask` switches S2T on before its threshold is read, whatever the order.
        let c = ObjectiveConfig::with_overrides("grpo", [("tau_p", "0.01"), ("mask", "s2t")]).unwrap();
        assert_eq!(c.mask, MaskConfig::S2t { tau_p: 0.01, tau_h: TauH::PAPER });
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
        let mut s = ObjectiveConfig::preset("dapo_s2t").unwrap();
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
