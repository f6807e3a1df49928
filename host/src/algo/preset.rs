//! Named presets of [`ObjectiveConfig`]: the objectives the STAPO paper compares, one
//! line each in [`PRESETS`] (name, summary, builder). The types live in `config.rs`; a
//! preset is adjusted by laying a partial serde form on it ([`ObjectiveConfig::overlay`]).
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
    ///   `max_tokens`, L_cache the same fraction of it (0.2);
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
                     it starts after {start} tokens (L_max {} - L_cache {}); set actor.objective.overlong.max_len \
                     to the run's max_tokens",
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
    use crate::algo::config::{KlConfig, KlKind, QuantileOver, S2tThresholds, TauH};
    use serde_json::json;

    #[test]
    fn presets_have_design_defaults() {
        // stapo: JustRL's settings + S2T, tau_h the 0.75-quantile over the candidates (§3, §4.1).
        let s = ObjectiveConfig::preset("stapo").unwrap();
        assert_eq!(s.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None });
        assert_eq!(s.agg, AggMode::TokenMean);
        let paper = TauH::Quantile { q: 0.75, over: QuantileOver::Candidates };
        assert_eq!(s.mask, MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: paper }));
        assert_eq!(s.kl, None);
        assert_eq!(s.entropy_coef, 0.0);
        assert!(!s.dynamic_sampling && s.overlong.is_none());
        assert_eq!(
            ObjectiveConfig { mask: MaskConfig::None, ..s },
            ObjectiveConfig::preset("justrl").unwrap()
        );
        // dapo_s2t: DAPO + the same S2T mask.
        let ds = ObjectiveConfig::preset("dapo_s2t").unwrap();
        assert_eq!(ds.mask, MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: paper }));
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
        // The serde form of the S2T mask: tau_h a quantile map or a number.
        let TauH::Quantile { q, over } = TauH::PAPER else { panic!("the paper's tau_h is a quantile") };
        let s2t = serde_json::to_value(MaskConfig::S2T_DEFAULT).unwrap();
        let want = json!({"kind": "s2t", "tau_p": 0.002f32, "tau_h": {"q": q, "over": over.name()}});
        assert_eq!(s2t, want);
        for j in [
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": {"q": 0.75, "over": "candidates"}}"#,
            r#"{"kind": "s2t", "tau_p": 0.002, "tau_h": 0.3}"#,
        ] {
            let m: MaskConfig = serde_json::from_str(j).unwrap();
            let back: MaskConfig = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
            assert_eq!(back, m, "{j}");
        }
        // What the map leaves out is the paper's.
        let m: MaskConfig = serde_json::from_str(r#"{"kind": "s2t"}"#).unwrap();
        assert_eq!(m, MaskConfig::S2T_DEFAULT);
        let m: MaskConfig = serde_json::from_str(r#"{"kind": "s2t", "tau_h": {"q": 0.5}}"#).unwrap();
        assert_eq!(
            m,
            MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: TauH::Quantile { q: 0.5, over } })
        );
        // A population that is not one of the two is an error naming the choices.
        let e = serde_json::from_str::<MaskConfig>(r#"{"kind": "s2t", "tau_h": {"q": 0.8, "over": "all"}}"#)
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
    fn overlays_switch_kinds_and_keep_the_rest() {
        let TauH::Quantile { over: paper_over, .. } = TauH::PAPER else { panic!("a quantile") };
        let q = |q, over| MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: TauH::Quantile { q, over } });
        let c = ObjectiveConfig::preset("grpo")
            .unwrap()
            .overlay(
                "o",
                &json!({"loss": {"eps_high": 0.28, "dual_clip": 3}, "agg": "token-mean", "kl": {"beta": 0.04},
                        "adv": "dr_grpo", "mask": {"kind": "s2t", "tau_h": {"q": 0.5}}}),
            )
            .unwrap();
        assert_eq!(c.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: Some(3.0) });
        assert_eq!(c.agg, AggMode::TokenMean);
        assert_eq!(c.kl, Some(KlConfig { kind: KlKind::K3, beta: 0.04 }));
        assert_eq!(c.adv, AdvEstimator::DrGrpo);
        assert_eq!(c.mask, q(0.5, paper_over));
        // `over` alone keeps q; a number replaces the quantile; a quantile map over a number
        // takes the paper's values for what it leaves out.
        let c = c.overlay("o", &json!({"mask": {"tau_h": {"over": "response"}}})).unwrap();
        assert_eq!(c.mask, q(0.5, QuantileOver::Response));
        let c = c.overlay("o", &json!({"mask": {"tau_h": 0.3}})).unwrap();
        assert_eq!(c.mask, MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: TauH::Abs(0.3) }));
        let c = c.overlay("o", &json!({"mask": {"tau_h": {"q": 0.6}}})).unwrap();
        assert_eq!(c.mask, q(0.6, paper_over));
        // Optional sections: null clears, a map switches on with the defaults.
        assert_eq!(c.overlay("o", &json!({"kl": null})).unwrap().kl, None);
        let k1 = c.overlay("o", &json!({"kl": null})).unwrap().overlay("o", &json!({"kl": {"kind": "k1"}}));
        assert_eq!(k1.unwrap().kl, Some(KlConfig { kind: KlKind::K1, beta: 0.001 }));
        assert_eq!(c.overlay("o", &json!({"overlong": {}})).unwrap().overlong, Some(DAPO_OVERLONG));
        // Switching the loss kind takes that kind's defaults; the same kind merges.
        let d = ObjectiveConfig::preset("dapo").unwrap();
        let loss = |over: serde_json::Value| d.overlay("o", &json!({ "loss": over })).unwrap().loss;
        assert_eq!(loss(json!({"kind": "gspo"})), PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 4e-4 });
        assert_eq!(
            loss(json!({"kind": "gspo", "eps_high": 5e-4})),
            PolicyLoss::Gspo { eps_low: 3e-4, eps_high: 5e-4 }
        );
        assert_eq!(
            loss(json!({"kind": "sapo", "tau_neg": 2})),
            PolicyLoss::Sapo { tau_pos: 1.0, tau_neg: 2.0 }
        );
        assert_eq!(loss(json!({"kind": "pg"})), PolicyLoss::Pg);
        assert_eq!(
            loss(json!({"kind": "ppo"})),
            PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None }
        );
    }

    #[test]
    fn overlay_errors_name_the_path_and_the_nearest_key() {
        let c = ObjectiveConfig::preset("stapo").unwrap();
        let err = |over: serde_json::Value| c.overlay("actor.objective", &over).unwrap_err().to_string();
        let e = err(json!({"loss": {"eps_lo": 0.1}}));
        assert!(e.contains("`loss.eps_lo`") && e.contains("did you mean `eps_low`?"), "{e}");
        let e = err(json!({"loss": {"eps_low": "abc"}}));
        assert!(e.contains("`loss.eps_low`") && e.contains("abc"), "{e}");
        let e = err(json!({"loss": {"eps_low": 1.5}})); // parses, fails validation
        assert!(e.contains("loss.eps_low") && e.contains("[0, 1)"), "{e}");
        let e = err(json!({"loss": {"dual_clip": 0.5}}));
        assert!(e.contains("loss.dual_clip") && e.contains("> 1"), "{e}");
        let e = err(json!({"loss": {"kind": "sapo", "eps_low": 0.1}}));
        assert!(e.contains("`loss.eps_low`") && e.contains("tau_pos"), "{e}");
        let e = err(json!({"mask": {"rho": 0.2}}));
        assert!(e.contains("`mask.rho`"), "{e}");
        let e = err(json!({"mask": {"tau_P": 0.1}}));
        assert!(e.contains("`mask.tau_P`") && e.contains("did you mean `tau_p`?"), "{e}");
        let e = err(json!({"agg": "mean"}));
        assert!(e.contains("`agg`") && e.contains("token-mean"), "{e}");
        let e = err(json!({"mask": {"tau_h": {"q": 1.5}}}));
        assert!(e.contains("mask.tau_h.q"), "{e}");
        let e = err(json!({"overlong": {"cache_len": 99999}})); // cache > max_len
        assert!(e.contains("overlong"), "{e}");
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
        let mut u = ObjectiveConfig::preset("dapo")
            .unwrap()
            .overlay("o", &json!({"overlong": {"max_len": 8192}}))
            .unwrap();
        let notes = u.fit_to_run(64);
        assert_eq!(u.overlong.unwrap().max_len, 8192);
        assert!(notes.len() == 1 && notes[0].contains("never fire"), "{notes:?}");
    }
}
