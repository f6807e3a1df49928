//! Prompt formats end to end: a model folder declares its template and every
//! entry point (REPL `rollout` / `evaluate`, `stapo generate`, `stapo eval`)
//! defaults to it; the template option is spelled the same everywhere (a
//! name or a map); forcing another template leaves a note.

use std::path::PathBuf;
use std::process::Command;

use stapo::script::HostOptions;

use crate::common::tempdir;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn repl(input: &str) -> String {
    let o = HostOptions {
        smoke: false,
        args: Default::default(),
        run_dir: Some(tempdir().keep()),
        resume: false,
        apply_changes: false,
        repair_metrics: false,
        progress: false,
        watch: false,
        stdlib_dirs: vec![repo().join("stdlib")],
        time_limits: Default::default(),
    };
    let mut out = Vec::new();
    stapo::repl::run_repl(input.as_bytes(), &mut out, o).expect("repl");
    String::from_utf8(out).expect("utf-8")
}

#[test]
fn a_repl_rollout_of_the_tiny_model_gets_real_answers_with_its_default_template() {
    // With an earlier default template the shipped model answered in backslashes (reward 0).
    let root = repo();
    let out = repl(&format!(
        r#"let m = load_model("{root}/models/tiny-qwen3");
let ps = load_data("{root}/data/arith/test.jsonl");
let r = rollout(m, sample_prompts(ps, 2, 0), #{{n: 4, max_tokens: 32}});
score(r);
print(`mean=${{r.mean_reward}}`);
print(`prompt=${{r.sample(0).prompt}}`);
let raw = rollout(m, sample_prompts(ps, 1, 0), #{{n: 1, max_tokens: 4, template: #{{kind: "raw", suffix: ""}}}});
print(`raw_map=${{raw.sample(0).prompt}}`);
let forced = rollout(m, sample_prompts(ps, 1, 0), #{{n: 1, max_tokens: 4, template: "raw"}});
let e = evaluate(m, ps, #{{n: 2, limit: 4, max_tokens: 32, template: #{{kind: "none"}}}});
print(`eval_avg=${{e.avg}}`);
:quit
"#,
        root = root.display()
    ));
    assert!(!out.contains("error"), "{out}");
    let mean: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("mean="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no mean reward: {out}"));
    assert!(mean > 0.0, "the tiny model should solve some problems with its own template: {out}");
    // The bare problem, no instruction suffix.
    let prompt = out.lines().find_map(|l| l.strip_prefix("prompt=")).expect("prompt line");
    assert!(prompt.starts_with("Compute ") && prompt.ends_with('.'), "{prompt:?}");
    let raw_map = out.lines().find_map(|l| l.strip_prefix("raw_map=")).expect("raw_map line");
    assert!(raw_map.starts_with("Compute ") && !raw_map.contains("boxed"), "{raw_map:?}");
    // Forcing "raw" on a folder that declares "none" says so.
    assert!(out.contains("note:") && out.contains("stapo_template") && out.contains("\"raw\""), "{out}");
    assert!(out.contains("eval_avg="), "{out}");
}

#[test]
fn cli_generate_and_eval_default_to_the_folder_template() {
    let dir = tempdir();
    let root = repo();
    let model = root.join("models/tiny-qwen3");
    let gen = |template: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_stapo"));
        c.args(["generate", "--model"]).arg(&model).args([
            "--prompt",
            "Compute 3+4.",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ]);
        if let Some(t) = template {
            c.args(["--template", t]);
        }
        c.output().expect("stapo generate")
    };
    let out = gen(None);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("Compute 3+4.") && stdout.contains("\\boxed{"), "{stdout}");
    assert!(!stderr.contains("note:"), "{stderr}");
    let out = gen(Some(r#"{"kind":"raw"}"#));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("note:"), "{stderr}");
    let out = gen(Some("bogus"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("\"bogus\""), "{stderr}");

    let samples = dir.path().join("samples.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["eval", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(root.join("data/arith/test.jsonl"))
        .args(["--limit", "8", "--n", "1", "--max-tokens", "64", "--temperature", "0"])
        .arg("--out")
        .arg(&samples)
        .output()
        .expect("stapo eval");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let row = stdout.lines().find(|l| l.starts_with("test")).unwrap_or_else(|| panic!("{stdout}"));
    let avg: f64 =
        row.split_whitespace().nth(2).and_then(|v| v.trim_end_matches('%').parse().ok()).expect("avg");
    assert!(avg > 0.0, "greedy answers of the tiny model with its own template: {stdout}");
}
