//! Bindings for the RL math on a rollout: group advantages and STAPO's S2T
//! mask (computed from the rollout's own per-token p and H, i.e. the policy
//! at sampling time, which is what the first update epoch sees), plus the
//! objective presets and their override keys.

use rhai::plugin::{export_module, exported_module};
use rhai::{Array, Dynamic, Engine, Map};
use serde::Deserialize;

use super::{lock, RolloutHandle};
use crate::algo::{AdvEstimator, ObjectiveConfig, S2tStats, S2tThresholds, StdKind};
use crate::script::convert::{clean_f64, config_arg, options, to_dynamic, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};

/// `advantages(r, opts)`.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct AdvOpts {
    /// Default grpo.
    adv: Option<AdvEstimator>,
    /// Default sample.
    std: Option<StdKind>,
}

fn advantages(r: &RolloutHandle, opts: &Map) -> RhaiResult<Array> {
    let o: AdvOpts = options("advantages", opts)?;
    let (est, std) = (o.adv.unwrap_or(AdvEstimator::Grpo), o.std.unwrap_or(StdKind::Sample));
    let a = lock(&r.0, "rollout")?.compute_advantages(est, std).map_err(|e| bad_arg("advantages", e))?;
    Ok(a.into_iter().map(|x| Dynamic::from(x as f64)).collect())
}

fn s2t(r: &RolloutHandle, opts: &Map) -> RhaiResult<Map> {
    let over = to_json("s2t", &Dynamic::from_map(opts.clone()))?;
    let th = S2tThresholds::default().overlay("s2t", &over).map_err(|e| config_arg("s2t", e))?;
    let stats = lock(&r.0, "rollout")?.compute_s2t(th).map_err(|e| bad_arg("s2t", e))?;
    Ok(s2t_map(&stats, th.tau_p))
}

/// What `s2t` returns.
fn s2t_map(stats: &S2tStats, tau_p: f32) -> Map {
    let mut m = Map::new();
    m.insert("response_tokens".into(), (stats.n_response as i64).into());
    m.insert("candidates".into(), (stats.n_candidates as i64).into());
    m.insert(
        "tau_h_population".into(),
        stats.tau_h_population.map_or(Dynamic::UNIT, |n| Dynamic::from(n as i64)),
    );
    m.insert("silenced".into(), (stats.n_silenced as i64).into());
    m.insert("silenced_ratio".into(), (stats.silenced_ratio() as f64).into());
    m.insert("tau_p".into(), clean_f64(tau_p).into());
    m.insert("tau_h".into(), stats.tau_h.map_or(Dynamic::UNIT, |h| Dynamic::from(h as f64)));
    m
}

fn objective(name: &str, overrides: &Map) -> RhaiResult<Dynamic> {
    let over = to_json("objective", &Dynamic::from_map(overrides.clone()))?;
    let o = ObjectiveConfig::preset(name).map_err(host)?;
    to_dynamic(&o.overlay("objective", &over).map_err(|e| config_arg("objective", e))?)
}

/// Registers the advantage, S2T and objective functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible RL-math functions.
#[export_module]
mod fns {
    use rhai::{Array, Dynamic, Map};

    use super::RolloutHandle;
    use crate::algo::{S2tThresholds, PRESETS};
    use crate::script::convert::to_dynamic;
    use crate::script::error::RhaiResult;

    /// advantages(rollout) -> array of float
    ///
    /// GRPO group advantages (R - mean) / (std + 1e-6) of a scored rollout; stored for the token
    /// table.
    ///
    /// # Example
    ///
    /// ```rhai
    /// score(r); let a = advantages(r);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn advantages(r: RolloutHandle) -> RhaiResult<Array> {
        super::advantages(&r, &Map::new())
    }

    /// advantages(rollout, opts) -> array of float
    ///
    /// opts: #{adv: "grpo"|"dr_grpo", std: "sample"|"population"}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// advantages(r, #{adv: "dr_grpo"})
    /// ```
    #[rhai_fn(name = "advantages", volatile, return_raw)]
    pub fn advantages_with(r: RolloutHandle, opts: Map) -> RhaiResult<Array> {
        super::advantages(&r, &opts)
    }

    /// s2t(rollout) -> map
    ///
    /// STAPO's S2T mask with the paper's thresholds (§3, §4.1: tau_p 0.002, tau_h = the
    /// 0.75-quantile of the candidates' entropies): silences tokens with A > 0, p < tau_p,
    /// H < tau_h (strict).
    /// Returns #{response_tokens, candidates, tau_h_population, silenced, silenced_ratio, tau_p,
    /// tau_h}; the token table then marks them.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(s2t(r)); print(r.table(0));
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn s2t(r: RolloutHandle) -> RhaiResult<Map> {
        super::s2t(&r, &Map::new())
    }

    /// s2t(rollout, thresholds) -> map
    ///
    /// thresholds: #{tau_p, tau_h}, tau_h a number (absolute) or a quantile #{q, over} with over
    /// "candidates" (the tokens with A > 0 and p < tau_p) or "response" (every response token);
    /// what the map leaves out is the paper's. The same form as the thresholds hook's.
    ///
    /// # Example
    ///
    /// ```rhai
    /// s2t(r, #{tau_p: 0.05, tau_h: #{q: 0.5, over: "candidates"}})
    /// ```
    #[rhai_fn(name = "s2t", volatile, return_raw)]
    pub fn s2t_with(r: RolloutHandle, opts: Map) -> RhaiResult<Map> {
        super::s2t(&r, &opts)
    }

    /// presets() -> array of string
    ///
    /// The objective presets: grpo, dapo, gspo, sapo, entropy20, justrl, stapo, drgrpo.
    ///
    /// # Example
    ///
    /// ```rhai
    /// for p in presets() { print(objective(p).loss.kind); }
    /// ```
    #[rhai_fn(volatile)]
    pub fn presets() -> Array {
        PRESETS.iter().map(|p| Dynamic::from(p.name.to_string())).collect()
    }

    /// default_thresholds() -> map
    ///
    /// The paper's S2T thresholds in the form the thresholds hook returns: #{tau_p, tau_h: #{q, over}}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(default_thresholds().tau_h.q);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn default_thresholds() -> RhaiResult<Dynamic> {
        to_dynamic(&S2tThresholds::default())
    }

    /// objective(preset) -> map
    ///
    /// The full objective settings of a preset.
    ///
    /// # Example
    ///
    /// ```rhai
    /// objective("stapo").mask
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn objective(name: &str) -> RhaiResult<Dynamic> {
        super::objective(name, &Map::new())
    }

    /// objective(preset, overrides) -> map
    ///
    /// A preset with a partial objective laid on top (the form of a run's actor.objective),
    /// validated; an unknown key is an error naming the nearest.
    ///
    /// # Example
    ///
    /// ```rhai
    /// objective("grpo", #{loss: #{eps_high: 0.28}})
    /// ```
    #[rhai_fn(name = "objective", volatile, return_raw)]
    pub fn objective_with(name: &str, overrides: Map) -> RhaiResult<Dynamic> {
        super::objective(name, &overrides)
    }
}
