//! The block pool and tables against hand-counted blocks: allocation as tokens
//! arrive, an exhausted pool, forks and copy on write, chained hashes, the
//! prefix cache's reuse and least-recently-used eviction.

use super::blocks::*;

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

/// A table of `tokens`, its full blocks named in `pool`'s prefix cache.
fn filled(pool: &mut BlockPool, tokens: &[u32]) -> BlockTable {
    let mut t = BlockTable::default();
    t.append(pool, tokens.len()).expect("room");
    let toks = tokens[t.unnamed_full(pool.block_size())].to_vec();
    t.register_full(pool, &toks);
    t
}

/// A block's hash is chained on its parent's: the same tokens after a
/// different prefix get another hash; the same sequence always the same.
#[test]
fn block_hashes_chain_on_the_prefix() {
    let a = [1u32, 2, 3, 4, 5, 6, 7, 8];
    let b = [9u32, 2, 3, 4, 5, 6, 7, 8];
    let (ha, hb) = (hash_blocks(None, &a, 4), hash_blocks(None, &b, 4));
    assert_eq!(ha.len(), 2);
    assert_eq!(ha, hash_blocks(None, &a, 4), "deterministic");
    assert_eq!(ha[0], hash_block(None, &a[..4]));
    assert_eq!(ha[1], hash_block(Some(ha[0]), &a[4..]));
    assert_ne!(ha[0], hb[0]);
    assert_ne!(ha[1], hb[1], "the same tokens after another block");
    assert_ne!(hash_block(None, &a[4..]), ha[1], "the same tokens at the start");
    assert_eq!(hash_blocks(None, &a[..7], 4).len(), 1, "partial blocks have no hash");
    let mut pool = BlockPool::new(8, 4).expect("pool");
    let t = filled(&mut pool, &a);
    assert_eq!(t.hashes(), &ha[..]);
    assert_eq!(pool.longest_cached(&ha), t.blocks());
    assert_eq!(pool.longest_cached(&hb), Vec::<u32>::new());
    assert_eq!(pool.longest_cached(&[ha[0], hb[1]]), t.blocks()[..1]);
}

/// Freed named blocks stay cached and free; a new table shares them;
/// new tokens take empty blocks first, then evict the least recently
/// freed cached block (a table's tail before its head); the pool never
/// hands out more blocks than it has.
#[test]
fn cached_free_blocks_are_shared_again_then_evicted_least_recent_first() {
    let mut pool = BlockPool::new(5, 2).expect("pool");
    let toks = [1u32, 2, 3, 4, 5, 6, 7];
    let mut a = filled(&mut pool, &toks); // 3 full blocks and one with 1 token
    let (blocks, hashes) = (a.blocks().to_vec(), a.hashes().to_vec());
    assert_eq!((hashes.len(), pool.cached_blocks(), pool.used_blocks()), (3, 3, 4));
    a.release(&mut pool);
    // The 3 named blocks are cached and free; the partial one is empty.
    assert_eq!((pool.used_blocks(), pool.free_blocks(), pool.cached_free_blocks()), (0, 5, 3));
    assert_eq!(pool.longest_cached(&hashes), blocks[..3]);
    // Shared again: they leave the free count.
    let mut b = BlockTable::from_cached(&mut pool, &blocks[..2], &hashes[..2]);
    assert_eq!((b.len(), pool.used_blocks(), pool.free_blocks(), pool.cached_free_blocks()), (4, 2, 3, 1));
    assert_eq!(pool.refs(blocks[0]), 1);
    b.release(&mut pool);
    assert_eq!((pool.free_blocks(), pool.cached_free_blocks(), pool.evictions()), (5, 3, 0));
    // Cached free, least recent first: blocks[2] (freed with a), then b's
    // blocks[1] and blocks[0] (its tail first). 2 empty blocks go first.
    let mut c = BlockTable::default();
    c.append(&mut pool, 4).expect("room");
    assert_eq!((pool.evictions(), pool.cached_blocks()), (0, 3));
    c.append(&mut pool, 2).expect("room");
    assert_eq!(pool.evictions(), 1);
    assert_eq!(pool.lookup(hashes[2]), None, "the least recently freed block went first");
    assert_eq!(pool.longest_cached(&hashes), blocks[..2]);
    c.append(&mut pool, 2).expect("room");
    assert_eq!(pool.longest_cached(&hashes), blocks[..1], "the tail before the head");
    c.append(&mut pool, 2).expect("room");
    assert_eq!((pool.evictions(), pool.cached_blocks(), pool.free_blocks()), (3, 0, 0));
    assert!(c.append(&mut pool, 1).is_none(), "5 blocks are all the pool has");
    assert_eq!((pool.used_blocks(), pool.peak_used()), (5, 5));
}

