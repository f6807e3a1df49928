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
pub use stapo::model::cuda::SampleParams;

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
    assert!(
        hkv > 0 && hq.is_multiple_of(hkv) && d <= src::PAGED_ATTENTION_MAX_HEAD_DIM,
        "heads {hq}:{hkv}, d {d}"
    );
    assert_eq!(q.len(), hq * tokens * d, "q");
    assert!(k.len() == v.len() && k.len().is_multiple_of(hkv * d), "pools");
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

mod ffi2 {
    use half::bf16;

    extern "C" {
        pub fn cpu_rms_norm_f32(
            g: *const u32,
            b: *const u32,
            x: *const f32,
            w: *const f32,
            y: *mut f32,
            n: i32,
            eps: f32,
        );
        pub fn cpu_rms_norm_bf16(
            g: *const u32,
            b: *const u32,
            x: *const bf16,
            w: *const bf16,
            y: *mut bf16,
            n: i32,
            eps: f32,
        );
        pub fn cpu_add_rms_norm_f32(
            g: *const u32,
            b: *const u32,
            x: *const f32,
            r: *const f32,
            w: *const f32,
            h: *mut f32,
            y: *mut f32,
            n: i32,
            eps: f32,
        );
        pub fn cpu_add_rms_norm_bf16(
            g: *const u32,
            b: *const u32,
            x: *const bf16,
            r: *const bf16,
            w: *const bf16,
            h: *mut bf16,
            y: *mut bf16,
            n: i32,
            eps: f32,
        );
        pub fn cpu_swiglu_f32(
            g: *const u32,
            b: *const u32,
            gate: *const f32,
            up: *const f32,
            out: *mut f32,
            n: u64,
            cols: u64,
            stride: u64,
        );
        pub fn cpu_swiglu_bf16(
            g: *const u32,
            b: *const u32,
            gate: *const bf16,
            up: *const bf16,
            out: *mut bf16,
            n: u64,
            cols: u64,
            stride: u64,
        );
        pub fn cpu_norm_rope_f32(
            g: *const u32,
            b: *const u32,
            x: *const f32,
            w: *const f32,
            cs: *const f32,
            sn: *const f32,
            out: *mut f32,
            l: i32,
            nh: i32,
            d: i32,
            xs: u64,
            eps: f32,
        );
        pub fn cpu_norm_rope_bf16(
            g: *const u32,
            b: *const u32,
            x: *const bf16,
            w: *const bf16,
            cs: *const bf16,
            sn: *const bf16,
            out: *mut bf16,
            l: i32,
            nh: i32,
            d: i32,
            xs: u64,
            eps: f32,
        );
        pub fn cpu_norm_rope_write_kv_f32(
            g: *const u32,
            b: *const u32,
            k: *const f32,
            v: *const f32,
            w: *const f32,
            cs: *const f32,
            sn: *const f32,
            slots: *const u32,
            pk: *mut f32,
            pv: *mut f32,
            nh: i32,
            d: i32,
            kvs: u64,
            eps: f32,
        );
        pub fn cpu_norm_rope_write_kv_f32_bf16pool(
            g: *const u32,
            b: *const u32,
            k: *const f32,
            v: *const f32,
            w: *const f32,
            cs: *const f32,
            sn: *const f32,
            slots: *const u32,
            pk: *mut bf16,
            pv: *mut bf16,
            nh: i32,
            d: i32,
            kvs: u64,
            eps: f32,
        );
        pub fn cpu_norm_rope_write_kv_bf16(
            g: *const u32,
            b: *const u32,
            k: *const bf16,
            v: *const bf16,
            w: *const bf16,
            cs: *const bf16,
            sn: *const bf16,
            slots: *const u32,
            pk: *mut bf16,
            pv: *mut bf16,
            nh: i32,
            d: i32,
            kvs: u64,
            eps: f32,
        );
        pub fn cpu_logp_entropy_tile_f32(
            g: *const u32,
            b: *const u32,
            x: *const f32,
            ld: u64,
            v0: i32,
            n: i32,
            targets: *const u32,
            state: *mut f64,
        );
        pub fn cpu_logp_entropy_tile_bf16(
            g: *const u32,
            b: *const u32,
            x: *const bf16,
            ld: u64,
            v0: i32,
            n: i32,
            targets: *const u32,
            state: *mut f64,
        );
        pub fn cpu_logp_entropy_finish(
            g: *const u32,
            b: *const u32,
            state: *const f64,
            out: *mut f32,
            rows: i32,
        );
        pub fn cpu_logp_entropy_bwd_tile_f32(
            g: *const u32,
            b: *const u32,
            x: *const f32,
            ld: u64,
            v0: i32,
            n: i32,
            targets: *const u32,
            res: *const f32,
            dres: *const f32,
            dx: *mut f32,
            ldd: u64,
        );
        pub fn cpu_logp_entropy_bwd_tile_bf16(
            g: *const u32,
            b: *const u32,
            x: *const bf16,
            ld: u64,
            v0: i32,
            n: i32,
            targets: *const u32,
            res: *const f32,
            dres: *const f32,
            dx: *mut bf16,
            ldd: u64,
        );
        pub fn cpu_sample_rows(
            g: *const u32,
            b: *const u32,
            logits: *const f32,
            v: i32,
            uniforms: *const f64,
            inv_t: f32,
            top_k: i32,
            top_p: f64,
            min_p: f64,
            out: *mut f32,
        );
    }
}

