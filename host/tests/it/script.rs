//! The Rhai host end to end on a tiny model made here (random 2-layer Qwen3 with
//! a BPE tokenizer trained on generated arithmetic): every script in scripts/
//! in smoke mode, hooks, hot reload through the file watcher, the REPL driven
//! through its input, error positions, limits and cancellation, resume, and
//! the `stapo run` batch summary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use stapo::data::{self, TaskConfig, TokenizerConfig};
use stapo::model::{self, Config};
use stapo::script::{self, Console, Host, HostOptions};

use crate::common::tempdir;

/// A model folder and a training file for the scripts.
struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    model: PathBuf,
    data: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempdir();
    let root = dir.path().to_path_buf();
    let problems = data::generate(48, 3, &TaskConfig::default()).expect("problems");
    let tmpl = data::Prompter::standalone(&data::PromptTemplate::raw()).expect("template");
    let tok = data::train_tokenizer(
        data::tokenizer_corpus(&problems, |q| tmpl.render(&q.into()).expect("render")),
        &TokenizerConfig { vocab_size: 300, min_frequency: 2 },
    )
    .expect("tokenizer");
    let eos = tok.id_of("<|endoftext|>").expect("eos");
    let cfg = Config::from_json_str(
        &format!(
            r#"{{"vocab_size": {}, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true,
                "eos_token_id": {eos}, "torch_dtype": "float32"}}"#,
            tok.vocab_size()
        ),
        "fixture",
    )
    .expect("config");
    let m = model::init(&cfg, 0, 0.2, DType::F32, &Device::Cpu).expect("init");
    let model_dir = root.join("model");
    model::save(&m, &model_dir, DType::F32, None).expect("save");
    data::save_tokenizer(&tok, &model_dir).expect("save tokenizer");
    let data_path = root.join("train.jsonl");
    data::write_jsonl(&data_path, &problems).expect("data");
    Fixture { _dir: dir, root, model: model_dir, data: data_path }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn opts(f: &Fixture, run_dir: &Path, smoke: bool) -> HostOptions {
    let mut args = BTreeMap::new();
    // For scripts that read ARGS.model / ARGS.data, and laid over every train() config.
    args.insert("model".to_string(), f.model.display().to_string());
    args.insert("data".to_string(), f.data.display().to_string());
    args.insert("model.path".to_string(), f.model.display().to_string());
    args.insert("data.train".to_string(), f.data.display().to_string());
    args.insert("data.test".to_string(), f.data.display().to_string());
    HostOptions {
        smoke,
        args,
        run_dir: Some(run_dir.to_path_buf()),
        resume: false,
        apply_changes: false,
        repair_metrics: false,
        progress: false,
        watch: false,
        stdlib_dirs: vec![repo().join("stdlib")],
        time_limits: Default::default(),
    }
}

fn buffered(o: HostOptions) -> (Arc<Host>, Arc<Mutex<String>>) {
    let buf = Arc::new(Mutex::new(String::new()));
    (Host::new(o, Console::Buffer(buf.clone())), buf)
}

fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line"))
        .collect()
}

/// A config map literal for the fixture, tiny but not clamped.
fn tiny_cfg(f: &Fixture, objective: &str) -> String {
    format!(
        r#"#{{ model: #{{ path: "{}" }}, data: #{{ train: "{}", prompts_per_step: 1 }},
            actor: #{{ preset: "{objective}", optim: #{{ lr: 1e-4 }},
                       objective: #{{ overlong: #{{ max_len: 4, cache_len: 1 }} }} }},
            rollout: #{{ sampling: #{{ n: 2, max_tokens: 4 }} }} }}"#,
        f.model.display(),
        f.data.display()
    )
}

/// scripts/paper.rhai in smoke mode, as `stapo run --smoke scripts/paper.rhai`
/// runs it: a random Qwen3 with the real 151k-token tokenizer, verl-style rows,
/// the chat template, two training steps and all six benchmark files at both
/// sampling settings.
#[test]
fn paper_script_smoke_runs_the_real_model_path() {
    let dir = tempdir();
    let run_dir = dir.path().join("paper");
    let mut args = BTreeMap::new();
    args.insert("benchmarks".to_string(), repo().join("data/benchmarks").display().to_string());
    args.insert("tokenizer".to_string(), repo().join("models/qwen3-tokenizer").display().to_string());
    args.insert("paper_size".to_string(), "1.7B".to_string());
    let o = HostOptions {
        smoke: true,
        args,
        run_dir: Some(run_dir.clone()),
        resume: false,
        apply_changes: false,
        repair_metrics: false,
        progress: false,
        watch: false,
        stdlib_dirs: vec![repo().join("stdlib")],
        time_limits: Default::default(),
    };
    let (host, buf) = buffered(o);
    let out = script::run_file(&host, &repo().join("scripts/paper.rhai"));
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\noutput:\n{printed}", out.error);
    assert!(printed.contains("smoke model: 2 layers, hidden 64, vocab 151669"), "{printed}");
    assert_eq!(out.trains.len(), 1);
    let t = &out.trains[0];
    assert!(t.steps >= 1 && t.steps <= 2, "{t:?}");
    // The run trained on the verl-style rows with the paper's template and extractor.
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&t.run_dir).join("run_config.json")).expect("run_config"),
    )
    .expect("json");
    assert_eq!(cfg["actor"]["preset"], "stapo");
    assert_eq!(cfg["data"]["extract"], "strict");
    assert_eq!(cfg["data"]["options"]["strip_instruction"], true);
    assert_eq!(cfg["actor"]["optim"]["lr"], 1e-6);
    // The paper's protocol: grad clip 1.0, constant lr after 10 warm-up steps, no overlong shaping.
    assert_eq!(cfg["actor"]["optim"]["max_grad_norm"], 1.0);
    assert_eq!(cfg["actor"]["optim"]["schedule"]["warmup_steps"], 10);
    assert!(cfg["actor"]["objective"]["overlong"].is_null(), "{cfg}");
    // The report in the paper's table layout, with the paper's STAPO 1.7B row beside ours.
    assert!(
        printed.contains("AIME24    AIME25     AMC23   MATH500   Minerva  Olympiad       Avg"),
        "{printed}"
    );
    assert!(printed.contains(
        "STAPO 1.7B (paper)       17.40     15.42     55.94     73.55     28.22     38.54     38.18"
    ));
    assert!(printed.contains(
        "STAPO 1.7B (paper)           -         -         -         -         -         -     36.72"
    ));
    // One row per benchmark and sampling setting, with the paper's n (clamped to 1 in smoke mode).
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(run_dir.join("paper_eval.jsonl"))
        .expect("paper_eval.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("row"))
        .collect();
    assert_eq!(rows.len(), 12, "{rows:?}");
    let names: Vec<&str> = rows[..6].iter().filter_map(|r| r["benchmark"].as_str()).collect();
    assert_eq!(names, ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]);
    assert!(rows.iter().all(|r| r["problems"] == 2 && r["avg"].as_f64().is_some()), "{rows:?}");
    assert_eq!((rows[6]["temperature"].as_f64(), rows[6]["top_p"].as_f64()), (Some(0.7), Some(0.9)));
}

