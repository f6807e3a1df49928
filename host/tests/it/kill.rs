//! Fault tolerance: a `stapo run` child killed with SIGKILL at arbitrary
//! moments loses at most the steps since its last checkpoint, never leaves a
//! corrupt checkpoint behind, and resumes from it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use stapo::train::Trainer;

use crate::common::{arith_fixture, tempdir};

fn latest_step(run: &Path) -> Option<u64> {
    let name = std::fs::read_to_string(run.join("checkpoints/latest")).ok()?;
    name.trim().strip_prefix("step-")?.parse().ok()
}

#[test]
fn sigkill_mid_run_leaves_a_loadable_checkpoint_that_resumes() {
    let dir = tempdir();
    let (model, train, _) = arith_fixture(dir.path());
    let script = dir.path().join("long.rhai");
    std::fs::write(
        &script,
        format!(
            r#"train(#{{ model: #{{ path: "{}" }}, data: #{{ train: "{}", prompts_per_step: 2 }},
                actor: #{{ preset: "grpo", optim: #{{ lr: 1e-3 }} }}, rollout: #{{ sampling: #{{ n: 2, max_tokens: 8 }} }},
                checkpoint: #{{ save_every: 1, keep: 2 }} }}, 100000);"#,
            model.display(),
            train.display()
        ),
    )
    .unwrap();
    // Kill at different moments relative to the checkpoint writes.
    for (round, extra_ms) in [0u64, 37, 111].into_iter().enumerate() {
        let run = dir.path().join(format!("run-{round}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_stapo"))
            .args(["run", "--quiet", "--out"])
            .arg(&run)
            .arg(&script)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while latest_step(&run).is_none_or(|s| s < 2) {
            assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint after 120 s");
            assert!(child.try_wait().unwrap().is_none(), "the run ended by itself");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(extra_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let at = latest_step(&run).unwrap();
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        let logged = metrics.lines().count() as u64;
        assert!(logged >= at, "round {round}: {logged} metric lines but checkpoint at step {at}");
        // Lost at most the steps since the checkpoint (the one in flight included).
        assert!(logged - at <= 2, "round {round}: {logged} logged, checkpoint at {at}");
        // The checkpoint the pointer names is complete, and resumes.
        let mut t = Trainer::resume(&run).unwrap_or_else(|e| panic!("round {round}: resume failed: {e}"));
        assert_eq!(t.step_count(), at);
        let m = t.step(&t.default_plan(), None, None).unwrap();
        assert_eq!(m.step, at);
        assert!(m.update.loss.is_finite());
    }
}
