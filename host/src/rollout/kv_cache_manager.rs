//! The KV-cache manager (vLLM v1's `kv_cache_manager.py`; mistral.rs's
//! `block_engine.rs` + `cache_engine.rs`): owns the block budget, the pool of
//! blocks ([`super::blocks`]) and the key/value tensors they index
//! (`model::PagedKvCache`), and gives a unit's tokens their slots.
//!
//! The budget is `kv_cache_gb`, or a share of the memory the device has
//! (`Memory`: on the CPU the host's available memory, read by
//! [`host_memory`], the one reader of /proc/meminfo; on CUDA the free device
//! memory), divided into whole blocks of [`PagedKvCache::bytes_per_token`]
//! (the one KV-bytes formula) and capped by what the call can use.
//!
//! With automatic prefix caching (`enable_prefix_caching`, vLLM's name and
//! scheme), every full block a unit writes is named by a hash chained over its
//! tokens, and a unit being admitted first looks up the longest run of its
//! leading full blocks already in the cache (`KvCacheManager::cached_prefix`).

use super::blocks::{blocks_for, hash_blocks, BlockHash, BlockPool, BlockTable};
use super::config::{EngineConfig, CPU_CACHE_FRACTION};
use super::request::{Kind, Requests};
use super::SamplingParams;
use crate::model::{PagedKvCache, Qwen3};
use crate::{Error, Result};

/// The block pool and the cache tensors of one call.
pub(super) struct KvCacheManager {
    pub(super) pool: BlockPool,
    cache: PagedKvCache,
    /// Prefix caching on (asked for, and allowed by the scheduling policy).
    caching: bool,
    bytes_per_token: usize,
}

impl KvCacheManager {
    /// A pool for `prompts` x `params.n` sequences under `cfg`'s budget,
    /// `max_rows` decoded at once.
    pub(super) fn new(
        model: &Qwen3,
        cfg: &EngineConfig,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        max_rows: usize,
        caching: bool,
    ) -> Result<Self> {
        let cache_dtype = PagedKvCache::pool_dtype(model, cfg.kv_cache_dtype.dtype());
        let bytes_per_token = PagedKvCache::bytes_per_token(model.config(), cache_dtype);
        let budget_bytes = budget_bytes(cfg, memory(model)?);
        let num_blocks = pool_blocks(budget_bytes, prompts, params, cfg, max_rows, bytes_per_token)?;
        Ok(Self {
            cache: PagedKvCache::with_dtype(model, num_blocks, cfg.block_size, Some(cache_dtype))?,
            pool: BlockPool::new(num_blocks, cfg.block_size)?,
            caching,
            bytes_per_token,
        })
    }

    /// Whether this pool, kept from an earlier call, can serve a call of
    /// `prompts` under `cfg` with prefix caching `caching`: the same model shape,
    /// cache dtype, device, block size and caching, every sequence of the call
    /// fits it, and it is within `kv_cache_gb` when that is set. (With the budget
    /// unset, the share of the free memory it was sized by is not asked again:
    /// the pool itself is what now occupies that memory.)
    pub(super) fn serves(
        &self,
        model: &Qwen3,
        cfg: &EngineConfig,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        caching: bool,
    ) -> bool {
        let bs = cfg.block_size;
        let longest = prompts.iter().map(|p| p.len() + params.max_new_tokens - 1).max().unwrap_or(0);
        let bytes = (self.pool.num_blocks() * bs * self.bytes_per_token) as f64;
        self.cache.serves(model, cfg.kv_cache_dtype.dtype())
            && self.pool.block_size() == bs
            && self.cache.block_size() == bs
            && self.caching == caching
            && blocks_for(longest, bs) <= self.pool.num_blocks()
            && cfg.kv_cache_gb.is_none_or(|gb| bytes <= gb * 1e9 * (1.0 + 1e-9))
    }

    /// The cache tensors the model call reads and writes.
    pub(super) fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Whether prefix caching is on.
    pub(super) fn caching(&self) -> bool {
        self.caching
    }

    /// Bytes of cache per token.
    pub(super) fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    /// Tokens per block.
    pub(super) fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// The prefix cache's blocks for a unit being admitted: the longest run of
    /// its leading full blocks in the cache, short of the block holding its
    /// last token (which must run to give logits), and their hashes.
    pub(super) fn cached_prefix(&self, reqs: &Requests, kind: Kind) -> (Vec<u32>, Vec<BlockHash>) {
        if !self.caching {
            return (Vec::new(), Vec::new());
        }
        let bs = self.pool.block_size();
        let full = (reqs.total(kind) - 1) / bs;
        let mut hashes = hash_blocks(None, &reqs.tokens(kind, 0..full * bs), bs);
        let blocks = self.pool.longest_cached(&hashes);
        hashes.truncate(blocks.len());
        (blocks, hashes)
    }

    /// Slots for `n` more tokens of a unit (copying a shared last block
    /// first); with caching, names the blocks this fills.
    pub(super) fn append(
        &mut self,
        reqs: &Requests,
        kind: Kind,
        table: &mut BlockTable,
        n: usize,
    ) -> Result<()> {
        let a = table
            .append(&mut self.pool, n)
            .ok_or_else(|| Error::invalid("rollout engine: KV cache blocks miscounted"))?;
        if let Some((from, to)) = a.copy {
            self.cache.copy_block(from, to)?;
        }
        if self.caching {
            let toks = reqs.tokens(kind, table.unnamed_full(self.pool.block_size()));
            table.register_full(&mut self.pool, &toks);
        }
        Ok(())
    }
}

/// Blocks in the pool: the budget, but no more than this call can use (all
/// its sequences at full length, or `max_rows` of them and one group more).
/// A sequence that cannot fit the whole budget is an error.
pub(super) fn pool_blocks(
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
pub(super) enum Memory {
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
pub(super) fn budget_bytes(cfg: &EngineConfig, mem: Memory) -> f64 {
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
        // 8 GB where /proc/meminfo cannot be read.
        candle_core::Device::Cpu => Ok(Memory::Host(host_memory().map_or(8_000_000_000, |m| m.available))),
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

/// The host's memory in bytes, from /proc/meminfo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal`: the machine's memory.
    pub total: u64,
    /// `MemAvailable`: what this process can take without swapping.
    pub available: u64,
}

/// Reads [`HostMemory`] from /proc/meminfo; `None` where it cannot be read
/// (not Linux, or a field missing).
pub fn host_memory() -> Option<HostMemory> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// [`HostMemory`] of the text of /proc/meminfo (`MemTotal:  16318504 kB`).
fn parse_meminfo(text: &str) -> Option<HostMemory> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some(HostMemory { total: field("MemTotal")?, available: field("MemAvailable")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       16318504 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n";
        let m = parse_meminfo(text).expect("parsed");
        assert_eq!(m, HostMemory { total: 16318504 * 1024, available: 8_000_000 * 1024 });
        assert_eq!(parse_meminfo("MemTotal: 12 kB\n"), None, "no MemAvailable");
        if let Some(m) = host_memory() {
            assert!(m.available <= m.total && m.total > 0, "{m:?}");
        }
    }
}
