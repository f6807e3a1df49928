//! The guards of a run, "nothing lost, nothing silent": each failure they prevent as a
//! test, named after its family (`nothing_lost_...`: data or state a run could lose;
//! `nothing_silent_...`: input dropped without a word; `crashes_...`: sizes bounded
//! before allocation; `model_folder_...`: checks at load; `errors_...`: errors that name
//! their file, field or token). Unknown config keys and a resume with a changed config
//! are tested with the configuration; a script's dropped data rows, a hot edit that
//! raises and bad `--set` values in `script.rs`; the REPL's input completeness beside
//! the REPL.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use stapo::guard::{self, check_folder_finite};
use stapo::model::{self, Config};
use stapo::rollout::{self, GenerateOptions, SamplingParams};
use stapo::train::{RunConfig, Trainer};

use crate::common::{arith_fixture, tempdir, tiny_config, weight_bits};

/// A tiny run on the arithmetic fixture whose updates have non-zero gradients, with the
/// fields of `extra` laid over it.
fn config_with(model: &Path, train: &Path, extra: serde_json::Value) -> RunConfig {
    let mut v = serde_json::json!({
        "model": {"path": model},
        "data": {"train": train, "prompts_per_step": 2, "extract": stapo::reward::ExtractMode::Flexible},
        "rollout": {"sampling": {"n": 3, "max_tokens": 8}},
        "actor": {"preset": "grpo", "optim": {"lr": 1e-3}},
    });
    merge(&mut v, extra);
    RunConfig::from_json(&v).unwrap()
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn config(model: PathBuf, train: PathBuf) -> RunConfig {
    config_with(&model, &train, serde_json::json!({}))
}

/// A trainer in `dir/run` on the arithmetic fixture, with `extra` laid over the tiny
/// config, and its weights' bits before any step.
fn trainer_with(dir: &Path, extra: serde_json::Value) -> (Trainer, Vec<u32>) {
    let (model, train, _) = arith_fixture(dir);
    let t = Trainer::new(config_with(&model, &train, extra), &dir.join("run")).unwrap();
    let before = weight_bits(&t);
    (t, before)
}

fn stapo_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_stapo"))
}

/// an update whose weights would not be finite is skipped (weights and moments
/// untouched), counted with its reason, and three in a row stop the run naming the step
/// and the quantity; every checkpoint written holds finite values only.
#[test]
fn nothing_lost_nan_step_is_skipped() {
    let dir = tempdir();
    // An lr whose f32 step size overflows: every updated weight would be inf or NaN.
    let (mut t, before) = trainer_with(
        dir.path(),
        serde_json::json!({"actor": {"optim": {"lr": 1e39, "weight_decay": 0.0,
            "schedule": {"kind": "constant", "warmup_steps": 0}}}, "checkpoint": {"save_every": 1}}),
    );
    let run = dir.path().join("run");
    for step in 0..2 {
        let m = t.step(&t.default_plan(), None, None).unwrap();
        assert_eq!((m.update.skipped_steps, m.update.optimizer_steps), (1, 0), "step {step}");
        assert!(m.update.skip_reasons[0].contains("updated weights of `"), "{:?}", m.update.skip_reasons);
        assert_eq!(weight_bits(&t), before, "step {step}: the weights changed");
    }
    let e = t.step(&t.default_plan(), None, None).unwrap_err().to_string();
    assert!(e.contains("step 2: 3 step(s) in a row (steps 0-2)") && e.contains("would not be finite"), "{e}");
    // Logged with its reason, and the checkpoints (steps 1-3) hold finite weights.
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 3);
    assert!(
        lines.lines().all(|l| l.contains("\"skipped_steps\":1") && l.contains("skip_reasons")),
        "{lines}"
    );
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-000003");
    check_folder_finite(&run.join("checkpoints").join(latest.trim()), "latest").unwrap();
}

/// `lr = 1e30` with weight decay used to multiply every weight by
/// `1 - lr * wd` (finite, so no finiteness check caught it); it is a clear error.
#[test]
fn nothing_lost_lr_times_weight_decay_at_least_one_is_refused() {
    let dir = tempdir();
    let (mut t, before) = trainer_with(
        dir.path(),
        serde_json::json!({"actor": {"optim": {"lr": 1e30, "schedule": {"kind": "constant", "warmup_steps": 0}}}}),
    );
    let e = t.step(&t.default_plan(), None, None).unwrap_err().to_string();
    assert!(e.contains("weight_decay") && e.contains("lower `actor.optim.lr`"), "{e}");
    assert_eq!(weight_bits(&t), before);
}

