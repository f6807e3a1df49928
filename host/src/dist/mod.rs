//! Data-parallel communication: one [`Comm`] abstraction over the ranks of a
//! job, with a single-process implementation ([`Local`]), an in-process group
//! of threads for tests ([`ThreadComm`]), MPI (`--features mpi`, rsmpi over the
//! system's MPI library) and, for GPUs, NCCL gradient all-reduce bootstrapped
//! over MPI (`--features nccl`).
//!
//! The collectives are the ones data-parallel RL needs (verl's and PyTorch
//! DDP's): a bucketed all-reduce of gradients (many tensors flattened into a
//! few large buffers, PyTorch DDP's 25 MB buckets, never one call per tensor),
//! all-reduce of scalar sums (metrics, normalisers), all-gather of f32 vectors
//! of any length per rank (STAPO's tau_h quantile over all ranks' candidates)
//! and of bytes (records for rank 0), and broadcast (rank 0's decisions, the
//! NCCL unique id). For sharded training (ZeRO-1/2, `train::optim::ShardedAdamW`)
//! there are reduce-scatter and all-gather of equal blocks of f32 and bf16
//! values (`MPI_Reduce_scatter_block`/`MPI_Allgather`, `ncclReduceScatter`/
//! `ncclAllGather`), on host slices and on 1-D tensors (`blocks.rs`).
//!
//! Every collective must be called by all ranks in the same order; results are
//! identical on every rank (sums are taken in rank order, so bitwise equal).
//!
//! For jobs whose ranks play different roles (`rollout.async.roles`: rollout ranks
//! and trainer ranks) a communicator splits into groups ([`Comm::split`],
//! `MPI_Comm_split`), each a communicator of its own with the same collectives, and
//! two ranks exchange messages point to point ([`Comm::send_bytes`] /
//! [`Comm::recv_bytes`], `MPI_Send`/`MPI_Recv`; messages from one rank to another
//! arrive in the order they were sent).

mod blocks;
mod threads;
pub use blocks::{all_gather_tensor_host, block_len, reduce_scatter_tensor_host};
pub use threads::ThreadComm;

#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use half::bf16;

use crate::{Error, Result};

/// Elements per gradient bucket: 25 MB of f32, PyTorch DDP's default `bucket_cap_mb`.
pub const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;