/// C entry points of the kernels, by argument list (`T` the storage type, `P` the pools').
type RmsNormFn<T> = unsafe extern "C" fn(*const u32, *const u32, *const T, *const T, *mut T, i32, f32);
type AddRmsNormFn<T> =
    unsafe extern "C" fn(*const u32, *const u32, *const T, *const T, *const T, *mut T, *mut T, i32, f32);
type SwigluFn<T> = unsafe extern "C" fn(*const u32, *const u32, *const T, *const T, *mut T, u64, u64, u64);
type NormRopeFn<T> = unsafe extern "C" fn(
    *const u32,
    *const u32,
    *const T,
    *const T,
    *const T,
    *const T,
    *mut T,
    i32,
    i32,
    i32,
    u64,
    f32,
);
type LogpTileFn<T> =
    unsafe extern "C" fn(*const u32, *const u32, *const T, u64, i32, i32, *const u32, *mut f64);
type LogpBwdTileFn<T> = unsafe extern "C" fn(
    *const u32,
    *const u32,
    *const T,
    u64,
    i32,
    i32,
    *const u32,
    *const f32,
    *const f32,
    *mut T,
    u64,
);
type WriteKvFn<T, P> = unsafe extern "C" fn(
    *const u32,
    *const u32,
    *const T,
    *const T,
    *const T,
    *const T,
    *const T,
    *const u32,
    *mut P,
    *mut P,
    i32,
    i32,
    u64,
    f32,
);

/// The storage types of the row kernels: f32 and bf16, each naming its
/// kernels' C entry points.
pub trait Float: Copy + Default + Send + Sync + 'static {
    #[doc(hidden)]
    const RMS_NORM: RmsNormFn<Self>;
    #[doc(hidden)]
    const ADD_RMS_NORM: AddRmsNormFn<Self>;
    #[doc(hidden)]
    const SWIGLU: SwigluFn<Self>;
    #[doc(hidden)]
    const NORM_ROPE: NormRopeFn<Self>;
    #[doc(hidden)]
    const LOGP_TILE: LogpTileFn<Self>;
    #[doc(hidden)]
    const LOGP_BWD_TILE: LogpBwdTileFn<Self>;
}

impl Float for f32 {
    const RMS_NORM: RmsNormFn<Self> = ffi2::cpu_rms_norm_f32;
    const ADD_RMS_NORM: AddRmsNormFn<Self> = ffi2::cpu_add_rms_norm_f32;
    const SWIGLU: SwigluFn<Self> = ffi2::cpu_swiglu_f32;
    const NORM_ROPE: NormRopeFn<Self> = ffi2::cpu_norm_rope_f32;
    const LOGP_TILE: LogpTileFn<Self> = ffi2::cpu_logp_entropy_tile_f32;
    const LOGP_BWD_TILE: LogpBwdTileFn<Self> = ffi2::cpu_logp_entropy_bwd_tile_f32;
}

impl Float for bf16 {
    const RMS_NORM: RmsNormFn<Self> = ffi2::cpu_rms_norm_bf16;
    const ADD_RMS_NORM: AddRmsNormFn<Self> = ffi2::cpu_add_rms_norm_bf16;
    const SWIGLU: SwigluFn<Self> = ffi2::cpu_swiglu_bf16;
    const NORM_ROPE: NormRopeFn<Self> = ffi2::cpu_norm_rope_bf16;
    const LOGP_TILE: LogpTileFn<Self> = ffi2::cpu_logp_entropy_tile_bf16;
    const LOGP_BWD_TILE: LogpBwdTileFn<Self> = ffi2::cpu_logp_entropy_bwd_tile_bf16;
}