/// a checkpoint is verified finite before it becomes `latest`.
#[test]
fn nothing_lost_checkpoint_with_nan_never_becomes_latest() {
    let dir = tempdir();
    let (mut t, _) = trainer_with(dir.path(), serde_json::json!({}));
    let run = dir.path().join("run");
    t.step(&t.default_plan(), None, None).unwrap();
    t.checkpoint().unwrap();
    t.step(&t.default_plan(), None, None).unwrap();
    // Poison one weight as a diverged step would have.
    let (name, var) = t.model().params().into_iter().next().unwrap();
    let mut vals = var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    vals[3] = f32::NAN;
    var.set(&Tensor::from_vec(vals, var.shape(), &Device::Cpu).unwrap()).unwrap();
    let e = t.checkpoint().unwrap_err().to_string();
    assert!(e.contains(&format!("`{name}`")) && e.contains("1 non-finite value"), "{e}");
    let ckpts = run.join("checkpoints");
    assert_eq!(std::fs::read_to_string(ckpts.join("latest")).unwrap().trim(), "step-000001");
    let names: Vec<String> =
        std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert!(!names.iter().any(|n| n.contains("000002")), "a step-2 folder was left: {names:?}");
}

/// `stapo init --out` and `stapo update --out` never replace a folder they did not
/// create unless `--force`; `update --out` equal to `--model` is refused.
#[test]
fn nothing_lost_init_and_update_refuse_a_folder_they_did_not_create() {
    let dir = tempdir();
    let (model, _, _) = arith_fixture(dir.path());
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    let out = stapo_bin()
        .args(["init", "--config"])
        .arg(model.join("config.json"))
        .arg("--out")
        .arg(&model)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--force") && err.contains("model.safetensors"), "{err}");
    assert_eq!(
        std::fs::read(model.join("model.safetensors")).unwrap(),
        weights,
        "init overwrote the weights"
    );
    // The same folder spelt another way is still --model.
    let alias = dir.path().join("model/../model");
    let out = stapo_bin()
        .args(["update", "--rollouts", "none.jsonl", "--model"])
        .arg(&model)
        .arg("--out")
        .arg(&alias)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is the --model folder"), "{err}");
    // With --force, init replaces the folder (a new, empty folder needs nothing).
    let fresh = dir.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    for (target, force) in [(&fresh, false), (&model, true)] {
        let mut c = stapo_bin();
        c.args(["init", "--config"]).arg(model.join("config.json")).arg("--out").arg(target);
        if force {
            c.arg("--force");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    assert_ne!(std::fs::read(model.join("model.safetensors")).unwrap(), weights);
}

/// a run folder carries a marker; a run refuses a non-empty folder that is not a
/// stapo run, and leaves the user's files as they were.
#[test]
fn nothing_lost_run_refuses_a_foreign_non_empty_folder() {
    let dir = tempdir();
    let (model, train, _) = arith_fixture(dir.path());
    let user = dir.path().join("my-notes");
    std::fs::create_dir(&user).unwrap();
    std::fs::write(user.join("thesis.tex"), "precious").unwrap();
    std::fs::write(user.join("metrics.jsonl"), "{\"mine\": 1}\n").unwrap();
    let e = Trainer::new(config(model.clone(), train.clone()), &user).err().unwrap().to_string();
    assert!(e.contains("is not empty and is not a stapo run folder") && e.contains("thesis.tex"), "{e}");
    let mut names: Vec<String> =
        std::fs::read_dir(&user).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    names.sort();
    assert_eq!(names, ["metrics.jsonl", "thesis.tex"]);
    assert_eq!(std::fs::read_to_string(user.join("metrics.jsonl")).unwrap(), "{\"mine\": 1}\n");
    // A new folder and an empty one become runs, with the marker.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for d in [dir.path().join("new"), empty] {
        drop(Trainer::new(config(model.clone(), train.clone()), &d).unwrap());
        assert!(d.join(guard::folder::RUN_MARKER).is_file() && guard::folder::is_run_folder(&d));
    }
}

/// a run folder is locked while a trainer lives in it; a second one (a resume of
/// a run still going) gets an error naming the holder's pid; the lock goes with the trainer.
#[test]
fn nothing_lost_second_process_on_a_run_folder_is_refused() {
    let dir = tempdir();
    let (mut a, _) = trainer_with(dir.path(), serde_json::json!({}));
    let run = dir.path().join("run");
    a.step(&a.default_plan(), None, None).unwrap();
    a.checkpoint().unwrap();
    let e = Trainer::resume(&run).err().unwrap().to_string();
    let pid = std::process::id();
    assert!(e.contains(&format!("process {pid} is training in it")) && e.contains(".stapo-lock"), "{e}");
    // Another process (the CLI) is refused too, by the kernel's flock.
    std::fs::write(run.join("script.rhai"), "train(#{}, 1);").unwrap();
    // --apply-changes: past the config comparison to the lock, which comes before any change.
    let out = stapo_bin().args(["run", "--quiet", "--apply-changes", "--resume"]).arg(&run).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&format!("process {pid}")), "{err}");
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 1, "the refused resume touched metrics.jsonl");
    drop(a);
    let b = Trainer::resume(&run).unwrap();
    assert_eq!(b.step_count(), 1);
}

