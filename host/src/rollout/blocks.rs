//! The bookkeeping of a paged KV cache: a pool of fixed-size blocks with
//! reference counts, a block table per sequence, and automatic prefix caching.
//!
//! Follows vLLM's block manager (`BlockPool` / `BlockSpaceManager`, Kwon et
//! al. 2023, "Efficient Memory Management for Large Language Model Serving
//! with PagedAttention"): a sequence takes a block only when a token arrives
//! that does not fit its last one, returns its blocks when it ends, and the
//! `n` samples of a prompt share the prompt's blocks by reference count. The
//! last block of a shared prompt is usually only partly filled; the first
//! sample that writes into it gets a private copy (copy on write), and the
//! last sample left holding it writes in place.
//!
//! **Prefix caching** (vLLM v1's automatic prefix caching: `kv_cache_utils.py`
//! `hash_block_tokens`, `block_pool.py` `cached_block_hash_to_block` and its
//! LRU `free_block_queue`): a full block is named by a hash of its tokens
//! chained on the hash of the block before it ([`hash_block`]), so equal
//! hashes mean equal tokens at every position up to the block's end, hence
//! equal keys and values under one model. The pool maps hashes to blocks
//! ([`BlockTable::register_full`]); a new sequence whose leading blocks' hashes
//! are in the map shares those blocks ([`BlockPool::longest_cached`],
//! [`BlockTable::from_cached`]) instead of computing them. A hashed block
//! whose last holder lets go is not wiped: it stays in the map, *free but
//! cached*, on a least-recently-used list. Taking a block for new tokens takes
//! a never-hashed free block first, then evicts the least recently freed
//! cached one (dropping its hash), so the pool never holds more than its
//! blocks. A table returns its blocks last to first, so a sequence's tail is
//! evicted before its head (a longer prefix survives), as in vLLM.
//!
//! Nothing here touches tensors: [`BlockTable::append`] says which slots the
//! new tokens go to and which block to copy first; the model side
//! (`model::paged`) does the copying and writing.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::{Error, Result};

/// The name of a full block's contents: a 128-bit hash of its tokens chained
/// on the hash of the block before it (vLLM's `BlockHash`). Two blocks with the
/// same hash hold the same tokens after the same prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(u128);

/// The hash of a block of `tokens` after the block whose hash is `parent`
/// (`None` for a sequence's first block). Deterministic: two SipHash-1-3
/// passes with fixed keys (std's `DefaultHasher::new`) and different salts,
/// 128 bits together, so that a collision (which would silently share the
/// wrong keys and values) is out of reach. The model and the cache's dtype
/// are fixed for a pool's life (one rollout), so the tokens are all a block's
/// keys and values depend on.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let half = |salt: u8| {
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    BlockHash((u128::from(half(0)) << 64) | u128::from(half(1)))
}

/// The hashes of the full blocks of `tokens`, in order, each chained on the
/// one before (the first on `parent`).
pub fn hash_blocks(parent: Option<BlockHash>, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size.max(1));
    for chunk in tokens.chunks_exact(block_size.max(1)) {
        out.push(hash_block(out.last().copied().or(parent), chunk));
    }
    out
}

/// No block (the end of the LRU list).
const NIL: u32 = u32::MAX;

/// The free but cached blocks, least recently freed first: a doubly linked
/// list threaded through block ids (vLLM's `FreeKVCacheBlockQueue`), so a hit
/// takes a block out of the middle in O(1).
#[derive(Debug, Clone)]
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    fn new(num_blocks: usize) -> Self {
        Self { prev: vec![NIL; num_blocks], next: vec![NIL; num_blocks], head: NIL, tail: NIL, len: 0 }
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        (self.prev[i], self.next[i]) = (self.tail, NIL);
        match self.tail {
            NIL => self.head = b,
            t => self.next[t as usize] = b,
        }
        self.tail = b;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        (self.prev[i], self.next[i]) = (NIL, NIL);
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        (b != NIL).then(|| {
            self.remove(b);
            b
        })
    }
}