fn row_dims(rows: usize) -> ([u32; 3], [u32; 3]) {
    ([rows as u32, 1, 1], [src::ROW_THREADS, 1, 1])
}

/// RMSNorm (`rms_norm.cu`) of the rows of `x` (`w.len()` wide).
pub fn rms_norm<T: Float>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let n = w.len();
    assert!(n > 0 && x.len().is_multiple_of(n), "rms_norm: {} values in rows of {n}", x.len());
    let mut y = vec![T::default(); x.len()];
    let (g, b) = row_dims(x.len() / n);
    // SAFETY: one block per row of `n`, inside `x` and `y`.
    unsafe { T::RMS_NORM(g.as_ptr(), b.as_ptr(), x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), n as i32, eps) };
    y
}

/// RMSNorm after a residual add (`rms_norm.cu`): `(h, y)` with `h = x + r`.
pub fn add_rms_norm<T: Float>(x: &[T], r: &[T], w: &[T], eps: f32) -> (Vec<T>, Vec<T>) {
    let n = w.len();
    assert!(n > 0 && x.len().is_multiple_of(n) && r.len() == x.len(), "add_rms_norm: sizes");
    let (mut h, mut y) = (vec![T::default(); x.len()], vec![T::default(); x.len()]);
    let (g, b) = row_dims(x.len() / n);
    // SAFETY: one block per row of `n`, inside every buffer.
    unsafe {
        T::ADD_RMS_NORM(
            g.as_ptr(),
            b.as_ptr(),
            x.as_ptr(),
            r.as_ptr(),
            w.as_ptr(),
            h.as_mut_ptr(),
            y.as_mut_ptr(),
            n as i32,
            eps,
        )
    };
    (h, y)
}

/// SwiGLU's gating (`swiglu.cu`): `silu(gate) * up`.
pub fn swiglu<T: Float>(gate: &[T], up: &[T]) -> Vec<T> {
    assert_eq!(gate.len(), up.len(), "swiglu: sizes");
    let n = gate.len() as u64;
    let mut out = vec![T::default(); gate.len()];
    let g = dims(src::swiglu_grid(gate.len()));
    let b = [src::SWIGLU_THREADS, 1, 1];
    // SAFETY: the grid-stride loop stays below `n`; one row of `n`.
    unsafe { T::SWIGLU(g.as_ptr(), b.as_ptr(), gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), n, n, n) };
    out
}

/// SwiGLU's gating (`swiglu.cu`) of the rows of one product over
/// `[Wgate; Wup]`: `gate_up` `(N, 2 * cols)`, each row's gate then up;
/// returns `(N, cols)`.
pub fn swiglu_rows<T: Float>(gate_up: &[T], cols: usize) -> Vec<T> {
    assert!(cols > 0 && gate_up.len().is_multiple_of(2 * cols), "swiglu_rows: sizes");
    let n = gate_up.len() / 2;
    let mut out = vec![T::default(); n];
    let g = dims(src::swiglu_grid(n));
    let b = [src::SWIGLU_THREADS, 1, 1];
    let (gate, up) = (gate_up.as_ptr(), gate_up[cols..].as_ptr());
    // SAFETY: row r reads [r * 2 cols, r * 2 cols + cols) from each pointer, inside `gate_up`.
    unsafe {
        T::SWIGLU(g.as_ptr(), b.as_ptr(), gate, up, out.as_mut_ptr(), n as u64, cols as u64, 2 * cols as u64)
    };
    out
}

/// Per-head RMSNorm + rotary embedding (`norm_rope.cu`): `x` `(B, L, H, D)`,
/// `cos`/`sin` `(B, L, D/2)`; returns `(B, H, L, D)`.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope<T: Float>(
    x: &[T],
    w: &[T],
    cos: &[T],
    sin: &[T],
    (b, l, h, d): (usize, usize, usize, usize),
    eps: f32,
) -> Vec<T> {
    norm_rope_rows(x, (0, h * d), w, cos, sin, (b, l, h, d), eps)
}

