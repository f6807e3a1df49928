//! The fused CPU kernels of AdamW: one pass per parameter that reads `p, g, m, v`
//! and writes `p, m, v` in place, parallel over chunks with rayon (see the module
//! docs of `optim` for why the in-place update is sound), and the gradient's sum of
//! squares for the global norm.

use std::cell::RefCell;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};
use rayon::prelude::*;

use super::state::{Hyper, ParamState};
use crate::Result;

/// Elements per rayon task in the fused passes: 64 Ki elements (256 KiB of f32) is
/// large enough to amortise scheduling and small enough to balance two cores.
pub(super) const CHUNK: usize = 1 << 16;

/// Element types the fused kernels read and write; arithmetic is in f32.
trait Elem: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for half::bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// Whether `var` can take the fused path: a contiguous f32/bf16/f16 CPU tensor.
pub(super) fn fused_supported(var: &Tensor) -> bool {
    var.device().is_cpu()
        && var.is_contiguous()
        && matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// `sum(g^2)` in f64: one read-only pass on the CPU, candle ops elsewhere.
pub(super) fn grad_sum_sq(g: &Tensor) -> Result<f64> {
    let fused = {
        let (storage, layout) = g.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(s), Some((a, b))) => match s {
                CpuStorage::F32(x) => x.get(a..b).map(sum_sq),
                CpuStorage::BF16(x) => x.get(a..b).map(sum_sq),
                CpuStorage::F16(x) => x.get(a..b).map(sum_sq),
                _ => None,
            },
            _ => None,
        }
    };
    match fused {
        Some(s) => Ok(s),
        // Other devices and dtypes, or a strided gradient. f32 because Metal lacks f64.
        None => Ok(g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64),
    }
}

/// Deterministic parallel `sum(x^2)`: per-chunk sums are collected in order and
/// added sequentially, so the result does not depend on rayon's scheduling.
fn sum_sq<T: Elem>(x: &[T]) -> f64 {
    let partial: Vec<f64> = x.par_chunks(CHUNK).map(sum_sq_chunk).collect();
    partial.iter().sum()
}

/// `sum(x^2)` over one chunk with eight independent f64 accumulators: float
/// addition is not associative, so a single accumulator would be a serial chain
/// the compiler may not vectorise; eight lanes it can.
#[inline]
fn sum_sq_chunk<T: Elem>(x: &[T]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0f64; LANES];
    let mut blocks = x.chunks_exact(LANES);
    for blk in &mut blocks {
        for j in 0..LANES {
            let v = blk[j].to_f32() as f64;
            acc[j] += v * v;
        }
    }
    let mut s: f64 = blocks.remainder().iter().map(|v| (v.to_f32() as f64).powi(2)).sum();
    for a in acc {
        s += a;
    }
    s
}

/// The fused update of one chunk: one pass reading `p, g, m, v` and writing
/// `p, m, v`. Slices are re-sliced to a common length first so the compiler
/// drops bounds checks and vectorises the loop.
#[inline]
fn adamw_chunk<T: Elem>(p: &mut [T], g: &[T], m: &mut [f32], v: &mut [f32], h: &Hyper) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i].to_f32() * h.clip;
        let mi = h.b1 * m[i] + h.one_minus_b1 * gi;
        let vi = h.b2 * v[i] + h.one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let denom = vi.sqrt() * h.inv_sqrt_bc2 + h.eps;
        p[i] = T::from_f32(p[i].to_f32() * h.decay - h.step_size * mi / denom);
    }
}

/// [`adamw_chunk`]'s arithmetic, element for element, with nothing written: whether
/// every new weight (rounded to `T`, as stored) and moment of the chunk is finite.
#[inline]
fn stays_finite_chunk<T: Elem>(p: &[T], g: &[T], m: &[f32], v: &[f32], h: &Hyper) -> bool {
    let n = p.len();
    let (g, m, v) = (&g[..n], &m[..n], &v[..n]);
    let mut ok = true;
    for i in 0..n {
        let gi = g[i].to_f32() * h.clip;
        let mi = h.b1 * m[i] + h.one_minus_b1 * gi;
        let vi = h.b2 * v[i] + h.one_minus_b2 * gi * gi;
        let denom = vi.sqrt() * h.inv_sqrt_bc2 + h.eps;
        let pi = T::from_f32(p[i].to_f32() * h.decay - h.step_size * mi / denom).to_f32();
        ok &= mi.is_finite() & vi.is_finite() & pi.is_finite();
    }
    ok
}

