//! Reduce-scatter and all-gather of equal blocks, the two collectives of sharded
//! data parallelism (ZeRO-1/2 in DeepSpeed, FSDP's `reduce_scatter_tensor` and
//! `all_gather_into_tensor` in PyTorch): a buffer of `size` equal blocks is
//! summed over ranks and rank `r` keeps block `r`; each rank's block is gathered
//! back into the whole. Blocks are equal, as NCCL and `MPI_Reduce_scatter_block`
//! require, so callers pad their flat buffers to a multiple of the world size
//! (as FSDP pads its flat parameters).
//!
//! This file holds the checks every transport shares and the default tensor
//! versions, which copy through host memory (threads, MPI); NCCL overrides them
//! to stay on the GPU.

use candle_core::{DType, Tensor};
use half::bf16;

use super::Comm;
use crate::{Error, Result};

/// The block length of a `len`-element reduce-scatter over `size` ranks; an
/// error naming `what` when `len` is not a multiple of `size`.
pub fn block_len(len: usize, size: usize, what: &str) -> Result<usize> {
    let size = size.max(1);
    if !len.is_multiple_of(size) {
        return Err(Error::invalid(format!(
            "{what}: {len} values cannot be cut into {size} equal blocks (pad to a multiple of the ranks)"
        )));
    }
    Ok(len / size)
}

/// The 1-D tensor `t` as f32 or bf16 (the dtypes the collectives carry), or an error naming it.
fn flat_of(t: &Tensor, what: &str) -> Result<Tensor> {
    if t.rank() != 1 {
        return Err(Error::invalid(format!("{what}: expected a 1-D tensor, found shape {:?}", t.dims())));
    }
    match t.dtype() {
        DType::F32 | DType::BF16 => Ok(t.contiguous()?),
        other => Err(Error::invalid(format!("{what}: expected an f32 or bf16 tensor, found {other:?}"))),
    }
}

/// [`Comm::reduce_scatter_tensor`] through host memory.
pub fn reduce_scatter_tensor_host<C: Comm + ?Sized>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let t = flat_of(t, "reduce-scatter")?;
    let n = block_len(t.elem_count(), comm.size(), "reduce-scatter")?;
    let out = match t.dtype() {
        DType::BF16 => Tensor::from_vec(comm.reduce_scatter_bf16(&t.to_vec1::<bf16>()?)?, n, t.device())?,
        _ => Tensor::from_vec(comm.reduce_scatter_f32(&t.to_vec1::<f32>()?)?, n, t.device())?,
    };
    Ok(out)
}

/// [`Comm::all_gather_tensor`] through host memory.
pub fn all_gather_tensor_host<C: Comm + ?Sized>(comm: &C, t: &Tensor) -> Result<Tensor> {
    let t = flat_of(t, "all-gather")?;
    let n = t.elem_count() * comm.size();
    let all = match t.dtype() {
        DType::BF16 => Tensor::from_vec(comm.all_gather_bf16(&t.to_vec1::<bf16>()?)?, n, t.device())?,
        _ => {
            let v = comm.all_gather_f32(&t.to_vec1::<f32>()?)?;
            if v.len() != n {
                return Err(Error::invalid(format!(
                    "all-gather: {} values from {} ranks, expected {n} (lengths differ between ranks)",
                    v.len(),
                    comm.size()
                )));
            }
            Tensor::from_vec(v, n, t.device())?
        }
    };
    Ok(all)
}

/// The sum over ranks of every rank's `bufs[rank]`, block `rank` of it, in rank
/// order (so every transport that sums in rank order agrees bitwise): the
/// in-process transport's reduce-scatter once it holds every rank's buffer.
pub(super) fn sum_block(bufs: &[Vec<f32>], rank: usize, what: &str) -> Result<Vec<f32>> {
    let len = bufs.first().map_or(0, Vec::len);
    if let Some(b) = bufs.iter().find(|b| b.len() != len) {
        return Err(Error::invalid(format!("{what}: {len} values on one rank, {} on another", b.len())));
    }
    let n = block_len(len, bufs.len(), what)?;
    let mut out = vec![0f32; n];
    for b in bufs {
        out.iter_mut().zip(&b[rank * n..(rank + 1) * n]).for_each(|(a, x)| *a += x);
    }
    Ok(out)
}

/// bf16 values widened to f32 / f32 values rounded to bf16 (the transports
/// without a bf16 sum reduce bf16 in f32).
pub(super) fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}
pub(super) fn narrow(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}
