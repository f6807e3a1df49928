//! What one rollout did ([`EngineStats`]): tokens, model calls, rows per
//! call, cache blocks, preemptions, prefix-cache hits and the seconds of each
//! phase of a step (vLLM v1's `SchedulerStats` / `IterationStats`).

use serde::{Deserialize, Serialize};

use crate::model::budget;

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
    /// Rows of each decode step, in order (for the rows per call at the end of
    /// a rollout, where the long responses run alone); not serialized.
    #[serde(skip)]
    pub decode_rows: Vec<u32>,
    /// Bytes the decode steps had to read at the least: weights and live
    /// keys and values ([`budget::decode_step_bytes`]), summed over the steps.
    #[serde(default)]
    pub decode_bytes: u64,
    /// Device work of the decode steps ([`budget::Counts`]): kernel launches
    /// (per decoder layer among them) and copies to the host.
    #[serde(default)]
    pub decode_counts: budget::Counts,
    /// The decode path that ran: `kernels, fused projections` (the fused CPU
    /// kernels or the project's CUDA kernels over `model::DecodeWeights`) or
    /// `composed` (`--kernels composed`).
    #[serde(default)]
    pub decode_path: String,
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

    /// Rows per decode step over the last `share` of the decode steps (at least
    /// one step; 0 without any): [`rows_per_call_tail`] of [`EngineStats::decode_rows`].
    pub fn decode_rows_tail(&self, share: f64) -> f64 {
        rows_per_call_tail(&self.decode_rows, share)
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

/// Mean of `rows` over its last `share` (at least one entry; 0 when empty):
/// rows per decode call at the end of a rollout.
pub fn rows_per_call_tail(rows: &[u32], share: f64) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    let k = ((rows.len() as f64 * share).ceil() as usize).clamp(1, rows.len());
    rows[rows.len() - k..].iter().map(|&r| r as f64).sum::<f64>() / k as f64
}

/// Mean of `rows` (0 when empty).
pub fn rows_per_call(rows: &[u32]) -> f64 {
    rows.iter().map(|&r| r as f64).sum::<f64>() / rows.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_per_call_over_the_last_tenth() {
        // 20 calls: the last 2 (10%) decode 1 and 3 rows.
        let mut rows = vec![64u32; 18];
        rows.extend([1, 3]);
        assert_eq!(rows_per_call_tail(&rows, 0.1), 2.0);
        assert_eq!(rows_per_call(&rows), (18.0 * 64.0 + 4.0) / 20.0);
        // 5 calls: 10% rounds up to one call.
        assert_eq!(rows_per_call_tail(&[9, 9, 9, 9, 5], 0.1), 5.0);
        assert_eq!((rows_per_call_tail(&[], 0.1), rows_per_call(&[])), (0.0, 0.0));
    }
}
