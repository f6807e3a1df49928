//! The rollout engine: continuous batching over a paged KV cache.
//!
//! Follows vLLM's scheduler (Kwon et al. 2023; Yu et al. 2022, "Orca",
//! iteration-level scheduling): a waiting queue and a running list. Every
//! step, each running sequence gets its next token (decode) or its next
//! chunk of prompt (chunked prefill, at most [`PREFILL_TOKENS`] prompt tokens
//! per step so that a long prompt never stalls the decoding rows), then
//! waiting prompts are admitted while there are rows (`max_rows`) and free
//! blocks for them. When the pool runs out, the most recently admitted
//! sequence is preempted: its blocks are returned and it waits, at the front
//! of the queue, to be recomputed (prefilled again with the tokens it has
//! drawn, which it keeps). All of a step's tokens, prefill and decode, go
//! through the model in one call ([`model::decode_paged`]).
//!
//! A GRPO group is prefilled once, as one unit; when its prompt is in the
//! cache it forks into its `n` samples, which share the prompt's blocks
//! (`rollout::blocks`: reference counts, copy on write of the partial last
//! block) and each draw their first token from the prompt's last logits.
//!
//! With automatic prefix caching (`enable_prefix_caching`, vLLM's name and
//! scheme; `rollout::blocks`), every full block a unit writes is named by a
//! hash chained over its tokens, and a unit being admitted (a new prompt, or a
//! preempted sequence being recomputed) first looks up the longest run of its
//! leading full blocks already in the cache (held by another sequence, or
//! freed but not yet evicted), shares them, and prefills only the rest. The
//! block holding its last token is never taken from the cache, so that token
//! runs through the model and gives the logits of the first draw (vLLM
//! recomputes the last block of a fully cached prompt the same way). Prompts
//! that share a system prompt (the chat template's) compute it once, and a
//! preempted sequence recomputes only what was evicted.
//!
//! Every response draws from its own generator (`row_seed`), one number per
//! token, so what it samples does not depend on the schedule: not on its
//! neighbours, on preemption, or on the policy. [`Policy::Static`] is the
//! engine this one replaced, kept as a policy for the benchmark's baseline:
//! a whole chunk of `max_rows / n` prompts is admitted at once with every
//! sequence's full length reserved (what a dense cache allocates), and the
//! next chunk waits until the last response of this one ends.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::blocks::{blocks_for, hash_blocks, BlockHash, BlockPool, BlockTable};
use super::device::StepLogits;
use super::row::{Row, StopRules};
use super::sampler::{row_seed, Sampler};
use super::{Finish, Sample, SamplingParams};
use crate::model::{self, budget, PagedKvCache, PagedSeq, Qwen3};
use crate::{Error, Result};

/// Optional controls of a generation ([`super::generate_with`] and this module's `run`).
#[derive(Clone, Copy, Default)]
pub struct GenerateHooks<'a> {
    /// Called after every step with the number of tokens sampled so far.
    pub progress: Option<&'a dyn Fn(usize)>,
    /// When set to true, generation stops at the next step with an error.
    pub cancel: Option<&'a AtomicBool>,
    /// The KV cache budget, rows decoded at once and block size.
    pub engine: EngineConfig,
    /// How the scheduler admits prompts (continuous batching by default).
    pub policy: Policy,
    /// Index of `prompts[0]` in the whole batch, for the per-response seeds: a
    /// data-parallel rank that samples prompts `[lo, hi)` of a step's batch
    /// passes `lo`, so every response is drawn as in a one-process run.
    pub first_prompt_index: usize,
    /// Forced lengths (benchmarks): response `(global prompt index, sample
    /// index)` ends, as truncated, at this many tokens (at most `max_new_tokens`).
    pub lengths: Option<&'a dyn Fn(usize, usize) -> usize>,
}

/// Prompt tokens prefilled per step at most (vLLM's chunked prefill budget):
/// bounds how long a step of the decoding rows can take.
pub const PREFILL_TOKENS: usize = 512;

/// Rows decoded at once on the CPU by default. Measured on the 2-core AVX2 machine
/// (2026-12-04, quiet; `stapo bench rollout --lengths lognormal:50:1000 --prompts 8
/// --max-new 1024 --rows-sweep 16,32,64`, 16.8M shape): 521, 685 and 818 tok/s: a
/// decode step streams every weight once whatever its rows, so fuller steps win.
/// (On the AVX-512 machine of the issue, 16 rows had beaten 64 with the dense cache.)
pub const CPU_MAX_ROWS: usize = 64;

/// Rows decoded at once by default on other devices (a GPU step costs about
/// the same for 8 rows as for 200).
pub const DEVICE_MAX_ROWS: usize = 256;

/// Share of the available memory the KV cache takes on the CPU when
/// `kv_cache_gb` is not set.
pub const CPU_CACHE_FRACTION: f64 = 0.25;

/// Default share of the free device memory the KV cache takes on a GPU when
/// `kv_cache_gb` is not set (vLLM's `gpu_memory_utilization`).
pub const GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// `enable_prefix_caching`'s default, on as in vLLM: prompts' shared
/// prefixes are computed once, and caching changes no draw where checked. On
/// the CPU a cached prompt block's keys and values equal recomputed ones bit
/// for bit (a prefill call takes one gemm kernel whatever its size, at the
/// widths of real models: `bench rollout --prefix-caching off,on` counts the
/// differences, none at the 16.8M shape); the tiny test model agrees within
/// 1e-5 with the same draws (`prefix_caching_changes_no_draw`). A block that
/// decoding steps filled (a preempted sequence's answer) holds the decoding
/// kernel's values, which a recompute by gemm would round differently:
/// reusing it keeps the values the sequence had before it was preempted.
pub const PREFIX_CACHING_DEFAULT: bool = true;

/// The engine's settings, as a run's config gives them (`rollout.engine`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// The KV cache's budget in GB (1e9 bytes); `None`: a quarter of the
    /// available memory on the CPU ([`CPU_CACHE_FRACTION`]), on CUDA
    /// `gpu_memory_utilization` of the device memory free when the rollout
    /// starts (after the weights and optimizer state), and on other devices
    /// what `max_rows` full-length sequences need.
    pub kv_cache_gb: Option<f64>,
    /// On CUDA with `kv_cache_gb` unset: the share of the free device memory
    /// the KV cache takes (vLLM's `gpu_memory_utilization`, but of the memory
    /// free after the weights rather than of the whole device).
    pub gpu_memory_utilization: f64,
    /// Sequences decoded at once; `None`: [`CPU_MAX_ROWS`] on the CPU,
    /// [`DEVICE_MAX_ROWS`] elsewhere.
    pub max_rows: Option<usize>,
    /// Tokens per cache block.
    pub block_size: usize,
    /// The cache's element type (vLLM's `kv_cache_dtype`): `auto`, the
    /// sampling model's activation dtype, or `bfloat16`, which halves the
    /// bytes per token of an f32 model (twice the tokens in the same budget,
    /// half the bytes attention reads per step) at the price of keys and
    /// values rounded to bf16.
    pub kv_cache_dtype: KvCacheDtype,
    /// Automatic prefix caching (vLLM's `enable_prefix_caching`): full
    /// blocks are named by a hash of their tokens and the prefix before them,
    /// and a prompt (or a preempted sequence's recompute) whose leading blocks
    /// are in the cache shares them instead of prefilling them; freed blocks
    /// stay cached until a new token needs them (least recently used first).
    /// Continuous batching only (the static policy is the old engine's
    /// baseline and ignores it).
    pub enable_prefix_caching: bool,
}