/// A block some table holds is never evicted: a pool whose free blocks
/// are used up refuses rather than take a held cached block.
#[test]
fn a_held_cached_block_is_never_evicted() {
    let mut pool = BlockPool::new(4, 2).expect("pool");
    let a = filled(&mut pool, &[1, 2, 3, 4]);
    let mut b = BlockTable::default();
    b.append(&mut pool, 4).expect("room");
    assert_eq!(b.blocks_needed(&pool, 1), 1);
    assert!(b.append(&mut pool, 1).is_none());
    assert_eq!(pool.longest_cached(a.hashes()), a.blocks());
    assert_eq!((pool.evictions(), pool.refs(a.blocks()[0])), (0, 1));
}

/// A second block with the tokens of a cached one is not named (the cache
/// keeps the first): freed, it is empty, not cached.
#[test]
fn an_equal_block_computed_twice_is_cached_once() {
    let mut pool = BlockPool::new(4, 2).expect("pool");
    let a = filled(&mut pool, &[1, 2]);
    let mut b = filled(&mut pool, &[1, 2]);
    assert_eq!(a.hashes(), b.hashes());
    assert_eq!((pool.cached_blocks(), pool.lookup(a.hashes()[0])), (1, Some(a.blocks()[0])));
    b.release(&mut pool);
    assert_eq!((pool.free_blocks(), pool.cached_free_blocks()), (3, 0));
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

/// Forgetting the prefix cache's names (a pool kept across a weight update):
/// nothing is found any more, held blocks stay held, cached free blocks become
/// empty free ones, and a table that stopped naming fills blocks no one finds.
#[test]
fn forgotten_names_are_found_no_more_and_stopped_tables_name_nothing() {
    let a = [1u32, 2, 3, 4, 5, 6, 7, 8];
    let b = [11u32, 12, 13, 14];
    let mut pool = BlockPool::new(8, 4).expect("pool");
    let mut held = filled(&mut pool, &a);
    let mut freed = filled(&mut pool, &b);
    freed.release(&mut pool);
    assert_eq!((pool.used_blocks(), pool.cached_free_blocks(), pool.cached_blocks()), (2, 1, 3));
    pool.forget_names();
    assert_eq!((pool.used_blocks(), pool.cached_free_blocks(), pool.cached_blocks()), (2, 0, 0));
    assert_eq!(pool.free_blocks(), 6);
    assert!(pool.longest_cached(&hash_blocks(None, &a, 4)).is_empty());
    assert!(pool.longest_cached(&hash_blocks(None, &b, 4)).is_empty());
    // The held table goes on and stops naming: four more tokens fill a block no one finds.
    held.stop_naming();
    held.append(&mut pool, 4).expect("room");
    assert_eq!(held.unnamed_full(4), 0..0);
    held.register_full(&mut pool, &[]);
    assert_eq!(pool.cached_blocks(), 0);
    // A new table over the same tokens computes them again, and names its blocks.
    let fresh = filled(&mut pool, &a);
    assert_eq!(pool.cached_blocks(), 2);
    assert!(fresh.blocks().iter().all(|b| !held.blocks().contains(b)));
    held.release(&mut pool);
    let mut again = held.clone();
    again.append(&mut pool, 4).expect("room");
    assert_eq!(again.unnamed_full(4), 0..4, "a released table names again");
    assert_eq!(pool.evictions(), 0, "forgetting is not evicting");
}