#[test]
fn every_script_in_scripts_runs_in_smoke_mode() {
    let f = fixture();
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(repo().join("scripts"))
        .expect("scripts/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "rhai"))
        // paper.rhai builds its own real-tokenizer model in smoke mode, and the stress scripts'
        // smoke runs are checked in detail: their own tests.
        .filter(|p| {
            p.file_stem()
                .is_some_and(|s| !["paper", "stress", "long_stress"].contains(&&*s.to_string_lossy()))
        })
        .collect();
    scripts.sort();
    assert!(scripts.len() >= 2, "{scripts:?}");
    for s in &scripts {
        let stem = s.file_stem().unwrap().to_string_lossy().to_string();
        let run_dir = f.root.join("runs").join(&stem);
        let (host, buf) = buffered(opts(&f, &run_dir, true));
        let out = script::run_file(&host, s);
        let printed = buf.lock().unwrap().clone();
        assert!(out.ok(), "{}: {:?}\noutput:\n{printed}", s.display(), out.error);
        for t in &out.trains {
            assert!(t.steps >= 1 && t.steps <= 2, "{stem}: {t:?}");
            assert!(
                Path::new(&t.run_dir).join("script.rhai").is_file(),
                "{stem}: script not saved in {}",
                t.run_dir
            );
            assert!(
                Path::new(&t.run_dir).join("checkpoints/latest").is_file(),
                "{stem}: no final checkpoint"
            );
        }
    }
}

#[test]
fn hooks_steer_each_step_and_should_stop_ends_the_run() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("hooks.rhai");
    std::fs::write(
        &path,
        format!(
            r#"import "thresholds" as th;
fn sampling(step) {{ #{{ n: 2, temperature: 0.5 + step, max_tokens: 3 }} }}
fn thresholds(step, stats) {{ th::adaptive(stats, 0.5, #{{ start: 0.01, factor: 2.0 }}) }}
fn lr(step) {{ 1e-3 * (step + 1) }}
fn on_step(step, m) {{ print(`on_step ${{step}} lr=${{m.lr}} tau_p=${{m.tau_p}}`); }}
fn should_stop(step, m) {{ step >= 2 }}
let res = train({}, 10);
print(`summary steps=${{res.steps}} early=${{res.stopped_early}}`);
"#,
            tiny_cfg(&f, "stapo")
        ),
    )
    .unwrap();
    let (host, buf) = buffered(opts(&f, &run_dir, false));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    assert!(printed.contains("summary steps=3 early=true"), "{printed}");
    let m = metrics(&run_dir);
    assert_eq!(m.len(), 3);
    for (i, line) in m.iter().enumerate() {
        let lr = line["lr"].as_f64().unwrap();
        assert!((lr - 1e-3 * (i as f64 + 1.0)).abs() < 1e-12, "step {i}: lr {lr}");
        assert!(line["response_len_mean"].as_f64().unwrap() <= 3.0);
    }
    // The adaptive policy doubles tau_p while fewer than half the tokens are silenced.
    assert!(printed.contains("on_step 0 lr=0.001 tau_p=0.01"), "{printed}");
    let run_cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("run_config.json")).unwrap()).unwrap();
    assert_eq!(run_cfg["actor"]["preset"], "stapo");
    assert!(run_dir.join("script.rhai").is_file());
}

#[test]
fn a_thresholds_hook_never_turns_another_objective_into_stapo() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("grpo_thresholds.rhai");
    std::fs::write(
        &path,
        format!(
            r#"fn thresholds(step, stats) {{ #{{ tau_p: 0.9, tau_h: 100.0 }} }}
let res = train({}, 1);
print(`has_tau_p=${{"tau_p" in res.final}} silenced=${{res.final.silenced_tokens}}`);
let t = trainer({});
let err = "";
try {{ t.step(#{{ thresholds: #{{ tau_p: 0.5 }} }}); }} catch (e) {{ err = `${{e}}`; }}
print(`step_error=${{err}}`);
"#,
            tiny_cfg(&f, "grpo"),
            tiny_cfg(&f, "grpo")
        ),
    )
    .unwrap();
    let (host, buf) = buffered(opts(&f, &run_dir, false));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    assert!(printed.contains("has_tau_p=false silenced=0"), "{printed}");
    assert!(printed.contains("thresholds hook is ignored"), "{printed}");
    assert!(printed.contains("step_error=") && printed.contains("no S2T mask"), "{printed}");
}

/// Writes `text` to `path` the way editors do: a new file renamed over the old one.
fn save_by_rename(path: &Path, text: &str) {
    let tmp = path.with_extension("rhai.swp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn hot_reload_swaps_hooks_at_the_next_step_and_keeps_them_on_a_broken_edit() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("live.rhai");
    // on_step busy-waits so the test can edit the file between steps.
    let script = |lr: &str, tail: &str| {
        format!(
            r#"fn lr(step) {{ {lr} }}
fn on_step(step, m) {{ let t = timestamp(); while t.elapsed < 1.5 {{ }} }}
{tail}
train({}, 3);
"#,
            tiny_cfg(&f, "grpo")
        )
    };
    std::fs::write(&path, script("0.001", "")).unwrap();
    let mut o = opts(&f, &run_dir, false);
    o.watch = true;
    let (host, buf) = buffered(o);
    let h2 = host.clone();
    let p2 = path.clone();
    let runner = std::thread::spawn(move || script::run_file(&h2, &p2));

    // Step 0 logged: edit lr; the swap happens at step 1.
    wait_for("step 0", Duration::from_secs(60), || !metrics(&run_dir).is_empty());
    save_by_rename(&path, &script("0.002", "// edited"));
    // Step 1 logged: break the script; step 2 keeps the edited hooks.
    wait_for("step 1", Duration::from_secs(60), || metrics(&run_dir).len() >= 2);
    save_by_rename(&path, &script("0.003", "let broken = ;"));
    let out = runner.join().unwrap();
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    let lrs: Vec<f64> = metrics(&run_dir).iter().map(|m| m["lr"].as_f64().unwrap()).collect();
    assert_eq!(lrs, vec![0.001, 0.002, 0.002], "{printed}");
    let log = std::fs::read_to_string(run_dir.join("reloads.log")).unwrap();
    assert!(log.contains("step 1: reloaded"), "{log}");
    assert!(log.contains("step 2: reload of") && log.contains("keeping the previous hooks"), "{log}");
    assert!(log.contains("live.rhai:3:"), "the broken edit's position is reported: {log}");
    assert!(run_dir.join("reloads/step-000001.rhai").is_file());
    // The model, optimizer and step counter carried on: one run, three steps.
    assert_eq!(out.trains.len(), 1);
    assert_eq!(out.trains[0].steps, 3);
}

#[test]
fn the_watcher_debounces_and_sees_saves_by_rename() {
    let dir = tempdir();
    let path = dir.path().join("w.rhai");
    std::fs::write(&path, "1").unwrap();
    let (host, _buf) = buffered(HostOptions::default());
    host.set_script(Some(path.clone()));
    let _w = script::watch::start(host.clone(), &[dir.path().to_path_buf()]).unwrap();
    std::fs::write(dir.path().join("unrelated.txt"), "x").unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(!host.take_reload_request(), "an unrelated file triggered a reload");
    for i in 0..3 {
        save_by_rename(&path, &format!("{i}"));
    }
    wait_for("reload request", Duration::from_secs(10), || host.take_reload_request());
    std::thread::sleep(Duration::from_millis(400));
    assert!(!host.take_reload_request(), "a burst of saves gave more than one request");
}

#[test]
fn the_repl_is_driven_through_its_input() {
    let f = fixture();
    let o = opts(&f, &f.root.join("repl-run"), false);
    let input = format!(
        r#"let m = load_model("{model}");
let ds = load_data("{data}");
let r = rollout(m, sample_prompts(ds, 1, 0), #{{ n: 3, max_tokens: 6 }});
score(r).len
advantages(r).len
let st = s2t(r, #{{ tau_p: 0.5, tau_h: #{{ q: 1.0 }} }});
st.response_tokens > 0
r
fn double(x) {{
  x * 2
}}
double(21)
:vars
:help rollout
:help nope
let t = trainer({cfg});
type_of(t.step()) == "map"
t.steps
t.rollout.len
:quit
"#,
        model = f.model.display(),
        data = f.data.display(),
        cfg = tiny_cfg(&f, "stapo").replace('\n', " ")
    );
    let mut out = Vec::new();
    stapo::repl::run_repl(input.as_bytes(), &mut out, o).unwrap();
    let out = String::from_utf8(out).unwrap();
    assert!(!out.contains("error"), "{out}");
    assert!(out.contains("3\n"), "score/advantages lengths: {out}");
    assert!(out.contains("Rollout: 3 samples"), "{out}");
    assert!(out.contains("pos") && out.contains("token") && out.contains("S2T"), "token table header: {out}");
    assert!(out.contains("42\n"), "{out}");
    assert!(out.contains("m ") && out.contains("Model"), ":vars: {out}");
    assert!(out.contains("rollout(model, prompts, opts)"), ":help: {out}");
    assert!(out.contains("no function named `nope`"), "{out}");
    assert!(out.contains("true\n"), "{out}");
    assert!(out.contains("1\n"), "t.steps: {out}");
}

fn script_error(src: &str) -> (String, String) {
    let dir = tempdir();
    let path = dir.path().join("bad.rhai");
    std::fs::write(&path, src).unwrap();
    let (host, _buf) = buffered(HostOptions { run_dir: Some(dir.path().join("run")), ..Default::default() });
    let out = script::run_file(&host, &path);
    match out.error {
        Some(stapo::Error::Script { pos, msg } | stapo::Error::Host { pos, msg }) => (pos, msg),
        other => panic!("expected a script error, found {other:?}"),
    }
}

fn script_error_is_host(src: &str) -> bool {
    let dir = tempdir();
    let path = dir.path().join("bad.rhai");
    std::fs::write(&path, src).unwrap();
    let (host, _buf) = buffered(HostOptions { run_dir: Some(dir.path().join("run")), ..Default::default() });
    let err = script::run_file(&host, &path).error.expect("the script fails");
    script::is_host_error(&err)
}

#[test]
fn script_errors_carry_file_line_col() {
    let (pos, msg) = script_error("let a = 1;\nlet b = (a + ;\n");
    assert!(pos.ends_with("bad.rhai:2:14") || pos.contains("bad.rhai:2:"), "{pos}");
    assert!(msg.contains("syntax"), "{msg}");

    let (pos, msg) = script_error("fn f(x) {\n    x + missing_var\n}\nf(1);\n");
    assert!(pos.contains("bad.rhai:2:"), "{pos} {msg}");
    assert!(msg.contains("missing_var") && msg.contains("`f`"), "{msg}");

    // A host failure is a host error (which a script's `throw` cannot forge) and points at the call.
    let src = "let x = 1;\n\nlet m = load_model(\"/nonexistent/model\");\n";
    let (pos, msg) = script_error(src);
    assert!(pos.contains("bad.rhai:3:"), "{pos}");
    assert!(msg.contains("/nonexistent/model"), "{msg}");
    assert!(script_error_is_host(src));
    assert!(!script_error_is_host("let x = 1;\nthrow \"[host] /nonexistent/model\";\n"));

    // Unknown config keys name the key.
    let (_, msg) = script_error("train(#{ modle: \"x\" }, 1);");
    assert!(msg.contains("modle"), "{msg}");

    // Imports outside the search folders are refused.
    let (_, msg) = script_error("import \"../etc/passwd\" as p;");
    assert!(msg.contains("without `..`"), "{msg}");
}

#[test]
fn limits_and_cancellation_stop_runaway_scripts() {
    let (host, _buf) = buffered(HostOptions::default());
    let mut engine = script::build_engine(&host);
    engine.set_max_operations(10_000);
    let e = engine.run("let i = 0; loop { i += 1; }").unwrap_err();
    let err = script::from_eval("loop.rhai", e);
    assert!(err.to_string().contains("too many operations"), "{err}");

    let (host, _buf) = buffered(HostOptions::default());
    let engine = script::build_engine(&host);
    let flag = host.cancel_flag();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        flag.store(true, Ordering::SeqCst);
    });
    let e = engine.run("loop { }").unwrap_err();
    t.join().unwrap();
    assert!(script::from_eval("x", e).to_string().contains("cancelled"));

    // No file I/O and no `eval` in the language.
    let (host, _buf) = buffered(HostOptions::default());
    let engine = script::build_engine(&host);
    assert!(engine.compile("eval(\"1\")").is_err());
    assert!(engine.run("open_file(\"/etc/passwd\")").is_err());
}

#[test]
fn evaluate_reports_pass_at_k_for_a_list_of_k() {
    let f = fixture();
    let path = f.root.join("passk.rhai");
    let src = format!(
        r#"let m = load_model("{model}");
let r = evaluate(m, "{data}", #{{ n: 4, pass_k: [1, 2, 4], limit: 3, max_tokens: 4 }});
if r.pass_at_k.len() != 3 {{ throw `keys ${{r.pass_at_k.keys()}}`; }}
if r.pass_at_k["4"] != r.pass {{ throw "pass@4 is not pass@n"; }}
if abs(r.pass_at_k["1"] - r.avg) > 1e-9 {{ throw "pass@1 is not avg@n"; }}
if r.pass_at_k["1"] > r.pass_at_k["2"] || r.pass_at_k["2"] > r.pass_at_k["4"] {{ throw "not monotone in k"; }}
let msg = "no error";
try {{ evaluate(m, "{data}", #{{ n: 2, pass_k: [4], limit: 1, max_tokens: 2 }}); }} catch (e) {{ msg = `${{e}}`; }}
print(msg);
// The engine's settings reach the rollout: a cache budget of under one block is refused.
try {{ evaluate(m, "{data}", #{{ n: 2, limit: 1, max_tokens: 2, engine: #{{ kv_cache_gb: 1e-12 }} }}); }}
catch (e) {{ print(`engine: ${{e}}`); }}
"#,
        model = f.model.display(),
        data = f.data.display()
    );
    std::fs::write(&path, src).unwrap();
    let (host, buf) = buffered(opts(&f, &f.root.join("run"), false));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    assert!(printed.contains("k = 4") && printed.contains("2 samples"), "{printed}");
    assert!(printed.contains("engine: ") && printed.contains("kv_cache_gb = 0.000000000001"), "{printed}");
}

#[test]
fn a_resumed_run_continues_the_step_counter() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("resume.rhai");
    std::fs::write(&path, format!("let steps = ARGS.steps ?? 1;\ntrain({}, steps);\n", tiny_cfg(&f, "dapo")))
        .unwrap();
    let (host, _) = buffered(opts(&f, &run_dir, false));
    let out = script::run_file(&host, &path);
    assert!(out.ok(), "{:?}", out.error);
    assert_eq!(out.trains[0].steps, 1);
    let mut o = opts(&f, &run_dir, false);
    o.resume = true;
    o.args.insert("steps".into(), "3".into());
    let (host, _) = buffered(o);
    let out = script::run_file(&host, &run_dir.join("script.rhai"));
    assert!(out.ok(), "{:?}", out.error);
    assert_eq!(out.trains[0].steps, 3);
    let steps: Vec<u64> = metrics(&run_dir).iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![0, 1, 2]);

    // Resuming with another config (here another --set) stops, naming the field and both
    // values, before any step runs...
    let mut o = opts(&f, &run_dir, false);
    o.resume = true;
    o.args.insert("steps".into(), "4".into());
    o.args.insert("actor.optim.lr".into(), "0.5".into());
    let (host, _) = buffered(o.clone());
    let out = script::run_file(&host, &run_dir.join("script.rhai"));
    let err = out.error.expect("a changed config is refused").to_string();
    assert!(err.contains("actor.optim.lr (0.0001 -> 0.5)") && err.contains("--apply-changes"), "{err}");
    assert_eq!(metrics(&run_dir).len(), 3, "no step ran");
    // ...and with apply_changes continues under it, keeping the old file and saying so.
    o.apply_changes = true;
    let (host, buf) = buffered(o);
    let out = script::run_file(&host, &run_dir.join("script.rhai"));
    assert!(out.ok(), "{:?}", out.error);
    assert_eq!(out.trains[0].steps, 4);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("run_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["actor"]["optim"]["lr"], 0.5);
    let old: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("run_config-step-000003.json")).unwrap())
            .unwrap();
    assert_eq!(old["actor"]["optim"]["lr"], 1e-4);
    assert!(buf.lock().unwrap().contains("resume: applying 1 changed field(s): actor.optim.lr"));
    assert!(std::fs::read_to_string(run_dir.join("reloads.log")).unwrap().contains("actor.optim.lr"));
    // Step 3 ran at the new base rate (0.5 x 4/10 of the warm-up).
    let last = metrics(&run_dir).pop().unwrap();
    assert_eq!((last["step"].as_u64(), last["lr"].as_f64()), (Some(3), Some(0.5 * 4.0 / 10.0)));
}

#[test]
fn batch_runs_report_a_summary_and_fail_if_any_script_fails() {
    let f = fixture();
    let good = f.root.join("good.rhai");
    let bad = f.root.join("bad.rhai");
    std::fs::write(&good, format!("train({}, 1);", tiny_cfg(&f, "grpo"))).unwrap();
    std::fs::write(&bad, "let x = ;").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"))
        .current_dir(&f.root)
        .args(["run", "--smoke", "--quiet"])
        .arg(&bad)
        .arg(&good)
        .arg("--set")
        .arg(format!("model.path={}", f.model.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("bad.rhai:1:"), "{stderr}");
    assert!(stdout.contains("FAILED") && stdout.contains(" ok "), "{stdout}");
    assert!(stdout.contains("runs/good-"), "the good script ran into its own folder: {stdout}");
}

/// The run `<m>-s<seed>` of a paired stress script's folder: same start model, the
/// `stapo` preset, its seed, and evaluations at steps 0, 1, 2 at T 1.0 (eval.jsonl) and at
/// T 0.7 / top-p 0.9 (apart). Returns its run_config.json.
fn check_paired_run(run_dir: &Path, f: &Fixture, m: &str, seed: u64) -> serde_json::Value {
    let d = run_dir.join(format!("{m}-s{seed}"));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("run_config.json")).unwrap()).unwrap();
    assert_eq!((cfg["seed"].as_u64(), cfg["actor"]["preset"].as_str()), (Some(seed), Some("stapo")), "{m}");
    assert_eq!(cfg["model"]["path"].as_str(), Some(f.model.to_str().unwrap()), "{m}: same start");
    for (file, t) in [("eval.jsonl", 1.0), ("eval-t0.7-p0.9.jsonl", 0.7)] {
        let rows = jsonl(&d, file);
        let steps: Vec<u64> = rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [0, 1, 2], "{m}-s{seed} {file}");
        assert!(rows.iter().all(|r| r["temperature"] == t), "{m}-s{seed} {file}");
    }
    cfg
}

/// scripts/stress.rhai in smoke mode: both arms (justrl, stapo) for two seeds from the
/// same start, evaluated at both sampling settings, one row per run, one pairing row per
/// seed and one band figure; then the collect mode rebuilds the same rows from the folders.
#[test]
fn stress_script_smoke_pairs_the_arms_over_seeds() {
    let f = fixture();
    let run_dir = f.root.join("runs").join("stress");
    let (host, buf) = buffered(opts(&f, &run_dir, true));
    let out = script::run_file(&host, &repo().join("scripts/stress.rhai"));
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\noutput:\n{printed}", out.error);
    let arms = ["justrl", "stapo"];
    for m in arms {
        for seed in 0..2 {
            let cfg = check_paired_run(&run_dir, &f, m, seed);
            let tau_h = &cfg["actor"]["objective"]["mask"]["tau_h"];
            assert_eq!(tau_h.as_f64() == Some(-1.0), m == "justrl", "{m}: {cfg}");
        }
        assert!(printed.lines().any(|l| l.starts_with(m) && l.contains(" ± ")), "{m} row:\n{printed}");
    }
    let read = |name: &str| jsonl(&run_dir, name);
    let rows = read("stress.jsonl");
    assert_eq!(rows.len(), 4);
    for r in &rows {
        assert!(
            r["avg8_t1_end"].is_number()
                && r["avg8_t07_end"].is_number()
                && r["entropy_p99_mean"].is_number(),
            "{r}"
        );
        assert_eq!(r["steps"], 2, "{r}");
        if r["arm"] == "justrl" {
            assert_eq!(r["silenced_total"], 0, "the justrl arm silences nothing: {r}");
        }
    }
    let pairs = read("stress-pairs.jsonl");
    assert_eq!(pairs.len(), 2);
    assert!(pairs.iter().all(|p| p["paired"] == true), "first divergence = first silencing: {pairs:?}");
    assert_eq!(&std::fs::read(run_dir.join("stress.png")).unwrap()[..4], b"\x89PNG");
    let svg = std::fs::read_to_string(run_dir.join("stress.svg")).unwrap();
    assert!(svg.contains("stapo (n=2)") && svg.contains("held-out accuracy"), "figure legend");

    // Collect mode: no training, the same rows from the folders.
    std::fs::remove_file(run_dir.join("stress.jsonl")).unwrap();
    let mut o = opts(&f, &run_dir, true);
    o.args.insert("collect".into(), "true".into());
    let (host, buf) = buffered(o);
    let out = script::run_file(&host, &repo().join("scripts/stress.rhai"));
    assert!(out.ok(), "{:?}\n{}", out.error, buf.lock().unwrap());
    assert!(out.trains.is_empty());
    assert_eq!(read("stress.jsonl"), rows);
}

/// The lines of a JSON-lines file of `dir`.
fn jsonl(dir: &Path, name: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join(name))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// scripts/long_stress.rhai in smoke mode: justrl and stapo for two seeds from the same
/// start, evaluated at both settings, the per-mini-batch S2T figures in metrics.jsonl, and
/// the report (rows whose rates are the metrics' sums, pairs, figures, tables); run again
/// with resume, finished runs are skipped and a run missing its last evaluation gets just
/// that one.
#[test]
fn long_stress_script_smoke_trains_the_pairs_reports_and_resumes() {
    let f = fixture();
    let run_dir = f.root.join("runs").join("long_stress");
    let (host, buf) = buffered(opts(&f, &run_dir, true));
    let script_path = repo().join("scripts/long_stress.rhai");
    let out = script::run_file(&host, &script_path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\noutput:\n{printed}", out.error);
    let mut sums = Vec::new();
    for m in ["justrl", "stapo"] {
        for seed in 0..2u64 {
            let cfg = check_paired_run(&run_dir, &f, m, seed);
            let d = run_dir.join(format!("{m}-s{seed}"));
            let mask = &cfg["actor"]["objective"]["mask"];
            if m == "justrl" {
                assert_eq!(mask["tau_h"].as_f64(), Some(-1.0), "{cfg}");
            } else {
                // The paper's rule.
                assert_eq!(
                    (mask["tau_p"].as_f64(), mask["tau_h"]["q"].as_f64()),
                    (Some(0.002), Some(0.75)),
                    "{cfg}"
                );
                assert_eq!(mask["tau_h"]["over"].as_str(), Some("candidates"), "{cfg}");
            }
            assert_eq!(cfg["actor"]["mini_batch"], 2, "two mini-batches of a smoke step");
            // Each step: two S2T mini-batches whose tokens are the step's response tokens.
            let (mut tokens, mut cand, mut mbs, mut two) = (0u64, 0u64, 0u64, 0u64);
            for row in jsonl(&d, "metrics.jsonl") {
                let per = row["s2t_by_mini_batch"].as_array().expect("s2t_by_mini_batch");
                assert_eq!(per.len(), 2, "{row}");
                let t: u64 = per.iter().map(|b| b["tokens"].as_u64().unwrap()).sum();
                assert_eq!(t, row["response_tokens"].as_u64().unwrap(), "{row}");
                let c: u64 = per.iter().map(|b| b["candidates"].as_u64().unwrap()).sum();
                assert_eq!(c, row["s2t_candidates"].as_u64().unwrap(), "{row}");
                tokens += t;
                cand += c;
                mbs += 2;
                two += per.iter().filter(|b| b["candidates"].as_u64().unwrap() >= 2).count() as u64;
            }
            sums.push((m, seed, tokens, cand, mbs, two));
        }
    }
    // The report: one row per run, its rates the sums of its metrics.
    let rows = jsonl(&run_dir, "long_stress.jsonl");
    assert_eq!(rows.len(), 4);
    for (m, seed, tokens, cand, mbs, two) in sums {
        let r = rows.iter().find(|r| r["method"] == m && r["seed"] == seed).expect("row");
        assert_eq!((r["steps"].as_u64(), r["eval_end"].as_u64()), (Some(2), Some(2)), "{r}");
        assert_eq!(
            (r["response_tokens"].as_u64(), r["mini_batches"].as_u64()),
            (Some(tokens), Some(mbs)),
            "{r}"
        );
        let per_10k = r["candidates_per_10k"].as_f64().unwrap();
        assert!((per_10k - cand as f64 / tokens as f64 * 1e4).abs() < 1e-9, "{r}");
        assert!((r["share_2plus"].as_f64().unwrap() - two as f64 / mbs as f64).abs() < 1e-12, "{r}");
        assert!(r["avg8_t1_end"].is_number() && r["avg8_t07_end"].is_number(), "{r}");
        if m == "justrl" {
            assert_eq!(r["silenced"], 0, "justrl silences nothing: {r}");
        }
    }
    let pairs = jsonl(&run_dir, "long_stress-pairs.jsonl");
    assert_eq!(pairs.len(), 2, "{pairs:?}");
    // Paired: stapo leaves justrl only where it silences.
    assert!(
        pairs.iter().all(|p| p["method"] == "stapo" && p["first_divergence"] == p["first_silenced"]),
        "{pairs:?}"
    );
    for fig in ["entropy", "long_stress"] {
        assert_eq!(&std::fs::read(run_dir.join(format!("{fig}.png"))).unwrap()[..4], b"\x89PNG", "{fig}");
    }
    let svg = std::fs::read_to_string(run_dir.join("entropy.svg")).unwrap();
    assert!(svg.contains("entropy, 0.99-quantile") && svg.contains("stapo (n=2)"), "entropy figure");
    let svg = std::fs::read_to_string(run_dir.join("long_stress.svg")).unwrap();
    assert!(svg.contains("held-out avg@8, T 0.7 / top-p 0.9"), "accuracy at the low setting");
    for head in
        ["| method | runs | steps |", "share with >= 2 cand.", "| method | seed | at step | Δ avg@8 T 1.0"]
    {
        assert!(printed.contains(head), "{head}:\n{printed}");
    }

    // Again with resume: the four finished runs are skipped; one missing its last
    // evaluation at T 0.7 resumes and gets that one alone.
    let d = run_dir.join("stapo-s1");
    let low = std::fs::read_to_string(d.join("eval-t0.7-p0.9.jsonl")).unwrap();
    let cut: String = low.lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(d.join("eval-t0.7-p0.9.jsonl"), cut).unwrap();
    let before = std::fs::read_to_string(d.join("metrics.jsonl")).unwrap();
    let mut o = opts(&f, &run_dir, true);
    o.resume = true;
    let (host, buf) = buffered(o);
    let out = script::run_file(&host, &script_path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\noutput:\n{printed}", out.error);
    assert_eq!(printed.matches("finished, skipped").count(), 3, "{printed}");
    assert!(printed.contains("stapo-s1: resumed at step 2"), "{printed}");
    assert_eq!(
        std::fs::read_to_string(d.join("eval-t0.7-p0.9.jsonl")).unwrap(),
        low,
        "the same evaluation again"
    );
    let steps: Vec<u64> = jsonl(&d, "eval.jsonl").iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [0, 1, 2], "no evaluation repeated");
    assert_eq!(std::fs::read_to_string(d.join("metrics.jsonl")).unwrap(), before, "no step ran again");
    assert_eq!(jsonl(&run_dir, "long_stress.jsonl").len(), 4);
}

/// `stapo run --smoke scripts/long_stress.rhai` from the repository (models/tiny-qwen3 on
/// data/long), then `--resume` on its folder of named runs: without the script it says to
/// give it; with it, every finished run is skipped.
#[test]
fn long_stress_runs_from_the_command_line_and_resumes_its_folder() {
    let dir = tempdir();
    let out_dir = dir.path().join("ls");
    let stapo = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"))
            .current_dir(repo())
            .args(args)
            .output()
            .unwrap();
        let text =
            format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    };
    let o = out_dir.to_str().unwrap();
    let (ok, text) = stapo(&["run", "--smoke", "--quiet", "--out", o, "scripts/long_stress.rhai"]);
    assert!(ok, "{text}");
    assert!(text.contains("models/tiny-qwen3") && text.contains("| stapo |"), "{text}");
    assert!(
        out_dir.join("stapo-s1/checkpoints/latest").is_file() && !out_dir.join("run_config.json").exists()
    );
    let (ok, text) = stapo(&["run", "--smoke", "--quiet", "--resume", o]);
    assert!(!ok && text.contains("give the script"), "{text}");
    let (ok, text) = stapo(&["run", "--smoke", "--quiet", "--resume", o, "scripts/long_stress.rhai"]);
    assert!(ok, "{text}");
    assert_eq!(text.matches("finished, skipped").count(), 4, "{text}");
}

/// The calibrated policy of stdlib/thresholds.rhai against a synthetic run whose
/// candidate share follows a power law in tau_p (slope 0.6, not the policy's initial
/// guess of 1): the silenced share reaches the target within a few steps and stays.
#[test]
fn the_calibrated_threshold_policy_reaches_its_target() {
    let dir = tempdir();
    let path = dir.path().join("cal.rhai");
    std::fs::write(
        &path,
        r#"import "thresholds" as th;
let n = 20000;
let target = 0.004;
let stats = #{ prev: #{} };
let out = th::calibrated(stats, target, #{});
print(`first tau_p=${out.tau_p}`);
let shares = [];
for step in 0..12 {
    // The step runs at out.tau_p: candidates follow 0.3 * tau_p^0.6, silenced = q * candidates.
    let tau = out.tau_p;
    let cand = (n.to_float() * 0.3 * exp(0.6 * ln(tau))).floor().to_int();
    let silenced = (0.75 * cand.to_float()).floor() / n.to_float();
    shares.push(silenced);
    stats = #{ response_tokens: n, s2t_candidates: cand, silenced_ratio: silenced, prev: out };
    out = th::calibrated(stats, target, #{});
}
print(`shares=${shares}`);
print(`slope=${out.state.slope}`);
// No candidates at all: tau_p grows by max_step, and stays within max.
let none = th::calibrated(#{ response_tokens: 100, s2t_candidates: 0, prev: #{ tau_p: 0.3 } }, target, #{});
print(`grown=${none.tau_p}`);
"#,
    )
    .unwrap();
    let o = opts_plain(dir.path());
    let (host, buf) = buffered(o);
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    assert!(printed.contains("first tau_p=0.002"), "{printed}");
    let nums = |key: &str| -> Vec<f64> {
        let line = printed.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{key}: {printed}"));
        line[key.len()..]
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .map(|x| x.trim().parse().unwrap())
            .collect()
    };
    let shares = nums("shares=");
    // The paper's tau_p silences 0.75 * 0.3 * 0.002^0.6 = 0.0054: too much for the target.
    assert!((shares[0] - 0.0054).abs() < 2e-4, "{shares:?}");
    for s in &shares[6..] {
        assert!((s / 0.004 - 1.0).abs() < 0.05, "share {s} not at the target 0.004: {shares:?}");
    }
    // The secant moved from its initial guess of 1 to near the plant's slope (the
    // integer candidate counts blur it a little).
    let slope = nums("slope=")[0];
    assert!((slope - 0.6).abs() < 0.1, "slope {slope}");
    assert_eq!(nums("grown=")[0], 0.5, "0.3 x 4 clamped to max 0.5");
}

fn opts_plain(dir: &Path) -> HostOptions {
    HostOptions {
        smoke: false,
        args: BTreeMap::new(),
        run_dir: Some(dir.join("runs")),
        resume: false,
        apply_changes: false,
        repair_metrics: false,
        progress: false,
        watch: false,
        stdlib_dirs: vec![repo().join("stdlib")],
        time_limits: Default::default(),
    }
}

/// STAPO's token analysis from a script, on the bundled tiny model (mixed rewards): a
/// run's spurious.png, the silenced tokens' contexts in the metrics, the token table,
/// run.silenced(n) and silenced_tokens.tsv, and spurious_plot for a run's rollout and
/// for a plain one.
#[test]
fn silenced_tokens_come_with_contexts_and_the_spurious_figure() {
    let dir = tempdir();
    let repo = repo().canonicalize().unwrap();
    let model = repo.join("models/tiny-qwen3");
    let path = dir.path().join("spur.rhai");
    std::fs::write(
        &path,
        format!(
            r#"let t = trainer(#{{ model: #{{ path: "{model}" }},
    data: #{{ train: "{data}", prompts_per_step: 6, template: #{{ kind: "raw", suffix: "" }} }},
    rollout: #{{ sampling: #{{ n: 4, max_tokens: 40 }} }}, seed: 3,
    actor: #{{ preset: "stapo", optim: #{{ lr: 1e-4 }}, objective: #{{ mask: #{{ tau_p: 0.5, tau_h: 100.0 }},
        dynamic_sampling: false, overlong: #{{ max_len: 40, cache_len: 8 }} }} }} }});
let m = t.step();
print(`silenced=${{m.silenced_tokens}} examples=${{m.silenced_examples.len}}`);
print(`example=${{m.silenced_examples[0]}}`);
let top = t.silenced(2);
print(`top=${{top[0][0]}} contexts=${{top[0][2].len}}`);
let r = t.rollout;
let f = spurious_plot(r, t.run_dir + "/spurious-last");
print(`plot points=${{f.points}} silenced=${{f.silenced}}`);
let shown = "";
for i in 0..r.len {{
    let rows = r.tokens(i).filter(|x| x.silenced == true);
    if rows.len > 0 {{ shown = r.table(i); print(`row_context=${{rows[0].context}}`); break; }}
}}
print(`table_has_context=${{shown.contains("silenced at")}}`);
t.checkpoint();
let m2 = load_model("{model}");
let ds = load_data("{test}");
let r2 = rollout(m2, sample_prompts(ds, 6, 1), #{{ n: 4, max_tokens: 40, template: "none", seed: 5 }});
score(r2);
let s = s2t(r2, #{{ tau_p: 0.5, tau_h: 100.0 }});
let g = spurious_plot(m2, r2, t.run_dir + "/plain");
print(`plain points=${{g.points}} silenced=${{g.silenced}} s2t=${{s.silenced}}`);
let err = "";
try {{ spurious_plot(r2, t.run_dir + "/x"); }} catch (e) {{ err = `${{e}}`; }}
print(`plain_error=${{err}}`);
print(`dir=${{t.run_dir}}`);
"#,
            model = model.display(),
            data = repo.join("data/arith/train.jsonl").display(),
            test = repo.join("data/arith/test.jsonl").display(),
        ),
    )
    .unwrap();
    let (host, buf) = buffered(opts_plain(dir.path()));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    let field = |key: &str| -> String {
        let at = printed.find(key).unwrap_or_else(|| panic!("{key}: {printed}")) + key.len();
        printed[at..].split([' ', '\n']).next().unwrap().to_string()
    };
    let silenced: usize = field("silenced=").parse().unwrap();
    assert!(silenced > 0, "{printed}");
    assert!(field("examples=").parse::<usize>().unwrap() > 0);
    // Contexts show the token between its neighbours.
    let example = printed.lines().find_map(|l| l.strip_prefix("example=")).unwrap();
    assert!(example.contains('⟦') && example.contains('⟧'), "{example}");
    assert!(field("contexts=").parse::<usize>().unwrap() >= 1, "{printed}");
    assert!(printed.lines().any(|l| l.starts_with("row_context=") && l.contains('⟦')), "{printed}");
    assert!(printed.contains("table_has_context=true"), "{printed}");
    // The run's scatter holds every positive-advantage token, and all the silenced ones (one epoch).
    let plot = pairs(&printed, "plot ");
    assert_eq!(plot["silenced"], silenced, "{printed}");
    assert!(plot["points"] > silenced, "{printed}");
    // The plain rollout: the figure marks exactly the tokens s2t(r) silenced (all have A > 0).
    let plain = pairs(&printed, "plain ");
    assert!(plain["points"] > 0 && plain["silenced"] > 0, "{printed}");
    assert_eq!(plain["silenced"], plain["s2t"], "{printed}");
    assert!(
        printed.contains("plain_error=") && printed.contains("spurious_plot(model, rollout, path)"),
        "{printed}"
    );
    let run = PathBuf::from(printed.lines().find_map(|l| l.strip_prefix("dir=")).unwrap());
    for f in
        ["spurious.png", "spurious.svg", "spurious-last.png", "spurious-last.svg", "plain.png", "plain.svg"]
    {
        assert!(run.join(f).is_file(), "missing {f}");
    }
    let svg = std::fs::read_to_string(run.join("spurious.svg")).unwrap();
    assert!(
        svg.contains(&format!("silenced by S2T ({silenced})")) && svg.contains("S2T region"),
        "spurious.svg"
    );
    // silenced_tokens.tsv: token, count, contexts.
    let tsv = std::fs::read_to_string(run.join("silenced_tokens.tsv")).unwrap();
    let first = tsv.lines().next().unwrap();
    assert_eq!(first.split('\t').count(), 3, "{first}");
    assert!(first.contains('⟦'), "{first}");
    let line: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().next().unwrap(),
    )
    .unwrap();
    assert!(line["silenced_examples"].as_array().is_some_and(|a| !a.is_empty()), "{line}");
}

/// The `key=count` pairs of the printed line that starts with `prefix`.
fn pairs<'a>(printed: &'a str, prefix: &str) -> std::collections::HashMap<&'a str, usize> {
    printed
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?}: {printed}"))
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect()
}

/// `tiny_cfg` with a hook time limit of `secs` seconds.
fn cfg_with_hook_timeout(f: &Fixture, secs: u32) -> String {
    tiny_cfg(f, "grpo").replacen("#{", &format!("#{{ hook_timeout: {secs},"), 1)
}

#[test]
fn a_hook_past_its_time_limit_stops_naming_the_hook_and_its_line() {
    let f = fixture();
    let path = f.root.join("slow.rhai");
    std::fs::write(
        &path,
        format!(
            "fn thresholds(step) {{ 0 }}\nfn lr(step) {{\n  loop {{ }}\n}}\ntrain({}, 2);\n",
            cfg_with_hook_timeout(&f, 1)
        ),
    )
    .unwrap();
    let (host, buf) = buffered(opts(&f, &f.root.join("run"), false));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    let err = out.error.expect("the hook is stopped").to_string();
    let at = format!("{}:2", path.display());
    assert!(err.contains(&format!("hook `lr` (defined at {at}) ran past its time limit of 1 s")), "{err}");
    // Loaded with a hook-like function the loop never calls: warned about, with the signature.
    let warning = format!(
        "warning: {}:1: fn thresholds(step) is never called: the hook is thresholds(step, stats)",
        path.display()
    );
    assert!(printed.contains(&warning), "{printed}");
}

#[test]
fn a_reloaded_hook_past_its_time_limit_falls_back_to_the_previous_hooks() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("live.rhai");
    // on_step waits (under the 1 s limit) so the test can edit between steps.
    let script = |lr: &str, on_step: &str| {
        format!(
            "fn lr(step) {{ {lr} }}\n\nfn {on_step}(step, m) {{ let t = timestamp(); while t.elapsed < 0.6 {{ }} }}\n\
             train({}, 3);\n",
            cfg_with_hook_timeout(&f, 1)
        )
    };
    std::fs::write(&path, script("0.001", "on_step")).unwrap();
    let (host, buf) = buffered(opts(&f, &run_dir, false));
    let h2 = host.clone();
    let p2 = path.clone();
    let runner = std::thread::spawn(move || script::run_file(&h2, &p2));
    wait_for("step 0", Duration::from_secs(60), || !metrics(&run_dir).is_empty());
    // An edit whose lr never returns, and a misspelt hook; asked to reload as the watcher would.
    std::fs::write(&path, script("loop { }", "on_steps")).unwrap();
    host.request_reload();
    let out = runner.join().unwrap();
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    let lrs: Vec<f64> = metrics(&run_dir).iter().map(|m| m["lr"].as_f64().unwrap()).collect();
    assert_eq!(lrs, vec![0.001, 0.001, 0.001], "{printed}");
    let log = std::fs::read_to_string(run_dir.join("reloads.log")).unwrap();
    let at = format!("{}:1", path.display());
    assert!(log.contains("step 1: reloaded"), "{log}");
    assert!(
        log.contains(&format!("step 1: script error at {}", path.display()))
            && log.contains(&format!("hook `lr` (defined at {at}) ran past its time limit of 1 s"))
            && log.contains("keeping the previous hooks"),
        "{log}"
    );
    // The reload's warning names the line and the hook it resembles.
    assert!(
        log.contains(&format!(
            "warning: {}:3: fn on_steps(step, m) is never called: did you mean the hook on_step(step, metrics)?",
            path.display()
        )),
        "{log}"
    );
    assert_eq!(out.trains[0].steps, 3);
}

#[test]
fn a_script_past_its_time_limit_stops_even_while_an_array_grows() {
    let dir = tempdir();
    let path = dir.path().join("grow.rhai");
    std::fs::write(&path, "let a = [];\nloop { a.push(1); }\n").unwrap();
    let o = HostOptions {
        run_dir: Some(dir.path().join("run")),
        time_limits: script::TimeLimits { hook: None, script: Some(Duration::from_secs(1)) },
        ..Default::default()
    };
    let (host, _buf) = buffered(o);
    let out = script::run_file(&host, &path);
    let err = out.error.expect("the script is stopped").to_string();
    assert!(err.contains(&format!("the script {} ran past its time limit of 1 s", path.display())), "{err}");
    assert!(err.contains("grow.rhai:2:"), "{err}");
}

/// A hot edit whose hook raises at run time is a broken edit like a
/// syntax error: the run goes back to the previous hooks and logs the error's file:line.
#[test]
fn nothing_silent_reloaded_hook_that_raises_reverts_to_the_previous_hooks() {
    let f = fixture();
    let run_dir = f.root.join("run");
    let path = f.root.join("live.rhai");
    let script = |body: &str| {
        format!(
            "fn lr(step) {{ 0.001 }}\nfn on_step(step, m) {{\n  {body}\n  let t = timestamp(); while t.elapsed < 0.6 {{ }}\n}}\n\
             train({}, 3);\n",
            tiny_cfg(&f, "grpo")
        )
    };
    std::fs::write(&path, script("print(`ok ${step}`);")).unwrap();
    let (host, buf) = buffered(opts(&f, &run_dir, false));
    let (h2, p2) = (host.clone(), path.clone());
    let runner = std::thread::spawn(move || script::run_file(&h2, &p2));
    wait_for("step 0", Duration::from_secs(60), || !metrics(&run_dir).is_empty());
    std::fs::write(&path, script("let x = no_such_variable + 1;")).unwrap();
    host.request_reload();
    let out = runner.join().unwrap();
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}\n{printed}", out.error);
    assert_eq!(out.trains[0].steps, 3);
    let log = std::fs::read_to_string(run_dir.join("reloads.log")).unwrap();
    assert!(log.contains("step 1: reloaded"), "{log}");
    assert!(
        log.contains(&format!("step 1: script error at {}:3:", path.display()))
            && log.contains("no_such_variable")
            && log.contains("keeping the previous hooks"),
        "{log}"
    );
    // The previous on_step ran for every step, the failed call's step included.
    assert_eq!(printed.matches("ok ").count(), 3, "{printed}");
}

/// `load_data()` in a script warns about the rows it drops, with
/// file:line, as train and eval do.
#[test]
fn nothing_silent_load_data_warns_about_dropped_rows() {
    let f = fixture();
    let data = f.root.join("mixed.jsonl");
    std::fs::write(&data, "{\"problem\": \"1+1\", \"answer\": \"2\"}\nnot json\n{\"problem\": \"x\"}\n")
        .unwrap();
    let path = f.root.join("load.rhai");
    std::fs::write(&path, format!("let ds = load_data(\"{}\");\nprint(`n=${{ds.len}}`);\n", data.display()))
        .unwrap();
    let (host, buf) = buffered(opts(&f, &f.root.join("run"), false));
    let out = script::run_file(&host, &path);
    let printed = buf.lock().unwrap().clone();
    assert!(out.ok(), "{:?}", out.error);
    assert!(printed.contains("n=1"), "{printed}");
    for line in [2, 3] {
        assert!(
            printed.contains(&format!("warning: load_data: skipped {}:{line}:", data.display())),
            "{printed}"
        );
    }
    assert!(printed.contains("2 record(s) skipped, 1 loaded"), "{printed}");
}

/// `--set actor.optim.lr=fast` and `--set rollout.sampling.n=-2` name the
/// field; a failed run's error says where its checkpoint is.
#[test]
fn errors_set_values_name_their_field_and_a_failed_run_shows_its_checkpoint() {
    let f = fixture();
    let path = f.root.join("set.rhai");
    std::fs::write(&path, format!("train({}, 2);\n", tiny_cfg(&f, "grpo"))).unwrap();
    for (key, val) in
        [("actor.optim.lr", "fast"), ("rollout.sampling.n", "-2"), ("rollout.sampling.min_p", "1.5")]
    {
        let mut o = opts(&f, &f.root.join(format!("run-{key}")), false);
        o.args.insert(key.into(), val.into());
        let (host, _) = buffered(o);
        let e = script::run_file(&host, &path).error.expect("refused").to_string();
        assert!(e.contains(key), "{key}={val}: {e}");
    }
    // A run stopped by the non-finite guard after one step: the error names the checkpoint.
    let cfg = tiny_cfg(&f, "grpo")
        .replacen("#{", "#{ guard: #{ max_nonfinite_steps: 1 },", 1)
        .replace("optim: #{ lr: 1e-4 }", "optim: #{ lr: 1e39, weight_decay: 0.0 }");
    assert!(cfg.contains("1e39"), "{cfg}");
    std::fs::write(&path, format!("train({cfg}, 3);\n")).unwrap();
    let run_dir = f.root.join("run-nan");
    let (host, _) = buffered(opts(&f, &run_dir, false));
    let e = script::run_file(&host, &path).error.expect("stopped").to_string();
    let ckpt = run_dir.join("checkpoints/step-000001");
    assert!(
        e.contains("guard.max_nonfinite_steps = 1")
            && e.contains(&format!("checkpointed at {}", ckpt.display())),
        "{e}"
    );
    assert!(ckpt.is_dir());
}