/// Whether the fused update of `p` (moments `m`, `v`) with gradient `g` would leave
/// every weight and moment finite: one read-only parallel pass with the kernel's own
/// arithmetic. Views (a narrowed range of a flat shard) are read in place.
pub(super) fn fused_stays_finite(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: &Hyper) -> Result<bool> {
    let g = g.to_device(p.device())?.to_dtype(p.dtype())?.contiguous()?;
    let (ps, pl) = p.storage_and_layout();
    let (gs, gl) = g.storage_and_layout();
    let (ms, ml) = m.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(ps), Storage::Cpu(gs), Storage::Cpu(ms), Storage::Cpu(vs)) = (&*ps, &*gs, &*ms, &*vs)
    else {
        return Err(crate::Error::invalid("adamw: the fused finiteness check needs CPU tensors"));
    };
    let (m, v) = match (ms, vs) {
        (CpuStorage::F32(m), CpuStorage::F32(v)) => {
            (range_of(m, ml, "exp_avg")?, range_of(v, vl, "exp_avg_sq")?)
        }
        _ => return Err(crate::Error::invalid("adamw: moments must be f32")),
    };
    fn all<T: Elem>(p: &[T], g: &[T], m: &[f32], v: &[f32], h: &Hyper) -> candle_core::Result<bool> {
        if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
            candle_core::bail!("adamw: length mismatch in the finiteness check");
        }
        Ok(p.par_chunks(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks(CHUNK))
            .zip(v.par_chunks(CHUNK))
            .all(|(((p, g), m), v)| stays_finite_chunk(p, g, m, v, h)))
    }
    Ok(match (ps, gs) {
        (CpuStorage::F32(pd), CpuStorage::F32(gd)) => {
            all(range_of(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)?
        }
        (CpuStorage::BF16(pd), CpuStorage::BF16(gd)) => {
            all(range_of(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)?
        }
        (CpuStorage::F16(pd), CpuStorage::F16(gd)) => {
            all(range_of(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)?
        }
        (ps, gs) => {
            return Err(crate::Error::invalid(format!(
                "adamw: no fused check for param dtype {:?} with grad dtype {:?}",
                ps.dtype(),
                gs.dtype()
            )))
        }
    })
}

/// The fused update over a whole parameter, parallel over chunks.
fn adamw_slices<T: Elem>(
    p: &mut [T],
    g: &[T],
    m: &mut [f32],
    v: &mut [f32],
    h: &Hyper,
) -> candle_core::Result<()> {
    if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
        candle_core::bail!(
            "adamw: length mismatch: param {}, grad {}, exp_avg {}, exp_avg_sq {}",
            p.len(),
            g.len(),
            m.len(),
            v.len()
        );
    }
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| adamw_chunk(p, g, m, v, h));
    Ok(())
}

/// An in-place op that hands candle's locked, mutable storage of one tensor to a
/// closure. `cpu_fwd` takes `&self`, hence the `RefCell<Option<_>>` to move the
/// `FnOnce` out; candle calls it at most once per `inplace_op1`.
struct WithCpuMut<F>(RefCell<Option<F>>);

impl<F> InplaceOp1 for WithCpuMut<F>
where
    F: FnOnce(&mut CpuStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "stapo-adamw-state"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        match self.0.borrow_mut().take() {
            Some(f) => f(storage, layout),
            None => candle_core::bail!("stapo-adamw-state: op applied twice"),
        }
    }
}

/// The same for a destination and one read-only source (the parameter and its gradient).
struct WithCpuMut2<F>(RefCell<Option<F>>);

impl<F> InplaceOp2 for WithCpuMut2<F>
where
    F: FnOnce(&mut CpuStorage, &Layout, &CpuStorage, &Layout) -> candle_core::Result<()>,
{
    fn name(&self) -> &'static str {
        "stapo-adamw-param"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        match self.0.borrow_mut().take() {
            Some(f) => f(s1, l1, s2, l2),
            None => candle_core::bail!("stapo-adamw-param: op applied twice"),
        }
    }
}

