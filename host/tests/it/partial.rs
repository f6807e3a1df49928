//! Partial rollouts in the training loop: with no extra groups in flight they train
//! as the synchronous loop, weight for weight; a run resumed from a checkpoint that
//! holds unfinished responses equals the uninterrupted one; a cache kept across updates
//! is not in the checkpoint, so the resumed run recomputes it once.

use serde_json::{json, Value};
use stapo::reward::ExtractMode;
use stapo::train::{RunConfig, StepMetrics, Trainer};

use crate::common::{arith_fixture, tempdir, weight_bits};

fn config(dir: &std::path::Path, partial: Value) -> RunConfig {
    let (model, train, test) = arith_fixture(dir);
    // Stop tokens the random model draws now and then (about one token in ten), so
    // that the groups of a step end at different times.
    let stops: Vec<u32> = (1..=40).map(|t| 5 * t).collect();
    RunConfig::from_json(&json!({
        "model": {"path": model},
        "data": {"train": train, "test": test, "prompts_per_step": 3, "extract": ExtractMode::Flexible},
        "rollout": {"sampling": {"n": 4, "max_tokens": 32, "stop_token_ids": stops}, "partial": partial},
        "actor": {"preset": "dapo_s2t", "optim": {"lr": 1e-2},
                  "objective": {"mask": {"tau_p": 0.05}, "dynamic_sampling": false}},
        "checkpoint": {"save_every": 2},
    }))
    .unwrap()
}

fn steps(t: &mut Trainer, k: usize) -> Vec<StepMetrics> {
    (0..k).map(|_| t.step(&t.default_plan(), None, None).unwrap()).collect()
}

fn same_metrics(a: &StepMetrics, b: &StepMetrics) {
    let (a, b) = (serde_json::to_value(a).unwrap(), serde_json::to_value(b).unwrap());
    for key in
        ["loss", "reward_mean", "entropy", "kept_tokens", "silenced_tokens", "grad_norm", "response_len_mean"]
    {
        assert_eq!(a[key], b[key], "metric {key}");
    }
}

/// `rollout.partial` on with no group in flight beyond the step's: every step's groups
/// are its own prompts, sampled whole, so the run is the synchronous one bit for bit.
#[test]
fn partial_rollouts_without_extra_groups_train_as_the_synchronous_loop() {
    let dir = tempdir();
    let off = config(dir.path(), json!({}));
    assert!(!off.rollout.partial.enable, "off by default");
    let on = config(dir.path(), json!({"enable": true, "extra_prompts": 0}));
    let mut a = Trainer::new(off, &dir.path().join("off")).unwrap();
    let mut b = Trainer::new(on, &dir.path().join("on")).unwrap();
    let (ma, mb) = (steps(&mut a, 3), steps(&mut b, 3));
    assert!(a.last_update().unwrap().advantages.iter().any(|x| *x != 0.0), "the policy gradient moved");
    assert_eq!(weight_bits(&a), weight_bits(&b), "weights differ");
    for (x, y) in ma.iter().zip(&mb) {
        same_metrics(x, y);
        assert!(x.partial.is_none(), "no partial figures when off");
        let p = y.partial.as_ref().expect("partial figures");
        assert_eq!((p.staleness_max, p.carried_responses, p.recomputed_tokens), (0, 0, 0), "{p:?}");
    }
    let line = std::fs::read_to_string(dir.path().join("off/metrics.jsonl")).unwrap();
    assert!(!line.contains("\"partial\""), "metrics.jsonl of a synchronous run is unchanged");
}