/// The ranks of a data-parallel job and the collectives between them.
pub trait Comm: Send + Sync {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// What carries the messages ("local", "threads", "mpi", "mpi+nccl").
    fn backend(&self) -> &'static str;
    /// Element-wise sum over ranks, in place; `buf` has the same length on every rank.
    fn all_reduce_f64(&self, buf: &mut [f64]) -> Result<()>;
    /// Element-wise sum over ranks, in place; `buf` has the same length on every rank.
    fn all_reduce_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `local` (any length per rank), concatenated in rank order.
    fn all_gather_f32(&self, local: &[f32]) -> Result<Vec<f32>>;
    /// Every rank's `local` bytes, one entry per rank in rank order.
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Replaces `buf` on every rank by `root`'s `buf`.
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()>;
    /// Waits until every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// This rank's block of the element-wise sum over ranks (`MPI_Reduce_scatter_block`):
    /// `buf` is `size()` equal blocks, the same length on every rank, and rank `r`
    /// receives block `r` of the sum (see [`block_len`]).
    fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>>;
    /// [`Comm::reduce_scatter_f32`] of bf16 values: summed in f32, rounded to bf16 once.
    fn reduce_scatter_bf16(&self, buf: &[bf16]) -> Result<Vec<bf16>>;
    /// Every rank's `local` bf16 values (the same length on every rank), in rank order.
    fn all_gather_bf16(&self, local: &[bf16]) -> Result<Vec<bf16>>;
    /// [`Comm::reduce_scatter_f32`] of a 1-D f32 or bf16 tensor, as a tensor of the
    /// same dtype and device. The default goes through host memory; NCCL stays on the GPU.
    fn reduce_scatter_tensor(&self, t: &Tensor) -> Result<Tensor> {
        reduce_scatter_tensor_host(self, t)
    }
    /// Every rank's 1-D f32 or bf16 tensor (the same length on every rank),
    /// concatenated in rank order. The default goes through host memory.
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        all_gather_tensor_host(self, t)
    }
    /// The groups of a split (`MPI_Comm_split`): ranks that pass the same `color` form
    /// one communicator, ranked by `key`, then by their rank here. Collective: every
    /// rank of this communicator calls it.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>>;
    /// Sends `buf` to rank `dest` (`MPI_Send`); it may wait until `dest` receives it.
    fn send_bytes(&self, dest: usize, buf: &[u8]) -> Result<()>;
    /// The next message rank `src` sent to this rank (`MPI_Recv`), waiting for it.
    fn recv_bytes(&self, src: usize) -> Result<Vec<u8>>;
    /// Sends f32 values to rank `dest` (see [`Comm::send_bytes`]).
    fn send_f32(&self, dest: usize, buf: &[f32]) -> Result<()> {
        self.send_bytes(dest, &f32_bytes(buf))
    }
    /// The next f32 values rank `src` sent to this rank (see [`Comm::recv_bytes`]).
    fn recv_f32(&self, src: usize) -> Result<Vec<f32>> {
        let b = self.recv_bytes(src)?;
        if b.len() % 4 != 0 {
            return Err(Error::invalid(format!(
                "receive: {} bytes from rank {src} are not f32 values",
                b.len()
            )));
        }
        Ok(bytes_f32(&b))
    }
    /// Replaces `buf` on every rank by `root`'s `buf`, which has the same length on
    /// every rank.
    fn broadcast_f32(&self, root: usize, buf: &mut [f32]) -> Result<()> {
        let mut bytes = if self.rank() == root { f32_bytes(buf) } else { Vec::new() };
        self.broadcast_bytes(root, &mut bytes)?;
        if bytes.len() != 4 * buf.len() {
            return Err(Error::invalid(format!(
                "broadcast: {} values from rank {root}, {} expected",
                bytes.len() / 4,
                buf.len()
            )));
        }
        buf.copy_from_slice(&bytes_f32(&bytes));
        Ok(())
    }
    /// Sums `tensors` over ranks in place, flattened into buckets of at most
    /// `bucket_elems` elements (one collective per bucket). The default copies
    /// each bucket through host memory as f32; NCCL reduces on the device.
    fn all_reduce_tensors(&self, tensors: &mut [Tensor], bucket_elems: usize) -> Result<()> {
        all_reduce_tensors_host(self, tensors, bucket_elems)
    }
}

/// The single-process communicator: rank 0 of 1; every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct Local;

impl Comm for Local {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "local"
    }
    fn all_reduce_f64(&self, _buf: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_f32(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather_f32(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(local.to_vec())
    }
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![local.to_vec()])
    }
    fn broadcast_bytes(&self, _root: usize, _buf: &mut Vec<u8>) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>> {
        Ok(buf.to_vec())
    }
    fn reduce_scatter_bf16(&self, buf: &[bf16]) -> Result<Vec<bf16>> {
        Ok(buf.to_vec())
    }
    fn all_gather_bf16(&self, local: &[bf16]) -> Result<Vec<bf16>> {
        Ok(local.to_vec())
    }
    fn all_reduce_tensors(&self, _tensors: &mut [Tensor], _bucket_elems: usize) -> Result<()> {
        Ok(())
    }
    fn split(&self, _color: usize, _key: usize) -> Result<Arc<dyn Comm>> {
        Ok(Arc::new(Local))
    }
    fn send_bytes(&self, dest: usize, _buf: &[u8]) -> Result<()> {
        Err(Error::invalid(format!("send: no rank {dest} in a single process")))
    }
    fn recv_bytes(&self, src: usize) -> Result<Vec<u8>> {
        Err(Error::invalid(format!("receive: no rank {src} in a single process")))
    }
}