/// The KV cache's element type (`rollout.engine.kv_cache_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The sampling model's activation dtype.
    #[default]
    Auto,
    /// bf16, whatever the model's dtype.
    Bfloat16,
}

impl KvCacheDtype {
    /// Parses `auto` or `bfloat16`; `what` names the field in the error.
    pub fn parse(s: &str, what: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "bfloat16" | "bf16" => Ok(Self::Bfloat16),
            _ => Err(Error::invalid(format!("{what}: expected \"auto\" or \"bfloat16\", got {s:?}"))),
        }
    }

    /// The name [`KvCacheDtype::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Bfloat16 => "bfloat16",
        }
    }

    /// The pools' dtype, `None` for the model's own.
    pub fn dtype(self) -> Option<candle_core::DType> {
        match self {
            Self::Auto => None,
            Self::Bfloat16 => Some(candle_core::DType::BF16),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_cache_gb: None,
            gpu_memory_utilization: GPU_MEMORY_UTILIZATION,
            max_rows: None,
            block_size: 16,
            kv_cache_dtype: KvCacheDtype::Auto,
            enable_prefix_caching: PREFIX_CACHING_DEFAULT,
        }
    }
}

impl EngineConfig {
    /// `max_rows`, or the default of `model`'s device.
    pub fn rows(&self, model: &Qwen3) -> usize {
        self.max_rows.unwrap_or(if model.device().is_cpu() { CPU_MAX_ROWS } else { DEVICE_MAX_ROWS })
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| Err(Error::invalid(format!("rollout.engine.{field}: {msg}")));
        if let Some(g) = self.kv_cache_gb {
            if !(g.is_finite() && g > 0.0) {
                return bad("kv_cache_gb", format!("expected a positive number of GB, found {g}"));
            }
        }
        let u = self.gpu_memory_utilization;
        if !(u.is_finite() && u > 0.0 && u <= 1.0) {
            return bad("gpu_memory_utilization", format!("expected a share in (0, 1], found {u}"));
        }
        if self.max_rows == Some(0) {
            return bad("max_rows", "expected at least 1, found 0".into());
        }
        if self.block_size == 0 {
            return bad("block_size", "expected at least 1 token per block, found 0".into());
        }
        Ok(())
    }
}

/// How the scheduler admits work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Continuous batching (the default).
    #[default]
    Continuous,
    /// The replaced static batcher, for benchmarks: whole chunks of
    /// `max_rows / n` prompts, every sequence's maximum length reserved, no
    /// refill until the chunk ends.
    Static,
}

/// What one rollout did, for the metrics and the benchmark.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Tokens sampled.
    pub tokens: usize,
    /// Wall-clock seconds of the rollout.
    pub secs: f64,
    /// Model calls (steps).
    pub model_calls: usize,
    /// Sequences fed over all calls (a decode row or a prefill chunk each).
    pub rows_fed: usize,
    /// Prompt (and recomputed) tokens prefilled.
    pub prefill_tokens: usize,
    /// Sequences preempted (their blocks freed, recomputed later).
    pub preemptions: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Blocks in the pool and the most held at once.
    pub pool_blocks: usize,
    /// The most blocks held at once.
    pub peak_blocks: usize,
    /// The static policy's most blocks reserved at once (0 under continuous batching).
    pub peak_reserved_blocks: usize,
    /// Bytes of cache per token.
    pub bytes_per_token: usize,
    /// The most tokens the running sequences held at once, a shared prompt
    /// counted once per sample (what per-sequence caches of exact size hold).
    pub peak_live_tokens: usize,
    /// Tokens of the units admitted (a prompt, or a preempted sequence's
    /// prompt and drawn tokens) that were looked up in the prefix cache
    /// (vLLM's `prefix_cache_queries`; 0 with prefix caching off).
    #[serde(default)]
    pub prefix_cache_queried_tokens: usize,
    /// Of those, the tokens found in the cache and so not prefilled (vLLM's
    /// `prefix_cache_hits`).
    #[serde(default)]
    pub prefix_cache_hit_tokens: usize,
    /// Cached free blocks taken for new tokens (their hash dropped).
    #[serde(default)]
    pub prefix_cache_evictions: usize,
    /// Where the time went: scheduling (block tables, admission, preemption),
    /// the model call (on a GPU mostly launching kernels: they run
    /// asynchronously), the step's logits to sampling statistics (on a GPU
    /// where the host first waits for the device), and the draws.
    #[serde(default)]
    pub phases: Phases,
    /// Decode steps: model calls in which every row added one token.
    #[serde(default)]
    pub decode_steps: usize,
    /// Seconds of the decode steps (model call, logits and draws).
    #[serde(default)]
    pub decode_secs: f64,
    /// Bytes the decode steps had to read at the least: weights and live
    /// keys and values ([`budget::decode_step_bytes`]), summed over the steps.
    #[serde(default)]
    pub decode_bytes: u64,
    /// Device work of the decode steps ([`budget::Counts`]): kernel launches
    /// (per decoder layer among them) and copies to the host.
    #[serde(default)]
    pub decode_counts: budget::Counts,
}

/// Seconds of a rollout spent in each phase of a step (see
/// [`EngineStats::phases`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Choosing the step's work: block tables, admission, preemption.
    pub schedule: f64,
    /// `model::decode_paged` (on a GPU mostly launching its kernels).
    pub model: f64,
    /// The step's logits to sampling statistics (on a GPU, where the host waits).
    pub logits: f64,
    /// Drawing tokens, stop rules, retiring finished samples.
    pub draw: f64,
}

impl Phases {
    /// One line for people: each phase's seconds and share of their sum.
    pub fn line(&self) -> String {
        let all = (self.schedule + self.model + self.logits + self.draw).max(1e-9);
        let part = |name: &str, s: f64| format!("{name} {s:.2} s ({:.0}%)", 100.0 * s / all);
        [
            part("schedule", self.schedule),
            part("model call", self.model),
            part("logits", self.logits),
            part("draw", self.draw),
        ]
        .join(", ")
    }
}

impl EngineStats {
    /// Mean bytes a decode step had to read ([`EngineStats::decode_bytes`]).
    pub fn bytes_per_decode_step(&self) -> f64 {
        self.decode_bytes as f64 / self.decode_steps.max(1) as f64
    }

    /// Copies to the host per decode step.
    pub fn host_copies_per_step(&self) -> f64 {
        self.decode_counts.host_copies as f64 / self.decode_steps.max(1) as f64
    }

    /// The decode steps' share of a device's memory bandwidth `bytes_per_sec`:
    /// the bytes they had to read over their time, over the bandwidth.
    pub fn bandwidth_fraction(&self, bytes_per_sec: f64) -> f64 {
        self.decode_bytes as f64 / self.decode_secs.max(1e-9) / bytes_per_sec
    }