/// temporary checkpoint folders a killed process left are removed at resume,
/// reported with the next step's warnings.
#[test]
fn nothing_lost_leftover_tmp_checkpoints_are_removed_at_resume() {
    let dir = tempdir();
    let (mut a, _) = trainer_with(dir.path(), serde_json::json!({}));
    let run = dir.path().join("run");
    a.step(&a.default_plan(), None, None).unwrap();
    a.checkpoint().unwrap();
    drop(a);
    let ckpts = run.join("checkpoints");
    let left = ckpts.join(".step-000002.tmp-4242");
    std::fs::create_dir(&left).unwrap();
    std::fs::write(left.join("model.safetensors"), vec![0u8; 1000]).unwrap();
    std::fs::write(ckpts.join(".latest.tmp-4242"), "step-000002").unwrap();
    let mut b = Trainer::resume(&run).unwrap();
    assert!(!left.exists() && !ckpts.join(".latest.tmp-4242").exists());
    assert!(ckpts.join("step-000001").is_dir());
    let m = b.step(&b.default_plan(), None, None).unwrap();
    assert!(m.update.warnings.iter().any(|w| w.contains(".step-000002.tmp-4242")), "{:?}", m.update.warnings);
}

/// A tiny model and prompts for the generation bounds (max_position_embeddings 128).
fn tiny() -> model::Qwen3 {
    model::init(&tiny_config(true), 1, 0.2, DType::F32, &Device::Cpu).unwrap()
}

fn gen(m: &model::Qwen3, prompts: &[Vec<u32>], p: &SamplingParams) -> String {
    let decode = |_: &[u32]| String::new();
    rollout::generate_with(m, prompts, p, 0, &decode, &GenerateOptions::default()).unwrap_err().to_string()
}

/// `max_tokens: 10^9` and prompt lengths are bounded by max_position_embeddings
/// before anything is allocated, and a batch whose KV cache exceeds the machine's memory
/// is refused up front.
#[test]
fn crashes_max_tokens_and_memory_are_bounded_before_allocation() {
    let m = tiny();
    let p = SamplingParams { max_new_tokens: 1_000_000_000, ..SamplingParams::greedy(1) };
    let e = gen(&m, &[vec![2, 3]], &p);
    assert!(e.contains("`max_tokens`") && e.contains("1000000000") && e.contains("128"), "{e}");
    let p = SamplingParams::greedy(100);
    let e = gen(&m, &[vec![2; 10], vec![2; 40]], &p);
    assert!(e.contains("prompt 1 (40 tokens) plus max_tokens (100)") && e.contains("at most 88"), "{e}");
    // One sequence of 10^12 positions x 512 bytes of KV cache: more than any machine.
    let mut cfg = tiny_config(true);
    cfg.max_position_embeddings = 4_000_000_000_000;
    let long = model::init(&cfg, 1, 0.2, DType::F32, &Device::Cpu).unwrap();
    let e = gen(&long, &[vec![2; 20]], &SamplingParams::greedy(1_000_000_000_000));
    assert!(e.contains("more than this machine's") && e.contains("GB"), "{e}");
}