/// The default bucketed all-reduce: flattens consecutive tensors into host f32
/// buffers of at most `bucket_elems` elements (a tensor larger than a bucket
/// gets a bucket of its own), reduces each buffer with one call, and rebuilds
/// every tensor with its shape, dtype and device.
pub fn all_reduce_tensors_host<C: Comm + ?Sized>(
    comm: &C,
    tensors: &mut [Tensor],
    bucket_elems: usize,
) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    for range in buckets(tensors.iter().map(|t| t.elem_count()), bucket_elems) {
        let mut flat = Vec::with_capacity(tensors[range.clone()].iter().map(|t| t.elem_count()).sum());
        for t in &tensors[range.clone()] {
            flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        comm.all_reduce_f32(&mut flat)?;
        let mut at = 0;
        for t in &mut tensors[range] {
            let n = t.elem_count();
            let summed = Tensor::from_slice(&flat[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype())?;
            *t = summed;
            at += n;
        }
    }
    Ok(())
}

/// Consecutive index ranges of tensors with `sizes` elements, each holding at
/// most `cap` elements, except a tensor larger than `cap`, which is alone.
pub fn buckets(sizes: impl IntoIterator<Item = usize>, cap: usize) -> Vec<Range<usize>> {
    let cap = cap.max(1);
    let mut out = Vec::new();
    let (mut start, mut fill, mut i) = (0, 0, 0);
    for n in sizes {
        if i > start && fill + n > cap {
            out.push(start..i);
            start = i;
            fill = 0;
        }
        fill += n;
        i += 1;
    }
    if i > start {
        out.push(start..i);
    }
    out
}

/// Sums the gradients of `params` over ranks, in place, in buckets of
/// [`BUCKET_ELEMS`]. A parameter with a gradient on some rank but not on
/// another gets the other ranks' sum (the absent one counts as zero); one with
/// no gradient on any rank stays absent, as it would in a one-process run.
pub fn all_reduce_grads(comm: &dyn Comm, params: &[&Var], grads: &mut GradStore) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mut present: Vec<f32> =
        params.iter().map(|v| if grads.get(v.as_tensor()).is_some() { 1.0 } else { 0.0 }).collect();
    comm.all_reduce_f32(&mut present)?;
    let mut order = Vec::new();
    let mut tensors = Vec::new();
    for (v, &p) in params.iter().zip(&present) {
        if p == 0.0 {
            continue;
        }
        let g = match grads.remove(v.as_tensor()) {
            Some(g) => g,
            None => v.as_tensor().zeros_like()?,
        };
        order.push(*v);
        tensors.push(g);
    }
    comm.all_reduce_tensors(&mut tensors, BUCKET_ELEMS)?;
    for (v, g) in order.into_iter().zip(tensors) {
        grads.insert(v.as_tensor(), g);
    }
    Ok(())
}

/// The contiguous share `[lo, hi)` of `n` items that `rank` of `size` owns:
/// the first `n % size` ranks get one more. Used for prompts, so a GRPO group
/// (the responses to one prompt) always stays on one rank.
pub fn shard(n: usize, rank: usize, size: usize) -> Range<usize> {
    let size = size.max(1);
    let (base, extra) = (n / size, n % size);
    let lo = rank * base + rank.min(extra);
    let hi = lo + base + usize::from(rank < extra);
    lo.min(n)..hi.min(n)
}

/// Sums of `vals` over ranks (one collective).
pub fn sum_f64<const N: usize>(comm: &dyn Comm, mut vals: [f64; N]) -> Result<[f64; N]> {
    comm.all_reduce_f64(&mut vals)?;
    Ok(vals)
}

