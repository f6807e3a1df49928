//! Errors that name the cause: a NaN weight names its tensor (and `stapo score` fails
//! instead of printing NaN), a prompt that cannot fit the model is named by file:line when
//! the run starts, a reward beyond f32 names its sample, hints give the config tree's
//! paths. (An adapter deeper than its base: `model::peft`'s unit tests.)

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use stapo::model;
use stapo::rollout::RolloutBatch;
use stapo::train::{RunConfig, Trainer};

use crate::common::{arith_fixture, tempdir};

fn run_config(model: &Path, train: &Path, extra: serde_json::Value) -> RunConfig {
    let mut v = serde_json::json!({
        "model": {"path": model},
        "data": {"train": train, "prompts_per_step": 2},
        "rollout": {"sampling": {"n": 2, "max_tokens": 8}},
        "actor": {"preset": "grpo", "optim": {"lr": 1e-3}},
    });
    if let (Some(a), serde_json::Value::Object(b)) = (v.as_object_mut(), extra) {
        a.extend(b);
    }
    RunConfig::from_json(&v).unwrap()
}

#[test]
fn errors_name_the_cause_nan_weight_at_load_names_the_tensor_and_score_fails() {
    let dir = tempdir();
    let (model_dir, _, _) = arith_fixture(dir.path());
    let file = model_dir.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    let t = &tensors[name];
    let mut vals = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    vals[5] = f32::NAN;
    let bad = Tensor::from_vec(vals, t.dims(), &Device::Cpu).unwrap();
    tensors.insert(name.to_string(), bad);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let e = model::load(&model_dir, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains(name) && e.contains("1 NaN") && e.contains("flat index 5"), "{e}");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["score", "--ids", "3,4,5", "--model"])
        .arg(&model_dir)
        .output()
        .unwrap();
    assert!(!o.status.success(), "score printed {}", String::from_utf8_lossy(&o.stdout));
    assert!(String::from_utf8_lossy(&o.stderr).contains(name));
}

#[test]
fn errors_name_the_cause_a_prompt_longer_than_the_positions_is_found_at_load() {
    let dir = tempdir();
    let (model, _, _) = arith_fixture(dir.path());
    // The tiny model has 128 positions; line 3's prompt needs more with 8 response tokens.
    let long = "1+".repeat(200) + "1";
    let lines = [
        r#"{"problem": "Compute 1+1.", "answer": "2"}"#.to_string(),
        r#"{"problem": "Compute 2+2.", "answer": "4"}"#.to_string(),
        format!(r#"{{"problem": "Compute {long}.", "answer": "201"}}"#),
    ];
    let train = dir.path().join("long.jsonl");
    std::fs::write(&train, lines.join("\n")).unwrap();
    let e = Trainer::new(run_config(&model, &train, serde_json::json!({})), &dir.path().join("run"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&format!("{}:3", train.display())), "{e}");
    assert!(
        e.contains("max_position_embeddings (128)") && e.contains("rollout.sampling.max_tokens = 8"),
        "{e}"
    );
}

#[test]
fn errors_name_the_cause_a_reward_beyond_f32_names_its_sample() {
    let dir = tempdir();
    let path = dir.path().join("rollouts.jsonl");
    let prompt = r#"{"kind":"prompt","index":0,"id":"a","text":"1+1","answer":"2"}"#;
    let sample = |reward: &str| {
        format!(
            r#"{{"kind":"sample","group":0,"prompt_index":0,"sample_index":0,"prompt_ids":[1],"response_ids":[2],"logprobs":[-1.0],"old_logprobs":[-1.0],"entropies":[0.5],"text":"2","finish":"eos","truncated":false,"reward":{reward}}}"#
        )
    };
    std::fs::write(&path, format!("{prompt}\n{}\n{}\n", sample("1.0"), sample("1e39"))).unwrap();
    let e = RolloutBatch::load_jsonl(&path).err().unwrap().to_string();
    assert!(e.contains("rollouts.jsonl:3") && e.contains("sample 1") && e.contains("(1e+39)"), "{e}");
}

#[test]
fn errors_name_the_cause_hints_give_the_config_tree_paths() {
    let dir = tempdir();
    let (model, train, _) = arith_fixture(dir.path());
    let cfg = run_config(&model, &train, serde_json::json!({}));
    let mut t = Trainer::new(cfg, &dir.path().join("run")).unwrap();
    let mut plan = t.default_plan();
    plan.lr = 1e3; // times the default weight decay 0.01: 10
    let e = t.step(&plan, None, None).err().unwrap().to_string();
    assert!(e.contains("actor.optim.lr") && e.contains("actor.optim.weight_decay"), "{e}");
    assert!(!e.contains("adamw.weight_decay"), "{e}");
}
