//! Continuous batching (Yu et al. 2022, "Orca", iteration-level scheduling;
//! vLLM's default): every step, waiting units are admitted first come, first
//! served, while there are rows (`max_rows`), prefill budget
//! ([`PREFILL_TOKENS`]: chunked prefill) and free blocks for them, so a
//! finished response's row is refilled at the next step. When the pool runs
//! out, the newest running units are preempted and recomputed later.
//!
//! A unit being admitted first takes the longest run of its leading blocks
//! the prefix cache holds and prefills only the rest.

use super::policy::{Admission, Scheduling};
use crate::rollout::blocks::{blocks_for, BlockTable};
use crate::Result;

/// Prompt tokens prefilled per step at most (vLLM's chunked prefill budget):
/// bounds how long a step of the decoding rows can take.
pub const PREFILL_TOKENS: usize = 512;

/// Continuous batching.
#[derive(Debug, Default)]
pub(super) struct Continuous;

impl Scheduling for Continuous {
    fn prefill_budget(&self) -> usize {
        PREFILL_TOKENS
    }

    /// Admits waiting units while rows, the prefill budget and free blocks
    /// allow (keeping one free block per running unit for its next token).
    fn admit(&mut self, a: &mut Admission<'_, '_>) -> Result<()> {
        let mut rows: usize = a.queues.running.iter().map(|u| a.reqs.rows_of(u.kind)).sum();
        while let Some(&kind) = a.queues.waiting.front() {
            let r = a.reqs.rows_of(kind);
            if a.budget == 0 || (rows > 0 && rows + r > a.max_rows) {
                break;
            }
            let total = a.reqs.total(kind);
            let (hit, hashes) = a.kv.cached_prefix(a.reqs, kind);
            let start = hit.len() * a.kv.block_size();
            let n = (total - start).min(a.budget);
            // New blocks, plus cached free blocks the hit takes off the free list.
            let pool = &a.kv.pool;
            let need = blocks_for(start + n, pool.block_size()) - hit.len() + pool.free_among(&hit);
            if need + a.queues.running.len() > pool.free_blocks() && !a.queues.running.is_empty() {
                break;
            }
            if need > pool.free_blocks() {
                break;
            }
            a.queues.waiting.pop_front();
            let table = BlockTable::from_cached(&mut a.kv.pool, &hit, &hashes);
            a.start(kind, table, n)?;
            if a.kv.caching() {
                a.stats.prefix_cache_queried_tokens += total;
                a.stats.prefix_cache_hit_tokens += start;
            }
            (a.budget, rows) = (a.budget - n, rows + r);
        }
        Ok(())
    }
}
