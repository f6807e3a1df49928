//! Bindings for the RL math on a rollout: group advantages and STAPO's S2T
//! mask (computed from the rollout's own per-token p and H, i.e. the policy
//! at sampling time, which is what the first update epoch sees), plus the
//! objective presets and their override keys.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rhai::{Array, Dynamic, Engine, Map};

use super::{lock, RolloutHandle, RolloutState};
use crate::algo::{self, AdvEstimator, ObjectiveConfig, S2tThresholds, StdKind, PRESETS, SET_KEYS};
use crate::script::convert::{clean_f64, get_num, get_str, to_dynamic};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::host::Host;

/// Rewards of every sample, or an error when the rollout is not scored.
fn rewards(st: &RolloutState) -> RhaiResult<Vec<f32>> {
    st.batch
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.reward.ok_or_else(|| {
                bad_arg("advantages", format!("sample {i} has no reward; call score(r) first"))
            })
        })
        .collect()
}

/// Computes and stores the group advantages.
pub fn compute_advantages(st: &mut RolloutState, opts: &Map) -> RhaiResult<Vec<f32>> {
    let est = match get_str(opts, "adv")?.as_deref() {
        None | Some("grpo") => AdvEstimator::Grpo,
        Some("dr_grpo") | Some("drgrpo") => AdvEstimator::DrGrpo,
        Some(o) => return Err(bad_arg("adv", format!("expected grpo or dr_grpo, found {o:?}"))),
    };
    let std = match get_str(opts, "std")?.as_deref() {
        None | Some("sample") => StdKind::Sample,
        Some("population") => StdKind::Population,
        Some(o) => return Err(bad_arg("std", format!("expected sample or population, found {o:?}"))),
    };
    let r = rewards(st)?;
    let groups: Vec<usize> = st.batch.samples.iter().map(|s| s.group).collect();
    let a = algo::group_advantages(&r, &groups, est, std).map_err(host)?;
    st.advantages = Some(a.values.clone());
    Ok(a.values)
}

/// `(B, T)` f32 tensor of per-sample vectors, zero-padded.
fn grid(rows: &[&[f32]], t: usize) -> candle_core::Result<Tensor> {
    let flat: Vec<f32> =
        rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, t - r.len()))).collect();
    Tensor::from_vec(flat, (rows.len(), t), &Device::Cpu)
}

/// Applies the S2T mask with thresholds from `opts` (`tau_p`, and `tau_h` or
/// `tau_h_quantile`; paper defaults 0.002 and the 0.75-quantile), storing
/// which tokens are silenced; returns the statistics.
pub fn compute_s2t(st: &mut RolloutState, opts: &Map) -> RhaiResult<Map> {
    if st.advantages.is_none() {
        compute_advantages(st, &Map::new())?;
    }
    let adv = st.advantages.clone().unwrap_or_default();
    let th = S2tThresholds::default()
        .with(get_num(opts, "tau_p")?, get_num(opts, "tau_h")?, get_num(opts, "tau_h_quantile")?)
        .map_err(host)?;
    let (tau_p, tau_h) = (th.tau_p, th.tau_h);
    let samples = &st.batch.samples;
    let t = samples.iter().map(|s| s.response_ids.len()).max().unwrap_or(0).max(1);
    let logp: Vec<&[f32]> = samples.iter().map(|s| s.old_logprobs.as_slice()).collect();
    let ent: Vec<&[f32]> = samples.iter().map(|s| s.entropies.as_slice()).collect();
    let ones: Vec<Vec<f32>> = samples.iter().map(|s| vec![1.0; s.response_ids.len()]).collect();
    let ones_ref: Vec<&[f32]> = ones.iter().map(|v| v.as_slice()).collect();
    let (mask, stats) = (|| -> crate::Result<_> {
        let l = grid(&logp, t)?;
        let h = grid(&ent, t)?;
        let m = grid(&ones_ref, t)?;
        let a = Tensor::from_vec(adv.clone(), (adv.len(),), &Device::Cpu)?;
        algo::s2t_mask(&l, &h, &a, &m, tau_p, tau_h)
    })()
    .map_err(host)?;
    drop(mask);
    let mut silenced: Vec<Vec<bool>> = samples.iter().map(|s| vec![false; s.response_ids.len()]).collect();
    for &(b, p) in &stats.positions {
        if let Some(x) = silenced.get_mut(b).and_then(|r| r.get_mut(p)) {
            *x = true;
        }
    }
    st.silenced = Some(silenced);
    let mut m = Map::new();
    m.insert("response_tokens".into(), (stats.n_response as i64).into());
    m.insert("candidates".into(), (stats.n_candidates as i64).into());
    m.insert("silenced".into(), (stats.n_silenced as i64).into());
    m.insert("silenced_ratio".into(), (stats.silenced_ratio() as f64).into());
    m.insert("tau_p".into(), clean_f64(tau_p).into());
    m.insert("tau_h".into(), stats.tau_h.map_or(Dynamic::UNIT, |h| Dynamic::from(h as f64)));
    Ok(m)
}