/// The largest of every rank's `x` (one collective).
pub fn max_f64(comm: &dyn Comm, x: f64) -> Result<f64> {
    if comm.size() == 1 {
        return Ok(x);
    }
    let all = comm.all_gather_bytes(&x.to_le_bytes())?;
    Ok(all.iter().flat_map(|b| bytes_f64(b)).fold(f64::NEG_INFINITY, f64::max))
}

/// Where this rank's `n` items start in the rank-ordered concatenation of every
/// rank's items, and how many there are in all (one collective).
pub fn offset_and_total(comm: &dyn Comm, n: usize) -> Result<(usize, usize)> {
    if comm.size() == 1 {
        return Ok((0, n));
    }
    let counts: Vec<usize> = comm
        .all_gather_bytes(&(n as u64).to_le_bytes())?
        .iter()
        .map(|b| b.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize))
        .collect();
    Ok((counts[..comm.rank()].iter().sum(), counts.iter().sum()))
}

/// Rank `root`'s value of a serde value, on every rank (JSON over [`Comm::broadcast_bytes`]).
pub fn broadcast_json<T: serde::Serialize + serde::de::DeserializeOwned>(
    comm: &dyn Comm,
    root: usize,
    value: &T,
) -> Result<T> {
    let mut buf = if comm.rank() == root {
        serde_json::to_vec(value).map_err(|e| Error::invalid(format!("broadcast: {e}")))?
    } else {
        Vec::new()
    };
    comm.broadcast_bytes(root, &mut buf)?;
    serde_json::from_slice(&buf).map_err(|e| Error::invalid(format!("broadcast: {e}")))
}

/// A serde value as bytes that [`exact_json_value`] turns back into the same value,
/// every float bit for bit: JSON, then the bits of each of its floats in order
/// (a JSON reader may round a float's last bit).
pub fn exact_json_bytes<T: serde::Serialize>(value: &T) -> Result<Vec<u8>> {
    let v = serde_json::to_value(value).map_err(|e| Error::invalid(format!("message: {e}")))?;
    let mut bits = Vec::new();
    visit_floats(&v, &mut |x| bits.push(x));
    let json = serde_json::to_vec(&v).map_err(|e| Error::invalid(format!("message: {e}")))?;
    let mut out = Vec::with_capacity(8 + json.len() + 8 * bits.len());
    out.extend((json.len() as u64).to_le_bytes());
    out.extend(json);
    out.extend(bits.iter().flat_map(|b: &f64| b.to_le_bytes()));
    Ok(out)
}

/// The value [`exact_json_bytes`] wrote.
pub fn exact_json_value<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let bad = || Error::invalid("message: cut short");
    let n = bytes.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or_else(bad)? as usize;
    let json = bytes.get(8..8 + n).ok_or_else(bad)?;
    let mut v: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| Error::invalid(format!("message: {e}")))?;
    let mut floats = bytes_f64(bytes.get(8 + n..).ok_or_else(bad)?).into_iter();
    let mut short = false;
    set_floats(&mut v, &mut || {
        floats.next().or_else(|| {
            short = true;
            None
        })
    });
    if short || floats.next().is_some() {
        return Err(Error::invalid("message: its floats do not match its JSON"));
    }
    serde_json::from_value(v).map_err(|e| Error::invalid(format!("message: {e}")))
}

fn visit_floats(v: &serde_json::Value, f: &mut impl FnMut(f64)) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => f(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::Array(a) => a.iter().for_each(|x| visit_floats(x, f)),
        serde_json::Value::Object(o) => o.values().for_each(|x| visit_floats(x, f)),
        _ => {}
    }
}

fn set_floats(v: &mut serde_json::Value, next: &mut impl FnMut() -> Option<f64>) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            if let Some(x) = next().and_then(serde_json::Number::from_f64) {
                *n = x;
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(|x| set_floats(x, next)),
        serde_json::Value::Object(o) => o.values_mut().for_each(|x| set_floats(x, next)),
        _ => {}
    }
}