    /// Tokens sampled per second.
    pub fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.secs.max(1e-9)
    }

    /// Share of the looked-up tokens the prefix cache held (0 when none were looked up).
    pub fn prefix_cache_hit_rate(&self) -> f64 {
        self.prefix_cache_hit_tokens as f64 / self.prefix_cache_queried_tokens.max(1) as f64
    }

    /// Sequences per model call.
    pub fn mean_rows(&self) -> f64 {
        self.rows_fed as f64 / self.model_calls.max(1) as f64
    }

    /// Bytes of the most blocks held at once; under the static policy, of the
    /// most reserved (what its dense cache allocated).
    pub fn peak_cache_bytes(&self) -> usize {
        self.peak_blocks.max(self.peak_reserved_blocks) * self.block_size * self.bytes_per_token
    }
}

/// The engine's figures over a training step's generation batches, for
/// metrics.jsonl and TensorBoard (`stapo/rollout_engine/...`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutFigures {
    /// Sequences per model call (decode rows and prefill chunks).
    pub rows_per_step: f64,
    /// Model calls over the step's generation batches.
    pub model_calls: usize,
    /// The most cache blocks held at once, and their size in GB.
    pub peak_blocks: usize,
    /// Size of those blocks in GB.
    pub peak_cache_gb: f64,
    /// Sequences preempted over the step.
    pub preemptions: usize,
    /// Tokens looked up in the prefix cache over the step.
    pub prefix_cache_queried_tokens: usize,
    /// Tokens found there (not prefilled).
    pub prefix_cache_hit_tokens: usize,
    /// `prefix_cache_hit_tokens / prefix_cache_queried_tokens` (0 when nothing was looked up).
    pub prefix_cache_hit_rate: f64,
}

impl RolloutFigures {
    /// Adds one rollout's figures.
    pub fn add(&mut self, s: &EngineStats) {
        let calls = self.model_calls + s.model_calls;
        self.rows_per_step =
            (self.rows_per_step * self.model_calls as f64 + s.rows_fed as f64) / calls.max(1) as f64;
        self.model_calls = calls;
        if s.peak_cache_bytes() as f64 / 1e9 > self.peak_cache_gb {
            self.peak_cache_gb = s.peak_cache_bytes() as f64 / 1e9;
        }
        self.peak_blocks = self.peak_blocks.max(s.peak_blocks.max(s.peak_reserved_blocks));
        self.preemptions += s.preemptions;
        self.prefix_cache_queried_tokens += s.prefix_cache_queried_tokens;
        self.prefix_cache_hit_tokens += s.prefix_cache_hit_tokens;
        self.prefix_cache_hit_rate =
            self.prefix_cache_hit_tokens as f64 / self.prefix_cache_queried_tokens.max(1) as f64;
    }
}

/// What runs through the model: a group's prompt before it forks, or one
/// sample (its prompt and the tokens it has drawn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Local prompt index.
    Group(usize),
    /// Row id (`prompt * n + sample`).
    Sample(usize),
}

/// A unit admitted to the cache.
struct Unit {
    kind: Kind,
    table: BlockTable,
    /// Still prefilling (its tokens count as prefill): from admission until it
    /// draws (a group forks into decoding samples).
    prefill: bool,
}

/// One call of [`run`]: the inputs, the cache and the queues.
struct Engine<'a> {
    model: &'a Qwen3,
    prompts: &'a [Vec<u32>],
    params: &'a SamplingParams,
    sampler: Sampler,
    stops: StopRules,
    decode: &'a dyn Fn(&[u32]) -> String,
    hooks: &'a GenerateHooks<'a>,
    policy: Policy,
    max_rows: usize,
    /// Prefix caching on (and the policy continuous).
    caching: bool,
    cache: PagedKvCache,
    pool: BlockPool,
    rows: Vec<Row>,
    running: Vec<Unit>,
    waiting: VecDeque<Kind>,
    out: Vec<Sample>,
    stats: EngineStats,
}

/// Samples `params.n` responses for each of `prompts` (validated by the
/// caller) with the engine; returns them in order of completion and the
/// rollout's figures.
pub(super) fn run(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    decode: &dyn Fn(&[u32]) -> String,
    hooks: &GenerateHooks,
    eos: Option<u32>,
) -> Result<(Vec<Sample>, EngineStats)> {
    let start = Instant::now();
    let cfg = hooks.engine;
    cfg.validate()?;
    let max_rows = cfg.rows(model);
    let cache_dtype = PagedKvCache::pool_dtype(model, cfg.kv_cache_dtype.dtype());
    let bytes_per_token = PagedKvCache::bytes_per_token(model.config(), cache_dtype);
    let budget_bytes = budget_bytes(&cfg, memory(model)?);
    let num_blocks = pool_blocks(budget_bytes, prompts, params, &cfg, max_rows, bytes_per_token)?;
    let n = params.n;
    let rows = (0..prompts.len() * n)
        .map(|id| {
            let seed = row_seed(params.seed, hooks.first_prompt_index + id / n, id % n);
            Row::new(id / n, id % n, StdRng::seed_from_u64(seed), params.max_new_tokens)
        })
        .collect();
    let mut e = Engine {
        model,
        prompts,
        params,
        sampler: Sampler::new(params),
        stops: StopRules::new(params, eos),
        decode,
        hooks,
        policy: hooks.policy,
        max_rows,
        caching: cfg.enable_prefix_caching && hooks.policy == Policy::Continuous,
        cache: PagedKvCache::with_dtype(model, num_blocks, cfg.block_size, Some(cache_dtype))?,
        pool: BlockPool::new(num_blocks, cfg.block_size)?,
        rows,
        running: Vec::new(),
        waiting: (0..prompts.len()).map(Kind::Group).collect(),
        out: Vec::with_capacity(prompts.len() * n),
        stats: EngineStats {
            block_size: cfg.block_size,
            pool_blocks: num_blocks,
            bytes_per_token,
            ..EngineStats::default()
        },
    };
    while !(e.running.is_empty() && e.waiting.is_empty()) {
        e.step()?;
        if let Some(progress) = hooks.progress {
            progress(e.stats.tokens);
        }
        let busy = !(e.running.is_empty() && e.waiting.is_empty());
        if busy && hooks.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Error::invalid(format!("generate: cancelled after {} tokens", e.stats.tokens)));
        }
    }
    e.stats.peak_blocks = e.pool.peak_used();
    e.stats.prefix_cache_evictions = e.pool.evictions();
    e.stats.secs = start.elapsed().as_secs_f64();
    Ok((e.out, e.stats))
}

