//! Gradient all-reduce through NCCL (`--features nccl`): each rank drives one
//! GPU; MPI starts the ranks, broadcasts NCCL's unique id from rank 0 (the
//! bootstrap nccl-tests and most HPC launchers use) and carries everything
//! that is not a gradient (scalars, tau_h candidates, records for rank 0).
//!
//! A bucket is flattened and concatenated on the device and reduced by one
//! `ncclAllReduce` on candle's own CUDA stream, so it is ordered after the
//! backward pass that produced it and before the optimizer step that reads it.
//! Nothing is copied to the host. The sharded optimizer's reduce-scatter and
//! all-gather of 1-D f32/bf16 tensors (`ncclReduceScatter`, `ncclAllGather`) run
//! the same way, on device buffers.

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::safe::NcclType;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm as NcclComm, Id, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use half::bf16;

use super::{
    all_gather_tensor_host, all_reduce_tensors_host, block_len, buckets, reduce_scatter_tensor_host, Comm,
};
use crate::{Error, Result};

/// NCCL's communicator is a raw pointer; every use goes through `&self` of
/// [`MpiNccl`], whose collectives are called by one thread at a time (the
/// training loop), which is what NCCL requires of one communicator.
struct Nccl(NcclComm);
// SAFETY: see `Nccl`.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

/// MPI for everything, NCCL for tensors on the GPU.
pub(super) struct MpiNccl {
    mpi: Arc<dyn Comm>,
    nccl: Arc<Nccl>,
    device: CudaDevice,
}

/// Sets up NCCL over `mpi`'s ranks on `device` (collective: every rank calls it).
pub(super) fn init(mpi: Arc<dyn Comm>, device: &Device) -> Result<Arc<dyn Comm>> {
    let Device::Cuda(dev) = device else {
        return Err(Error::invalid("nccl: the model is not on a CUDA device"));
    };
    let mut bytes = if mpi.rank() == 0 {
        let id = Id::new().map_err(|e| Error::invalid(format!("nccl: unique id: {e:?}")))?;
        id.internal().iter().map(|&c| c as u8).collect()
    } else {
        Vec::new()
    };
    mpi.broadcast_bytes(0, &mut bytes)?;
    if bytes.len() != 128 {
        return Err(Error::invalid(format!("nccl: unique id of {} bytes, expected 128", bytes.len())));
    }
    let mut internal = [0 as std::ffi::c_char; 128];
    for (d, s) in internal.iter_mut().zip(&bytes) {
        *d = *s as std::ffi::c_char;
    }
    let comm = NcclComm::from_rank(dev.cuda_stream(), mpi.rank(), mpi.size(), Id::uninit(internal))
        .map_err(|e| Error::invalid(format!("nccl: init rank {} of {}: {e:?}", mpi.rank(), mpi.size())))?;
    Ok(Arc::new(MpiNccl { mpi, nccl: Arc::new(Nccl(comm)), device: dev.clone() }))
}

/// Sum over ranks of a contiguous f32 CUDA tensor, as a no-backward custom op.
struct AllReduceSum(Arc<Nccl>);

impl CustomOp1 for AllReduceSum {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-sum"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("nccl all-reduce: the tensor is on the CPU")
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((lo, hi)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl all-reduce: the bucket is not contiguous")
        };
        let src = s.as_cuda_slice::<f32>()?.slice(lo..hi);
        let dev = s.device().clone();
        let mut dst = dev.alloc_zeros::<f32>(hi - lo)?;
        self.0 .0.all_reduce(&src, &mut dst, &ReduceOp::Sum).map_err(|e| {
            candle_core::Error::Msg(format!("nccl all-reduce of {} elements: {e:?}", hi - lo))
        })?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), l.shape().clone()))
    }
}

/// Reduce-scatter (sum, rank `r` keeps block `r`) or all-gather of a contiguous
/// 1-D f32 or bf16 CUDA tensor, as a no-backward custom op on candle's stream.
struct Blocks {
    nccl: Arc<Nccl>,
    size: usize,
    gather: bool,
}

impl Blocks {
    fn what(&self) -> &'static str {
        if self.gather {
            "nccl all-gather"
        } else {
            "nccl reduce-scatter"
        }
    }

    fn run<T>(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)>
    where
        T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits,
    {
        let Some((lo, hi)) = l.contiguous_offsets() else {
            candle_core::bail!("{}: the buffer is not contiguous", self.what())
        };
        let n = hi - lo;
        if !self.gather && !n.is_multiple_of(self.size) {
            candle_core::bail!("{}: {n} values cannot be cut into {} equal blocks", self.what(), self.size)
        }
        let src = s.as_cuda_slice::<T>()?.slice(lo..hi);
        let dev = s.device().clone();
        let out = if self.gather { n * self.size } else { n / self.size };
        let mut dst = dev.alloc_zeros::<T>(out)?;
        let done = if self.gather {
            self.nccl.0.all_gather(&src, &mut dst)
        } else {
            self.nccl.0.reduce_scatter(&src, &mut dst, &ReduceOp::Sum)
        };
        done.map_err(|e| candle_core::Error::Msg(format!("{} of {n} elements: {e:?}", self.what())))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), Shape::from(out)))
    }
}

