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

/// One kernel of a source: its name (an `extern "C"` entry of the PTX, the
/// name the CUDA build fetches from the loaded module) and its threads per
/// block at launch. Every launch passes `shared_mem_bytes: 0`: a kernel's
/// shared memory is all static.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    /// The entry's name.
    pub name: &'static str,
    /// Threads per block.
    pub threads: u32,
}

/// One kernel source as the CUDA build loads it: the module's name in
/// candle's device, the text NVRTC compiles (`common.cuh` prepended; no
/// `#include`, no headers, options [`NVRTC_OPTIONS`]) and its kernels.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// The module's name in candle's device.
    pub module: &'static str,
    /// The `.cu` file, for messages.
    pub file: &'static str,
    /// The CUDA C text.
    pub text: &'static str,
    /// Every kernel of the text.
    pub kernels: &'static [Kernel],
}

/// The options the CUDA build passes to NVRTC: none. The PTX is written for
/// NVRTC's default virtual architecture and the driver compiles it for the
/// device when the module loads.
pub const NVRTC_OPTIONS: &[&str] = &[];

const fn kernel(name: &'static str, threads: u32) -> Kernel {
    Kernel { name, threads }
}

/// `paged_attention.cu`.
pub const PAGED_ATTENTION_SOURCE: Source = Source {
    module: "stapo_paged_attention",
    file: "paged_attention.cu",
    text: PAGED_ATTENTION,
    kernels: &[
        kernel("paged_attention_f32", PAGED_ATTENTION_THREADS),
        kernel("paged_attention_f32_bf16kv", PAGED_ATTENTION_THREADS),
        kernel("paged_attention_bf16", PAGED_ATTENTION_THREADS),
    ],
};

/// `rms_norm.cu`.
pub const RMS_NORM_SOURCE: Source = Source {
    module: "stapo_rms_norm",
    file: "rms_norm.cu",
    text: RMS_NORM,
    kernels: &[
        kernel("rms_norm_f32", ROW_THREADS),
        kernel("rms_norm_bf16", ROW_THREADS),
        kernel("add_rms_norm_f32", ROW_THREADS),
        kernel("add_rms_norm_bf16", ROW_THREADS),
    ],
};

/// `swiglu.cu`.
pub const SWIGLU_SOURCE: Source = Source {
    module: "stapo_swiglu",
    file: "swiglu.cu",
    text: SWIGLU,
    kernels: &[kernel("swiglu_f32", SWIGLU_THREADS), kernel("swiglu_bf16", SWIGLU_THREADS)],
};

/// `norm_rope.cu`.
pub const NORM_ROPE_SOURCE: Source = Source {
    module: "stapo_norm_rope",
    file: "norm_rope.cu",
    text: NORM_ROPE,
    kernels: &[
        kernel("norm_rope_f32", NORM_ROPE_THREADS),
        kernel("norm_rope_bf16", NORM_ROPE_THREADS),
        kernel("norm_rope_write_kv_f32", NORM_ROPE_THREADS),
        kernel("norm_rope_write_kv_f32_bf16pool", NORM_ROPE_THREADS),
        kernel("norm_rope_write_kv_bf16", NORM_ROPE_THREADS),
    ],
};

/// `logp_entropy.cu`.
pub const LOGP_ENTROPY_SOURCE: Source = Source {
    module: "stapo_logp_entropy",
    file: "logp_entropy.cu",
    text: LOGP_ENTROPY,
    kernels: &[
        kernel("logp_entropy_tile_f32", ROW_THREADS),
        kernel("logp_entropy_tile_bf16", ROW_THREADS),
        kernel("logp_entropy_finish", FINISH_THREADS),
        kernel("logp_entropy_bwd_tile_f32", ROW_THREADS),
        kernel("logp_entropy_bwd_tile_bf16", ROW_THREADS),
    ],
};

/// `sample.cu`.
pub const SAMPLE_SOURCE: Source = Source {
    module: "stapo_sample",
    file: "sample.cu",
    text: SAMPLE,
    kernels: &[kernel("sample_rows", ROW_THREADS)],
};

/// Every kernel source with its kernels (the NVRTC checks compile each).
pub const SOURCES: [&Source; 6] = [
    &PAGED_ATTENTION_SOURCE,
    &RMS_NORM_SOURCE,
    &SWIGLU_SOURCE,
    &NORM_ROPE_SOURCE,
    &LOGP_ENTROPY_SOURCE,
    &SAMPLE_SOURCE,
];

/// The names of the `extern "C" __global__` functions of a CUDA C text, in
/// order.
pub fn entry_points(text: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("__global__") {
        rest = &rest[i + "__global__".len()..];
        let head = rest.trim_start();
        let Some(head) = head.strip_prefix("void") else { continue };
        let head = head.trim_start();
        let end = head.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(head.len());
        if end > 0 && head[end..].trim_start().starts_with('(') {
            names.push(&head[..end]);
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table lists every kernel of each source and nothing else, each
    /// once, with a block of whole warps (the block sums assume it).
    #[test]
    fn the_table_lists_every_kernel_of_each_source() {
        let mut all = Vec::new();
        for s in SOURCES {
            let listed: Vec<&str> = s.kernels.iter().map(|k| k.name).collect();
            assert_eq!(entry_points(s.text), listed, "{}", s.file);
            for k in s.kernels {
                assert!(
                    s.text.contains(&format!("extern \"C\" __global__ void {}(", k.name)),
                    "{}: {} is not extern \"C\"",
                    s.file,
                    k.name
                );
                assert!(
                    k.threads.is_multiple_of(32) && (32..=1024).contains(&k.threads),
                    "{}: {}",
                    k.name,
                    k.threads
                );
            }
            all.extend(listed);
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a kernel name is used twice");
        assert_eq!(n, 20);
    }

    /// Every kernel name that the CUDA build's ops fetch from a module
    /// (`model/cuda_ops.rs`, `model/paged_cuda.rs`: the snake_case string
    /// literals other than the module names) is in the table, so the NVRTC
    /// check, which finds each table entry in the PTX, covers them.
    #[test]
    fn every_kernel_the_cuda_ops_fetch_is_in_the_table() {
        let listed: Vec<&str> = SOURCES.iter().flat_map(|s| s.kernels.iter().map(|k| k.name)).collect();
        let modules: Vec<&str> = SOURCES.iter().map(|s| s.module).collect();
        let mut fetched = 0;
        for (file, text) in [
            ("cuda_ops.rs", include_str!("../cuda_ops.rs")),
            ("paged_cuda.rs", include_str!("../paged_cuda.rs")),
        ] {
            for lit in text.split('"').skip(1).step_by(2) {
                let snake = lit.contains('_')
                    && lit.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
                if snake && !modules.contains(&lit) {
                    assert!(listed.contains(&lit), "{file} fetches kernel {lit}, which no source defines");
                    fetched += 1;
                }
            }
        }
        assert!(fetched >= 20, "{fetched} kernel names found in the CUDA ops");
    }

    #[test]
    fn entry_points_reads_names_across_lines() {
        let t = "template <typename T>\n__global__ void inner(int x) {}\nextern \"C\" __global__\nvoid a_1 (int);\n// __global__ comment\n";
        assert_eq!(entry_points(t), ["inner", "a_1"]);
    }
}
