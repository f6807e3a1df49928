//! What every `stapo bench` part shares: the command's arguments
//! ([`BenchArgs`]), FLOP counts, timing, peak memory, the report line and a
//! synthetic RL batch. `bench.rs` dispatches to the parts (`bench_lengths.rs`,
//! `bench_rollout.rs`, `bench_shard.rs`); all of them import this file, which
//! imports none of them.

use std::time::Instant;

use clap::{Args, ValueEnum};
use stapo::model::Config;
use stapo::train::Sequence;

use super::DeviceArgs;

/// Which part of the pipeline `stapo bench` times.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    /// Forward pass over a batch (hidden states and logits), no graph.
    Forward,
    /// The pieces of one RL update: old-policy forward, forward + loss,
    /// backward, optimizer, and the full `train::update` step.
    Train,
    /// Batched sampling with a KV cache.
    Generate,
    /// One rollout with forced lengths (`--lengths lognormal:LO:HI`): continuous
    /// batching over the paged cache against the static policy at equal cache memory;
    /// with `--steps S --partial off,on`, S steps' rollouts synchronous against partial.
    Rollout,
    /// candle CPU matmul for this shape's products in the layouts the step uses.
    Matmul,
    /// The large products of one update at this shape and batch (projections
    /// forward, `dx` and `dw`, the head) on each library of this build: the
    /// `gemm` crate, and the system's OpenBLAS with `--features blas`. Wall
    /// and CPU time, GFLOP/s, and the largest difference between them.
    Gemm,
    /// AdamW steps over this shape's parameter count (f32, CPU), ours against candle-nn's.
    Optimizer,
    /// Per-rank memory of full updates with the optimizer sharded (`--shard`), one
    /// process or every rank under `mpirun -np N`: optimizer bytes, peak RSS, seconds.
    Shard,
    /// Self-check of the CPU bf16 kernels on every path this CPU supports
    /// (AMX, AVX-512 BF16, AVX2, portable) against f64, with GFLOP/s and the
    /// roofline peaks; exits non-zero on a mismatch. No model is built.
    Kernels,
    /// Steps per hour of a training run on the bundled tiny model and arithmetic task,
    /// synchronous against one step off (`rollout.async`), on the same cores:
    /// `--steps` steps of `--prompts` prompts x `--samples` samples of at most
    /// `--max-new` tokens each, `--rounds` rounds of (synchronous, asynchronous).
    Async,
    /// Everything.
    All,
}

