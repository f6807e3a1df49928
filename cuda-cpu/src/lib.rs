//! stapo's CUDA C kernels (`host/src/model/cuda/*.cu`) compiled for the CPU
//! with `cuda_cpu.h`, a small emulation of the CUDA programming model (one
//! fiber per GPU thread, real block barriers and warp shuffles; see the
//! header and docs/cuda.md), and safe Rust entry points that launch them with
//! the launch geometry the CUDA build uses (`stapo::model::cuda`). The test
//! program `tests/kernels.rs` checks every kernel against the CPU path.
//!
//! Dev-only: nothing of stapo depends on this crate.

use half::bf16;
use stapo::model::cuda as src;

/// A launch's grid and block, as `(x, y, z)`.
pub type Dim = (u32, u32, u32);

mod ffi {
    use half::bf16;

    macro_rules! paged_attention {
        ($name:ident, $t:ty, $k:ty) => {
            extern "C" {
                pub fn $name(
                    g: *const u32,
                    b: *const u32,
                    q: *const $t,
                    kp: *const $k,
                    vp: *const $k,
                    out: *mut $t,
                    meta: *const u32,
                    nt: i32,
                    hq: i32,
                    hkv: i32,
                    d: i32,
                    bs: i32,
                    maxb: i32,
                    scale: f32,
                );
            }
        };
    }
    paged_attention!(cpu_paged_attention_f32, f32, f32);
    paged_attention!(cpu_paged_attention_f32_bf16kv, f32, bf16);
    paged_attention!(cpu_paged_attention_bf16, bf16, bf16);
}

fn dims(d: Dim) -> [u32; 3] {
    [d.0, d.1, d.2]
}

/// Element types of the paged-attention kernel's queries and pools: f32
/// over f32, f32 over bf16, bf16 over bf16.
pub trait PagedTypes<K>: Copy + Default {
    /// Runs the kernel that serves `Self` queries over `K` pools.
    ///
    /// # Safety
    /// Every slot the block tables name lies inside the pools, and `out`
    /// holds `tokens * hq * d` elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        g: Dim,
        b: Dim,
        q: &[Self],
        k: &[K],
        v: &[K],
        out: &mut [Self],
        meta: &[u32],
        p: &PagedShape,
        maxb: usize,
    );
}

macro_rules! paged_types {
    ($t:ty, $k:ty, $f:ident) => {
        impl PagedTypes<$k> for $t {
            unsafe fn launch(
                g: Dim,
                b: Dim,
                q: &[Self],
                k: &[$k],
                v: &[$k],
                out: &mut [Self],
                meta: &[u32],
                p: &PagedShape,
                maxb: usize,
            ) {
                let (g, b) = (dims(g), dims(b));
                // SAFETY: the caller's contract; the arguments follow the kernel's signature.
                unsafe {
                    ffi::$f(
                        g.as_ptr(),
                        b.as_ptr(),
                        q.as_ptr(),
                        k.as_ptr(),
                        v.as_ptr(),
                        out.as_mut_ptr(),
                        meta.as_ptr(),
                        p.tokens as i32,
                        p.hq as i32,
                        p.hkv as i32,
                        p.d as i32,
                        p.block_size as i32,
                        maxb as i32,
                        1.0 / (p.d as f32).sqrt(),
                    )
                }
            }
        }
    };
}
paged_types!(f32, f32, cpu_paged_attention_f32);
paged_types!(f32, bf16, cpu_paged_attention_f32_bf16kv);
paged_types!(bf16, bf16, cpu_paged_attention_bf16);

/// The sizes of a paged-attention call.
#[derive(Debug, Clone, Copy)]
pub struct PagedShape {
    /// New tokens of the call.
    pub tokens: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

/// The paged-attention kernel (`paged_attention.cu`) as `model::paged_cuda`
/// launches it: `q` `(Hq, T, D)`, pools `(slots, Hkv, D)`; returns
/// `(T, Hq, D)`. Panics when a table, position or size would send the kernel
/// outside its buffers.
pub fn paged_attention<T: PagedTypes<K>, K>(
    q: &[T],
    k: &[K],
    v: &[K],
    row: &[u32],
    pos: &[u32],
    tables: &[&[u32]],
    p: PagedShape,
) -> Vec<T> {
    let PagedShape { tokens, hq, hkv, d, block_size: bs } = p;
    assert!(hkv > 0 && hq % hkv == 0 && d <= src::PAGED_ATTENTION_MAX_HEAD_DIM, "heads {hq}:{hkv}, d {d}");
    assert_eq!(q.len(), hq * tokens * d, "q");
    assert!(k.len() == v.len() && k.len() % (hkv * d) == 0, "pools");
    assert!(row.len() == tokens && pos.len() == tokens, "row/pos");
    let slots = k.len() / (hkv * d);
    for (&r, &ps) in row.iter().zip(pos) {
        let t = tables[r as usize];
        assert!((ps as usize) < t.len() * bs, "position {ps} beyond the table of row {r}");
        assert!(t.iter().all(|&b| (b as usize + 1) * bs <= slots), "a block of row {r} beyond the pools");
    }
    let (meta, maxb) = src::paged_attention_meta(row, pos, tables);
    let mut out = vec![T::default(); tokens * hq * d];
    let grid = src::paged_attention_grid(tokens, hq);
    // SAFETY: checked above.
    unsafe { T::launch(grid, (src::PAGED_ATTENTION_THREADS, 1, 1), q, k, v, &mut out, &meta, &p, maxb) };
    out
}