/// Every rank's value of a serde value, in rank order.
pub fn all_gather_json<T: serde::Serialize + serde::de::DeserializeOwned>(
    comm: &dyn Comm,
    value: &T,
) -> Result<Vec<T>> {
    let bytes = serde_json::to_vec(value).map_err(|e| Error::invalid(format!("all-gather: {e}")))?;
    comm.all_gather_bytes(&bytes)?
        .iter()
        .map(|b| serde_json::from_slice(b).map_err(|e| Error::invalid(format!("all-gather: {e}"))))
        .collect()
}

/// Runs `f` on rank 0 only and hands its outcome to every rank, so a failure
/// there (a file that cannot be written) fails every rank instead of leaving
/// the others waiting in the next collective.
pub fn on_root<T>(comm: &dyn Comm, f: impl FnOnce() -> Result<T>) -> Result<Option<T>> {
    if comm.size() == 1 {
        return f().map(Some);
    }
    let (out, err) = if comm.rank() == 0 {
        match f() {
            Ok(v) => (Some(v), String::new()),
            Err(e) => (None, e.to_string()),
        }
    } else {
        (None, String::new())
    };
    let err: String = broadcast_json(comm, 0, &err)?;
    if err.is_empty() {
        Ok(out)
    } else if comm.rank() == 0 {
        Err(Error::invalid(err))
    } else {
        Err(Error::invalid(format!("rank 0 failed: {err}")))
    }
}

// ---------------------------------------------------------------------------
// The process's world
// ---------------------------------------------------------------------------

static WORLD: OnceLock<Arc<dyn Comm>> = OnceLock::new();

/// Ranks announced by an MPI launcher in the environment (Open MPI's
/// `OMPI_COMM_WORLD_SIZE`, MPICH/Hydra's and Slurm PMI's `PMI_SIZE`,
/// MVAPICH's `MV2_COMM_WORLD_SIZE`); `None` when not started by one.
pub fn launched_size() -> Option<usize> {
    size_from_env(|k| std::env::var(k).ok())
}

fn size_from_env(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"]
        .iter()
        .find_map(|k| get(k).and_then(|v| v.trim().parse::<usize>().ok()))
}

/// Sets up the process's world once, at start-up: MPI's world when the binary
/// was started by an MPI launcher and built with `--features mpi`, else the
/// single process. Started by a launcher with more than one rank but built
/// without MPI, it fails with how to get a binary that has it.
pub fn init() -> Result<Arc<dyn Comm>> {
    if let Some(w) = WORLD.get() {
        return Ok(w.clone());
    }
    let launched = launched_size();
    let world: Arc<dyn Comm> = match launched {
        #[cfg(feature = "mpi")]
        Some(_) => mpi::init_world()?,
        #[cfg(not(feature = "mpi"))]
        Some(n) if n > 1 => {
            return Err(Error::invalid(format!(
                "started by an MPI launcher with {n} ranks, but this stapo binary was built without MPI \
                 support, so every rank would train alone. Rebuild it with MPI: install an MPI library \
                 (Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin libclang-dev) and run \
                 `cargo build --release --features mpi` (add `cuda,nccl` for GPUs); see \
                 docs/distributed.md"
            )))
        }
        _ => Arc::new(Local),
    };
    Ok(WORLD.get_or_init(|| world).clone())
}

/// The process's world: what [`init`] set up, or the single process.
pub fn world() -> Arc<dyn Comm> {
    WORLD.get().cloned().unwrap_or_else(|| Arc::new(Local))
}

/// Ends the job's communication before the process exits (MPI_Finalize); a
/// no-op for the single process. Call once, last, from `main`.
pub fn finalize() {
    #[cfg(feature = "mpi")]
    mpi::finalize();
}

/// Aborts every rank of the job (MPI_Abort) after a failure on this one, so
/// the others do not wait forever in their next collective. A no-op for the
/// single process.
pub fn abort(code: i32) {
    let _ = code;
    #[cfg(feature = "mpi")]
    if world().size() > 1 {
        mpi::abort(code);
    }
}

