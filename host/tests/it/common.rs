//! Fixtures shared by the integration tests: tiny random models built in milliseconds,
//! and trainers run on in-process ranks.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use stapo::dist::{Comm, Local, ThreadComm};
use stapo::model::{self, Config, Qwen3};
use stapo::train::{RunConfig, StepMetrics, Trainer};

/// `steps` steps of `cfg` on `ranks` in-process ranks (threads sharing a
/// `ThreadComm` group; one rank is `Local`), from scratch into `dir` or
/// resumed from it; `done` reads each rank's trainer after its last step.
/// Returns every rank's step metrics and result, rank 0 first.
pub fn on_ranks<T: Send>(
    ranks: usize,
    cfg: &RunConfig,
    dir: &Path,
    (steps, resume): (usize, bool),
    done: impl Fn(&Trainer) -> T + Sync,
) -> Vec<(Vec<StepMetrics>, T)> {
    let comms: Vec<Arc<dyn Comm>> = if ranks == 1 {
        vec![Arc::new(Local)]
    } else {
        ThreadComm::group(ranks).into_iter().map(|c| Arc::new(c) as Arc<dyn Comm>).collect()
    };
    let done = &done;
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let mut t = if resume {
                        Trainer::resume_on(c, dir).unwrap()
                    } else {
                        Trainer::new_on(c, cfg.clone(), dir).unwrap()
                    };
                    let metrics =
                        (0..steps).map(|_| t.step(&t.default_plan(), None, None).unwrap()).collect();
                    (metrics, done(&t))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A 2-layer, 64-wide Qwen3 configuration.
pub fn tiny_config(tied: bool) -> Config {
    let text = format!(
        r#"{{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": {tied},
            "eos_token_id": 1, "torch_dtype": "float32"}}"#
    );
    Config::from_json_str(&text, "tiny").expect("tiny config")
}

/// A random tiny model; `std` large enough that logits are far from uniform.
pub fn tiny_model(tied: bool, dtype: DType, seed: u64) -> Qwen3 {
    model::init(&tiny_config(tied), seed, 0.2, dtype, &Device::Cpu).expect("init")
}

/// Largest absolute difference between two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// A fresh temporary directory removed on drop.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// A tiny model folder for the arithmetic task: a BPE tokenizer trained on a
/// few generated problems, a random 2-layer Qwen3 sized to it, and train/test
/// JSONL files. Returns (model dir, train file, test file).
pub fn arith_fixture(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use stapo::data::{task, PromptTemplate, Prompter};
    let (train, test) = task::generate_split(200, 20, 7, &task::TaskConfig::default()).unwrap();
    let tpl = Prompter::standalone(&PromptTemplate::raw()).unwrap();
    let tok = task::train_tokenizer(
        task::tokenizer_corpus(&train, |p| tpl.render(&p.into()).unwrap()),
        &task::TokenizerConfig::default(),
    )
    .unwrap();
    let model_dir = dir.join("model");
    let mut cfg = tiny_config(true);
    cfg.vocab_size = tok.vocab_size();
    cfg.eos_token_id = tok.id_of("<|endoftext|>");
    let m = stapo::model::init(&cfg, 3, 0.2, DType::F32, &Device::Cpu).unwrap();
    stapo::model::save(&m, &model_dir, DType::F32, None).unwrap();
    task::save_tokenizer(&tok, &model_dir).unwrap();
    let (tr, te) = (dir.join("train.jsonl"), dir.join("test.jsonl"));
    task::write_jsonl(&tr, &train).unwrap();
    task::write_jsonl(&te, &test).unwrap();
    (model_dir, tr, te)
}

/// Every master weight of a trainer's model as f32 bits (for "unchanged" checks that
/// must see a flipped bit or a NaN); bf16 weights are widened, which is exact.
pub fn weight_bits(t: &stapo::train::Trainer) -> Vec<u32> {
    t.model()
        .params()
        .iter()
        .flat_map(|(_, v)| {
            v.as_tensor().flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
        })
        .map(f32::to_bits)
        .collect()
}
