//! The MPI world (rsmpi over the system's MPI library, e.g. Debian's Open MPI).
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED` and every call, on the world
//! or on a group split from it, goes through one process-wide mutex, so the
//! library's threads (rayon, the script watcher) may call in from anywhere
//! without two calls ever overlapping.

use std::sync::{Arc, Mutex};

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::{Count, Threading};

use half::bf16;

use super::blocks::{block_len, narrow, widen};
use super::{check_peer, check_root, Comm};
use crate::{Error, Result};

/// Kept until [`finalize`]; dropping it calls `MPI_Finalize`.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);

/// Held during every MPI call of the process, whichever communicator it is on.
static CALLS: Mutex<()> = Mutex::new(());

/// A communicator. rsmpi's handle is a raw MPI pointer and so neither `Send`
/// nor `Sync`; it is only touched under [`CALLS`], and MPI runs in
/// `MPI_THREAD_SERIALIZED` mode, which allows calls from any thread as long
/// as they do not overlap.
struct Handle(SimpleCommunicator);
// SAFETY: see `Handle`: every use is serialized under `CALLS`.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// MPI's `MPI_COMM_WORLD`, or a group split from it.
pub(super) struct Mpi {
    comm: Handle,
    rank: usize,
    size: usize,
}

/// Largest number of elements one MPI call carries here (below `i32::MAX`);
/// longer buffers go in several calls.
const CHUNK: usize = 1 << 28;

pub(super) fn init_world() -> Result<Arc<dyn Comm>> {
    let mut slot = UNIVERSE.lock().map_err(|_| Error::invalid("mpi: init lock poisoned"))?;
    let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
        .ok_or_else(|| Error::invalid("mpi: MPI was already initialised in this process"))?;
    if matches!(provided, Threading::Single | Threading::Funneled) {
        return Err(Error::invalid(format!(
            "mpi: the MPI library offers thread level {provided:?}; stapo needs MPI_THREAD_SERIALIZED"
        )));
    }
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    *slot = Some(universe);
    Ok(Arc::new(Mpi { comm: Handle(world), rank, size }))
}

pub(super) fn finalize() {
    if let Ok(mut slot) = UNIVERSE.lock() {
        // Dropping the universe calls MPI_Finalize.
        slot.take();
    }
}

pub(super) fn abort(code: i32) {
    if let Ok(slot) = UNIVERSE.lock() {
        if let Some(u) = slot.as_ref() {
            u.world().abort(code);
        }
    }
}

fn count(n: usize, what: &str) -> Result<Count> {
    Count::try_from(n)
        .map_err(|_| Error::invalid(format!("mpi: {what} of {n} elements exceeds MPI's count limit")))
}

impl Mpi {
    fn with<T>(&self, f: impl FnOnce(&SimpleCommunicator) -> Result<T>) -> Result<T> {
        let _held = CALLS.lock().map_err(|_| Error::invalid("mpi: communicator lock poisoned"))?;
        f(&self.comm.0)
    }

    /// Lengths of every rank's `n`.
    fn counts(w: &SimpleCommunicator, n: usize, size: usize) -> Result<(Vec<Count>, Vec<Count>, usize)> {
        let mine = count(n, "all-gather")?;
        let mut counts = vec![0 as Count; size];
        w.all_gather_into(&mine, &mut counts[..]);
        let mut displs = Vec::with_capacity(size);
        let mut total = 0usize;
        for &c in &counts {
            displs.push(count(total, "all-gather")?);
            total += c as usize;
        }
        Ok((counts, displs, total))
    }
}

impl Comm for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn all_reduce_f64(&self, buf: &mut [f64]) -> Result<()> {
        count(buf.len(), "all-reduce")?;
        self.with(|w| {
            let send = buf.to_vec();
            w.all_reduce_into(&send[..], buf, SystemOperation::sum());
            Ok(())
        })
    }
    fn all_reduce_f32(&self, buf: &mut [f32]) -> Result<()> {
        count(buf.len(), "all-reduce")?;
        self.with(|w| {
            let send = buf.to_vec();
            w.all_reduce_into(&send[..], buf, SystemOperation::sum());
            Ok(())
        })
    }
    fn all_gather_f32(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.with(|w| {
            let (counts, displs, total) = Self::counts(w, local.len(), self.size)?;
            let mut out = vec![0f32; total];
            let mut part = PartitionMut::new(&mut out[..], counts, &displs[..]);
            w.all_gather_varcount_into(local, &mut part);
            Ok(out)
        })
    }
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.with(|w| {
            let (counts, displs, total) = Self::counts(w, local.len(), self.size)?;
            let mut out = vec![0u8; total];
            {
                let mut part = PartitionMut::new(&mut out[..], &counts[..], &displs[..]);
                w.all_gather_varcount_into(local, &mut part);
            }
            Ok(counts
                .iter()
                .zip(&displs)
                .map(|(&c, &d)| out[d as usize..d as usize + c as usize].to_vec())
                .collect())
        })
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()> {
        check_root(root, self.size)?;
        self.with(|w| {
            let p = w.process_at_rank(root as i32);
            let mut n = buf.len() as u64;
            p.broadcast_into(&mut n);
            buf.resize(n as usize, 0);
            count(buf.len(), "broadcast")?;
            p.broadcast_into(&mut buf[..]);
            Ok(())
        })
    }
    fn barrier(&self) -> Result<()> {
        self.with(|w| {
            w.barrier();
            Ok(())
        })
    }
    fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>> {
        let n = block_len(buf.len(), self.size, "reduce-scatter")?;
        count(buf.len(), "reduce-scatter")?;
        self.with(|w| {
            // Every rank must pass the same length; MPI cannot check it, so agree first.
            let (counts, _, _) = Self::counts(w, buf.len(), self.size)?;
            if let Some(&c) = counts.iter().find(|&&c| c as usize != buf.len()) {
                return Err(Error::invalid(format!(
                    "reduce-scatter: {} values on rank {}, {c} on another",
                    buf.len(),
                    self.rank
                )));
            }
            let mut out = vec![0f32; n];
            w.reduce_scatter_block_into(buf, &mut out[..], SystemOperation::sum());
            Ok(out)
        })
    }
    fn reduce_scatter_bf16(&self, buf: &[bf16]) -> Result<Vec<bf16>> {
        Ok(narrow(&self.reduce_scatter_f32(&widen(buf))?))
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>> {
        let c = i32::try_from(color).map_err(|_| Error::invalid(format!("mpi: split colour {color}")))?;
        let k = i32::try_from(key).map_err(|_| Error::invalid(format!("mpi: split key {key}")))?;
        let group = self.with(|w| {
            w.split_by_color_with_key(Color::with_value(c), k)
                .ok_or_else(|| Error::invalid("mpi: MPI_Comm_split gave this rank no group"))
        })?;
        let (rank, size) = (group.rank() as usize, group.size() as usize);
        Ok(Arc::new(Mpi { comm: Handle(group), rank, size }))
    }
    fn send_bytes(&self, dest: usize, buf: &[u8]) -> Result<()> {
        check_peer(self.rank, self.size, dest, "send")?;
        self.with(|w| {
            let p = w.process_at_rank(dest as i32);
            // The length first, then the bytes in calls of at most `CHUNK`.
            p.send(&(buf.len() as u64));
            for c in buf.chunks(CHUNK) {
                p.send(c);
            }
            Ok(())
        })
    }
    fn recv_bytes(&self, src: usize) -> Result<Vec<u8>> {
        check_peer(self.rank, self.size, src, "receive")?;
        self.with(|w| {
            let p = w.process_at_rank(src as i32);
            let (n, _) = p.receive::<u64>();
            let mut out = Vec::with_capacity(n as usize);
            while out.len() < n as usize {
                let (c, _) = p.receive_vec::<u8>();
                if c.is_empty() {
                    return Err(Error::invalid(format!("mpi: an empty piece of a message from rank {src}")));
                }
                out.extend_from_slice(&c);
            }
            if out.len() != n as usize {
                return Err(Error::invalid(format!(
                    "mpi: {} bytes from rank {src}, {n} announced",
                    out.len()
                )));
            }
            Ok(out)
        })
    }
    fn broadcast_f32(&self, root: usize, buf: &mut [f32]) -> Result<()> {
        check_root(root, self.size)?;
        self.with(|w| {
            let p = w.process_at_rank(root as i32);
            // Every rank must pass the same length; agree on it first.
            let mut n = buf.len() as u64;
            p.broadcast_into(&mut n);
            if n as usize != buf.len() {
                return Err(Error::invalid(format!(
                    "broadcast: {n} values from rank {root}, {} expected on rank {}",
                    buf.len(),
                    self.rank
                )));
            }
            for c in buf.chunks_mut(CHUNK) {
                p.broadcast_into(c);
            }
            Ok(())
        })
    }
    fn all_gather_bf16(&self, local: &[bf16]) -> Result<Vec<bf16>> {
        // bf16 travels as its bit pattern (MPI has no bf16 type; nothing is summed).
        let bits: Vec<u16> = local.iter().map(|x| x.to_bits()).collect();
        self.with(|w| {
            let (counts, displs, total) = Self::counts(w, bits.len(), self.size)?;
            if counts.iter().any(|&c| c as usize != bits.len()) {
                return Err(Error::invalid(format!(
                    "all-gather: {} values on rank {}, another number on another rank",
                    bits.len(),
                    self.rank
                )));
            }
            let mut out = vec![0u16; total];
            let mut part = PartitionMut::new(&mut out[..], counts, &displs[..]);
            w.all_gather_varcount_into(&bits[..], &mut part);
            Ok(out.into_iter().map(bf16::from_bits).collect())
        })
    }
}