/// a prompt longer than max_position_embeddings is reported (not trained on).
#[test]
fn nothing_silent_prompt_longer_than_the_positions_is_reported() {
    let e = gen(&tiny(), &[vec![2; 5], vec![2; 130]], &SamplingParams::greedy(4));
    assert!(
        e.contains("prompt 1 has 130 tokens, more than the model's max_position_embeddings (128)"),
        "{e}"
    );
}

/// a 10 MB data line is a bad line named by file:line, never a prompt.
#[test]
fn crashes_ten_megabyte_data_line_is_rejected_with_its_line() {
    use stapo::data::{BadLinePolicy, Dataset, DatasetOptions};
    let dir = tempdir();
    let path = dir.path().join("d.jsonl");
    let huge = "7+".repeat(5_000_000);
    std::fs::write(
        &path,
        format!(
            "{{\"problem\": \"1+1\", \"answer\": \"2\"}}\n{{\"problem\": \"{huge}1\", \"answer\": \"1\"}}\n"
        ),
    )
    .unwrap();
    let (ds, warns) = Dataset::load(&path, &DatasetOptions::default()).unwrap();
    assert_eq!(ds.len(), 1);
    assert!(
        warns.len() == 1
            && warns[0].contains(&format!("{}:2", path.display()))
            && warns[0].contains("10.0 MB"),
        "{warns:?}"
    );
    let strict = DatasetOptions { bad_lines: BadLinePolicy::Reject, ..Default::default() };
    let e = Dataset::load(&path, &strict).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}:2:", path.display())), "{e}");
}

/// Writes `cfg` and weights `tensors` as a model folder.
fn write_folder(dir: &Path, cfg: &serde_json::Value, tensors: &HashMap<String, Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    candle_core::safetensors::save(tensors, dir.join("model.safetensors")).unwrap();
}

fn tiny_folder_parts() -> (serde_json::Value, HashMap<String, Tensor>) {
    let m = tiny();
    let tensors = m.params().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
    (m.config().to_hf_json(), tensors)
}

