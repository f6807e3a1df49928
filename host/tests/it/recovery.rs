//! What a crash leaves behind is found and handled at the next command: a damaged line of
//! `metrics.jsonl` at resume, and the half-written siblings of a model folder that a killed
//! `stapo update --out X --force` (or `init`, `merge`) was replacing.

use std::path::Path;

use stapo::train::{ResumeOptions, RunConfig, Trainer};

use crate::common::{arith_fixture, tempdir};

fn three_steps(dir: &Path) -> std::path::PathBuf {
    let (model, train, _) = arith_fixture(dir);
    let v = serde_json::json!({
        "model": {"path": model},
        "data": {"train": train, "prompts_per_step": 2},
        "rollout": {"sampling": {"n": 2, "max_tokens": 6}},
        "actor": {"preset": "grpo", "optim": {"lr": 1e-3}},
    });
    let run = dir.join("run");
    let mut t = Trainer::new(RunConfig::from_json(&v).unwrap(), &run).unwrap();
    for _ in 0..3 {
        t.step(&t.default_plan(), None, None).unwrap();
    }
    t.checkpoint().unwrap();
    run
}

#[test]
fn metrics_damaged_line_is_an_error_naming_it_and_repair_cuts_back_to_the_last_whole_step() {
    let dir = tempdir();
    let run = three_steps(dir.path());
    let path = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3);
    // A line cut in the middle (a crash during an append, a bad edit).
    let damaged = format!("{}\n{}\n{}\n", lines[0], &lines[1][..lines[1].len() / 2], lines[2]);
    std::fs::write(&path, &damaged).unwrap();
    let e = Trainer::resume(&run).err().expect("a damaged line must stop the resume").to_string();
    assert!(e.contains("metrics.jsonl:2") && e.contains("--repair-metrics"), "{e}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        damaged,
        "nothing may change before the user says so"
    );

    let opts = ResumeOptions { repair_metrics: true, ..ResumeOptions::default() };
    let mut t = Trainer::resume_with(stapo::dist::world(), &run, opts).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", lines[0]));
    let m = t.step(&t.default_plan(), None, None).unwrap();
    let said = m.update.warnings.join("\n");
    assert!(said.contains("metrics.jsonl:2 was damaged") && said.contains("1 whole step line(s)"), "{said}");
    assert!(said.contains("2 line(s) dropped") && said.contains("steps 1-2 have no metrics line"), "{said}");
}

/// `stapo score` on `model`: its stderr (it must succeed).
fn score(model: &Path) -> String {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["score", "--ids", "3,4,5", "--model"])
        .arg(model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    err
}

#[test]
fn leftovers_of_a_killed_model_write_are_removed_by_the_next_command_and_reported() {
    let dir = tempdir();
    let (model, _, _) = arith_fixture(dir.path());
    // What a process (long gone: no pid can be this high) left while replacing `model`.
    let dead = 99_999_999u32;
    let tmp = dir.path().join(format!(".model.tmp-{dead}"));
    let old = dir.path().join(format!(".model.old-{dead}"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(tmp.join("model.safetensors"), b"half").unwrap();
    let err = score(&model);
    assert!(!tmp.exists() && !old.exists(), "{err}");
    assert!(err.contains(&format!("removed {}", tmp.display())), "{err}");
    assert!(err.contains(&format!("removed {}", old.display())), "{err}");

    // Killed between the two renames: the folder itself is gone, its old copy is moved back.
    std::fs::rename(&model, &old).unwrap();
    let err = score(&model);
    assert!(model.join("config.json").is_file() && !old.exists(), "{err}");
    assert!(err.contains("restored"), "{err}");
}