/// The contiguous f32 elements of a moment tensor's storage.
fn f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let range = l.contiguous_offsets();
    match (s, range) {
        (CpuStorage::F32(x), Some((a, b))) => match x.get_mut(a..b) {
            Some(x) => Ok(x),
            None => candle_core::bail!("adamw: moment layout {a}..{b} outside its storage"),
        },
        _ => candle_core::bail!("adamw: moments must be contiguous f32"),
    }
}

/// Locks `m` then `v` (both private to the optimizer) and runs the fused kernel.
fn with_moments<T: Elem>(p: &mut [T], g: &[T], m: &Tensor, v: &Tensor, h: &Hyper) -> candle_core::Result<()> {
    m.inplace_op1(&WithCpuMut(RefCell::new(Some(|ms: &mut CpuStorage, ml: &Layout| {
        let m = f32_mut(ms, ml)?;
        v.inplace_op1(&WithCpuMut(RefCell::new(Some(|vs: &mut CpuStorage, vl: &Layout| {
            let v = f32_mut(vs, vl)?;
            adamw_slices(p, g, m, v, h)
        }))))
    }))))
}

/// Borrows the contiguous range of `x` described by `l`.
fn range_of<'a, T>(x: &'a [T], l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets().and_then(|(a, b)| x.get(a..b)) {
        Some(x) => Ok(x),
        None => candle_core::bail!("adamw: {what} is not contiguous"),
    }
}

/// Mutable version of [`range_of`].
fn range_of_mut<'a, T>(x: &'a mut [T], l: &Layout, what: &str) -> candle_core::Result<&'a mut [T]> {
    match l.contiguous_offsets().and_then(|(a, b)| x.get_mut(a..b)) {
        Some(x) => Ok(x),
        None => candle_core::bail!("adamw: {what} is not contiguous"),
    }
}

/// The fused in-place update of one CPU parameter (of its f32 master weights when it
/// has them). See the module docs for why it is sound.
pub(super) fn update_fused(p: &ParamState, g: &Tensor, h: &Hyper) -> Result<()> {
    update_fused_tensors(p.trained(), g, &p.m, &p.v, h)
}

/// The fused in-place update of `p` (any float dtype) with its f32 moments `m`, `v`:
/// whole parameters, or (the sharded optimizer) views of one segment of flat 1-D
/// shards, which the kernel reaches through the views' contiguous offsets. `m` and
/// `v` must not share storage with `p`, `g` or each other.
pub(super) fn update_fused_tensors(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, h: &Hyper) -> Result<()> {
    // The kernel wants a contiguous gradient of the parameter's dtype. Backprop's
    // accumulated gradients are; anything else is converted (the one case that
    // allocates a temporary).
    let g_owned;
    let g = if g.dtype() != p.dtype() || !g.is_contiguous() || !g.device().is_cpu() {
        g_owned = g.to_device(p.device())?.to_dtype(p.dtype())?.contiguous()?;
        &g_owned
    } else {
        g
    };
    let op = |ps: &mut CpuStorage, pl: &Layout, gs: &CpuStorage, gl: &Layout| -> candle_core::Result<()> {
        match (ps, gs) {
            (CpuStorage::F32(pd), CpuStorage::F32(gd)) => {
                with_moments(range_of_mut(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)
            }
            (CpuStorage::BF16(pd), CpuStorage::BF16(gd)) => {
                with_moments(range_of_mut(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)
            }
            (CpuStorage::F16(pd), CpuStorage::F16(gd)) => {
                with_moments(range_of_mut(pd, pl, "param")?, range_of(gd, gl, "grad")?, m, v, h)
            }
            (ps, gs) => candle_core::bail!(
                "adamw: no fused kernel for param dtype {:?} with grad dtype {:?}",
                ps.dtype(),
                gs.dtype()
            ),
        }
    };
    p.inplace_op2(g, &WithCpuMut2(RefCell::new(Some(op))))?;
    Ok(())
}
