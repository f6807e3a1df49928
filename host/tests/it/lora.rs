//! LoRA runs: the trainer updates the adapters alone (the base stays bit for bit),
//! rollouts sample a merged copy equal to the trained policy, two ranks train as one,
//! and a peft-format checkpoint resumes adapters and their optimizer state.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use stapo::data::PromptTemplate;
use stapo::model::{self, LoraConfig, Qwen3, TokenBatch};
use stapo::train::{LrSchedule, RunConfig, Trainer};

use crate::common::{on_ranks, tempdir};

/// The bundled tiny Qwen3 (about 43% right on held-out arithmetic, so groups have mixed
/// rewards), STAPO with S2T candidates, several mini- and micro-batches, rank-4 adapters.
fn config() -> RunConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    // Room for the multi-step answers (at 16 tokens every response was truncated: no reward).
    RunConfig::from_json(&serde_json::json!({
        "model": {"path": root.join("models/tiny-qwen3")},
        "data": {"train": root.join("data/arith/train.jsonl"), "prompts_per_step": 4,
                 "template": PromptTemplate::Raw { suffix: String::new() }},
        "rollout": {"sampling": {"n": 4, "max_tokens": 40}},
        "actor": {"preset": "stapo", "objective": {"mask": {"tau_p": 0.95}}, "mini_batch": 8, "micro_batch": 3,
                  "optim": {"lr": 2e-4, "schedule": LrSchedule::Constant { warmup_steps: 0 }},
                  "lora": LoraConfig { alpha: Some(8.0), ..LoraConfig::new(4) }},
        "checkpoint": {"save_every": 2},
        "seed": 11,
    }))
    .unwrap()
}

fn flat(m: &Qwen3, lora: bool) -> Vec<f32> {
    let ps = if lora { m.lora_params() } else { m.params() };
    ps.iter().flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max)
}

/// `steps` steps on `ranks` in-process ranks; every rank's adapters and base weights.
fn train_on(
    ranks: usize,
    cfg: &RunConfig,
    dir: &Path,
    steps: usize,
    resume: bool,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    on_ranks(ranks, cfg, dir, (steps, resume), |t| (flat(t.model(), true), flat(t.model(), false)))
        .into_iter()
        .map(|(_, w)| w)
        .collect()
}

