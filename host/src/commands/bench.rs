//! `stapo bench`: times the pieces of a training step and generation for a
//! model shape given on the command line, with achieved GFLOP/s and peak memory.

use std::time::Instant;

use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use stapo::model::{self, Config, Grad, TokenBatch};

use super::DeviceArgs;

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    /// Forward pass over a batch (hidden states and logits), no graph.
    Forward,
    /// Everything.
    All,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// What to time.
    #[arg(value_enum, default_value = "all")]
    pub what: What,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// A Qwen3 shape; defaults are the 16.8M benchmark model.
#[derive(Args, Debug, Clone)]
pub struct ShapeArgs {
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long, default_value_t = 1536)]
    pub intermediate: usize,
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
    /// Untie the LM head from the embedding.
    #[arg(long)]
    pub untied: bool,
}

impl ShapeArgs {
    pub fn config(&self) -> anyhow::Result<Config> {
        let v = serde_json::json!({
            "vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "tie_word_embeddings": !self.untied, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        });
        Ok(Config::from_json_str(&v.to_string(), "bench shape")?)
    }
}

/// Matmul FLOPs of one forward pass over `tokens` tokens of `seq` length
/// (projections, attention scores and context, LM head).
pub fn forward_flops(cfg: &Config, batch: usize, seq: usize) -> f64 {
    let t = (batch * seq) as f64;
    let (h, i, d) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.head_dim as f64);
    let (nq, nkv) = (cfg.num_attention_heads as f64, cfg.num_key_value_heads as f64);
    let proj = 2.0 * t * (h * nq * d * 2.0 + h * nkv * d * 2.0 + 3.0 * h * i);
    let attn = 2.0 * 2.0 * batch as f64 * nq * (seq * seq) as f64 * d;
    let head = 2.0 * t * h * cfg.vocab_size as f64;
    cfg.num_hidden_layers as f64 * (proj + attn) + head
}

/// Peak resident memory of this process, in bytes (Linux `VmHWM`).
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Runs `f` once to warm up, then `reps` times; returns the mean seconds.
pub fn time<F: FnMut() -> anyhow::Result<()>>(reps: usize, mut f: F) -> anyhow::Result<f64> {
    f()?;
    let start = Instant::now();
    for _ in 0..reps.max(1) {
        f()?;
    }
    Ok(start.elapsed().as_secs_f64() / reps.max(1) as f64)
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let (device, dtype) = a.device.resolve()?;
    let cfg = a.shape.config()?;
    println!(
        "shape: {:.1}M params, {} layers, hidden {}, heads {}/{}, head_dim {}, intermediate {}, vocab {}; batch {} x {}; {:?} on {:?}",
        cfg.num_params() as f64 / 1e6,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        a.batch,
        a.seq,
        dtype,
        device_name(&device)
    );
    let m = model::init(&cfg, 0, 0.02, dtype, &device)?;
    let rows: Vec<Vec<u32>> =
        (0..a.batch).map(|b| (0..a.seq).map(|t| ((b * 7919 + t * 104_729) % cfg.vocab_size) as u32).collect()).collect();
    let batch = TokenBatch::left_padded(&rows, 0, &device)?;
    if matches!(a.what, What::Forward | What::All) {
        let secs = time(a.reps, || {
            let h = m.forward_hidden(&batch, Grad::Off)?;
            let logits = m.lm_head(&h, Grad::Off)?;
            logits.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
            Ok(())
        })?;
        report("forward (no grad)", secs, Some(forward_flops(&cfg, a.batch, a.seq)), a.batch * a.seq);
    }
    if let Some(p) = peak_rss() {
        println!("peak memory (RSS): {:.2} GB", p as f64 / 1e9);
    }
    Ok(())
}

/// Prints one timing line: seconds, tokens/s and GFLOP/s when FLOPs are known.
pub fn report(name: &str, secs: f64, flops: Option<f64>, tokens: usize) {
    let gf = flops.map(|f| format!("  {:>7.1} GFLOP/s", f / secs / 1e9)).unwrap_or_default();
    println!("{name:<28} {:>9.1} ms  {:>9.0} tok/s{gf}", secs * 1e3, tokens as f64 / secs);
}

fn device_name(d: &Device) -> &'static str {
    if d.is_cuda() {
        "cuda"
    } else {
        "cpu"
    }
}