/// `--partial-kv`: `rollout.partial.kv` for the benchmark's partial steps.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartialKvArg {
    /// Prefilled again at the next step.
    Recompute,
    /// Kept in the pool across steps.
    Keep,
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
    /// Tokens per sequence; for `train`, a comma-separated list (1024,2048,...)
    /// prints one row per length: full update time, tokens/s, peak memory and
    /// the memory growth per token from the previous length.
    #[arg(long = "seq", value_delimiter = ',', default_value = "128")]
    pub seqs: Vec<usize>,
    /// Response tokens per sequence for `train` (the rest is prompt); default seq / 2.
    #[arg(long)]
    pub response: Option<usize>,
    /// Prompt tokens for `generate`.
    #[arg(long, default_value_t = 16)]
    pub prompt: usize,
    /// New tokens per sequence for `generate`.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Long-answer cases for `generate`: new tokens per sequence, comma-separated
    /// (e.g. 1024,4096), each timed once with its KV-cache size and peak memory.
    #[arg(long, value_delimiter = ',')]
    pub long: Vec<usize>,
    /// Activation checkpointing for `train`: auto, on or off (default:
    /// $STAPO_RECOMPUTE, else auto).
    #[arg(long)]
    pub recompute: Option<String>,
    /// Kernels: `fused` (the fused CPU kernels where they apply) or `composed`
    /// (candle ops on every device: the code CUDA and bf16 run; default:
    /// composed when $STAPO_NO_FUSED=1, else fused).
    #[arg(long)]
    pub kernels: Option<String>,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Untimed full updates before each length of the `--seq` table is timed
    /// (first-step costs: allocating the AdamW moments, faulting pages in).
    /// The peak memory then counts from what the warm-up left allocated, as
    /// in a long run.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// `train`: the `--seq` table (a fresh process per length, one full
    /// update per repetition, no pieces) even for one length.
    #[arg(long)]
    pub table: bool,
    /// Internal: run one length of the `--seq` table in this process and print
    /// it as one machine-readable row. The table runs each length in a fresh
    /// process, so that no length's peak memory depends on the lengths before
    /// it (freed memory that the allocator keeps would count).
    #[arg(long, hide = true)]
    pub table_row: bool,
    /// For `train`: response lengths drawn from `lognormal:LO:HI` (LO and HI the 2.5% and
    /// 97.5% quantiles, draws clamped to them; prompts of `--prompt` tokens, `--batch`
    /// responses): one full update with padded micro-batches against one with micro-batches
    /// cut by `--max-tokens-per-micro`, with their padding shares.
    #[arg(long)]
    pub lengths: Option<String>,
    /// With `--lengths`: the token budget of the budget path.
    #[arg(long, default_value_t = 16384)]
    pub max_tokens_per_micro: usize,
    /// With `--lengths`: sequences per micro-batch of the padded path (default: as many
    /// of the longest sequence as fit the budget).
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// `rollout`: prompts, each sampled `--samples` times.
    #[arg(long, default_value_t = 64)]
    pub prompts: usize,
    /// `rollout`: responses per prompt (the GRPO group size).
    #[arg(long, default_value_t = 8)]
    pub samples: usize,
    /// `rollout`: prompt tokens.
    #[arg(long, default_value_t = 128)]
    pub rollout_prompt: usize,
    /// `rollout`: most new tokens per response (what the static policy reserves).
    #[arg(long, default_value_t = 4096)]
    pub max_new: usize,
    /// `rollout`: the static policy's rows (today's engine); by default the cache budget
    /// of both engines is what these reserve at full length.
    #[arg(long, default_value_t = 16)]
    pub max_rows: usize,
    /// `rollout`: rows the paged engine decodes at once; default the engine's default for
    /// the device (`rollout::config::CPU_MAX_ROWS` on the CPU).
    #[arg(long)]
    pub paged_rows: Option<usize>,
    /// `rollout`: the KV cache budget of both engines, in GB (the static policy's rows
    /// are the whole groups that fit it at full length).
    #[arg(long)]
    pub kv_cache_gb: Option<f64>,
    /// `rollout`: the paged engine's cache dtype, `auto` (the model's) or `bfloat16`
    /// (`rollout.engine.kv_cache_dtype`); a list (`auto,bfloat16`) runs the paged engine
    /// once per dtype after the static one in each round. The static policy keeps the
    /// model's.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// `rollout`: the paged engine's prefix caching (`rollout.engine.enable_prefix_caching`),
    /// `on` or `off`; a list (`off,on`) runs the paged engine once per setting (and per
    /// `--kv-cache-dtype`) at the same budget in each round, and counts the responses and
    /// log-probs that differ between them.
    #[arg(long, default_value = "on")]
    pub prefix_caching: String,
    /// `rollout`: the same this many tokens (a synthetic system prompt) before every
    /// prompt's `--rollout-prompt` own tokens, so that prefix caching has something to find.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// `rollout --partial`: consecutive training steps' rollouts in each run (default 1);
    /// `async`: training steps of each run (default 4).
    #[arg(long)]
    pub steps: Option<usize>,
    /// `rollout`: synchronous steps (`off`: each step samples `--prompts` prompts and
    /// waits for all their responses) against partial rollouts (`on`: `--prompts` plus
    /// `--extra-prompts` groups in flight, a step ends when `--prompts` groups are whole,
    /// the rest continue in the next step); `off,on` runs both, `--steps` steps each,
    /// interleaved over `--rounds`, same cache budget and rows.
    #[arg(long)]
    pub partial: Option<String>,
    /// `rollout --partial on`: groups in flight beyond `--prompts` (default `--prompts`).
    #[arg(long)]
    pub extra_prompts: Option<usize>,
    /// `rollout --partial on`: what the unfinished responses' keys and values do between
    /// steps, as `rollout.partial.kv`: `recompute` (prefilled again at the next step) or
    /// `keep` (kept in the pool, decoding goes on over them).
    #[arg(long, value_enum, default_value_t = PartialKvArg::Recompute)]
    pub partial_kv: PartialKvArg,
    /// `rollout`: rounds of (static, paged), interleaved.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// `rollout`: run the paged engine alone (no static baseline), e.g. at a GPU's cache size.
    #[arg(long)]
    pub paged_only: bool,
    /// `rollout`: the paged engine alone at each of these row caps (e.g. `8,16,32,64`), at the
    /// same cache budget, interleaved over `--rounds` in one process: which `max_rows` gives
    /// the most tokens/s on this machine.
    #[arg(long, value_delimiter = ',')]
    pub rows_sweep: Vec<usize>,
    /// `async`: threads of the rollout drawn ahead (`rollout.async.rollout_threads`; 0: the
    /// process's pool, shared with the update).
    #[arg(long, default_value_t = 0)]
    pub rollout_threads: usize,
    /// `async`: threads of the update beside it (`rollout.async.train_threads`).
    #[arg(long, default_value_t = 0)]
    pub train_threads: usize,
    /// `async` under `mpirun -np N`: rollout ranks of the role split
    /// (`rollout.async.roles.rollout_ranks`); compares N data-parallel ranks, synchronous,
    /// with R rollout ranks and N - R trainer ranks at staleness 0 and 1 (0: one process,
    /// two threads).
    #[arg(long, default_value_t = 0)]
    pub rollout_ranks: usize,
    /// For `shard`: none, optimizer (ZeRO-1) or gradients (ZeRO-2).
    #[arg(long, default_value = "none")]
    pub shard: String,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// LoRA: `train` updates adapters on a frozen base (AdamW over the adapters alone);
    /// `generate` times the unmerged adapter path against merged weights.
    #[command(flatten)]
    pub lora: super::lora::LoraArgs,
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

