//! The engine's settings (`rollout.engine` of a run's config: the fields of
//! vLLM's `CacheConfig` and `SchedulerConfig` it has, under vLLM's names where
//! they exist, `max_rows` for `max_num_seqs`) and the defaults they fall back on.

use serde::{Deserialize, Serialize};

use crate::model::Qwen3;
use crate::{Error, Result};

/// Rows decoded at once on the CPU by default. Measured on the 2-core AVX2 machine
/// (2026-12-04, quiet; `stapo bench rollout --lengths lognormal:50:1000 --prompts 8
/// --max-new 1024 --rows-sweep 16,32,64`, 16.8M shape): 521, 685 and 818 tok/s: a
/// decode step streams every weight once whatever its rows, so fuller steps win.
/// (On an AVX-512 machine, 16 rows had beaten 64 with the dense cache.)
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