/// layer count against the weights, unused tensors (an error, or a warning with
/// --allow-unused), special token ids in range, shard paths confined to the folder.
#[test]
fn model_folder_checks_at_load() {
    let dir = tempdir();
    let load = |d: &Path| model::load(d, DType::F32, &Device::Cpu).map(|_| ()).map_err(|e| e.to_string());
    let (cfg, tensors) = tiny_folder_parts();
    // The config declares fewer layers than the weights hold.
    let mut fewer = cfg.clone();
    fewer["num_hidden_layers"] = 1.into();
    write_folder(&dir.path().join("fewer"), &fewer, &tensors);
    let e = load(&dir.path().join("fewer")).unwrap_err();
    assert!(
        e.contains("`num_hidden_layers`: declares 1 decoder layers but the weights") && e.contains("hold 2"),
        "{e}"
    );
    // A tensor the model does not use.
    let mut extra = tensors.clone();
    extra.insert("model.mystery.weight".into(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap());
    write_folder(&dir.path().join("extra"), &cfg, &extra);
    let e = load(&dir.path().join("extra")).unwrap_err();
    assert!(
        e.contains("1 tensor(s)") && e.contains("model.mystery.weight") && e.contains("--allow-unused"),
        "{e}"
    );
    guard::set_allow_unused_tensors(true);
    let allowed = load(&dir.path().join("extra"));
    guard::set_allow_unused_tensors(false);
    allowed.unwrap();
    assert!(guard::take_notes().iter().any(|n| n.contains("model.mystery.weight")));
    // eos outside the vocabulary (97).
    let mut eos = cfg.clone();
    eos["eos_token_id"] = 500.into();
    write_folder(&dir.path().join("eos"), &eos, &tensors);
    let e = load(&dir.path().join("eos")).unwrap_err();
    assert!(e.contains("`eos_token_id`: token id 500 is outside the vocabulary (vocab_size 97)"), "{e}");
    // A shard index entry that leaves the folder.
    let sharded = dir.path().join("sharded");
    write_folder(&sharded, &cfg, &tensors);
    std::fs::rename(sharded.join("model.safetensors"), dir.path().join("outside.safetensors")).unwrap();
    let map: serde_json::Map<String, serde_json::Value> =
        tensors.keys().map(|k| (k.clone(), "../outside.safetensors".into())).collect();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    let e = load(&sharded).unwrap_err();
    assert!(e.contains("\"../outside.safetensors\" leaves the model folder"), "{e}");
}

/// a model/tokenizer vocabulary mismatch is an error naming both sizes.
#[test]
fn errors_model_and_tokenizer_vocabularies_must_match() {
    let dir = tempdir();
    let (model_dir, _, _) = arith_fixture(dir.path());
    let tok = stapo::data::Tokenizer::from_file(model_dir.join("tokenizer.json")).unwrap();
    let small = tiny(); // vocab 97, fewer than the fixture tokenizer's ids
    assert!(tok.vocab_size() > 97);
    let e =
        rollout::Generator::new(&small, &tok, &stapo::data::PromptTemplate::raw()).err().unwrap().to_string();
    assert!(
        e.contains("vocab_size 97") && e.contains("tokenizer.json") && e.contains("another model"),
        "{e}"
    );
}

/// a write that fails (a full disk; here a path under a file, since this
/// container's /dev/full accepts writes) names the file that could not be written.
#[test]
fn errors_disk_full_names_the_path() {
    let dir = tempdir();
    std::fs::write(dir.path().join("file"), "x").unwrap();
    let target = dir.path().join("file/optimizer.safetensors");
    let t: HashMap<String, Tensor> =
        [("w".to_string(), Tensor::zeros(1024, DType::F32, &Device::Cpu).unwrap())].into();
    let e = model::checkpoint::save_safetensors(&t, &target).unwrap_err().to_string();
    assert!(e.contains(&target.display().to_string()) && e.contains("cannot write"), "{e}");
}

/// an out-of-vocabulary token id in `stapo update`'s rollouts is an error naming
/// the file, sample and token, not a candle backtrace.
#[test]
fn errors_update_names_an_out_of_vocab_token() {
    let dir = tempdir();
    let (model_dir, train, _) = arith_fixture(dir.path());
    let mut t = Trainer::new(config(model_dir.clone(), train), &dir.path().join("run")).unwrap();
    t.step(&t.default_plan(), None, None).unwrap();
    let mut batch = t.last_rollout().unwrap().clone();
    drop(t);
    batch.samples[1].response_ids[0] = 99_999;
    let rollouts = dir.path().join("r.jsonl");
    batch.save_jsonl(&rollouts).unwrap();
    let out = stapo_bin()
        .args(["update", "--model"])
        .arg(&model_dir)
        .arg("--rollouts")
        .arg(&rollouts)
        .arg("--out")
        .arg(dir.path().join("m2"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("sample 1: `response_ids`[0] is token 99999")
            && !err.contains("backtrace"),
        "{err}"
    );
}

/// a UTF-8 byte-order mark is not data; bytes that are not UTF-8 are named by
/// line (and byte).
#[test]
fn errors_bom_and_non_utf8_data_lines() {
    use stapo::data::{Dataset, DatasetOptions};
    let dir = tempdir();
    let bom = dir.path().join("bom.jsonl");
    std::fs::write(&bom, "\u{feff}{\"problem\": \"1+1\", \"answer\": \"2\"}\n").unwrap();
    let (ds, warns) = Dataset::load(&bom, &DatasetOptions::default()).unwrap();
    assert_eq!((ds.len(), warns.len()), (1, 0), "{warns:?}");
    let latin1 = dir.path().join("latin1.jsonl");
    let mut bytes = b"{\"problem\": \"1+1\", \"answer\": \"2\"}\n{\"problem\": \"caf".to_vec();
    bytes.extend([0xe9, b'"', b',', b' ']);
    bytes.extend(b"\"answer\": \"3\"}\n");
    std::fs::write(&latin1, bytes).unwrap();
    let e = Dataset::load(&latin1, &DatasetOptions::default()).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}:2:", latin1.display())) && e.contains("byte 17") && e.contains("UTF-8"),
        "{e}"
    );
}

/// The non-finite config check and `Config` agree: a config built in memory with an eos
/// outside the vocabulary is refused by `validate` too.
#[test]
fn model_folder_special_token_ids_validated_in_memory() {
    let mut c: Config = tiny_config(true);
    c.bos_token_id = Some(97);
    let e = c.validate("cfg").unwrap_err().to_string();
    assert!(e.contains("`bos_token_id`") && e.contains("97"), "{e}");
}