/// Blocks of `block_size` token slots, each with a reference count, and the
/// prefix cache's map from block hashes to blocks. Block `b` holds slots
/// `b * block_size .. (b + 1) * block_size` of the cache tensors.
///
/// A block is *used* while some sequence holds it (reference count above 0)
/// and *free* otherwise; a free block is either empty (never hashed, or its
/// hash dropped) or *cached* (its hash still maps to it, on the LRU list, and
/// a later sequence may share it again). [`free_blocks`](Self::free_blocks)
/// counts both kinds: a cached free block is evicted when a new token needs
/// it. [`used_blocks`](Self::used_blocks) and [`peak_used`](Self::peak_used)
/// count held blocks only, so a pool never reports more than it holds.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    /// Empty free block ids; taken from the end (the most recently freed first,
    /// still warm in the CPU caches).
    free: Vec<u32>,
    /// Cached free blocks, least recently freed first (evicted in that order).
    lru: Lru,
    /// Each block's hash while the map names it.
    hash_of: Vec<Option<BlockHash>>,
    /// The prefix cache: hash to block, for held and cached free blocks alike.
    cached: HashMap<BlockHash, u32>,
    peak_used: usize,
    evictions: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("KV cache: block_size must be at least 1"));
        }
        if num_blocks >= u32::MAX as usize {
            return Err(Error::invalid(format!("KV cache: {num_blocks} blocks are more than u32 ids hold")));
        }
        Ok(Self {
            block_size,
            refs: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            lru: Lru::new(num_blocks),
            hash_of: vec![None; num_blocks],
            cached: HashMap::new(),
            peak_used: 0,
            evictions: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks no sequence holds: empty ones and cached ones (evicted on demand).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.lru.len
    }

    /// Free blocks that are cached (their hash still maps to them).
    pub fn cached_free_blocks(&self) -> usize {
        self.lru.len
    }

    /// Blocks the prefix cache names, held or free.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Cached free blocks taken for new tokens (their hash dropped) so far.
    pub fn evictions(&self) -> usize {
        self.evictions
    }

    /// Blocks some sequence holds.
    pub fn used_blocks(&self) -> usize {
        self.refs.len() - self.free_blocks()
    }

    /// The most blocks held at once since the pool was made.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// The reference count of block `b`.
    pub fn refs(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// The block the prefix cache names `h`, if any.
    pub fn lookup(&self, h: BlockHash) -> Option<u32> {
        self.cached.get(&h).copied()
    }

    /// The blocks of the longest run of `hashes`, from the first, that the
    /// prefix cache holds (vLLM's `find_longest_cache_hit`). Changes nothing.
    pub fn longest_cached(&self, hashes: &[BlockHash]) -> Vec<u32> {
        hashes.iter().map_while(|&h| self.lookup(h)).collect()
    }

    /// How many of `blocks` are free (cached): sharing them takes them off the
    /// free count, as new blocks would.
    pub fn free_among(&self, blocks: &[u32]) -> usize {
        blocks.iter().filter(|&&b| self.refs[b as usize] == 0).count()
    }

    /// Names block `b` (full, its keys and values written or being written in
    /// this step) by `h` in the prefix cache. False, with nothing changed, when
    /// another block already has that name (`b` then stays unnamed and is
    /// emptied when freed) or `b` has a name.
    fn register(&mut self, b: u32, h: BlockHash) -> bool {
        if self.hash_of[b as usize].is_some() || self.cached.contains_key(&h) {
            return false;
        }
        self.cached.insert(h, b);
        self.hash_of[b as usize] = Some(h);
        true
    }

    /// Drops every name of the prefix cache: held blocks stay held, free cached
    /// ones become empty. For a pool kept across a weight update, whose blocks
    /// hold keys and values of the weights before it: no later sequence may
    /// share them as if the new weights had computed them.
    pub fn forget_names(&mut self) {
        while let Some(b) = self.lru.pop_front() {
            self.free.push(b);
        }
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.cached.clear();
    }

    /// Starts counting [`peak_used`](Self::peak_used) again from the blocks held now
    /// (a pool kept from one call to the next reports each call's peak).
    pub fn reset_peak(&mut self) {
        self.peak_used = self.used_blocks();
    }

    fn note_peak(&mut self) {
        self.peak_used = self.peak_used.max(self.used_blocks());
    }

    /// A free block with one reference: an empty one first, else the least
    /// recently freed cached one, whose hash is dropped. `None` when every
    /// block is held.
    fn take(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.lru.pop_front()?;
                if let Some(h) = self.hash_of[b as usize].take() {
                    self.cached.remove(&h);
                }
                self.evictions += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        self.note_peak();
        Some(b)
    }

    /// One more reference to `b`; a cached free block leaves the LRU list.
    fn share(&mut self, b: u32) {
        if self.refs[b as usize] == 0 {
            self.lru.remove(b);
        }
        self.refs[b as usize] += 1;
        self.note_peak();
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released more often than taken");
        *r -= 1;
        if *r == 0 {
            if self.hash_of[b as usize].is_some() {
                self.lru.push_back(b);
            } else {
                self.free.push(b);
            }
        }
    }
}

/// Where the next tokens of a sequence go: their slots, and a block to copy
/// into a new one before writing (copy on write of a shared last block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// One slot per appended token, in order.
    pub slots: Vec<u32>,
    /// `(from, to)`: copy block `from` to block `to` before writing the slots.
    pub copy: Option<(u32, u32)>,
}

