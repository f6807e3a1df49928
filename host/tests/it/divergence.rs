//! The divergence guard on the case that used to pass without a word: weight decay 0 and
//! a learning rate of 1e5 wreck the model in one update while every value stays finite.
//! `guard.on_divergence` `warn` names the step and the quantity; `stop` ends the run and
//! leaves `latest` at the last good checkpoint; `rollback` goes back to it with the
//! learning rate scaled by `guard.rollback_lr_scale`.

use std::path::Path;

use stapo::train::{RunConfig, StepPlan, Trainer};

use crate::common::{tempdir, weight_bits};

/// A run of the bundled `models/tiny-qwen3` (trained on the arithmetic task: low entropy,
/// rewards of both kinds) on 64 problems of `data/arith/train.jsonl`, saving every step,
/// weight decay 0, with `guard` as its guard options.
fn trainer(dir: &Path, guard: serde_json::Value) -> Trainer {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let text = std::fs::read_to_string(root.join("data/arith/train.jsonl")).unwrap();
    let train = dir.join("train.jsonl");
    std::fs::write(&train, text.lines().take(64).collect::<Vec<_>>().join("\n")).unwrap();
    let v = serde_json::json!({
        "model": {"path": root.join("models/tiny-qwen3")},
        "data": {"train": train, "prompts_per_step": 4},
        "rollout": {"sampling": {"n": 4, "max_tokens": 48}},
        "actor": {"preset": "grpo", "optim": {"lr": 1e-4, "weight_decay": 0.0}},
        "checkpoint": {"save_every": 1, "keep": 5},
        "guard": guard,
    });
    Trainer::new(RunConfig::from_json(&v).unwrap(), &dir.join("run")).unwrap()
}

fn plan(t: &Trainer, lr: f64) -> StepPlan {
    let mut p = t.default_plan();
    p.lr = lr;
    p
}

fn latest(t: &Trainer) -> String {
    std::fs::read_to_string(t.run_dir().join("checkpoints/latest")).unwrap()
}

fn logged_steps(t: &Trainer) -> Vec<u64> {
    std::fs::read_to_string(t.run_dir().join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect()
}

/// Three healthy steps (checkpoints step-000001 to step-000003), then the weights before
/// the fourth.
fn healthy(t: &mut Trainer) -> Vec<u32> {
    for _ in 0..3 {
        let m = t.step(&plan(t, 1e-4), None, None).unwrap();
        assert!(!m.update.warnings.iter().any(|w| w.contains("divergence")), "{:?}", m.update.warnings);
    }
    assert_eq!(latest(t), "step-000003");
    weight_bits(t)
}

#[test]
fn divergence_warn_names_the_step_and_the_quantity() {
    let dir = tempdir();
    let mut t = trainer(dir.path(), serde_json::json!({}));
    healthy(&mut t);
    let m = t.step(&plan(&t, 1e5), None, None).unwrap();
    let w = m.update.warnings.join("\n");
    assert!(w.contains("divergence at step 3") && w.contains("the weights' norm grew"), "{w}");
    assert!(w.contains("guard.on_divergence = warn"), "{w}");
    // Warn goes on: the step is saved as usual.
    assert_eq!(latest(&t), "step-000004");
}

#[test]
fn divergence_stop_never_saves_the_diverged_step() {
    let dir = tempdir();
    let mut t = trainer(dir.path(), serde_json::json!({"on_divergence": "stop"}));
    healthy(&mut t);
    let e = t.step(&plan(&t, 1e5), None, None).unwrap_err().to_string();
    assert!(e.contains("step 3 diverged") && e.contains("the weights' norm grew"), "{e}");
    assert!(e.contains("last good checkpoint is step-000003"), "{e}");
    assert_eq!(latest(&t), "step-000003");
    assert!(!t.run_dir().join("checkpoints/step-000004").exists());
    // What a run ending now leaves is the good checkpoint, not the diverged weights.
    let left = t.save_on_exit().unwrap().unwrap();
    assert!(left.ends_with("step-000003"), "{}", left.display());
    assert!(!t.run_dir().join("checkpoints/step-000004").exists());
}

#[test]
fn divergence_stop_on_the_rollout_sets_aside_the_checkpoint_it_sampled_from() {
    // With the weights' norm unwatched, the wrecked weights are saved as step-000004 and
    // only the next rollout (sampled from them) shows the divergence.
    let dir = tempdir();
    let mut t = trainer(dir.path(), serde_json::json!({"on_divergence": "stop", "weight_norm_growth": 0.0}));
    healthy(&mut t);
    t.step(&plan(&t, 1e5), None, None).unwrap();
    assert_eq!(latest(&t), "step-000004");
    let mut e = String::new();
    for _ in 0..4 {
        match t.step(&plan(&t, 1e-4), None, None) {
            Ok(_) => continue,
            Err(err) => {
                e = err.to_string();
                break;
            }
        }
    }
    assert!(e.contains("diverged") && (e.contains("entropy") || e.contains("gradient norm 0")), "{e}");
    let ck = t.run_dir().join("checkpoints");
    assert_eq!(latest(&t), "step-000003", "{e}");
    assert!(ck.join("diverged-step-000004").is_dir(), "{e}");
    assert!(!ck.join("step-000004").exists());
}

#[test]
fn divergence_rollback_returns_to_the_last_good_checkpoint_with_a_scaled_lr() {
    let dir = tempdir();
    let mut t =
        trainer(dir.path(), serde_json::json!({"on_divergence": "rollback", "rollback_lr_scale": 0.25}));
    let good = healthy(&mut t);
    let m = t.step(&plan(&t, 1e5), None, None).unwrap();
    let w = m.update.warnings.join("\n");
    assert!(w.contains("step 3 diverged") && w.contains("rolled back to step-000003"), "{w}");
    assert_eq!(t.step_count(), 3);
    assert_eq!(t.lr_scale(), 0.25);
    assert_eq!(weight_bits(&t), good, "the weights are not those of the last good checkpoint");
    assert_eq!(logged_steps(&t), [0, 1, 2], "the diverged step's metrics must go");
    // The run goes on from there, at the scaled learning rate, and saves again.
    let m = t.step(&plan(&t, 1e-4), None, None).unwrap();
    assert_eq!((m.step, m.lr), (3, 0.25e-4));
    assert_eq!(logged_steps(&t), [0, 1, 2, 3]);
    assert_eq!(latest(&t), "step-000004");
    // The scale survives a resume.
    drop(t);
    let t = Trainer::resume(&dir.path().join("run")).unwrap();
    assert_eq!(t.lr_scale(), 0.25);
}