impl CustomOp1 for Blocks {
    fn name(&self) -> &'static str {
        if self.gather {
            "nccl-all-gather"
        } else {
            "nccl-reduce-scatter"
        }
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{}: the tensor is on the CPU", self.what())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        match s.dtype() {
            DType::F32 => self.run::<f32>(s, l),
            DType::BF16 => self.run::<bf16>(s, l),
            other => candle_core::bail!("{}: expected f32 or bf16, found {other:?}", self.what()),
        }
    }
}

impl MpiNccl {
    /// Whether `t` is a 1-D f32/bf16 tensor on this communicator's GPU (else the
    /// host path serves it).
    fn on_device(&self, t: &Tensor) -> bool {
        matches!(t.device(), Device::Cuda(d) if d.same_device(&self.device))
            && matches!(t.dtype(), DType::F32 | DType::BF16)
            && t.rank() == 1
    }

    fn blocks(&self, t: &Tensor, gather: bool) -> Result<Tensor> {
        if !gather {
            block_len(t.elem_count(), self.size(), "reduce-scatter")?;
        }
        let op = Blocks { nccl: self.nccl.clone(), size: self.size(), gather };
        Ok(t.contiguous()?.apply_op1_no_bwd(&op)?)
    }
}

impl Comm for MpiNccl {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }
    fn size(&self) -> usize {
        self.mpi.size()
    }
    fn backend(&self) -> &'static str {
        "mpi+nccl"
    }
    fn all_reduce_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.mpi.all_reduce_f64(buf)
    }
    fn all_reduce_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.mpi.all_reduce_f32(buf)
    }
    fn all_gather_f32(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.mpi.all_gather_f32(local)
    }
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.mpi.all_gather_bytes(local)
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<()> {
        self.mpi.broadcast_bytes(root, buf)
    }
    fn barrier(&self) -> Result<()> {
        self.mpi.barrier()
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>> {
        // The groups talk over MPI; a group that trains sets up its own NCCL (`for_device`).
        self.mpi.split(color, key)
    }
    fn send_bytes(&self, dest: usize, buf: &[u8]) -> Result<()> {
        self.mpi.send_bytes(dest, buf)
    }
    fn recv_bytes(&self, src: usize) -> Result<Vec<u8>> {
        self.mpi.recv_bytes(src)
    }
    fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>> {
        self.mpi.reduce_scatter_f32(buf)
    }
    fn reduce_scatter_bf16(&self, buf: &[bf16]) -> Result<Vec<bf16>> {
        self.mpi.reduce_scatter_bf16(buf)
    }
    fn all_gather_bf16(&self, local: &[bf16]) -> Result<Vec<bf16>> {
        self.mpi.all_gather_bf16(local)
    }
    fn reduce_scatter_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.on_device(t) {
            self.blocks(t, false)
        } else {
            reduce_scatter_tensor_host(self, t)
        }
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.on_device(t) {
            self.blocks(t, true)
        } else {
            all_gather_tensor_host(self, t)
        }
    }
    fn all_reduce_tensors(&self, tensors: &mut [Tensor], bucket_elems: usize) -> Result<()> {
        let on_gpu =
            tensors.iter().all(|t| matches!(t.device(), Device::Cuda(d) if d.same_device(&self.device)));
        if !on_gpu {
            return all_reduce_tensors_host(self, tensors, bucket_elems);
        }
        let op = AllReduceSum(self.nccl.clone());
        for range in buckets(tensors.iter().map(|t| t.elem_count()), bucket_elems) {
            let flat: Vec<Tensor> = tensors[range.clone()]
                .iter()
                .map(|t| t.to_dtype(DType::F32)?.flatten_all())
                .collect::<candle_core::Result<_>>()?;
            let summed = Tensor::cat(&flat, 0)?.apply_op1_no_bwd(&op)?;
            let mut at = 0;
            for t in &mut tensors[range] {
                let n = t.elem_count();
                *t = summed.narrow(0, at, n)?.reshape(t.shape())?.to_dtype(t.dtype())?;
                at += n;
            }
        }
        Ok(())
    }
}
