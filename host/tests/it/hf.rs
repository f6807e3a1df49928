//! Our Qwen3 against outputs of Hugging Face transformers (4.51.3, eager
//! attention) on folders written by `save_pretrained`: a tied f32 model and an
//! untied bf16 model sharded into three files. See tests/fixtures/README.md.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use stapo::model::{self, Grad, KvCache, TokenBatch};

#[derive(Deserialize)]
struct Single {
    ids: Vec<u32>,
    logprobs: Vec<f64>,
    entropies: Vec<f64>,
    logits_last: Vec<f64>,
}

#[derive(Deserialize)]
struct Padded {
    ids: Vec<Vec<u32>>,
    attention_mask: Vec<Vec<u8>>,
    position_ids: Vec<Vec<u32>>,
    logits: Vec<Vec<(usize, Vec<f64>)>>,
}

#[derive(Deserialize)]
struct Greedy {
    prompt: Vec<u32>,
    new_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Expected {
    single: Vec<Single>,
    padded_batch: Padded,
    greedy: Greedy,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixtures().join("hf-expected.json")).unwrap();
    let mut all: std::collections::HashMap<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    serde_json::from_value(all.remove(name).unwrap()).unwrap()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

fn check(name: &str) {
    let m = model::load(&fixtures().join(name), DType::F32, &Device::Cpu).unwrap();
    let exp = expected(name);
    for s in &exp.single {
        let batch = TokenBatch::left_padded(std::slice::from_ref(&s.ids), 0, &Device::Cpu).unwrap();
        let logits =
            m.lm_head(&m.forward_hidden(&batch, Grad::Off).unwrap(), Grad::Off).unwrap().squeeze(0).unwrap();
        let n = s.ids.len();
        let targets = Tensor::new(&s.ids[1..], &Device::Cpu).unwrap();
        let (lp, _) = model::logprob_entropy(&logits.narrow(0, 0, n - 1).unwrap(), &targets).unwrap();
        let (_, h) =
            model::logprob_entropy(&logits, &Tensor::zeros(n, DType::U32, &Device::Cpu).unwrap()).unwrap();
        let d_lp = max_diff(&lp.to_vec1::<f32>().unwrap(), &s.logprobs);
        let d_h = max_diff(&h.to_vec1::<f32>().unwrap(), &s.entropies);
        let d_last = max_diff(&logits.get(n - 1).unwrap().to_vec1::<f32>().unwrap(), &s.logits_last);
        assert!(
            d_lp < 1e-4 && d_h < 1e-4 && d_last < 1e-4,
            "{name} len {n}: logprob {d_lp}, entropy {d_h}, logits {d_last}"
        );
    }
    // Left-padded batch: our mask → positions must equal HF's, and the logits too.
    let p = &exp.padded_batch;
    let flat: Vec<u32> = p.ids.iter().flatten().copied().collect();
    let batch = TokenBatch::from_parts(flat, p.attention_mask.clone(), &Device::Cpu).unwrap();
    assert_eq!(batch.positions.to_vec2::<u32>().unwrap(), p.position_ids);
    let logits = m.lm_head(&m.forward_hidden(&batch, Grad::Off).unwrap(), Grad::Off).unwrap();
    for (r, row) in p.logits.iter().enumerate() {
        for (t, want) in row {
            let got = logits.get(r).unwrap().get(*t).unwrap().to_vec1::<f32>().unwrap();
            let d = max_diff(&got, want);
            assert!(d < 1e-4, "{name} padded row {r} position {t}: {d}");
        }
    }
    // Greedy decoding with the KV cache reproduces HF's generate().
    let g = &exp.greedy;
    let mut cache = KvCache::new(&m, 1, g.prompt.len() + g.new_ids.len()).unwrap();
    let mut logits = m
        .decode(
            &Tensor::new(g.prompt.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap(),
            None,
            &mut cache,
        )
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..g.new_ids.len() {
        let next = logits.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(next);
        logits = m.decode(&Tensor::new(&[[next]], &Device::Cpu).unwrap(), None, &mut cache).unwrap();
    }
    assert_eq!(out, g.new_ids, "{name}: greedy continuation");
}

#[test]
fn tied_f32_folder_matches_transformers() {
    check("hf-tiny-tied");
}

#[test]
fn untied_bf16_sharded_folder_matches_transformers() {
    check("hf-tiny-untied-bf16-sharded");
}
