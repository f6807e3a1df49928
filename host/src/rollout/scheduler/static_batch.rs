//! Static batching, the engine continuous batching replaced, kept as the
//! benchmark's baseline: when nothing runs, a whole chunk of `max_rows / n`
//! prompts is admitted at once with every sequence's full length reserved
//! (what a dense cache allocates), and the next chunk waits until the last
//! response of this one ends. No chunked prefill, no preemption (a full pool
//! is an error), no prefix caching.

use super::policy::{Admission, Scheduling};
use crate::rollout::blocks::BlockTable;
use crate::rollout::kv_cache_manager::KvCacheManager;
use crate::rollout::request::Kind;
use crate::{Error, Result};

/// Static batching.
#[derive(Debug, Default)]
pub(super) struct StaticBatch;

impl Scheduling for StaticBatch {
    fn prefill_budget(&self) -> usize {
        usize::MAX
    }

    fn prefix_caching(&self) -> bool {
        false
    }

    fn may_preempt(&self, kv: &KvCacheManager) -> Result<()> {
        Err(Error::invalid(format!(
            "rollout engine (static policy): the KV cache of {} blocks is full",
            kv.pool.num_blocks()
        )))
    }

    /// When nothing runs, admits the next chunk of `max_rows / n` prompts
    /// whole, reserving every sequence's maximum length.
    fn admit(&mut self, a: &mut Admission<'_, '_>) -> Result<()> {
        if !a.queues.running.is_empty() {
            return Ok(());
        }
        let per_chunk = (a.max_rows / a.reqs.n()).max(1).min(a.queues.waiting.len());
        let bs = a.kv.block_size();
        let chunk: Vec<Kind> = a.queues.waiting.drain(..per_chunk).collect();
        let reserved: usize = chunk.iter().map(|&k| a.reqs.full_blocks(k, bs)).sum();
        if reserved > a.kv.pool.num_blocks() {
            return Err(Error::invalid(format!(
                "rollout engine (static policy): a chunk reserves {reserved} blocks, the KV cache holds {}",
                a.kv.pool.num_blocks()
            )));
        }
        a.stats.peak_reserved_blocks = a.stats.peak_reserved_blocks.max(reserved);
        for kind in chunk {
            let len = a.reqs.total(kind);
            a.start(kind, BlockTable::default(), len)?;
        }
        Ok(())
    }
}