fn objective(name: &str, overrides: &Map) -> RhaiResult<Dynamic> {
    let pairs = overrides.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    to_dynamic(&ObjectiveConfig::with_overrides(name, pairs).map_err(host)?)
}

pub(super) fn register(engine: &mut Engine, _host: &Arc<Host>) {
    func!(engine, "advantages", "advantages(rollout) -> array of float\nGRPO group advantages (R - mean) / (std + 1e-6) of a scored rollout; stored for the token table.\nExample: `score(r); let a = advantages(r);`", |r: RolloutHandle| -> RhaiResult<Array> {
        let mut st = lock(&r.0, "rollout")?;
        Ok(compute_advantages(&mut st, &Map::new())?.into_iter().map(|x| Dynamic::from(x as f64)).collect())
    });
    func!(engine, "advantages", "advantages(rollout, opts) -> array of float\nopts: #{adv: \"grpo\"|\"dr_grpo\", std: \"sample\"|\"population\"}.\nExample: `advantages(r, #{adv: \"dr_grpo\"})`", |r: RolloutHandle, opts: Map| -> RhaiResult<Array> {
        let mut st = lock(&r.0, "rollout")?;
        Ok(compute_advantages(&mut st, &opts)?.into_iter().map(|x| Dynamic::from(x as f64)).collect())
    });
    func!(engine, "s2t", "s2t(rollout) -> map\nSTAPO's S2T mask with the paper's thresholds (tau_p 0.002, tau_h = 0.75-quantile of the candidates): silences tokens with A > 0, p < tau_p, H < tau_h. Returns #{response_tokens, candidates, silenced, silenced_ratio, tau_p, tau_h}; the token table then marks them.\nExample: `print(s2t(r)); print(r.table(0));`", |r: RolloutHandle| -> RhaiResult<Map> {
        let mut st = lock(&r.0, "rollout")?;
        compute_s2t(&mut st, &Map::new())
    });
    func!(engine, "s2t", "s2t(rollout, thresholds) -> map\nthresholds: #{tau_p, tau_h} (absolute) or #{tau_p, tau_h_quantile}.\nExample: `s2t(r, #{tau_p: 0.05, tau_h_quantile: 0.5})`", |r: RolloutHandle, opts: Map| -> RhaiResult<Map> {
        let mut st = lock(&r.0, "rollout")?;
        compute_s2t(&mut st, &opts)
    });
    func!(engine, "presets", "presets() -> array of string\nThe objective presets: grpo, dapo, gspo, sapo, entropy20, justrl, stapo.", || -> Array { PRESETS.iter().map(|p| Dynamic::from(p.to_string())).collect() });
    func!(engine, "set_keys", "set_keys() -> map\nThe keys accepted in a config's `set` map (objective overrides), with what each expects.", || -> Map { SET_KEYS.iter().map(|(k, v)| ((*k).into(), Dynamic::from(v.to_string()))).collect() });
    func!(engine, "objective", "objective(preset) -> map\nThe full objective settings of a preset.\nExample: `objective(\"stapo\").mask`", |name: &str| objective(name, &Map::new()));
    func!(engine, "objective", "objective(preset, overrides) -> map\nA preset with `set` overrides applied (validated).\nExample: `objective(\"grpo\", #{eps_high: 0.28})`", |name: &str, o: Map| objective(name, &o));
}