/// The blocks of one sequence, in order, how many of its tokens have slots,
/// and the hashes of its leading full blocks (for the prefix cache).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
    hashes: Vec<BlockHash>,
    /// Names none of its blocks any more ([`stop_naming`](Self::stop_naming)).
    unnamed: bool,
}

impl BlockTable {
    /// A table over `blocks`, full blocks from the prefix cache whose hashes
    /// are `hashes` (each gains a reference): the sequence's first
    /// `blocks.len() * block_size` tokens need no computing.
    pub fn from_cached(pool: &mut BlockPool, blocks: &[u32], hashes: &[BlockHash]) -> BlockTable {
        debug_assert_eq!(blocks.len(), hashes.len());
        for &b in blocks {
            pool.share(b);
        }
        BlockTable {
            blocks: blocks.to_vec(),
            len: blocks.len() * pool.block_size,
            hashes: hashes.to_vec(),
            unnamed: false,
        }
    }

    /// Tokens with a slot.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no token has a slot.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block ids, in token order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The hashes of the leading full blocks named so far.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Positions of the tokens in full blocks not yet named: the tokens
    /// [`register_full`](Self::register_full) wants.
    pub fn unnamed_full(&self, block_size: usize) -> std::ops::Range<usize> {
        if self.unnamed {
            return 0..0;
        }
        self.hashes.len() * block_size..self.len / block_size * block_size
    }

    /// Names no more of its blocks in the prefix cache: a sequence whose
    /// earlier keys and values an older policy computed (kept across a weight
    /// update) writes blocks no other sequence must share.
    pub fn stop_naming(&mut self) {
        self.unnamed = true;
    }

    /// Names the full blocks not yet named, given their `tokens` (the
    /// positions [`unnamed_full`](Self::unnamed_full) gives, in order), and
    /// enters each in `pool`'s prefix cache unless an equal block is there.
    pub fn register_full(&mut self, pool: &mut BlockPool, tokens: &[u32]) {
        let bs = pool.block_size;
        debug_assert_eq!(tokens.len(), self.unnamed_full(bs).len());
        for chunk in tokens.chunks_exact(bs) {
            let h = hash_block(self.hashes.last().copied(), chunk);
            pool.register(self.blocks[self.hashes.len()], h);
            self.hashes.push(h);
        }
    }

    /// Blocks [`append`](Self::append) takes from `pool` for `n` more tokens:
    /// the new blocks, plus one when the last block is partly filled and shared.
    pub fn blocks_needed(&self, pool: &BlockPool, n: usize) -> usize {
        let bs = pool.block_size;
        let fresh = (self.len + n).div_ceil(bs) - self.blocks.len();
        let cow =
            n > 0 && !self.len.is_multiple_of(bs) && self.blocks.last().is_some_and(|&b| pool.refs(b) > 1);
        fresh + usize::from(cow)
    }

    /// Gives the next `n` tokens slots, taking blocks from `pool`. Returns
    /// `None`, with nothing changed, when the pool has too few free blocks
    /// (check [`blocks_needed`](Self::blocks_needed) first).
    pub fn append(&mut self, pool: &mut BlockPool, n: usize) -> Option<Appended> {
        if self.blocks_needed(pool, n) > pool.free_blocks() {
            return None;
        }
        let bs = pool.block_size;
        let mut copy = None;
        if n > 0 && !self.len.is_multiple_of(bs) {
            let last = self.blocks.len() - 1;
            let old = self.blocks[last];
            if pool.refs(old) > 1 {
                let new = pool.take()?;
                pool.release(old);
                self.blocks[last] = new;
                copy = Some((old, new));
            }
        }
        let mut slots = Vec::with_capacity(n);
        for pos in self.len..self.len + n {
            if pos / bs == self.blocks.len() {
                self.blocks.push(pool.take()?);
            }
            slots.push(self.blocks[pos / bs] * bs as u32 + (pos % bs) as u32);
        }
        self.len += n;
        Some(Appended { slots, copy })
    }

    /// A second table over the same blocks (each gains a reference): a sample
    /// that reads its prompt's cache without copying it.
    pub fn fork(&self, pool: &mut BlockPool) -> BlockTable {
        for &b in &self.blocks {
            pool.share(b);
        }
        self.clone()
    }

    /// Returns every block to `pool`, last first (a block goes back to the
    /// free list when its last holder releases it; a cached one joins the LRU
    /// list, so the sequence's tail is evicted before its head), and empties
    /// the table.
    pub fn release(&mut self, pool: &mut BlockPool) {
        for &b in self.blocks.iter().rev() {
            pool.release(b);
        }
        self.blocks.clear();
        self.hashes.clear();
        self.len = 0;
        self.unnamed = false;
    }
}

/// Blocks of `block_size` tokens that `tokens` tokens fill.
pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size.max(1))
}
