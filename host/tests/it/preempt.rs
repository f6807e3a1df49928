//! Runs that survive the cluster: `stapo run` stopped by SIGTERM, SIGINT or SIGUSR1 at
//! any point of a step (the rollout, the update, a checkpoint being written, a second
//! signal during that write) exits with `128 + signal` after a checkpoint, says how to
//! continue, and `stapo run --resume` then ends with the same weights, optimizer state
//! and metrics as a run that was never stopped. The signals come from the real handler:
//! `STAPO_TEST_SIGNAL` makes the process raise them at a named point of a step, and one
//! case sends SIGTERM from outside at whatever moment it lands.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{arith_fixture, tempdir};

const STEPS: u64 = 4;

/// A run of `ARGS.steps` steps (default [`STEPS`]) saving every `ARGS.save_every` steps.
fn write_script(dir: &Path) -> PathBuf {
    let (model, train, _) = arith_fixture(dir);
    let script = dir.join("run.rhai");
    std::fs::write(
        &script,
        format!(
            r#"let steps = ARGS.steps ?? {STEPS};
train(#{{ model: #{{ path: "{}" }}, data: #{{ train: "{}", prompts_per_step: 2 }},
    actor: #{{ preset: "grpo", optim: #{{ lr: 1e-3 }} }}, rollout: #{{ sampling: #{{ n: 3, max_tokens: 8 }} }},
    checkpoint: #{{ save_every: ARGS.save_every ?? 0, keep: 3 }} }}, steps);"#,
            model.display(),
            train.display()
        ),
    )
    .unwrap();
    script
}

fn stapo(args: &[&str], signal: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_stapo"));
    c.args(args).env_remove("STAPO_TEST_SIGNAL");
    if let Some(s) = signal {
        c.env("STAPO_TEST_SIGNAL", s);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// What must equal between two runs: the final checkpoint's model and optimizer files,
/// and per step the metrics that depend on the weights.
#[derive(Debug, PartialEq)]
struct Outcome {
    model: Vec<u8>,
    optimizer: Vec<u8>,
    metrics: Vec<(u64, String)>,
}

fn outcome(run: &Path, step: u64) -> Outcome {
    let ck = run.join("checkpoints").join(format!("step-{step:06}"));
    let read =
        |f: &str| std::fs::read(ck.join(f)).unwrap_or_else(|e| panic!("{}: {e}", ck.join(f).display()));
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let keep = ["loss", "reward_mean", "entropy", "grad_norm", "approx_kl", "response_len_mean"];
            let figures: Vec<String> = keep
                .iter()
                .map(|k| {
                    assert!(!v[k].is_null(), "{}: a metrics line without {k}", run.display());
                    v[k].to_string()
                })
                .collect();
            (v["step"].as_u64().unwrap(), figures.join(" "))
        })
        .collect();
    Outcome { model: read("model.safetensors"), optimizer: read("optimizer.safetensors"), metrics }
}

fn latest(run: &Path) -> Option<String> {
    std::fs::read_to_string(run.join("checkpoints/latest")).ok()
}

#[test]
fn signals_at_rollout_update_and_save_resume_to_the_uninterrupted_weights() {
    let dir = tempdir();
    let script = write_script(dir.path());
    let script = script.to_str().unwrap();
    let reference = dir.path().join("reference");
    let o = stapo(&["run", "--quiet", "--out", reference.to_str().unwrap(), script], None);
    assert!(o.status.success(), "{}", text(&o));
    let want = outcome(&reference, STEPS);
    assert_eq!(want.metrics.iter().map(|m| m.0).collect::<Vec<_>>(), (0..STEPS).collect::<Vec<_>>());

    // (signals and where, --set save_every, exit status, checkpoint left: latest after the stop)
    let cases: [(&str, &str, i32, Option<&str>); 5] = [
        // The rollout of step 2 is abandoned; steps 0-1 are kept.
        ("TERM@rollout:2", "0", 143, Some("step-000002")),
        // The update of step 1 finishes, then the run stops.
        ("USR1@update:1", "0", 138, Some("step-000002")),
        // A signal while checkpoint step-000002 is written: it completes and is not written twice.
        ("INT@save:2", "1", 130, Some("step-000002")),
        // A second signal during that write exits at once: step-000001 stays the last good one.
        ("TERM,TERM@save:2", "1", 143, Some("step-000001")),
        // Stopped before any step completed: no checkpoint; the run resumes from step 0.
        ("INT@rollout:0", "0", 130, None),
    ];
    for (k, (signal, save_every, code, left)) in cases.into_iter().enumerate() {
        let run = dir.path().join(format!("run-{k}"));
        let set = format!("save_every={save_every}");
        let args = ["run", "--quiet", "--set", &set, "--out", run.to_str().unwrap(), script];
        let o = stapo(&args, Some(signal));
        let out = text(&o);
        assert_eq!(o.status.code(), Some(code), "{signal}: {out}");
        assert_eq!(latest(&run).as_deref(), left, "{signal}: {out}");
        let name = match code {
            130 => "SIGINT",
            138 => "SIGUSR1",
            _ => "SIGTERM",
        };
        if signal.contains(',') {
            // Exited inside the handler: no message, the checkpoint being written left as a
            // temporary folder that the resume removes.
            let leftovers: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(".step-000002.tmp-"))
                .collect();
            assert_eq!(leftovers.len(), 1, "{signal}: {out}");
        } else {
            let how = format!("stopped by {name}");
            assert!(out.contains(&how), "{signal}: {out}");
            assert!(out.contains(&format!("Continue with: stapo run --resume {}", run.display())), "{out}");
        }
        let o = stapo(&["run", "--quiet", "--set", &set, "--resume", run.to_str().unwrap()], None);
        assert!(o.status.success(), "{signal}: resume: {}", text(&o));
        assert_eq!(
            outcome(&run, STEPS),
            want,
            "{signal}: the resumed run differs from the uninterrupted one"
        );
    }
}

