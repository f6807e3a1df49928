//! CUDA attention over a paged KV cache: each query reads its sequence's keys
//! and values straight from the pools through the block table, with an online
//! softmax, as vLLM's `paged_attention_v1` kernel does (Kwon et al. 2023) and
//! as [`super::paged_attention`] does on the CPU. No gather of the cache: a
//! step reads each live key once per query head, whatever the other rows'
//! lengths (the composed path padded every row to the longest one).
//!
//! The kernel is CUDA C compiled at run time by NVRTC (cudarc, which candle
//! already links) and loaded into candle's device as a custom module. One
//! thread block serves one (token, query head): its warps take the keys in
//! turn, each warp keeping its own running max, sum and weighted values, and
//! the warps' partial results are merged at the end. Sums are f32 for f32 and
//! bf16 pools alike. Inference only: no backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{CustomOp3, DType, Layout, Shape, Storage, Tensor};

use super::cuda_ops::{view, PAGED_ATTENTION as MODULE};
use crate::{Error, Result};

/// Threads per block.
const THREADS: u32 = super::cuda::PAGED_ATTENTION_THREADS;
/// The largest head dimension the kernel holds in registers (8 per lane).
pub const MAX_HEAD_DIM: usize = super::cuda::PAGED_ATTENTION_MAX_HEAD_DIM;

/// The PTX of the kernel source (`model/cuda/paged_attention.cu`), compiled
/// once per process (NVRTC needs no GPU).
pub fn ptx() -> Result<&'static str> {
    MODULE.ptx()
}

/// Whether the kernel serves queries in `q` over pools in `pool` with heads
/// of `head_dim`: f32 over f32 or bf16 pools, bf16 over bf16.
pub fn supports(q: DType, pool: DType, head_dim: usize) -> bool {
    matches!((q, pool), (DType::F32, DType::F32 | DType::BF16) | (DType::BF16, DType::BF16))
        && head_dim <= MAX_HEAD_DIM
}

/// The block tables of one call, on the device: `row[T] | pos[T] |
/// tables[R * max_blocks]`, built once per call and shared by every layer.
pub struct Meta {
    meta: Tensor,
    tokens: usize,
    max_blocks: usize,
    block_size: usize,
}

impl Meta {
    /// `row` and `pos` per new token, `tables` per sequence (padded to the
    /// longest with block 0, never read past a sequence's length).
    pub fn new(
        row: &[u32],
        pos: &[u32],
        tables: &[&[u32]],
        block_size: usize,
        dev: &candle_core::Device,
    ) -> Result<Self> {
        let (meta, max_blocks) = super::cuda::paged_attention_meta(row, pos, tables);
        let n = meta.len();
        Ok(Self { meta: Tensor::from_vec(meta, n, dev)?, tokens: row.len(), max_blocks, block_size })
    }

    /// Attention of `q` `(1, Hq, T, D)` over pools `k`, `v` `(slots, Hkv, D)`;
    /// returns `(1, T, Hq * D)` in `q`'s dtype.
    pub fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (_, hq, t, d) = q.dims4()?;
        let (hkv, dk) = (k.dim(1)?, k.dim(2)?);
        if t != self.tokens
            || dk != d
            || v.dims() != k.dims()
            || hkv == 0
            || hq % hkv != 0
            || d > MAX_HEAD_DIM
        {
            return Err(Error::invalid(format!(
                "paged attention (CUDA): q {:?} for {} tokens against pools k {:?}, v {:?}",
                q.dims(),
                self.tokens,
                k.dims(),
                v.dims()
            )));
        }
        let op =
            Op { meta: &self.meta, tokens: t, hq, hkv, d, max_blocks: self.max_blocks, bs: self.block_size };
        // q's copy when strided, the kernel.
        super::budget::launch(super::budget::copy_of(q) + 1);
        let out = q.contiguous()?.apply_op3_no_bwd(k, v, &op)?; // (T, Hq, D)
        Ok(out.reshape((1, t, hq * d))?)
    }
}

struct Op<'a> {
    meta: &'a Tensor,
    tokens: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    max_blocks: usize,
    bs: usize,
}

impl Op<'_> {
    fn launch<T: DeviceRepr + candle_core::WithDType, K: DeviceRepr>(
        &self,
        name: &str,
        (q, lq): (&CudaSlice<T>, &Layout),
        (k, lk): (&CudaSlice<K>, &Layout),
        (v, lv): (&CudaSlice<K>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let ptx = ptx().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let func = dev.get_or_load_custom_func(name, MODULE.name(), ptx)?;
        let (meta_storage, meta_layout) = self.meta.storage_and_layout();
        let Storage::Cuda(meta_cuda) = &*meta_storage else {
            candle_core::bail!("paged attention (CUDA): the block tables are not on the GPU");
        };
        let meta = view(meta_cuda.as_cuda_slice::<u32>()?, meta_layout, "the block tables")?;
        let (q, k, v) = (view(q, lq, "q")?, view(k, lk, "the key pool")?, view(v, lv, "the value pool")?);
        // SAFETY: every element is written by the kernel (one block per (token, head), all D lanes).
        let out = unsafe { dev.alloc::<T>(self.tokens * self.hq * self.d)? };
        let cfg = LaunchConfig {
            grid_dim: super::cuda::paged_attention_grid(self.tokens, self.hq),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let dims = [self.tokens, self.hq, self.hkv, self.d, self.bs, self.max_blocks].map(|x| x as i32);
        let scale = 1f32 / (self.d as f32).sqrt();
        let mut b = func.builder();
        b.arg(&q);
        b.arg(&k);
        b.arg(&v);
        b.arg(&out);
        b.arg(&meta);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&scale);
        // SAFETY: the arguments match the kernel's signature; indices stay inside the pools
        // because `decode_paged`'s layout checked every slot against the pool's size.
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }
}

impl CustomOp3 for Op<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("paged attention (CUDA): called on the CPU; the CPU has model::paged_attention")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = q.device();
        let slice = match (&q.slice, &k.slice, &v.slice) {
            (CudaStorageSlice::F32(q), CudaStorageSlice::F32(k), CudaStorageSlice::F32(v)) => {
                CudaStorageSlice::F32(self.launch("paged_attention_f32", (q, lq), (k, lk), (v, lv), dev)?)
            }
            (CudaStorageSlice::F32(q), CudaStorageSlice::BF16(k), CudaStorageSlice::BF16(v)) => {
                CudaStorageSlice::F32(self.launch(
                    "paged_attention_f32_bf16kv",
                    (q, lq),
                    (k, lk),
                    (v, lv),
                    dev,
                )?)
            }
            (CudaStorageSlice::BF16(q), CudaStorageSlice::BF16(k), CudaStorageSlice::BF16(v)) => {
                CudaStorageSlice::BF16(self.launch("paged_attention_bf16", (q, lq), (k, lk), (v, lv), dev)?)
            }
            _ => candle_core::bail!(
                "paged attention (CUDA): no kernel for q {:?} over pools {:?}/{:?}",
                q.dtype(),
                k.dtype(),
                v.dtype()
            ),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((self.tokens, self.hq, self.d))))
    }
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles the kernel without a GPU: a syntax or type error in the
    /// source fails here, not first on a GPU machine.
    #[test]
    fn the_kernel_compiles() {
        let ptx = super::ptx().expect("NVRTC compiles the paged attention kernel");
        for name in ["paged_attention_f32", "paged_attention_f32_bf16kv", "paged_attention_bf16"] {
            assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
        }
    }
}
