//! The bookkeeping of a paged KV cache: a pool of fixed-size blocks with
//! reference counts, and a block table per sequence.
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
//! Nothing here touches tensors: [`BlockTable::append`] says which slots the
//! new tokens go to and which block to copy first; the model side
//! (`model::paged`) does the copying and writing.

use crate::{Error, Result};

/// Blocks of `block_size` token slots, each with a reference count. Block `b`
/// holds slots `b * block_size .. (b + 1) * block_size` of the cache tensors.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    /// Free block ids; taken from the end (the most recently freed first, still
    /// warm in the CPU caches).
    free: Vec<u32>,
    peak_used: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("KV cache: block_size must be at least 1"));
        }
        if num_blocks > u32::MAX as usize {
            return Err(Error::invalid(format!("KV cache: {num_blocks} blocks are more than u32 ids hold")));
        }
        Ok(Self {
            block_size,
            refs: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            peak_used: 0,
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

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks some sequence holds.
    pub fn used_blocks(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// The most blocks held at once since the pool was made.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    /// The reference count of block `b`.
    pub fn refs(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// A free block with one reference, or `None` when the pool is exhausted.
    fn take(&mut self) -> Option<u32> {
        let b = self.free.pop()?;
        self.refs[b as usize] = 1;
        self.peak_used = self.peak_used.max(self.used_blocks());
        Some(b)
    }

    fn share(&mut self, b: u32) {
        self.refs[b as usize] += 1;
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released more often than taken");
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
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

/// The blocks of one sequence, in order, and how many of its tokens have slots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
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

    /// Returns every block to `pool` (a block goes back to the free list when
    /// its last holder releases it) and empties the table.
    pub fn release(&mut self, pool: &mut BlockPool) {
        for &b in &self.blocks {
            pool.release(b);
        }
        self.blocks.clear();
        self.len = 0;
    }
}

/// Blocks of `block_size` tokens that `tokens` tokens fill.
pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_as_tokens_arrive_and_returned_at_the_end() {
        let mut pool = BlockPool::new(4, 4).expect("pool");
        let mut t = BlockTable::default();
        let a = t.append(&mut pool, 5).expect("room");
        assert_eq!(t.blocks().len(), 2);
        assert_eq!(a.slots.len(), 5);
        assert_eq!(a.copy, None);
        // Slots follow the block table: block b holds slots 4b..4b+4.
        let b = t.blocks().to_vec();
        let want: Vec<u32> = (0..5).map(|p| b[p / 4] * 4 + (p % 4) as u32).collect();
        assert_eq!(a.slots, want);
        assert_eq!(pool.used_blocks(), 2);
        // Three more tokens fit the second block: no new block.
        assert_eq!(t.blocks_needed(&pool, 3), 0);
        t.append(&mut pool, 3).expect("room");
        assert_eq!(pool.used_blocks(), 2);
        assert_eq!(t.blocks_needed(&pool, 1), 1);
        t.release(&mut pool);
        assert_eq!((pool.used_blocks(), pool.free_blocks(), pool.peak_used()), (0, 4, 2));
        assert!(t.is_empty());
    }

    #[test]
    fn an_exhausted_pool_refuses_and_changes_nothing() {
        let mut pool = BlockPool::new(2, 4).expect("pool");
        let mut t = BlockTable::default();
        t.append(&mut pool, 6).expect("room");
        let before = (t.clone(), pool.free_blocks());
        assert_eq!(t.blocks_needed(&pool, 3), 1);
        assert!(t.append(&mut pool, 3).is_none());
        assert_eq!((t, pool.free_blocks()), before);
        assert!(BlockPool::new(3, 0).is_err());
    }

    /// n samples share the prompt's blocks; the partly filled last block is
    /// copied for each writer but the last, who writes in place.
    #[test]
    fn forked_tables_share_full_blocks_and_copy_the_partial_one_on_write() {
        let mut pool = BlockPool::new(16, 4).expect("pool");
        let mut prompt = BlockTable::default();
        prompt.append(&mut pool, 6).expect("room"); // one full block, one with 2 of 4
        let (full, partial) = (prompt.blocks()[0], prompt.blocks()[1]);
        let mut samples: Vec<BlockTable> = (0..3).map(|_| prompt.fork(&mut pool)).collect();
        prompt.release(&mut pool);
        assert_eq!((pool.refs(full), pool.refs(partial), pool.used_blocks()), (3, 3, 2));
        let mut copies = Vec::new();
        for s in &mut samples {
            let need = s.blocks_needed(&pool, 1);
            let a = s.append(&mut pool, 1).expect("room");
            assert_eq!(need, usize::from(a.copy.is_some()));
            copies.push(a.copy);
            // The new token sits at position 6: offset 2 of the table's second block.
            assert_eq!(a.slots, vec![s.blocks()[1] * 4 + 2]);
        }
        assert!(copies[0].is_some_and(|(from, _)| from == partial));
        assert!(copies[1].is_some_and(|(from, _)| from == partial));
        assert_eq!(copies[2], None, "the last holder writes in place");
        assert_eq!(samples[2].blocks()[1], partial);
        assert_eq!(pool.refs(full), 3);
        assert_eq!(pool.used_blocks(), 4);
        // Filling the block to 4 and starting the next: fresh blocks, no copies.
        for s in &mut samples {
            let a = s.append(&mut pool, 2).expect("room");
            assert_eq!(a.copy, None);
        }
        assert_eq!(pool.used_blocks(), 7);
        for s in &mut samples {
            s.release(&mut pool);
        }
        assert_eq!(pool.used_blocks(), 0);
        assert_eq!(pool.peak_used(), 7);
    }

    #[test]
    fn a_shared_full_last_block_is_not_copied() {
        let mut pool = BlockPool::new(8, 4).expect("pool");
        let mut prompt = BlockTable::default();
        prompt.append(&mut pool, 8).expect("room");
        let mut a = prompt.fork(&mut pool);
        let mut b = prompt.fork(&mut pool);
        prompt.release(&mut pool);
        assert_eq!(a.blocks_needed(&pool, 1), 1);
        let x = a.append(&mut pool, 1).expect("room");
        let y = b.append(&mut pool, 1).expect("room");
        assert_eq!((x.copy, y.copy), (None, None));
        assert_eq!(a.blocks()[..2], b.blocks()[..2]);
        assert_ne!(a.blocks()[2], b.blocks()[2]);
        assert_eq!(blocks_for(9, 4), 3);
    }
}