/// Matmul FLOPs of the forward pass that an update runs
/// (`Qwen3::forward_hidden_from` the last prompt position): the decoder over
/// all `seq` positions but the last layer's queries, attention, output
/// projection and MLP, which run from the last prompt position on, and the LM
/// head over the `resp` response positions only.
pub fn update_forward_flops(cfg: &Config, batch: usize, seq: usize, resp: usize) -> f64 {
    let head = |n: usize| 2.0 * (batch * n) as f64 * cfg.hidden_size as f64 * cfg.vocab_size as f64;
    let (h, i, d) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.head_dim as f64);
    let nq = cfg.num_attention_heads as f64;
    // The last layer's positions before the last prompt position: no q, o, MLP, attention.
    let skipped =
        if cfg.num_hidden_layers > 0 { (batch * (seq - resp).saturating_sub(1)) as f64 } else { 0.0 };
    let per_row = 2.0 * (2.0 * h * nq * d + 3.0 * h * i) + 2.0 * 2.0 * nq * seq as f64 * d;
    forward_flops(cfg, batch, seq) - head(seq) + head(resp) - skipped * per_row
}

/// User + system CPU seconds used by this process so far (Linux `/proc/self/stat`,
/// assuming the usual 100 clock ticks per second).
pub fn cpu_seconds() -> Option<f64> {
    Some(stapo::train::update::cpu_seconds()).filter(|&s| s > 0.0)
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

/// Synthetic RL batch: `batch` sequences of `seq - resp` prompt and `resp`
/// response tokens, in groups of 4 with mixed rewards (so advantages are nonzero).
pub(super) fn synthetic_sequences(cfg: &Config, batch: usize, seq: usize, resp: usize) -> Vec<Sequence> {
    let v = cfg.vocab_size;
    let tok = |b: usize, t: usize| ((b * 7919 + t * 104_729 + 1) % v) as u32;
    (0..batch)
        .map(|b| Sequence {
            prompt_ids: (0..seq - resp).map(|t| tok(b / 4, t)).collect(),
            response_ids: (seq - resp..seq).map(|t| tok(b, t)).collect(),
            rollout_logprobs: None,
            reward: (b % 2) as f32,
            group: b / 4,
            truncated: false,
        })
        .collect()
}

/// Asks Linux to restart the peak-RSS count (`VmHWM`) from the current RSS.
pub(super) fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Prints one timing line: seconds, tokens/s and GFLOP/s when FLOPs are known.
pub fn report(name: &str, secs: f64, flops: Option<f64>, tokens: usize) {
    let gf = flops.map(|f| format!("  {:>7.1} GFLOP/s", f / secs / 1e9)).unwrap_or_default();
    println!("{name:<30} {:>9.1} ms  {:>9.0} tok/s{gf}", secs * 1e3, tokens as f64 / secs);
}