/// [`norm_rope`] of heads read from wider rows: token `n`'s `H` heads of
/// `D` start at `x[offset + n * stride]` (the queries inside the rows of
/// one product over `[Wq; Wk; Wv]`: offset 0, stride `(Hq + 2 Hkv) D`).
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_rows<T: Float>(
    x: &[T],
    (offset, stride): (usize, usize),
    w: &[T],
    cos: &[T],
    sin: &[T],
    (b, l, h, d): (usize, usize, usize, usize),
    eps: f32,
) -> Vec<T> {
    assert!(
        d.is_multiple_of(2) && d <= src::NORM_ROPE_MAX_HEAD_DIM && w.len() == d,
        "norm_rope: head dim {d}"
    );
    let n = b * l;
    assert!(
        stride >= h * d
            && (n == 0 || offset + (n - 1) * stride + h * d <= x.len())
            && cos.len() == n * d / 2
            && sin.len() == cos.len(),
        "norm_rope: sizes"
    );
    let mut out = vec![T::default(); n * h * d];
    let (g, bl) = ([n as u32, h as u32, 1], [src::NORM_ROPE_THREADS, 1, 1]);
    // SAFETY: one block per (token, head), reading inside `x` (checked above).
    unsafe {
        T::NORM_ROPE(
            g.as_ptr(),
            bl.as_ptr(),
            x[offset..].as_ptr(),
            w.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            out.as_mut_ptr(),
            l as i32,
            h as i32,
            d as i32,
            stride as u64,
            eps,
        )
    };
    out
}

/// Activation and pool types of `norm_rope_write_kv`: f32 into f32 or bf16
/// pools, bf16 into bf16.
pub trait KvTypes<P>: Float {
    #[doc(hidden)]
    const WRITE_KV: WriteKvFn<Self, P>;
}

impl KvTypes<f32> for f32 {
    const WRITE_KV: WriteKvFn<Self, f32> = ffi2::cpu_norm_rope_write_kv_f32;
}
impl KvTypes<bf16> for f32 {
    const WRITE_KV: WriteKvFn<Self, bf16> = ffi2::cpu_norm_rope_write_kv_f32_bf16pool;
}
impl KvTypes<bf16> for bf16 {
    const WRITE_KV: WriteKvFn<Self, bf16> = ffi2::cpu_norm_rope_write_kv_bf16;
}

/// Keys' per-head RMSNorm + rotary embedding written with the values into
/// their cache slots (`norm_rope.cu`): `k`, `v` `(T, H, D)`, `cos`/`sin`
/// `(T, D/2)`, `slots` `(T)`, pools `(slots, H, D)`.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_write_kv<T: KvTypes<P>, P>(
    k: &[T],
    v: &[T],
    w: &[T],
    cos: &[T],
    sin: &[T],
    slots: &[u32],
    pools: (&mut [P], &mut [P]),
    (h, d): (usize, usize),
    eps: f32,
) {
    assert!(k.len() == slots.len() * h * d && v.len() == k.len(), "norm_rope_write_kv: sizes");
    write_kv((k, v, h * d), (w, cos, sin, eps), slots, pools, (h, d))
}

/// [`norm_rope_write_kv`] of keys and values read from the rows of one
/// product over `[Wq; Wk; Wv]`, `qkv` `(T, stride)`: token `n`'s keys start
/// at `qkv[k_offset + n * stride]`, its values at `qkv[v_offset + n * stride]`.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_write_kv_rows<T: KvTypes<P>, P>(
    qkv: &[T],
    (k_offset, v_offset, stride): (usize, usize, usize),
    w: &[T],
    cos: &[T],
    sin: &[T],
    slots: &[u32],
    pools: (&mut [P], &mut [P]),
    (h, d): (usize, usize),
    eps: f32,
) {
    let t = slots.len();
    assert!(
        stride >= h * d && (t == 0 || k_offset.max(v_offset) + (t - 1) * stride + h * d <= qkv.len()),
        "norm_rope_write_kv_rows: sizes"
    );
    write_kv((&qkv[k_offset..], &qkv[v_offset..], stride), (w, cos, sin, eps), slots, pools, (h, d))
}

/// The keys' norm weight, the rotary tables and epsilon of a cache write.
type Rope<'a, T> = (&'a [T], &'a [T], &'a [T], f32);

/// The launch of both: token `n`'s keys at `k[n * stride]`, its values at
/// `v[n * stride]`.
fn write_kv<T: KvTypes<P>, P>(
    (k, v, stride): (&[T], &[T], usize),
    (w, cos, sin, eps): Rope<'_, T>,
    slots: &[u32],
    pools: (&mut [P], &mut [P]),
    (h, d): (usize, usize),
) {
    let t = slots.len();
    assert!(
        d % 2 == 0 && d <= src::NORM_ROPE_MAX_HEAD_DIM && w.len() == d,
        "norm_rope_write_kv: head dim {d}"
    );
    let last = if t == 0 { 0 } else { (t - 1) * stride + h * d };
    assert!(k.len() >= last && v.len() >= last && cos.len() == t * d / 2 && sin.len() == cos.len());
    assert!(
        pools.0.len() == pools.1.len() && slots.iter().all(|&s| (s as usize + 1) * h * d <= pools.0.len())
    );
    let (g, b) = ([t as u32, h as u32, 1], [src::NORM_ROPE_THREADS, 1, 1]);
    // SAFETY: every slot lies inside the pools and every row inside `k` and `v` (checked above).
    unsafe {
        T::WRITE_KV(
            g.as_ptr(),
            b.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            w.as_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            slots.as_ptr(),
            pools.0.as_mut_ptr(),
            pools.1.as_mut_ptr(),
            h as i32,
            d as i32,
            stride as u64,
            eps,
        )
    };
}