/// Blocks in the pool: the budget, but no more than this call can use (all
/// its sequences at full length, or `max_rows` of them and one group more).
/// A sequence that cannot fit the whole budget is an error.
fn pool_blocks(
    budget_bytes: f64,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    cfg: &EngineConfig,
    max_rows: usize,
    bytes_per_token: usize,
) -> Result<usize> {
    let bs = cfg.block_size;
    let block_bytes = (bs * bytes_per_token) as f64;
    // The relative 1e-9 keeps a budget given as exactly k blocks (in GB, rounded) at k.
    let budget = (budget_bytes / block_bytes * (1.0 + 1e-9)).floor().min(u32::MAX as f64) as usize;
    // The last sampled token is never fed back, hence the - 1.
    let seq_len = |p: &Vec<u32>| p.len() + params.max_new_tokens - 1;
    let longest = prompts.iter().map(seq_len).max().unwrap_or(0);
    let per_seq = blocks_for(longest, bs);
    if per_seq > budget {
        return Err(Error::invalid(format!(
            "rollout: a sequence of {longest} tokens needs {per_seq} cache blocks of {bs} tokens ({:.3} GB) \
             but the KV cache budget (rollout.engine.kv_cache_gb = {}) holds {budget} ({:.3} GB)",
            per_seq as f64 * block_bytes / 1e9,
            cfg.kv_cache_gb.map_or("unset: a share of the free memory".to_string(), |g| g.to_string()),
            budget as f64 * block_bytes / 1e9
        )));
    }
    let all: usize = prompts.iter().map(|p| params.n * blocks_for(seq_len(p), bs)).sum();
    let rows = (max_rows + params.n).saturating_mul(per_seq);
    Ok(budget.min(all).min(rows).max(per_seq))
}

/// The memory a KV cache budget left unset is a share of.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Memory {
    /// The CPU: bytes available to this process.
    Host(u64),
    /// A CUDA device: bytes free on it now.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(u64),
    /// A device whose free memory is not known (the pool is then sized to
    /// `max_rows` full-length sequences).
    Unknown,
}

/// The KV cache's budget in bytes: `kv_cache_gb`, or a share of `mem`.
fn budget_bytes(cfg: &EngineConfig, mem: Memory) -> f64 {
    match (cfg.kv_cache_gb, mem) {
        (Some(gb), _) => gb * 1e9,
        (None, Memory::Host(available)) => CPU_CACHE_FRACTION * available as f64,
        (None, Memory::Device(free)) => cfg.gpu_memory_utilization * free as f64,
        (None, Memory::Unknown) => f64::INFINITY,
    }
}

/// The memory of `model`'s device.
fn memory(model: &Qwen3) -> Result<Memory> {
    match model.device() {
        candle_core::Device::Cpu => Ok(Memory::Host(available_memory())),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(dev) => {
            let (free, _total) = dev.cuda_stream().context().mem_get_info().map_err(|e| {
                Error::invalid(format!("rollout: querying the free CUDA memory for the KV cache: {e:?}"))
            })?;
            Ok(Memory::Device(free as u64))
        }
        #[allow(unreachable_patterns)]
        _ => Ok(Memory::Unknown),
    }
}

/// Bytes of memory available to this process (`MemAvailable` of
/// /proc/meminfo; 8 GB where that cannot be read).
fn available_memory() -> u64 {
    let fallback = 8_000_000_000;
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return fallback };
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(fallback, |kb| kb * 1024)
}