/// With groups in flight beyond the step's, a checkpoint holds the unfinished responses;
/// a run resumed from it continues them and equals the uninterrupted run.
#[test]
fn a_resumed_run_continues_its_unfinished_responses() {
    let dir = tempdir();
    let mut cfg = config(dir.path(), json!({"enable": true, "extra_prompts": 3, "max_staleness": 2}));
    (cfg.checkpoint.save_every, cfg.checkpoint.keep) = (1, 10);
    let mut a = Trainer::new(cfg.clone(), &dir.path().join("run-a")).unwrap();
    let ma = steps(&mut a, 5);
    let figures: Vec<_> = ma.iter().map(|m| m.partial.clone().expect("partial figures")).collect();
    assert!(figures.iter().all(|f| f.staleness_max <= 2), "{figures:?}");
    assert!(
        figures.iter().any(|f| f.off_policy_token_frac > 0.0),
        "no response spanned an update: {figures:?}"
    );
    // The last step's batch: 3 whole groups of 4.
    let r = a.last_rollout().unwrap();
    for g in 0..3 {
        let mut idx: Vec<usize> = r.samples.iter().filter(|s| s.group == g).map(|s| s.sample_index).collect();
        idx.sort_unstable();
        assert_eq!(idx, [0, 1, 2, 3], "group {g}");
    }
    assert_eq!(r.samples.len(), 12);

    // Run b stops ("crashes") after the first checkpoint that holds unfinished responses
    // with tokens drawn, and resumes from it.
    let b_dir = dir.path().join("run-b");
    let mut b = Trainer::new(cfg, &b_dir).unwrap();
    let mut saved = None;
    for s in 1..=4u64 {
        b.step(&b.default_plan(), None, None).unwrap();
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(b_dir.join(format!("checkpoints/step-{s:06}/trainer_state.json")))
                .unwrap(),
        )
        .unwrap();
        let groups = state["partial"]["rollout"]["groups"].as_array().expect("groups in flight").clone();
        let drawn = groups
            .iter()
            .flat_map(|g| g["responses"].as_array().unwrap().clone())
            .filter_map(|r| r.get("running").cloned())
            .any(|r| {
                !r["ids"].as_array().unwrap().is_empty() && !r["versions"].as_array().unwrap().is_empty()
            });
        if drawn {
            saved = Some(s);
            break;
        }
    }
    let saved = saved.expect("no checkpoint held an unfinished response");
    drop(b);
    let mut b = Trainer::resume(&b_dir).unwrap();
    assert_eq!(b.step_count(), saved);
    let mb = steps(&mut b, 5 - saved as usize);
    assert_eq!(weight_bits(&a), weight_bits(&b), "weights differ after resume");
    same_metrics(&ma[4], mb.last().unwrap());
    assert_eq!(ma[4].partial, mb.last().unwrap().partial);
}

/// With `rollout.partial.kv = "keep"` the unfinished responses' keys and values stay in
/// the cache across updates (`partial.kept_tokens`, nothing recomputed); a checkpoint
/// holds no cache, so the run resumed from it recomputes the carried responses once
/// and then keeps them again.
#[test]
fn kept_caches_are_not_in_checkpoints_and_a_resumed_run_recomputes() {
    let dir = tempdir();
    let mut cfg =
        config(dir.path(), json!({"enable": true, "extra_prompts": 3, "max_staleness": 2, "kv": "keep"}));
    (cfg.checkpoint.save_every, cfg.checkpoint.keep) = (1, 10);
    assert_eq!(cfg.rollout.partial.kv, stapo::rollout::PartialKv::Keep);
    let run = dir.path().join("run");
    let mut a = Trainer::new(cfg, &run).unwrap();
    let mut kept = 0;
    let mut saved = false;
    for s in 1..=4u64 {
        let m = a.step(&a.default_plan(), None, None).unwrap();
        let f = m.partial.expect("partial figures");
        assert_eq!(f.recomputed_tokens, 0, "step {s}: nothing recomputed while the cache is kept: {f:?}");
        kept += f.kept_tokens;
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(run.join(format!("checkpoints/step-{s:06}/trainer_state.json")))
                .unwrap(),
        )
        .unwrap();
        let groups = state["partial"]["rollout"]["groups"].as_array().expect("groups in flight").clone();
        saved = groups
            .iter()
            .flat_map(|g| g["responses"].as_array().unwrap().clone())
            .filter_map(|r| r.get("running").cloned())
            .any(|r| !r["ids"].as_array().unwrap().is_empty());
        if saved && kept > 0 {
            break;
        }
    }
    assert!(saved && kept > 0, "no step kept a cache over a checkpoint with unfinished responses");
    drop(a);
    let mut b = Trainer::resume(&run).unwrap();
    let first = b.step(&b.default_plan(), None, None).unwrap().partial.expect("partial figures");
    assert!(first.recomputed_tokens > 0 && first.kept_tokens == 0, "{first:?}");
    let later: Vec<_> = steps(&mut b, 2).into_iter().map(|m| m.partial.expect("partial figures")).collect();
    assert!(later.iter().all(|f| f.recomputed_tokens == 0), "{later:?}");
}