/// The communicator for a model on `device`: with `--features nccl`, a CUDA
/// device and more than one rank, gradients go through NCCL (its unique id
/// broadcast over `world`); otherwise `world` itself. Collective: every rank
/// calls it at the same point.
pub fn for_device(world: Arc<dyn Comm>, device: &candle_core::Device) -> Result<Arc<dyn Comm>> {
    #[cfg(feature = "nccl")]
    if world.size() > 1 && device.is_cuda() {
        return nccl::init(world, device);
    }
    let _ = device;
    Ok(world)
}

/// This rank's index among the ranks on its host (Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH's `MPI_LOCALRANKID`, Slurm's
/// `SLURM_LOCALID`), to give each rank of a host its own GPU; 0 when unknown.
pub fn local_rank() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok()))
        .unwrap_or(0)
}

/// An error unless `peer` is another rank of `size` than `rank` (for point-to-point).
pub(crate) fn check_peer(rank: usize, size: usize, peer: usize, what: &str) -> Result<()> {
    if peer >= size || peer == rank {
        return Err(Error::invalid(format!(
            "{what}: rank {peer} is not another rank of {size} (this is rank {rank})"
        )));
    }
    Ok(())
}

/// An error unless `root` is one of `size` ranks (for broadcasts).
pub(crate) fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::invalid(format!("broadcast: root {root} of {size} ranks")));
    }
    Ok(())
}

