//! A group of ranks inside one process, one thread each: the same collectives
//! as MPI over shared memory, so the data-parallel code paths (sharding, global
//! normalisers, gradient all-reduce) run in the ordinary test suite without an
//! MPI launcher. Sums are taken in rank order, as a deterministic MPI reduce
//! of two ranks would, so every rank gets bitwise the same result. Groups split
//! from a group ([`Comm::split`]) are groups of their own; point-to-point
//! messages wait in a mailbox per (sender, receiver) until received, in order.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::bf16;

use super::blocks::{narrow, sum_block, widen};
use super::{bytes_f32, bytes_f64, check_peer, check_root, f32_bytes, f64_bytes, Comm};
use crate::{Error, Result};

/// How long a rank waits for the others at a collective before it gives up
/// with an error (a rank that failed or took another code path would otherwise
/// leave the rest blocked forever).
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(300);

struct Shared {
    state: Mutex<State>,
    arrived_cv: Condvar,
}

struct State {
    slots: Vec<Vec<u8>>,
    /// Ranks waiting at the current barrier.
    arrived: usize,
    /// Barriers completed so far.
    generation: u64,
    /// A rank has been dropped: nobody can complete a collective any more.
    left: bool,
    /// Point-to-point messages sent and not yet received, by (sender, receiver).
    mail: HashMap<(usize, usize), VecDeque<Vec<u8>>>,
    /// The groups of splits in progress, by (split number, colour): made by the
    /// first member to arrive, taken by each member, removed by the last.
    splits: HashMap<(usize, usize), Split>,
}

/// The ranks of one group of a split not yet taken, and how many were taken.
type Split = (Vec<Option<ThreadComm>>, usize);

/// One rank of an in-process group made by [`ThreadComm::group`]; give each
/// rank to its own thread.
pub struct ThreadComm {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    calls: AtomicUsize,
    /// Splits this rank has taken part in (every rank counts the same).
    splits: AtomicUsize,
}

impl ThreadComm {
    /// `size` connected ranks.
    pub fn group(size: usize) -> Vec<ThreadComm> {
        let size = size.max(1);
        let state = State {
            slots: vec![Vec::new(); size],
            arrived: 0,
            generation: 0,
            left: false,
            mail: HashMap::new(),
            splits: HashMap::new(),
        };
        let shared = Arc::new(Shared { state: Mutex::new(state), arrived_cv: Condvar::new() });
        (0..size)
            .map(|rank| ThreadComm {
                rank,
                size,
                shared: shared.clone(),
                calls: AtomicUsize::new(0),
                splits: AtomicUsize::new(0),
            })
            .collect()
    }

    /// Collectives this rank has taken part in (to check bucketing).
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| Error::invalid("thread communicator: another rank panicked"))
    }

    /// Waits until every rank has arrived; an error when a rank has left the
    /// group (dropped) or does not arrive within [`ARRIVAL_TIMEOUT`].
    fn wait_all<'a>(&self, mut st: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>> {
        let gone = || Error::invalid("thread communicator: another rank left the group");
        if st.left {
            return Err(gone());
        }
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.size {
            st.arrived = 0;
            st.generation += 1;
            self.shared.arrived_cv.notify_all();
            return Ok(st);
        }
        let deadline = Instant::now() + ARRIVAL_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (next, _) = self
                .shared
                .arrived_cv
                .wait_timeout(st, left)
                .map_err(|_| Error::invalid("thread communicator: another rank panicked"))?;
            st = next;
            if st.generation != generation {
                return Ok(st);
            }
            if st.left {
                return Err(gone());
            }
            if Instant::now() >= deadline {
                return Err(Error::invalid(format!(
                    "thread communicator: rank {} waited {} s for the other ranks at a collective",
                    self.rank,
                    ARRIVAL_TIMEOUT.as_secs()
                )));
            }
        }
    }

    /// Every rank's bytes, in rank order. Two barriers: all deposits are in
    /// before anyone reads, and all reads are done before anyone deposits again.
    fn exchange(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock()?;
        st.slots[self.rank] = mine;
        let st = self.wait_all(st)?;
        let all = st.slots.clone();
        drop(self.wait_all(st)?);
        Ok(all)
    }
}