/// The log-softmax statistics (`logp_entropy.cu`) of the rows of `x`
/// (`vocab` wide), folded `tile` columns at a time: `(rows, 3)` of
/// `[logp, H, lse]`.
pub fn logp_entropy<T: Float>(x: &[T], vocab: usize, targets: &[u32], tile: usize) -> Vec<f32> {
    let rows = targets.len();
    assert!(x.len() == rows * vocab && tile > 0 && targets.iter().all(|&t| (t as usize) < vocab));
    let mut state: Vec<f64> = (0..rows).flat_map(|_| [f64::NEG_INFINITY, 0.0, 0.0, 0.0]).collect();
    let (g, b) = row_dims(rows);
    for v0 in (0..vocab).step_by(tile) {
        let n = tile.min(vocab - v0);
        // SAFETY: columns [v0, v0 + n) of each row of `vocab`.
        unsafe {
            T::LOGP_TILE(
                g.as_ptr(),
                b.as_ptr(),
                x[v0..].as_ptr(),
                vocab as u64,
                v0 as i32,
                n as i32,
                targets.as_ptr(),
                state.as_mut_ptr(),
            )
        };
    }
    let mut out = vec![0f32; 3 * rows];
    let g = [rows.div_ceil(src::FINISH_THREADS as usize) as u32, 1, 1];
    let b = [src::FINISH_THREADS, 1, 1];
    // SAFETY: one thread per row, guarded.
    unsafe {
        ffi2::cpu_logp_entropy_finish(g.as_ptr(), b.as_ptr(), state.as_ptr(), out.as_mut_ptr(), rows as i32)
    };
    out
}

/// The backward of [`logp_entropy`] (`logp_entropy.cu`), a tile at a time:
/// `res` the forward's `(rows, 3)`, `dres` its gradient `(rows, 3)`; returns
/// the gradient of `x`.
pub fn logp_entropy_bwd<T: Float>(
    x: &[T],
    vocab: usize,
    targets: &[u32],
    res: &[f32],
    dres: &[f32],
    tile: usize,
) -> Vec<T> {
    let rows = targets.len();
    assert!(x.len() == rows * vocab && res.len() == 3 * rows && dres.len() == 3 * rows && tile > 0);
    let mut dx = vec![T::default(); x.len()];
    let (g, b) = row_dims(rows);
    for v0 in (0..vocab).step_by(tile) {
        let n = tile.min(vocab - v0);
        // SAFETY: columns [v0, v0 + n) of each row of `vocab`, in `x` and `dx`.
        unsafe {
            T::LOGP_BWD_TILE(
                g.as_ptr(),
                b.as_ptr(),
                x[v0..].as_ptr(),
                vocab as u64,
                v0 as i32,
                n as i32,
                targets.as_ptr(),
                res.as_ptr(),
                dres.as_ptr(),
                dx[v0..].as_mut_ptr(),
                vocab as u64,
            )
        };
    }
    dx
}

/// One draw per row of `logits` (`vocab` wide) with the row's uniform number
/// (`sample.cu`): `(rows, 4)` of `[logprob, logprob_raw, entropy, id]` (id -1
/// for a row the host sampler refuses).
pub fn sample(logits: &[f32], vocab: usize, uniforms: &[f64], p: SampleParams) -> Vec<f32> {
    let rows = uniforms.len();
    assert_eq!(logits.len(), rows * vocab, "sample: sizes");
    let mut out = vec![0f32; 4 * rows];
    let (g, b) = row_dims(rows);
    // SAFETY: one block per row of `vocab`.
    unsafe {
        ffi2::cpu_sample_rows(
            g.as_ptr(),
            b.as_ptr(),
            logits.as_ptr(),
            vocab as i32,
            uniforms.as_ptr(),
            p.inv_t,
            p.top_k as i32,
            p.top_p,
            p.min_p,
            out.as_mut_ptr(),
        )
    };
    out
}