/// Log-softmax of every position of a few rows under `m`.
fn logp(m: &Qwen3) -> Vec<f32> {
    let b = TokenBatch::left_padded(&[vec![5, 17, 3, 9, 30, 2], vec![8, 1, 44]], 0, &Device::Cpu).unwrap();
    let logits = m.forward(&b).unwrap().to_dtype(DType::F32).unwrap();
    model::ops::log_softmax(&logits).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// The update trains the adapters alone at lr x lr_scale; the rollout copy samples the
/// trained policy (merged weights: same log-probs); the checkpoint is a peft folder.
#[test]
fn lora_run_trains_adapters_and_samples_the_trained_policy() {
    let dir = tempdir();
    let cfg = config();
    let base = model::load(&cfg.model.path, DType::F32, &Device::Cpu).unwrap();
    let mut t = Trainer::new(cfg.clone(), &dir.path().join("run")).unwrap();
    assert!(t.model().base_frozen());
    assert!(!t.sampling_model().has_lora(), "rollouts sample merged weights");
    let start = flat(t.model(), true);
    for _ in 0..2 {
        let m = t.step(&t.default_plan(), None, None).unwrap();
        assert!(m.update.kept_tokens > 0 && m.update.grad_norm > 0.0, "no gradient: {:?}", m.update);
    }
    assert_eq!(flat(t.model(), false), flat(&base, false), "the frozen base moved");
    let moved = max_diff(&start, &flat(t.model(), true));
    assert!(moved > 1e-4, "the adapters did not train ({moved})");
    assert_ne!(logp(t.model()), logp(&base), "the policy did not change");
    // The merged rollout copy is the trained policy.
    let (policy, sampled) = (logp(t.model()), logp(t.sampling_model()));
    let d = max_diff(&policy, &sampled);
    assert!(d < 1e-4, "rollout copy log-probs differ from the policy's by {d}");
    let ck = dir.path().join("run/checkpoints/step-000002");
    for f in ["adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "tokenizer.json"] {
        assert!(ck.join(f).is_file(), "missing {f}");
    }
    assert!(!ck.join("model.safetensors").exists(), "a LoRA checkpoint holds the adapters only");
    // Loadable on its own (the base named in adapter_config.json): the trained policy.
    let loaded = model::load(&ck, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(logp(&loaded), policy);
    // The optimizer state covers the adapters alone.
    let opt = candle_core::safetensors::load(ck.join("optimizer.safetensors"), &Device::Cpu).unwrap();
    assert!(opt.keys().all(|k| k.contains("lora_")), "{:?}", opt.keys().take(3).collect::<Vec<_>>());

    // A KL penalty's reference is the frozen base under the adapters (shared, not reloaded):
    // the run trains with it, and the base it shares stays the base.
    let mut kl = cfg.clone();
    kl.actor.objective.kl = Some(stapo::algo::KlConfig { kind: stapo::algo::KlKind::K3, beta: 0.5 });
    let mut t = Trainer::new(kl, &dir.path().join("run-kl")).unwrap();
    for _ in 0..2 {
        let m = t.step(&t.default_plan(), None, None).unwrap();
        assert!(m.update.loss.is_finite() && m.update.grad_norm > 0.0, "{:?}", m.update);
    }
    assert_eq!(flat(t.model(), false), flat(&base, false), "the shared base moved");
}

/// Two ranks (threads) train the same adapters as one process, and the two-rank
/// checkpoint resumes on one rank with the adapters' optimizer state: step 3 as before.
#[test]
fn lora_two_ranks_train_as_one_and_resume() {
    let dir = tempdir();
    let cfg = config();
    let one = train_on(1, &cfg, &dir.path().join("one"), 3, false);
    let two_dir = dir.path().join("two");
    let two = train_on(2, &cfg, &two_dir, 3, false);
    assert_eq!(two[0], two[1], "ranks diverged");
    let d = max_diff(&one[0].0, &two[0].0);
    assert!(d <= 2e-5, "adapters differ by {d}");
    assert_eq!(one[0].1, two[0].1, "base weights differ");
    // The adapters learned (else the equalities would be vacuous).
    let fresh = Trainer::new(cfg.clone(), &dir.path().join("fresh")).unwrap();
    let moved = max_diff(&flat(fresh.model(), true), &one[0].0);
    assert!(moved > 1e-4, "no learning ({moved})");
    let resumed = train_on(1, &cfg, &two_dir, 1, true);
    let d = max_diff(&one[0].0, &resumed[0].0);
    assert!(d <= 2e-5, "resumed: adapters differ by {d}");
    // A checkpoint of other adapters is refused by name.
    let mut other = cfg.clone();
    other.actor.lora = Some(LoraConfig::new(2));
    std::fs::write(two_dir.join("run_config.json"), serde_json::to_string(&other).unwrap()).unwrap();
    let err = Trainer::resume(&two_dir).err().unwrap().to_string();
    assert!(err.contains("lora"), "{err}");
}

/// An adapter folder written by peft itself (`PeftModel.save_pretrained`, peft's own
/// tensor names and config; `base_model_name_or_path` relative to the folder) loads
/// here through `model::load` and gives PeftModel's logits. Fixture made once by hand
/// (tests/fixtures/README.md); the adapter's B is random, so it moves the logits.
#[test]
fn peft_saved_adapter_gives_peft_logits() {
    #[derive(serde::Deserialize)]
    struct Expected {
        ids: Vec<u32>,
        logits: Vec<Vec<f64>>,
        max_shift_from_base: f64,
    }
    let fx = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let exp: Expected =
        serde_json::from_str(&std::fs::read_to_string(fx.join("peft-expected.json")).unwrap()).unwrap();
    assert!(exp.max_shift_from_base > 1e-2, "the fixture's adapter must move the logits");
    let logits_of = |m: &Qwen3| -> Vec<Vec<f32>> {
        let batch = TokenBatch::left_padded(std::slice::from_ref(&exp.ids), 0, &Device::Cpu).unwrap();
        let h = m.forward_hidden(&batch, model::Grad::Off).unwrap();
        m.lm_head(&h, model::Grad::Off).unwrap().squeeze(0).unwrap().to_vec2::<f32>().unwrap()
    };
    let max_diff = |a: &[Vec<f32>]| -> f64 {
        a.iter()
            .flatten()
            .zip(exp.logits.iter().flatten())
            .map(|(x, y)| (*x as f64 - y).abs())
            .fold(0.0, f64::max)
    };
    let m = model::load(&fx.join("peft-tiny-lora"), DType::F32, &Device::Cpu).unwrap();
    assert!(m.base_frozen());
    let d = max_diff(&logits_of(&m));
    assert!(d < 1e-4, "peft adapter: max |logit - PeftModel's| = {d}");
    // The base alone is off by the adapter's shift: the comparison can tell them apart.
    let base = model::load(&fx.join("hf-tiny-tied"), DType::F32, &Device::Cpu).unwrap();
    assert!(max_diff(&logits_of(&base)) > 1e-2);
    // Written back by stapo: the same tensor names, shapes and values as peft wrote, and a
    // config peft reads the same way (r, alpha, targets).
    let out = tempdir();
    let lora = m.lora_config().unwrap().clone();
    model::peft::save_adapter(&m, &lora, &out.path().join("a"), "../hf-tiny-tied", None).unwrap();
    let read =
        |d: &Path| candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let (ours, theirs) = (read(&out.path().join("a")), read(&fx.join("peft-tiny-lora")));
    let mut names: Vec<_> = ours.keys().collect();
    names.sort();
    let mut want: Vec<_> = theirs.keys().collect();
    want.sort();
    assert_eq!(names, want);
    for (k, t) in &ours {
        let d = (t - &theirs[k]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{k}");
    }
    let cfg = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap()).unwrap()
    };
    let (c, w) = (cfg(&out.path().join("a")), cfg(&fx.join("peft-tiny-lora")));
    for key in ["r", "lora_alpha", "peft_type", "use_rslora", "use_dora"] {
        assert_eq!(c[key], w[key], "{key}");
    }
    let set = |v: &serde_json::Value| {
        let mut t: Vec<String> =
            v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
        t.sort();
        t
    };
    assert_eq!(set(&c["target_modules"]), set(&w["target_modules"]));
}