/// Bytes of `f32`s / from bytes, little-endian (for byte-level transports).
pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
pub(crate) fn f64_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn bytes_f64(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn shards_cover_everything_once_and_balance() {
        for n in 0..20 {
            for size in 1..6 {
                let parts: Vec<Range<usize>> = (0..size).map(|r| shard(n, r, size)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[size - 1].end, n);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{n} {size} {lens:?}");
            }
        }
        assert_eq!(shard(10, 0, 3), 0..4);
        assert_eq!(shard(10, 1, 3), 4..7);
        assert_eq!(shard(10, 2, 3), 7..10);
    }

    #[test]
    fn buckets_respect_the_cap() {
        assert_eq!(buckets([3, 3, 3, 3], 6), vec![0..2, 2..4]);
        assert_eq!(buckets([3, 10, 2, 2], 6), vec![0..1, 1..2, 2..4]);
        assert_eq!(buckets([7], 6), vec![0..1]);
        assert_eq!(buckets(Vec::<usize>::new(), 6), Vec::<Range<usize>>::new());
        assert_eq!(buckets([1, 1, 1], 100), vec![0..3]);
    }

    #[test]
    fn local_is_the_identity() {
        let c = Local;
        let mut v = [1.0f64, 2.0];
        c.all_reduce_f64(&mut v).unwrap();
        assert_eq!(v, [1.0, 2.0]);
        assert_eq!(c.all_gather_f32(&[1.0, 2.0]).unwrap(), vec![1.0, 2.0]);
        assert_eq!(on_root(&c, || Ok(5)).unwrap(), Some(5));
    }

    /// Four ranks on threads: the bucketed all-reduce of tensors with several
    /// shapes and dtypes equals the sum computed by hand, on every rank, and
    /// takes one collective per bucket.
    #[test]
    fn bucketed_tensor_all_reduce_sums_by_hand() {
        let comms = ThreadComm::group(4);
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let dev = Device::Cpu;
                        let mut ts = vec![
                            Tensor::new(&[[r, 1.0], [2.0, r * 10.0]], &dev).unwrap(),
                            Tensor::new(&[r + 0.5; 5], &dev).unwrap(),
                            Tensor::new(&[r; 3], &dev).unwrap().to_dtype(DType::F64).unwrap(),
                        ];
                        let before = c.calls();
                        // Cap 6: buckets [t0 (4 elements)], [t1 (5)], [t2 (3)].
                        c.all_reduce_tensors(&mut ts, 6).unwrap();
                        assert_eq!(c.calls() - before, 3);
                        assert_eq!(ts[0].dims(), &[2, 2]);
                        assert_eq!(ts[2].dtype(), DType::F64);
                        ts.iter()
                            .map(|t| {
                                t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Ranks 0..4: sum r = 6.
        let want = vec![vec![6.0, 4.0, 8.0, 60.0], vec![8.0; 5], vec![6.0; 3]];
        for r in &results {
            assert_eq!(r, &want);
        }
    }

    /// A gradient present on one rank only is summed with zeros; one absent
    /// everywhere stays absent.
    #[test]
    fn grads_missing_on_a_rank_count_as_zero() {
        let comms = ThreadComm::group(2);
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev).unwrap();
        let b = Var::new(&[3.0f32], &dev).unwrap();
        let out: Vec<(Vec<f32>, bool)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    let (a, b) = (&a, &b);
                    s.spawn(move || {
                        let mut g = GradStore::default();
                        if c.rank() == 1 {
                            g.insert(a.as_tensor(), Tensor::new(&[0.5f32, 0.25], &Device::Cpu).unwrap());
                        }
                        all_reduce_grads(c, &[a, b], &mut g).unwrap();
                        let ga = g.get(a.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
                        (ga, g.get(b.as_tensor()).is_some())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (ga, has_b) in out {
            assert_eq!(ga, vec![0.5, 0.25]);
            assert!(!has_b);
        }
    }

    #[test]
    fn offsets_and_maxima_over_ranks() {
        let comms = ThreadComm::group(3);
        let out: Vec<((usize, usize), f64)> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let n = [4, 0, 2][c.rank()];
                        (offset_and_total(c, n).unwrap(), max_f64(c, [1.5, -2.0, 7.25][c.rank()]).unwrap())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(out, vec![((0, 6), 7.25), ((4, 6), 7.25), ((4, 6), 7.25)]);
    }

    #[test]
    fn root_failure_reaches_every_rank() {
        let comms = ThreadComm::group(3);
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        on_root(c, || -> Result<()> { Err(Error::invalid("disk full")) })
                            .unwrap_err()
                            .to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(errs[0], "disk full");
        assert_eq!(errs[1], "rank 0 failed: disk full");
        assert_eq!(errs[2], "rank 0 failed: disk full");
    }

    /// Floats whose shortest decimal a JSON reader may round come back bit for bit,
    /// in nested maps and lists, f32 and f64, next to integers and strings.
    #[test]
    fn exact_json_keeps_every_float_bit() {
        #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        struct M {
            a: f64,
            b: Vec<f32>,
            c: std::collections::BTreeMap<String, (u64, f64)>,
            d: Option<f64>,
        }
        let mut c = std::collections::BTreeMap::new();
        c.insert("x".to_string(), (7, 11.545454545454545));
        c.insert("y".to_string(), (u64::MAX, 1.0));
        let m = M { a: 0.1 + 0.2, b: vec![1e-45, 3.4e38, -0.0, 2.5], c, d: Some(5e-324) };
        let back: M = exact_json_value(&exact_json_bytes(&m).unwrap()).unwrap();
        assert_eq!(back.a.to_bits(), m.a.to_bits());
        assert_eq!(back.c["x"].1.to_bits(), 11.545454545454545f64.to_bits());
        assert_eq!(back, m);
        let mut cut = exact_json_bytes(&m).unwrap();
        cut.truncate(cut.len() - 4);
        assert!(exact_json_value::<M>(&cut).is_err());
    }

    #[test]
    fn launcher_environment_is_detected() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(size_from_env(env(&[])), None);
        assert_eq!(size_from_env(env(&[("OMPI_COMM_WORLD_SIZE", "4")])), Some(4));
        assert_eq!(size_from_env(env(&[("PMI_SIZE", " 2\n")])), Some(2));
        assert_eq!(size_from_env(env(&[("PMI_SIZE", "x"), ("MV2_COMM_WORLD_SIZE", "3")])), Some(3));
    }
}