#[test]
fn signals_sigterm_from_outside_at_any_moment_resumes_to_the_uninterrupted_weights() {
    let dir = tempdir();
    let script = write_script(dir.path());
    let reference = dir.path().join("reference");
    let steps = "steps=6";
    let o = stapo(
        &["run", "--quiet", "--set", steps, "--out", reference.to_str().unwrap(), script.to_str().unwrap()],
        None,
    );
    assert!(o.status.success(), "{}", text(&o));
    let want = outcome(&reference, 6);
    for (round, delay_ms) in [0u64, 23].into_iter().enumerate() {
        let run = dir.path().join(format!("run-{round}"));
        let child = Command::new(env!("CARGO_BIN_EXE_stapo"))
            .args(["run", "--quiet", "--set", steps, "--out"])
            .arg(&run)
            .arg(&script)
            .env_remove("STAPO_TEST_SIGNAL")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // After the first logged step, mid-run.
        let start = Instant::now();
        while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 1 {
            assert!(start.elapsed() < Duration::from_secs(120), "no step after 120 s");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        let o = child.wait_with_output().unwrap();
        let out = text(&o);
        if o.status.success() {
            // The signal came after the last step: nothing to resume, nothing lost.
            assert_eq!(outcome(&run, 6), want, "{out}");
            continue;
        }
        assert_eq!(o.status.code(), Some(143), "{out}");
        assert!(out.contains("stopped by SIGTERM after step") && out.contains("Continue with"), "{out}");
        let o = stapo(&["run", "--quiet", "--set", steps, "--resume", run.to_str().unwrap()], None);
        assert!(o.status.success(), "resume: {}", text(&o));
        assert_eq!(
            outcome(&run, 6),
            want,
            "round {round}: the resumed run differs from the uninterrupted one"
        );
    }
}

/// Two runs a script holds itself (`trainer(cfg)`), stepped in turn, the way a paired
/// experiment drives its arms; the script checkpoints them at its end.
fn write_two_run_script(dir: &Path) -> PathBuf {
    let (model, train, _) = arith_fixture(dir);
    let script = dir.join("pair.rhai");
    std::fs::write(
        &script,
        format!(
            r#"let runs = [];
for name in ["a", "b"] {{
    runs.push(trainer(#{{ name: name, model: #{{ path: "{}" }},
        data: #{{ train: "{}", prompts_per_step: 2 }},
        actor: #{{ preset: "grpo", optim: #{{ lr: 1e-3 }} }}, rollout: #{{ sampling: #{{ n: 3, max_tokens: 8 }} }},
        checkpoint: #{{ save_every: 0, keep: 3 }} }}));
}}
loop {{
    let moved = false;
    for t in runs {{
        if t.steps < {STEPS} {{ t.step(); moved = true; }}
    }}
    if !moved {{ break; }}
}}
for t in runs {{ t.checkpoint(); }}"#,
            model.display(),
            train.display()
        ),
    )
    .unwrap();
    script
}

/// A signal in the middle of one held run's rollout ends the script before its closing
/// `checkpoint()` calls: each run it held is still checkpointed at its own last completed
/// step (run `a` had finished 2 steps and was rolling out its third; run `b` had finished
/// 2), the message names both, and the resumed script ends with the weights of the
/// uninterrupted one.
#[test]
fn a_signal_during_one_held_runs_rollout_checkpoints_every_run_the_script_holds() {
    let dir = tempdir();
    let script = write_two_run_script(dir.path());
    let script = script.to_str().unwrap();
    let reference = dir.path().join("reference");
    let o = stapo(&["run", "--quiet", "--out", reference.to_str().unwrap(), script], None);
    assert!(o.status.success(), "{}", text(&o));
    let run = dir.path().join("stopped");
    let o = stapo(&["run", "--quiet", "--out", run.to_str().unwrap(), script], Some("TERM@rollout:2"));
    let out = text(&o);
    assert_eq!(o.status.code(), Some(143), "{out}");
    for name in ["a", "b"] {
        assert_eq!(latest(&run.join(name)).as_deref(), Some("step-000002"), "{name}: {out}");
        let line = format!("{} after step 2: checkpoint", run.join(name).display());
        assert!(out.contains(&line), "{name}: {out}");
    }
    assert!(out.contains(&format!("Continue with: stapo run --resume {} {script}", run.display())), "{out}");
    let o = stapo(&["run", "--quiet", "--resume", run.to_str().unwrap(), script], None);
    assert!(o.status.success(), "resume: {}", text(&o));
    for name in ["a", "b"] {
        assert_eq!(
            outcome(&run.join(name), STEPS),
            outcome(&reference.join(name), STEPS),
            "{name}: the resumed run differs from the uninterrupted one"
        );
    }
}

/// The script of [`write_script`] with `hook` added (a hook that fails at some step).
fn script_with(dir: &Path, name: &str, hook: &str) -> PathBuf {
    let text = std::fs::read_to_string(dir.join("run.rhai")).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, format!("{hook}\n{text}")).unwrap();
    p
}

#[test]
fn stuck_folder_a_run_that_failed_early_starts_again_and_its_summary_row_shows_steps_and_folder() {
    let dir = tempdir();
    let good = write_script(dir.path());
    // Fails in the first rollout's hook: the folder holds a run_config.json and no checkpoint.
    let early = script_with(dir.path(), "early.rhai", r#"fn sampling(step) { throw "broken hook" }"#);
    let run = dir.path().join("run");
    let o = stapo(&["run", "--quiet", "--out", run.to_str().unwrap(), early.to_str().unwrap()], None);
    assert!(!o.status.success());
    let out = text(&o);
    assert!(run.join("run_config.json").is_file() && latest(&run).is_none(), "{out}");
    assert!(out.contains("start it again into the same folder"), "{out}");
    // The same folder takes a new run (before, it "already held a run" that nothing could use).
    let o = stapo(
        &["run", "--quiet", "--set", "steps=2", "--out", run.to_str().unwrap(), good.to_str().unwrap()],
        None,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(latest(&run).as_deref(), Some("step-000002"));
    let logged = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().count();
    assert_eq!(logged, 2);

    // A run failing after two steps: its summary row shows the steps and the folder.
    let late = script_with(
        dir.path(),
        "late.rhai",
        r#"fn on_step(step, m) { if step == 1 { throw "late failure" } }"#,
    );
    let run = dir.path().join("run-late");
    let o = stapo(&["run", "--quiet", "--out", run.to_str().unwrap(), late.to_str().unwrap()], None);
    assert!(!o.status.success());
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let row = out.lines().find(|l| l.contains("FAILED")).unwrap_or_else(|| panic!("no FAILED row: {out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[2], "2", "steps column: {row}");
    assert_eq!(*cols.last().unwrap(), run.display().to_string(), "folder column: {row}");
    assert_eq!(latest(&run).as_deref(), Some("step-000002"));
}
