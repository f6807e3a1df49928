//! The CUDA C sources of the project's own kernels and how each is launched.
//!
//! Each kernel lives in its own `.cu` file of this folder, with
//! `common.cuh` (bf16 helpers) prepended. A `--features cuda` build compiles
//! them at run time with NVRTC (`model::paged_cuda` and the other custom ops);
//! every build, the CPU one included, holds them as text together with their
//! launch geometry, so that the CPU harness (the `cuda-cpu` crate of the
//! workspace, see docs/cuda.md) compiles the very same sources with g++ and
//! launches them exactly as the CUDA build does, then checks them against the
//! CPU path.

/// Source of the paged-attention kernel (`paged_attention_f32`,
/// `paged_attention_f32_bf16kv`, `paged_attention_bf16`), with `common.cuh`.
pub const PAGED_ATTENTION: &str = concat!(include_str!("common.cuh"), include_str!("paged_attention.cu"));

/// Paged attention: threads per block (four warps share one query's keys).
pub const PAGED_ATTENTION_THREADS: u32 = 128;

/// Paged attention: the largest head dimension the kernel holds in
/// registers (8 per lane).
pub const PAGED_ATTENTION_MAX_HEAD_DIM: usize = 256;

/// Paged attention: the grid of a call of `tokens` new tokens over `hq`
/// query heads (one block per (token, head)).
pub fn paged_attention_grid(tokens: usize, hq: usize) -> (u32, u32, u32) {
    (tokens as u32, hq as u32, 1)
}

/// The block tables of a paged-attention call as the kernel reads them:
/// `row[T] | pos[T] | tables[R * max_blocks]`, each sequence's table padded
/// to the longest with block 0 (never read past a sequence's length); and
/// `max_blocks`.
pub fn paged_attention_meta(row: &[u32], pos: &[u32], tables: &[&[u32]]) -> (Vec<u32>, usize) {
    let max_blocks = tables.iter().map(|t| t.len()).max().unwrap_or(1).max(1);
    let mut meta = Vec::with_capacity(2 * row.len() + tables.len() * max_blocks);
    meta.extend_from_slice(row);
    meta.extend_from_slice(pos);
    for t in tables {
        meta.extend_from_slice(t);
        meta.resize(meta.len() + max_blocks - t.len(), 0);
    }
    (meta, max_blocks)
}

/// Threads per block of the kernels that give a block to a row (RMSNorm,
/// the log-softmax statistics, sampling): a power of two.
pub const ROW_THREADS: u32 = 256;

/// Source of RMSNorm alone and after a residual add (`rms_norm_{f32,bf16}`,
/// `add_rms_norm_{f32,bf16}`; one block of [`ROW_THREADS`] per row).
pub const RMS_NORM: &str = concat!(include_str!("common.cuh"), include_str!("rms_norm.cu"));

/// Source of SwiGLU's gating (`swiglu_{f32,bf16}`, a grid-stride loop).
pub const SWIGLU: &str = concat!(include_str!("common.cuh"), include_str!("swiglu.cu"));

/// SwiGLU: threads per block.
pub const SWIGLU_THREADS: u32 = 256;

/// SwiGLU: the grid for `n` elements (a grid-stride loop beyond 65,535 blocks).
pub fn swiglu_grid(n: usize) -> (u32, u32, u32) {
    (n.div_ceil(SWIGLU_THREADS as usize).clamp(1, 65_535) as u32, 1, 1)
}

/// Source of per-head RMSNorm + rotary embedding (`norm_rope_{f32,bf16}`) and
/// the same for keys fused with the write of keys and values into their cache
/// slots (`norm_rope_write_kv_{f32,f32_bf16pool,bf16}`); one block per
/// (token, head).
pub const NORM_ROPE: &str = concat!(include_str!("common.cuh"), include_str!("norm_rope.cu"));

/// Norm + rope: threads per block (each takes up to 4 pairs of a head).
pub const NORM_ROPE_THREADS: u32 = 64;

/// Norm + rope: the largest head dimension (`2 * 4 * NORM_ROPE_THREADS`).
pub const NORM_ROPE_MAX_HEAD_DIM: usize = 2 * 4 * NORM_ROPE_THREADS as usize;

/// Source of the log-softmax statistics over vocabulary tiles, forward
/// (`logp_entropy_tile_{f32,bf16}`, `logp_entropy_finish`) and backward
/// (`logp_entropy_bwd_tile_{f32,bf16}`).
pub const LOGP_ENTROPY: &str = concat!(include_str!("common.cuh"), include_str!("logp_entropy.cu"));

/// `logp_entropy_finish`: threads per block (one per row).
pub const FINISH_THREADS: u32 = 128;

/// Source of on-device sampling (`sample_rows`, one block of [`ROW_THREADS`]
/// per row).
pub const SAMPLE: &str = concat!(include_str!("common.cuh"), include_str!("sample.cu"));

/// The filters of one call of the sampling kernel (`sample_rows`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// 1 / temperature; 0 for greedy.
    pub inv_t: f32,
    /// Top-k; 0 for off.
    pub top_k: usize,
    /// Top-p; 1 for off.
    pub top_p: f64,
    /// Min-p; 0 for off.
    pub min_p: f64,
}