impl Engine<'_> {
    /// Tokens of a unit: its prompt, then (a sample) what it has drawn.
    fn total(&self, kind: Kind) -> usize {
        match kind {
            Kind::Group(p) => self.prompts[p].len(),
            Kind::Sample(id) => self.prompts[id / self.params.n].len() + self.rows[id].ids.len(),
        }
    }

    fn token(&self, kind: Kind, pos: usize) -> u32 {
        let (p, drawn) = match kind {
            Kind::Group(p) => (p, &[][..]),
            Kind::Sample(id) => (id / self.params.n, &self.rows[id].ids[..]),
        };
        let prompt = &self.prompts[p];
        if pos < prompt.len() {
            prompt[pos]
        } else {
            drawn[pos - prompt.len()]
        }
    }

    /// The tokens of a unit at positions `range`.
    fn tokens(&self, kind: Kind, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|p| self.token(kind, p)).collect()
    }

    /// The prefix cache's blocks for a unit being admitted: the longest run of
    /// its leading full blocks in the cache, short of the block holding its
    /// last token (which must run to give logits), and their hashes.
    fn cached_prefix(&self, kind: Kind) -> (Vec<u32>, Vec<BlockHash>) {
        if !self.caching {
            return (Vec::new(), Vec::new());
        }
        let bs = self.pool.block_size();
        let full = (self.total(kind) - 1) / bs;
        let mut hashes = hash_blocks(None, &self.tokens(kind, 0..full * bs), bs);
        let blocks = self.pool.longest_cached(&hashes);
        hashes.truncate(blocks.len());
        (blocks, hashes)
    }

    fn rows_of(&self, kind: Kind) -> usize {
        match kind {
            Kind::Group(_) => self.params.n,
            Kind::Sample(_) => 1,
        }
    }

    /// One step: schedule, run the model once, draw, retire finished rows.
    fn step(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let (mut sched, budget) = self.schedule_running()?;
        match self.policy {
            Policy::Continuous => self.admit_continuous(&mut sched, budget)?,
            Policy::Static => self.admit_static(&mut sched)?,
        }
        if sched.is_empty() {
            return Err(Error::invalid(format!(
                "rollout engine: no work fits the KV cache ({} of {} blocks free, {} waiting)",
                self.pool.free_blocks(),
                self.pool.num_blocks(),
                self.waiting.len()
            )));
        }
        let live: usize = self.running.iter().map(|u| u.table.len()).sum();
        self.stats.peak_live_tokens = self.stats.peak_live_tokens.max(live);
        self.stats.phases.schedule += t0.elapsed().as_secs_f64();
        let decode = sched.iter().all(|&(_, n)| n == 1);
        let context: usize = sched.iter().map(|&(i, _)| self.running[i].table.len()).sum();
        let (start, counts) = (Instant::now(), budget::snapshot());
        let logits = self.forward(&sched)?;
        let t0 = Instant::now();
        self.draw(&sched, &logits)?;
        self.stats.phases.draw += t0.elapsed().as_secs_f64();
        if decode {
            let s = &mut self.stats;
            s.decode_steps += 1;
            s.decode_secs += start.elapsed().as_secs_f64();
            s.decode_counts.add(&budget::snapshot().since(&counts));
            s.decode_bytes += budget::decode_step_bytes(
                self.model.config(),
                self.model.dtype(),
                self.cache.dtype(),
                sched.len(),
                context,
            );
        }
        Ok(())
    }

    /// Gives each running unit its next tokens, oldest first: one for a
    /// decoding sample, the next chunk of a prompt being prefilled. Preempts
    /// the newest units when blocks run out. Returns `(unit, tokens)` pairs
    /// and the prefill budget left.
    fn schedule_running(&mut self) -> Result<(Vec<(usize, usize)>, usize)> {
        let mut budget = self.prefill_budget();
        let mut sched = Vec::with_capacity(self.running.len());
        let mut i = 0;
        while i < self.running.len() {
            let u = &self.running[i];
            let need = self.total(u.kind) - u.table.len();
            let n = if need == 1 { 1 } else { need.min(budget) };
            if n == 0 {
                i += 1;
                continue;
            }
            if need > 1 {
                budget -= n;
            }
            if !self.make_room(i, n)? {
                break; // unit i itself was preempted, and every newer one
            }
            sched.push((i, n));
            i += 1;
        }
        Ok((sched, budget))
    }

    /// Prompt tokens a step may prefill.
    fn prefill_budget(&self) -> usize {
        match self.policy {
            Policy::Continuous => PREFILL_TOKENS,
            Policy::Static => usize::MAX,
        }
    }

    /// Frees blocks for `n` more tokens of running unit `i` by preempting the
    /// newest units; false when `i` had to go itself.
    fn make_room(&mut self, i: usize, n: usize) -> Result<bool> {
        loop {
            let need = self.running[i].table.blocks_needed(&self.pool, n);
            if need <= self.pool.free_blocks() {
                self.append(i, n)?;
                return Ok(true);
            }
            if self.policy == Policy::Static {
                return Err(Error::invalid(format!(
                    "rollout engine (static policy): the KV cache of {} blocks is full",
                    self.pool.num_blocks()
                )));
            }
            let Some(mut victim) = self.running.pop() else { return Ok(false) };
            victim.table.release(&mut self.pool);
            self.waiting.push_front(victim.kind);
            self.stats.preemptions += 1;
            if self.running.len() == i {
                return Ok(false);
            }
        }
    }

    /// Slots for `n` more tokens of running unit `i` (copying a shared last block first).
    fn append(&mut self, i: usize, n: usize) -> Result<()> {
        let a = self.running[i]
            .table
            .append(&mut self.pool, n)
            .ok_or_else(|| Error::invalid("rollout engine: KV cache blocks miscounted"))?;
        if let Some((from, to)) = a.copy {
            self.cache.copy_block(from, to)?;
        }
        if self.caching {
            let u = &self.running[i];
            let toks = self.tokens(u.kind, u.table.unnamed_full(self.pool.block_size()));
            self.running[i].table.register_full(&mut self.pool, &toks);
        }
        Ok(())
    }

    /// Admits waiting units while rows, the prefill budget and free blocks
    /// allow (keeping one free block per running unit for its next token).
    fn admit_continuous(&mut self, sched: &mut Vec<(usize, usize)>, mut budget: usize) -> Result<()> {
        let mut rows: usize = self.running.iter().map(|u| self.rows_of(u.kind)).sum();
        while let Some(&kind) = self.waiting.front() {
            let r = self.rows_of(kind);
            if budget == 0 || (rows > 0 && rows + r > self.max_rows) {
                break;
            }
            let total = self.total(kind);
            let (hit, hashes) = self.cached_prefix(kind);
            let start = hit.len() * self.pool.block_size();
            let n = (total - start).min(budget);
            // New blocks, plus cached free blocks the hit takes off the free list.
            let need = blocks_for(start + n, self.pool.block_size()) - hit.len() + self.pool.free_among(&hit);
            if need + self.running.len() > self.pool.free_blocks() && !self.running.is_empty() {
                break;
            }
            if need > self.pool.free_blocks() {
                break;
            }
            self.waiting.pop_front();
            let table = BlockTable::from_cached(&mut self.pool, &hit, &hashes);
            self.running.push(Unit { kind, table, prefill: true });
            self.append(self.running.len() - 1, n)?;
            sched.push((self.running.len() - 1, n));
            if self.caching {
                self.stats.prefix_cache_queried_tokens += total;
                self.stats.prefix_cache_hit_tokens += start;
            }
            (budget, rows) = (budget - n, rows + r);
        }
        Ok(())
    }

    /// The static policy: when nothing runs, admits the next chunk of
    /// `max_rows / n` prompts whole, reserving every sequence's maximum length.
    fn admit_static(&mut self, sched: &mut Vec<(usize, usize)>) -> Result<()> {
        if !self.running.is_empty() {
            return Ok(());
        }
        let per_chunk = (self.max_rows / self.params.n).max(1).min(self.waiting.len());
        let (bs, n) = (self.pool.block_size(), self.params.n);
        let chunk: Vec<Kind> = self.waiting.drain(..per_chunk).collect();
        let full = |k: &Kind| match *k {
            Kind::Group(p) => n * blocks_for(self.prompts[p].len() + self.params.max_new_tokens - 1, bs),
            Kind::Sample(id) => blocks_for(self.prompts[id / n].len() + self.params.max_new_tokens - 1, bs),
        };
        let reserved: usize = chunk.iter().map(full).sum();
        if reserved > self.pool.num_blocks() {
            return Err(Error::invalid(format!(
                "rollout engine (static policy): a chunk reserves {reserved} blocks, the KV cache holds {}",
                self.pool.num_blocks()
            )));
        }
        self.stats.peak_reserved_blocks = self.stats.peak_reserved_blocks.max(reserved);
        for kind in chunk {
            self.running.push(Unit { kind, table: BlockTable::default(), prefill: true });
            let len = self.total(kind);
            self.append(self.running.len() - 1, len)?;
            sched.push((self.running.len() - 1, len));
        }
        Ok(())
    }

    /// One model call over the scheduled units; logits `(units, vocab)`.
    fn forward(&mut self, sched: &[(usize, usize)]) -> Result<StepLogits> {
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(sched.len());
        for &(i, n) in sched {
            let u = &self.running[i];
            let len = u.table.len();
            tokens.extend((len - n..len).map(|p| self.token(u.kind, p)));
            seqs.push(PagedSeq { blocks: u.table.blocks().to_vec(), len, new: n });
            if u.prefill {
                self.stats.prefill_tokens += n;
            }
        }
        self.stats.model_calls += 1;
        self.stats.rows_fed += sched.len();
        let t0 = Instant::now();
        let logits = model::decode_paged(self.model, &tokens, &seqs, &self.cache)?;
        let t1 = Instant::now();
        let step = StepLogits::new(&logits, &self.sampler)?;
        self.stats.phases.model += (t1 - t0).as_secs_f64();
        self.stats.phases.logits += t1.elapsed().as_secs_f64();
        Ok(step)
    }

    /// Draws the next token of every unit whose tokens are all in the cache
    /// (a group's first tokens: one per sample), then retires finished samples.
    fn draw(&mut self, sched: &[(usize, usize)], logits: &StepLogits) -> Result<()> {
        let n = self.params.n;
        // (logits row, row id) of every draw, and the units that forked.
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        let mut forks: Vec<(usize, Vec<Unit>)> = Vec::new();
        for (k, &(i, _)) in sched.iter().enumerate() {
            let kind = self.running[i].kind;
            if self.running[i].table.len() < self.total(kind) {
                continue; // a prompt part-way through its prefill
            }
            self.running[i].prefill = false;
            match kind {
                Kind::Sample(id) => wanted.push((k, id)),
                Kind::Group(p) => {
                    let samples: Vec<Unit> = (p * n..(p + 1) * n)
                        .map(|id| Unit {
                            kind: Kind::Sample(id),
                            table: self.running[i].table.fork(&mut self.pool),
                            prefill: false,
                        })
                        .collect();
                    self.running[i].table.release(&mut self.pool);
                    wanted.extend((p * n..(p + 1) * n).map(|id| (k, id)));
                    forks.push((i, samples));
                }
            }
        }
        wanted.sort_by_key(|&(_, id)| id);
        let mut it = wanted.iter().peekable();
        let mut pairs = Vec::with_capacity(wanted.len());
        for (id, row) in self.rows.iter_mut().enumerate() {
            if let Some(&(k, _)) = it.next_if(|&&(_, w)| w == id) {
                pairs.push((k, &mut row.rng));
            }
        }
        let draws = logits.draw(&self.sampler, pairs)?;
        for (&(_, id), d) in wanted.iter().zip(draws) {
            self.rows[id].push(d);
            self.stats.tokens += 1;
            self.check_finish(id);
        }
        self.retire(forks);
        Ok(())
    }

    /// Ends row `id` if its last token stops it or it reached its length.
    fn check_finish(&mut self, id: usize) {
        let n = self.params.n;
        let row = &self.rows[id];
        let cap = match self.hooks.lengths {
            Some(f) => f(self.hooks.first_prompt_index + id / n, id % n).clamp(1, self.params.max_new_tokens),
            None => self.params.max_new_tokens,
        };
        let finish = self
            .stops
            .check(&row.ids, self.decode)
            .or_else(|| (row.ids.len() >= cap).then_some(Finish::Length));
        if let Some(finish) = finish {
            let prompts = self.prompts;
            let s = self.rows[id].finish(finish, &prompts[id / n], self.decode);
            self.out.push(s);
        }
    }

    /// Puts forked samples in their group's place and drops finished samples,
    /// returning their blocks.
    fn retire(&mut self, forks: Vec<(usize, Vec<Unit>)>) {
        let mut forks = forks.into_iter().peekable();
        let old = std::mem::take(&mut self.running);
        let mut running = Vec::with_capacity(old.len());
        for (i, u) in old.into_iter().enumerate() {
            if let Some((_, samples)) = forks.next_if(|(g, _)| *g == i) {
                running.extend(samples);
            } else {
                running.push(u);
            }
        }
        for mut u in running {
            match u.kind {
                Kind::Sample(id) if self.rows[id].done => u.table.release(&mut self.pool),
                _ => self.running.push(u),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Tensor;

    use super::*;
    use crate::model::KvCache;
    use crate::rollout::generate::generate_stats;
    use crate::rollout::test_support::{angle_decode, tiny_model};

    /// Bytes per token of the tiny model's cache (2 layers x 2 kv heads x 16 x f32, k and v).
    const TINY_TOKEN_BYTES: f64 = 512.0;

    fn prompts() -> Vec<Vec<u32>> {
        (0..6u32).map(|p| (0..(3 + 2 * p)).map(|i| (p * 13 + i * 7) % 90 + 5).collect()).collect()
    }

    fn budget(blocks: f64, block_size: usize) -> Option<f64> {
        Some(blocks * block_size as f64 * TINY_TOKEN_BYTES / 1e9)
    }

    /// The engine this one replaced, one response at a time: a dense cache
    /// per response, the same per-response generator. Returns each response's
    /// tokens and log-probs, by prompt then sample.
    fn dense_reference(
        m: &Qwen3,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
    ) -> Vec<(Vec<u32>, Vec<f32>)> {
        let sampler = Sampler::new(params);
        let eos = m.config().eos_token_id;
        let mut out = Vec::new();
        for (p, prompt) in prompts.iter().enumerate() {
            for s in 0..params.n {
                let mut rng = StdRng::seed_from_u64(row_seed(params.seed, p, s));
                let mut cache = KvCache::new(m, 1, prompt.len() + params.max_new_tokens).expect("cache");
                let ids = Tensor::from_vec(prompt.clone(), (1, prompt.len()), m.device()).expect("ids");
                let mut logits = m.decode(&ids, None, &mut cache).expect("prefill");
                let (mut toks, mut lps) = (Vec::new(), Vec::new());
                loop {
                    let d = StepLogits::new(&logits, &sampler)
                        .and_then(|l| l.draw(&sampler, vec![(0, &mut rng)]))
                        .expect("draw")[0];
                    toks.push(d.id);
                    lps.push(d.logprob_raw);
                    if Some(d.id) == eos || toks.len() == params.max_new_tokens {
                        break;
                    }
                    let next = Tensor::from_vec(vec![d.id], (1, 1), m.device()).expect("next");
                    logits = m.decode(&next, None, &mut cache).expect("decode");
                }
                out.push((toks, lps));
            }
        }
        out
    }

    /// Every schedule (all rows at once, refills through 2 rows, a cache so
    /// small that sequences are preempted and recomputed, the static policy)
    /// samples exactly the responses of the dense one-at-a-time engine with
    /// the same seeds. A draw could differ only where batched rounding flips a
    /// near-tie; the test counts such flips and none occur here.
    #[test]
    fn every_schedule_samples_what_the_dense_engine_samples() {
        let m = tiny_model(Some(3), 11);
        let params = SamplingParams { n: 3, max_new_tokens: 20, seed: 7, ..SamplingParams::default() };
        let want = dense_reference(&m, &prompts(), &params);
        let lens: Vec<usize> = want.iter().map(|w| w.0.len()).collect();
        assert!(lens.iter().any(|&l| l < 20), "some responses should end at EOS: {lens:?}");
        let cases = [
            (EngineConfig::default(), Policy::Continuous),
            (EngineConfig { max_rows: Some(2), ..EngineConfig::default() }, Policy::Continuous),
            (
                EngineConfig {
                    max_rows: Some(6),
                    block_size: 4,
                    kv_cache_gb: budget(10.5, 4),
                    ..EngineConfig::default()
                },
                Policy::Continuous,
            ),
            (EngineConfig { max_rows: Some(6), block_size: 4, ..EngineConfig::default() }, Policy::Static),
        ];
        for (i, (engine, policy)) in cases.into_iter().enumerate() {
            let hooks = GenerateHooks { engine, policy, ..GenerateHooks::default() };
            let (got, stats) =
                generate_stats(&m, &prompts(), &params, 0, &angle_decode, &hooks).expect("generate");
            assert_eq!(got.len(), want.len());
            let flips = got.iter().zip(&want).filter(|(g, w)| g.response_ids != w.0).count();
            assert_eq!(flips, 0, "case {i}: {flips} responses differ from the dense engine's");
            for (g, w) in got.iter().zip(&want) {
                for (a, b) in g.old_logprobs.iter().zip(&w.1) {
                    assert!((a - b).abs() < 1e-4, "case {i}: log-prob {a} vs {b}");
                }
            }
            assert_eq!(stats.tokens, lens.iter().sum::<usize>());
            if i == 2 {
                assert!(stats.preemptions > 0, "the 10-block cache should preempt");
                assert!(stats.peak_blocks <= 10 && stats.pool_blocks == 10, "{stats:?}");
            }
            if i == 1 {
                // A group of 3 is admitted alone when nothing runs, so up to 3 rows.
                assert!(stats.mean_rows() <= 3.0 + 1e-9, "{stats:?}");
            }
        }
    }

    /// A group's prompt is prefilled once and its samples share its blocks:
    /// the cache holds about the live tokens (a shared prompt once), while the
    /// static policy reserves every sequence's maximum length.
    #[test]
    fn shared_prompts_are_prefilled_once_and_the_cache_follows_live_tokens() {
        let m = tiny_model(None, 12);
        let long: Vec<Vec<u32>> =
            (0..3u32).map(|p| (0..40).map(|i| (p + i * 3) % 90 + 5).collect()).collect();
        let params =
            SamplingParams { n: 4, max_new_tokens: 30, seed: 1, ignore_eos: true, ..Default::default() };
        let forced = |p: usize, s: usize| 5 + (p * 7 + s * 5) % 20;
        let hooks = GenerateHooks { lengths: Some(&forced), ..GenerateHooks::default() };
        let (got, stats) = generate_stats(&m, &long, &params, 0, &angle_decode, &hooks).expect("generate");
        for s in &got {
            assert_eq!(s.response_len(), forced(s.prompt_index, s.sample_index));
            assert_eq!(s.finish, Finish::Length);
        }
        assert_eq!(stats.preemptions, 0);
        assert_eq!(stats.prefill_tokens, 3 * 40, "each prompt prefilled once");
        // 12 rows at once: at most the live tokens (shared prompts counted per
        // sample) plus one partly filled block per sequence.
        let bs = stats.block_size;
        assert!(
            stats.peak_blocks * bs <= stats.peak_live_tokens + 12 * bs,
            "{} blocks held for {} live tokens",
            stats.peak_blocks,
            stats.peak_live_tokens
        );
        let statik = GenerateHooks { policy: Policy::Static, ..hooks };
        let (same, st) = generate_stats(&m, &long, &params, 0, &angle_decode, &statik).expect("generate");
        let ids = |v: &[Sample]| v.iter().map(|s| s.response_ids.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&same), ids(&got));
        assert_eq!(st.peak_reserved_blocks, 12 * blocks_for(40 + 29, bs));
        assert!(st.peak_cache_bytes() > stats.peak_cache_bytes());
    }

    #[test]
    fn a_sequence_larger_than_the_budget_is_an_error() {
        let m = tiny_model(None, 13);
        let params = SamplingParams { n: 2, max_new_tokens: 100, ..Default::default() };
        let engine = EngineConfig { kv_cache_gb: budget(3.5, 16), ..EngineConfig::default() };
        let hooks = GenerateHooks { engine, ..GenerateHooks::default() };
        let err = generate_stats(&m, &prompts(), &params, 0, &angle_decode, &hooks).expect_err("too long");
        let err = err.to_string();
        assert!(
            err.contains("112 tokens needs 7 cache blocks") && err.contains("kv_cache_gb = 0.0000286"),
            "{err}"
        );
        for (bad, field) in [
            (EngineConfig { kv_cache_gb: Some(-1.0), ..Default::default() }, "kv_cache_gb"),
            (EngineConfig { max_rows: Some(0), ..Default::default() }, "max_rows"),
            (EngineConfig { block_size: 0, ..Default::default() }, "block_size"),
        ] {
            let err = bad.validate().expect_err(field).to_string();
            assert!(err.contains(&format!("rollout.engine.{field}")), "{err}");
        }
        for u in [0.0, 1.5, f64::NAN] {
            let bad = EngineConfig { gpu_memory_utilization: u, ..Default::default() };
            let err = bad.validate().expect_err("utilization").to_string();
            assert!(err.contains("rollout.engine.gpu_memory_utilization"), "{err}");
        }
        let parsed: EngineConfig =
            serde_json::from_str(r#"{"kv_cache_gb": 2.5, "max_rows": 8}"#).expect("parse");
        assert_eq!((parsed.kv_cache_gb, parsed.max_rows, parsed.block_size), (Some(2.5), Some(8), 16));
        assert!(serde_json::from_str::<EngineConfig>(r#"{"max_row": 8}"#).is_err());
        let bf16: EngineConfig = serde_json::from_str(r#"{"kv_cache_dtype": "bfloat16"}"#).expect("bf16");
        assert_eq!(bf16.kv_cache_dtype, KvCacheDtype::Bfloat16);
        assert!(serde_json::from_str::<EngineConfig>(r#"{"kv_cache_dtype": "fp8"}"#).is_err());
        assert!(parsed.enable_prefix_caching, "on by default");
        let off: EngineConfig = serde_json::from_str(r#"{"enable_prefix_caching": false}"#).expect("off");
        assert!(!off.enable_prefix_caching);
        let err = KvCacheDtype::parse("fp8", "--kv-cache-dtype").expect_err("fp8").to_string();
        assert!(err.contains("--kv-cache-dtype") && err.contains("bfloat16"), "{err}");
    }

    /// `kv_cache_dtype = "bfloat16"` under an f32 model: the pool holds twice
    /// the tokens of the same budget (half the bytes per token), and the
    /// responses are those of the f32 cache up to draws that the keys' and
    /// values' rounding flips (counted: most stay equal in this small model).
    #[test]
    fn a_bf16_cache_halves_the_bytes_per_token() {
        let m = tiny_model(None, 13);
        let params = SamplingParams { n: 2, max_new_tokens: 12, seed: 5, ..Default::default() };
        let run = |kv_cache_dtype| {
            let engine = EngineConfig { kv_cache_gb: Some(0.01), kv_cache_dtype, ..EngineConfig::default() };
            let hooks = GenerateHooks { engine, ..GenerateHooks::default() };
            generate_stats(&m, &prompts(), &params, 0, &angle_decode, &hooks).expect("rollout")
        };
        let ((f32_out, f32_stats), (bf16_out, bf16_stats)) =
            (run(KvCacheDtype::Auto), run(KvCacheDtype::Bfloat16));
        assert_eq!(f32_stats.bytes_per_token, 2 * bf16_stats.bytes_per_token);
        assert_eq!(f32_stats.tokens, bf16_stats.tokens);
        let same = f32_out.iter().zip(&bf16_out).filter(|(a, b)| a.response_ids == b.response_ids).count();
        assert!(
            2 * same >= f32_out.len(),
            "{same} of {} responses unchanged by the bf16 cache",
            f32_out.len()
        );
    }

    /// Prompts that share a system prompt of three blocks (of 4 tokens), then
    /// differ; one prompt has the same tokens as the others' second and third
    /// blocks after a different first block.
    fn shared_prefix_prompts() -> Vec<Vec<u32>> {
        let system: Vec<u32> = (0..12u32).map(|i| (i * 11 + 3) % 90 + 5).collect();
        let mut out: Vec<Vec<u32>> = (0..5u32)
            .map(|p| {
                system.iter().copied().chain((0..(2 + 3 * p)).map(|i| (p * 17 + i * 5) % 90 + 5)).collect()
            })
            .collect();
        let mut other = out[1].clone();
        other[..4].copy_from_slice(&[1, 2, 3, 4]);
        out.push(other);
        out
    }

    fn run_with(
        m: &Qwen3,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        engine: EngineConfig,
    ) -> (Vec<Sample>, EngineStats) {
        let hooks = GenerateHooks { engine, ..GenerateHooks::default() };
        generate_stats(m, prompts, params, 0, &angle_decode, &hooks).expect("rollout")
    }

    /// Prefix caching on samples exactly what it samples off, with the same
    /// log-probs, for prompts sharing a prefix of three blocks: all rows at
    /// once, refills through 2 rows, and a pool so small that sequences are
    /// preempted, recomputed from their cached blocks, and cached blocks are
    /// evicted. Both equal the dense one-at-a-time engine. The log-probs agree
    /// within 1e-5, not bit for bit, in this tiny model only: gemm multiplies a
    /// product of at most 16 x 16 outputs (here a call of up to 8 tokens through
    /// the 32-wide key projection) with another kernel, so a shorter prefill
    /// (the cached blocks skipped) rounds its own tokens differently. Models
    /// with projections wider than 128 take one kernel for every call of 2 or
    /// more tokens, and `stapo bench rollout --prefix-caching off,on` counts the
    /// responses and log-probs that differ there.
    #[test]
    fn prefix_caching_changes_no_draw() {
        let m = tiny_model(Some(3), 21);
        let prompts = shared_prefix_prompts();
        let params = SamplingParams { n: 2, max_new_tokens: 24, seed: 3, ..SamplingParams::default() };
        let want = dense_reference(&m, &prompts, &params);
        let cases = [
            EngineConfig { block_size: 4, ..EngineConfig::default() },
            EngineConfig { block_size: 4, max_rows: Some(2), ..EngineConfig::default() },
            EngineConfig {
                block_size: 4,
                max_rows: Some(6),
                kv_cache_gb: budget(14.5, 4),
                ..EngineConfig::default()
            },
        ];
        for (i, engine) in cases.into_iter().enumerate() {
            let (off, off_stats) =
                run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: false, ..engine });
            let (on, on_stats) =
                run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: true, ..engine });
            assert_eq!(on.len(), want.len());
            for ((a, b), w) in on.iter().zip(&off).zip(&want) {
                assert_eq!(a.response_ids, b.response_ids, "case {i}: caching changed a response");
                assert_eq!(a.response_ids, w.0, "case {i}: differs from the dense engine");
                for (x, y) in a.old_logprobs.iter().zip(&b.old_logprobs) {
                    assert!((x - y).abs() < 1e-5, "case {i}: log-prob {x} with caching, {y} without");
                }
                for (x, y) in a.old_logprobs.iter().zip(&w.1) {
                    assert!((x - y).abs() < 1e-4, "case {i}: log-prob {x} vs dense {y}");
                }
            }
            assert_eq!((off_stats.prefix_cache_queried_tokens, off_stats.prefix_cache_hit_tokens), (0, 0));
            assert!(on_stats.prefix_cache_hit_tokens > 0, "case {i}: {on_stats:?}");
            if i < 2 {
                // The same schedule: the cached tokens are exactly those not prefilled.
                assert_eq!(
                    on_stats.prefill_tokens + on_stats.prefix_cache_hit_tokens,
                    off_stats.prefill_tokens,
                    "case {i}"
                );
            } else {
                assert!(on_stats.prefill_tokens < off_stats.prefill_tokens, "{on_stats:?}\n{off_stats:?}");
                assert!(on_stats.preemptions > 0 && off_stats.preemptions > 0, "case 2 should preempt");
                assert!(on_stats.prefix_cache_evictions > 0, "case 2 should evict: {on_stats:?}");
                assert!(
                    on_stats.peak_blocks <= on_stats.pool_blocks && on_stats.pool_blocks == 14,
                    "{on_stats:?}"
                );
            }
        }
    }

    /// Each prompt's prefill skips the three blocks of system prompt the first
    /// one computed (and only those); the prompt whose second and third blocks
    /// hold the same tokens after a different first block hits nothing.
    #[test]
    fn a_cached_prefix_is_shared_only_after_the_same_tokens() {
        let m = tiny_model(None, 22);
        let prompts = shared_prefix_prompts();
        let params = SamplingParams { n: 3, max_new_tokens: 6, seed: 9, ..SamplingParams::default() };
        let engine = EngineConfig { block_size: 4, ..EngineConfig::default() };
        let (_, off) =
            run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: false, ..engine });
        let (_, on) = run_with(&m, &prompts, &params, engine);
        assert_eq!(off.preemptions + on.preemptions, 0);
        let total: usize = prompts.iter().map(Vec::len).sum();
        assert_eq!(off.prefill_tokens, total, "each prompt prefilled once");
        // Prompts 1..5 share the first one's 3 blocks; the last shares none.
        assert_eq!(on.prefix_cache_hit_tokens, 4 * 12, "{on:?}");
        assert_eq!(on.prefix_cache_queried_tokens, total);
        assert_eq!(on.prefill_tokens, total - 4 * 12);
        assert!((on.prefix_cache_hit_rate() - 48.0 / total as f64).abs() < 1e-12);
        let mut figures = RolloutFigures::default();
        figures.add(&on);
        figures.add(&off);
        assert_eq!(figures.prefix_cache_hit_tokens, 48);
        assert!((figures.prefix_cache_hit_rate - 48.0 / total as f64).abs() < 1e-12);
        // The last block of a prompt never comes from the cache: its last token
        // must run to give the first draw's logits. Twice the same prompt of
        // exactly 3 blocks: the second reuses 2 blocks and prefills the third.
        let same = vec![prompts[0][..12].to_vec(); 2];
        let (got, st) = run_with(&m, &same, &params, engine);
        assert_eq!(st.prefix_cache_hit_tokens, 8);
        assert_eq!(st.prefill_tokens, 12 + 4);
        assert_eq!(got.len(), 6);
    }

    /// With `kv_cache_gb` unset, a GPU's pool is `gpu_memory_utilization` of the
    /// free device memory (0.9 by default), the CPU's a quarter of the available
    /// memory; a set budget wins everywhere. The pool then holds whole blocks of
    /// that budget, capped by what the call can use.
    #[test]
    fn an_unset_budget_is_a_share_of_the_free_memory() {
        let gb = 1_000_000_000u64;
        let unset = EngineConfig::default();
        assert_eq!(budget_bytes(&unset, Memory::Device(80 * gb)), 72e9);
        assert_eq!(budget_bytes(&unset, Memory::Host(8 * gb)), 2e9);
        assert_eq!(budget_bytes(&unset, Memory::Unknown), f64::INFINITY);
        let half = EngineConfig { gpu_memory_utilization: 0.5, ..unset };
        assert_eq!(budget_bytes(&half, Memory::Device(80 * gb)), 40e9);
        let set = EngineConfig { kv_cache_gb: Some(3.0), ..half };
        assert_eq!(budget_bytes(&set, Memory::Device(80 * gb)), 3e9);
        assert_eq!(budget_bytes(&set, Memory::Host(gb)), 3e9);
        // 1,000 blocks of 16 tokens x 1,000 bytes are free: 0.9 of them is 900 blocks,
        // fewer than 64 prompts x 4 samples x 100 blocks would use.
        let prompts = vec![vec![1u32; 600]; 64];
        let params = SamplingParams { n: 4, max_new_tokens: 1001, ..SamplingParams::default() };
        let free = budget_bytes(&unset, Memory::Device(16_000_000));
        assert_eq!(pool_blocks(free, &prompts, &params, &unset, 256, 1000).expect("pool"), 900);
        // Two rows at most: the pool stops at (2 + 4) sequences of 100 blocks.
        assert_eq!(pool_blocks(free, &prompts, &params, &unset, 2, 1000).expect("pool"), 600);
        let tiny = budget_bytes(&unset, Memory::Device(1_000_000));
        let err = pool_blocks(tiny, &prompts, &params, &unset, 2, 1000).expect_err("too small").to_string();
        assert!(err.contains("needs 100 cache blocks") && err.contains("holds 56"), "{err}");
    }
}