impl ThreadComm {
    /// Sums `buf` element-wise over the ranks; `enc` and `dec` carry it as bytes.
    fn all_reduce<T: Copy + Default + std::ops::AddAssign>(
        &self,
        buf: &mut [T],
        enc: fn(&[T]) -> Vec<u8>,
        dec: fn(&[u8]) -> Vec<T>,
    ) -> Result<()> {
        let all = self.exchange(enc(buf))?;
        buf.iter_mut().for_each(|x| *x = T::default());
        for part in &all {
            let v = dec(part);
            if v.len() != buf.len() {
                return Err(Error::invalid(format!(
                    "all-reduce: {} values on one rank, {} on another",
                    buf.len(),
                    v.len()
                )));
            }
            buf.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }
}

impl Drop for ThreadComm {
    /// A rank that goes away (finished, or failed with an error) releases the
    /// others from any collective it will never join.
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.left = true;
            self.shared.arrived_cv.notify_all();
        }
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "threads"
    }
    fn all_reduce_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce(buf, f64_bytes, bytes_f64)
    }
    fn all_reduce_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce(buf, f32_bytes, bytes_f32)
    }
    fn all_gather_f32(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(self.exchange(f32_bytes(local))?.iter().flat_map(|b| bytes_f32(b)).collect())
    }
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.exchange(local.to_vec())
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()> {
        check_root(root, self.size)?;
        let mine = if self.rank == root { std::mem::take(buf) } else { Vec::new() };
        *buf = self.exchange(mine)?.swap_remove(root);
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        self.exchange(Vec::new()).map(|_| ())
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let mine = [color as u64, key as u64].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let all = self.exchange(mine)?;
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        // The members of this rank's colour, ordered by key, then rank.
        let mut members: Vec<(u64, usize)> = all
            .iter()
            .enumerate()
            .filter(|(_, b)| word(b, 0) == color as u64)
            .map(|(r, b)| (word(b, 1), r))
            .collect();
        members.sort();
        let index = members.iter().position(|&(_, r)| r == self.rank).unwrap_or(0);
        let mut st = self.lock()?;
        let entry = st
            .splits
            .entry((n, color))
            .or_insert_with(|| (ThreadComm::group(members.len()).into_iter().map(Some).collect(), 0));
        entry.1 += 1;
        let taken = entry.1;
        let comm = entry.0.get_mut(index).and_then(Option::take).ok_or_else(|| {
            Error::invalid(format!(
                "thread communicator: split {n}: rank {index} of colour {color} taken twice"
            ))
        })?;
        if taken == members.len() {
            st.splits.remove(&(n, color));
        }
        Ok(Arc::new(comm))
    }
    fn send_bytes(&self, dest: usize, buf: &[u8]) -> Result<()> {
        check_peer(self.rank, self.size, dest, "send")?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock()?;
        if st.left {
            return Err(Error::invalid("thread communicator: another rank left the group"));
        }
        st.mail.entry((self.rank, dest)).or_default().push_back(buf.to_vec());
        self.shared.arrived_cv.notify_all();
        Ok(())
    }
    fn recv_bytes(&self, src: usize) -> Result<Vec<u8>> {
        check_peer(self.rank, self.size, src, "receive")?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock()?;
        let deadline = Instant::now() + ARRIVAL_TIMEOUT;
        loop {
            // A message already sent is received even from a rank that has left since.
            if let Some(m) = st.mail.get_mut(&(src, self.rank)).and_then(|q| q.pop_front()) {
                return Ok(m);
            }
            if st.left {
                return Err(Error::invalid(format!(
                    "thread communicator: rank {src} left the group before sending to rank {}",
                    self.rank
                )));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::invalid(format!(
                    "thread communicator: rank {} waited {} s for a message from rank {src}",
                    self.rank,
                    ARRIVAL_TIMEOUT.as_secs()
                )));
            }
            st = self
                .shared
                .arrived_cv
                .wait_timeout(st, left)
                .map_err(|_| Error::invalid("thread communicator: another rank panicked"))?
                .0;
        }
    }
    fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>> {
        let all: Vec<Vec<f32>> = self.exchange(f32_bytes(buf))?.iter().map(|b| bytes_f32(b)).collect();
        sum_block(&all, self.rank, "reduce-scatter")
    }
    fn reduce_scatter_bf16(&self, buf: &[bf16]) -> Result<Vec<bf16>> {
        Ok(narrow(&self.reduce_scatter_f32(&widen(buf))?))
    }
    fn all_gather_bf16(&self, local: &[bf16]) -> Result<Vec<bf16>> {
        let bits: Vec<u8> = local.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        let all = self.exchange(bits)?;
        if let Some(b) = all.iter().find(|b| b.len() != 2 * local.len()) {
            return Err(Error::invalid(format!(
                "all-gather: {} values on one rank, {} on another",
                local.len(),
                b.len() / 2
            )));
        }
        Ok(all
            .iter()
            .flat_map(|b| b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_ranks<T: Send>(n: usize, f: impl Fn(&ThreadComm) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::group(n);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_by_hand() {
        let out = on_ranks(3, |c| {
            let r = c.rank();
            let mut s = [r as f64, 1.0];
            c.all_reduce_f64(&mut s).unwrap();
            let mut f = [r as f32 * 0.5];
            c.all_reduce_f32(&mut f).unwrap();
            // Rank r contributes r values (rank 0 none).
            let g = c.all_gather_f32(&vec![r as f32; r]).unwrap();
            let mut b = if r == 1 { b"from one".to_vec() } else { b"x".to_vec() };
            c.broadcast_bytes(1, &mut b).unwrap();
            let bytes = c.all_gather_bytes(&[r as u8]).unwrap();
            c.barrier().unwrap();
            (s, f, g, b, bytes)
        });
        for (s, f, g, b, bytes) in out {
            assert_eq!(s, [3.0, 3.0]);
            assert_eq!(f, [1.5]);
            assert_eq!(g, vec![1.0, 2.0, 2.0]);
            assert_eq!(b, b"from one".to_vec());
            assert_eq!(bytes, vec![vec![0u8], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_rank_that_leaves_releases_the_others_with_an_error() {
        let mut comms = ThreadComm::group(2);
        let one = comms.pop().expect("rank 1");
        let zero = comms.pop().expect("rank 0");
        let waiter = std::thread::spawn(move || {
            let mut v = [1.0f64];
            zero.all_reduce_f64(&mut v)
        });
        // Rank 1 fails before its collective and goes away.
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(one);
        let err = waiter.join().expect("no panic").expect_err("rank 0 cannot complete the collective");
        assert!(err.to_string().contains("left the group"), "{err}");
    }

    /// Three ranks: reduce-scatter and all-gather of f32 and bf16 blocks against
    /// sums written out by hand.
    #[test]
    fn block_collectives_by_hand() {
        let out = on_ranks(3, |c| {
            let r = c.rank() as f32;
            // Rank r gives [r, 1, 10r, 2, 100, r]: blocks of two.
            let buf = [r, 1.0, 10.0 * r, 2.0, 100.0, r];
            let f = c.reduce_scatter_f32(&buf).unwrap();
            let half: Vec<bf16> = buf.iter().map(|&x| bf16::from_f32(x)).collect();
            let h: Vec<f32> = c.reduce_scatter_bf16(&half).unwrap().iter().map(|x| x.to_f32()).collect();
            let g: Vec<f32> =
                c.all_gather_bf16(&[bf16::from_f32(r + 0.5)]).unwrap().iter().map(|x| x.to_f32()).collect();
            let odd = c.reduce_scatter_f32(&[1.0; 4]).is_err();
            (f, h, g, odd)
        });
        // Sums over r = 0, 1, 2: [3, 3, 30, 6, 300, 3].
        let want = [vec![3.0, 3.0], vec![30.0, 6.0], vec![300.0, 3.0]];
        for (r, (f, h, g, odd)) in out.into_iter().enumerate() {
            assert_eq!(f, want[r]);
            assert_eq!(h, want[r]);
            assert_eq!(g, vec![0.5, 1.5, 2.5]);
            assert!(odd, "4 values cannot be cut into 3 blocks");
        }
    }

    /// Five ranks split into colours {0, 2, 4} and {1, 3} (keys reverse the second
    /// group's order): each group's ranks, sizes and collectives are its own, and
    /// the parent group still works after the split.
    #[test]
    fn split_groups_are_communicators_of_their_own() {
        let out = on_ranks(5, |c| {
            let r = c.rank();
            let (color, key) = if r % 2 == 0 { (0, r) } else { (1, 10 - r) };
            let g = c.split(color, key).unwrap();
            let mut s = [r as f64];
            g.all_reduce_f64(&mut s).unwrap();
            let members = g.all_gather_bytes(&[r as u8]).unwrap();
            let mut w = [1.0f64];
            c.all_reduce_f64(&mut w).unwrap();
            (g.rank(), g.size(), s[0], members, w[0])
        });
        let even = vec![vec![0u8], vec![2], vec![4]];
        let odd = vec![vec![3u8], vec![1]];
        assert_eq!(out[0], (0, 3, 6.0, even.clone(), 5.0));
        assert_eq!(out[2], (1, 3, 6.0, even.clone(), 5.0));
        assert_eq!(out[4], (2, 3, 6.0, even, 5.0));
        assert_eq!(out[3], (0, 2, 4.0, odd.clone(), 5.0));
        assert_eq!(out[1], (1, 2, 4.0, odd, 5.0));
    }

    /// Point to point: messages from one rank to another arrive whole and in order,
    /// f32 values bit for bit (NaN and infinities too), and a message waits in the
    /// mailbox until it is received; a rank cannot send to itself or to a rank that
    /// does not exist.
    #[test]
    fn point_to_point_messages_arrive_in_order() {
        let weird = [f32::NAN, f32::INFINITY, -0.0, 1e-45, 3.5];
        let out = on_ranks(3, |c| match c.rank() {
            0 => {
                c.send_bytes(2, b"first").unwrap();
                c.send_bytes(2, b"").unwrap();
                c.send_f32(2, &weird).unwrap();
                c.send_bytes(1, b"to one").unwrap();
                let bad = c.send_bytes(0, b"self").is_err() && c.send_bytes(3, b"nobody").is_err();
                (Vec::new(), Vec::new(), bad)
            }
            1 => (vec![c.recv_bytes(0).unwrap()], Vec::new(), c.recv_bytes(1).is_err()),
            _ => {
                // Received after all of them were sent.
                std::thread::sleep(std::time::Duration::from_millis(20));
                let a = c.recv_bytes(0).unwrap();
                let b = c.recv_bytes(0).unwrap();
                let f = c.recv_f32(0).unwrap();
                (vec![a, b], f, false)
            }
        });
        assert!(out[0].2 && out[1].2);
        assert_eq!(out[1].0, vec![b"to one".to_vec()]);
        assert_eq!(out[2].0, vec![b"first".to_vec(), Vec::new()]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&out[2].1), bits(&weird));
    }

    /// A receive from a rank that has gone away without sending fails instead of
    /// waiting forever; what it sent before leaving is still received.
    #[test]
    fn a_receive_from_a_rank_that_left_is_an_error() {
        let mut comms = ThreadComm::group(2);
        let one = comms.pop().expect("rank 1");
        let zero = comms.pop().expect("rank 0");
        one.send_bytes(0, b"last words").unwrap();
        drop(one);
        assert_eq!(zero.recv_bytes(1).unwrap(), b"last words".to_vec());
        let e = zero.recv_bytes(1).unwrap_err().to_string();
        assert!(e.contains("left the group"), "{e}");
    }

    #[test]
    fn broadcast_of_f32_values() {
        let out = on_ranks(3, |c| {
            let mut v = if c.rank() == 2 { vec![1.5f32, f32::NAN, -2.0] } else { vec![0.0; 3] };
            c.broadcast_f32(2, &mut v).unwrap();
            let mut short = vec![0f32; 1 + usize::from(c.rank() == 0)];
            let bad = c.broadcast_f32(0, &mut short).is_err();
            (v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>(), bad)
        });
        for (r, (v, bad)) in out.iter().enumerate() {
            assert_eq!(v, &[1.5f32.to_bits(), f32::NAN.to_bits(), (-2.0f32).to_bits()]);
            assert_eq!(*bad, r != 0, "rank {r}: a length other than the root's is an error");
        }
    }

    #[test]
    fn mismatched_lengths_are_an_error() {
        let out = on_ranks(2, |c| {
            let mut v = vec![1.0f32; 1 + c.rank()];
            c.all_reduce_f32(&mut v).is_err()
        });
        assert_eq!(out, vec![true, true]);
    }
}
