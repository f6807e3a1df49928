//! Fused CPU kernels for the Qwen3 forward pass, each with a hand-written backward.
//!
//! candle's op-by-op autograd turns RMSNorm, rotary embedding, masked softmax
//! attention and the vocabulary log-softmax into ten or more full passes over
//! memory each, plus a zero-filled gradient buffer per node in the backward.
//! The ops here do each in one pass per row (rayon-parallel over rows or heads)
//! as candle [`CustomOp2`]/[`CustomOp3`]s whose `bwd` runs another fused kernel.
//! Attention follows FlashAttention's backward (Dao et al., 2022): the
//! probabilities are recomputed from q and k instead of being stored.
//!
//! Only CPU tensors in f32 or f64 are served ([`supported`]); `model::ops`
//! dispatches every other device and dtype to the composed candle ops, which
//! are also the reference the tests below check values and gradients against.

use std::ops::Neg;

use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Storage, Tensor, WithDType, D,
};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::Result;

/// True when the fused kernels serve `t`: a CPU tensor in f32 or f64, unless
/// the environment sets `STAPO_NO_FUSED=1` (for A/B benchmarks and debugging).
pub fn supported(t: &Tensor) -> bool {
    static DISABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let disabled = *DISABLED.get_or_init(|| std::env::var("STAPO_NO_FUSED").is_ok_and(|v| v == "1"));
    !disabled && t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The float types the kernels are written for.
trait Real: WithDType + Neg<Output = Self> {
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn fmax(self, o: Self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn fmax(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
        }
    };
}
real!(f32);
real!(f64);

fn zero<T: Real>() -> T {
    T::from_f64(0.0)
}

/// The contiguous slice of `s` that `l` describes.
fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("fused {what}: expected a contiguous tensor"),
    }
}

/// Runs `f` on the contiguous host data of a CPU tensor (an op's constant input).
fn with_host<T: WithDType, R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => f(slice::<T>(c, l, what)?),
        _ => bail!("fused {what}: expected a CPU tensor"),
    }
}

/// Dispatches on the storage dtype to a generic kernel.
macro_rules! by_dtype {
    ($s:expr, $name:expr, |$t:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(_) => {
                type $t = f32;
                $body
            }
            CpuStorage::F64(_) => {
                type $t = f64;
                $body
            }
            _ => bail!("fused {}: only f32 and f64 are supported", $name),
        }
    };
}

/// A raw pointer that rayon tasks may share to write disjoint elements.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: every use writes element ranges that no other task touches (documented
// at each use), and the buffer outlives the parallel loop that uses it.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// `dst (m×n) = beta * lhs (m×k) · rhs (k×n) [+ dst]`, single-threaded (callers
/// parallelise over heads). Strides are (row, column) in elements.
#[allow(clippy::too_many_arguments)]
unsafe fn mm<T: Real>(
    dims: (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    lhs_st: (usize, usize),
    rhs: *const T,
    rhs_st: (usize, usize),
    beta: T,
) {
    mm_par(dims, dst, dst_rs, accumulate, lhs, lhs_st, rhs, rhs_st, beta, Parallelism::None)
}

/// [`mm`] with a choice of parallelism (rayon for the big projections).
///
/// # Safety
/// Every pointer must address the full strided matrix it describes, and `dst`
/// must not overlap `lhs` or `rhs` nor be written concurrently by anyone else.
///
/// # Safety
/// As for [`mm`].
#[allow(clippy::too_many_arguments)]
unsafe fn mm_par<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const T,
    (rhs_rs, rhs_cs): (usize, usize),
    beta: T,
    par: Parallelism,
) {
    let alpha = if accumulate { T::from_f64(1.0) } else { zero() };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        alpha,
        beta,
        false,
        false,
        false,
        par,
    )
}

/// All of rayon's threads, for one big product.
fn all_threads() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// Rows per rayon task for row-wise kernels of width `n`: about 32K elements.
fn rows_per_task(n: usize) -> usize {
    (32 * 1024 / n.max(1)).max(1)
}

// ---------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------

/// `y = x w^T` for contiguous `x (.., in)` and `w (out, in)`: one gemm call
/// forward and two backward, with `dw` produced directly in `w`'s layout
/// (candle's `x.matmul(&w.t())` adds a transpose node and a strided
/// accumulation of the weight gradient).
struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (o, k) = l2.shape().dims2()?;
        let dims = l1.dims();
        if dims.last() != Some(&k) {
            bail!("fused linear: x of shape {dims:?} does not end in the {k} features w expects")
        }
        let n = l1.shape().elem_count() / k.max(1);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("checked above") = o;
        by_dtype!(s1, "linear", |T| {
            let x = slice::<T>(s1, l1, "linear")?;
            let w = slice::<T>(s2, l2, "linear")?;
            let mut y = vec![zero::<T>(); n * o];
            // SAFETY: x is n×k, w is o×k, y is n×o, all contiguous and owned here.
            unsafe {
                mm_par(
                    (n, o, k),
                    y.as_mut_ptr(),
                    o,
                    false,
                    x.as_ptr(),
                    (k, 1),
                    w.as_ptr(),
                    (1, k),
                    T::from_f64(1.0),
                    all_threads(),
                );
            }
            Ok((T::to_cpu_storage_owned(y), Shape::from(out_dims)))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &LinearBwd)?;
        let (nx, nw) = (x.elem_count(), w.elem_count());
        Ok((
            Some(both.narrow(0, 0, nx)?.reshape(x.shape())?),
            Some(both.narrow(0, nx, nw)?.reshape(w.shape())?),
        ))
    }
}

/// Backward of [`Linear`] over `(x, w, dy)`: `[dx = dy w | dw = dy^T x]`.
struct LinearBwd;

impl CustomOp3 for LinearBwd {
    fn name(&self) -> &'static str {
        "fused-linear-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (o, k) = l2.shape().dims2()?;
        let n = l1.shape().elem_count() / k.max(1);
        by_dtype!(s1, "linear", |T| {
            let x = slice::<T>(s1, l1, "linear")?;
            let w = slice::<T>(s2, l2, "linear")?;
            let dy = slice::<T>(s3, l3, "linear")?;
            let mut out = vec![zero::<T>(); n * k + o * k];
            let (dx, dw) = out.split_at_mut(n * k);
            let one = T::from_f64(1.0);
            // SAFETY: dy is n×o, w o×k, x n×k, dx n×k, dw o×k, all contiguous.
            unsafe {
                mm_par(
                    (n, k, o),
                    dx.as_mut_ptr(),
                    k,
                    false,
                    dy.as_ptr(),
                    (o, 1),
                    w.as_ptr(),
                    (k, 1),
                    one,
                    all_threads(),
                );
                mm_par(
                    (o, k, n),
                    dw.as_mut_ptr(),
                    k,
                    false,
                    dy.as_ptr(),
                    (1, o),
                    x.as_ptr(),
                    (k, 1),
                    one,
                    all_threads(),
                );
            }
            let len = out.len();
            Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
        })
    }
}

/// Fused `x @ w^T` for `x (.., in)`, `w (out, in)`; returns `(.., out)` with no
/// reshape nodes in the graph.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Linear)?)
}

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------

/// `y = w * x / sqrt(mean(x^2) + eps)` over the last dimension of a contiguous `x`.
struct RmsNorm {
    eps: f64,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "rms_norm", |T| {
            let x = slice::<T>(s1, l1, "rms_norm")?;
            let w = slice::<T>(s2, l2, "rms_norm")?;
            let n = w.len();
            let eps = T::from_f64(self.eps);
            let mut y = vec![zero::<T>(); x.len()];
            let chunk = rows_per_task(n) * n;
            y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(yc, xc)| {
                for (yr, xr) in yc.chunks_exact_mut(n).zip(xc.chunks_exact(n)) {
                    let r = inv_rms(xr, eps);
                    for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
                        *y = w * (x * r);
                    }
                }
            });
            Ok((T::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = w.elem_count();
        let rows = x.elem_count() / n.max(1);
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = both.narrow(0, rows, 1)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// `1 / sqrt(mean(x^2) + eps)`, accumulated in f64.
#[inline]
fn inv_rms<T: Real>(x: &[T], eps: T) -> T {
    let ss: f64 = x.iter().map(|&v| v.to_f64() * v.to_f64()).sum();
    T::from_f64(1.0) / (T::from_f64(ss / x.len() as f64) + eps).sqrt()
}

/// Backward of [`RmsNorm`]: returns `(rows + 1, n)`, the rows of dx then dw.
/// With `r = 1/rms(x)` and `g = w * dy`: `dx = r g - x r^3 sum(g x) / n`,
/// `dw = sum_rows(dy * x * r)`.
struct RmsNormBwd {
    eps: f64,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "fused-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "rms_norm", |T| {
            let x = slice::<T>(s1, l1, "rms_norm")?;
            let w = slice::<T>(s2, l2, "rms_norm")?;
            let dy = slice::<T>(s3, l3, "rms_norm")?;
            let n = w.len();
            let rows = x.len() / n;
            let eps = T::from_f64(self.eps);
            let mut out = vec![zero::<T>(); x.len() + n];
            let chunk = rows_per_task(n) * n;
            let dw = out[..x.len()]
                .par_chunks_mut(chunk)
                .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
                .map(|(dxc, (xc, dyc))| {
                    let mut dw = vec![0f64; n];
                    for ((dxr, xr), dyr) in
                        dxc.chunks_exact_mut(n).zip(xc.chunks_exact(n)).zip(dyc.chunks_exact(n))
                    {
                        let r = inv_rms(xr, eps);
                        let mut dot = 0f64;
                        for i in 0..n {
                            dot += (w[i] * dyr[i]).to_f64() * xr[i].to_f64();
                            dw[i] += (dyr[i] * xr[i] * r).to_f64();
                        }
                        let c = T::from_f64(dot / n as f64) * r * r * r;
                        for i in 0..n {
                            dxr[i] = r * w[i] * dyr[i] - xr[i] * c;
                        }
                    }
                    dw
                })
                .reduce(
                    || vec![0f64; n],
                    |mut a, b| {
                        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                        a
                    },
                );
            for (o, v) in out[x.len()..].iter_mut().zip(dw) {
                *o = T::from_f64(v);
            }
            Ok((T::to_cpu_storage_owned(out), Shape::from((rows + 1, n))))
        })
    }
}

/// Fused RMSNorm over the last dimension (see [`super::ops::rms_norm`]).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })?)
}

// ---------------------------------------------------------------------------
// Per-head RMSNorm + rotary embedding + (B, L, H, D) -> (B, H, L, D)
// ---------------------------------------------------------------------------

/// q/k preparation in one pass: per-head RMSNorm over D with weight `w`, then
/// rotate-half rotary embedding, written in `(B, H, L, D)` order. `cs` holds
/// `[cos | sin]` per position, `(B, L, D)`; it is a constant (no gradient).
struct NormRope {
    eps: f64,
    cs: Tensor,
    dims: (usize, usize, usize, usize),
}

/// Rotates `v` by the angles of `cs = [cos | sin]`: `[a c - b s, b c + a s]`,
/// or by the negative angles when `inverse` (the transpose of the rotation).
#[inline]
fn rotate<T: Real>(v: &[T], cs: &[T], out: &mut [T], inverse: bool) {
    let h = v.len() / 2;
    let (c, s) = cs.split_at(h);
    for j in 0..h {
        let (a, b) = (v[j], v[j + h]);
        let sj = if inverse { -s[j] } else { s[j] };
        out[j] = a * c[j] - b * sj;
        out[j + h] = b * c[j] + a * sj;
    }
}

impl CustomOp2 for NormRope {
    fn name(&self) -> &'static str {
        "fused-norm-rope"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, l, nh, d) = self.dims;
        by_dtype!(s1, "norm_rope", |T| {
            let x = slice::<T>(s1, l1, "norm_rope")?;
            let w = slice::<T>(s2, l2, "norm_rope")?;
            let eps = T::from_f64(self.eps);
            let mut y = vec![zero::<T>(); x.len()];
            with_host::<T, _>(&self.cs, "norm_rope", |cs| {
                // One task per (b, h): output rows (b, h, 0..L) are contiguous.
                y.par_chunks_mut(l * d).enumerate().for_each(|(bh, yc)| {
                    let (bi, hi) = (bh / nh, bh % nh);
                    let mut tmp = vec![zero::<T>(); d];
                    for (li, yr) in yc.chunks_exact_mut(d).enumerate() {
                        let xr = &x[((bi * l + li) * nh + hi) * d..][..d];
                        let r = inv_rms(xr, eps);
                        for j in 0..d {
                            tmp[j] = w[j] * (xr[j] * r);
                        }
                        rotate(&tmp, &cs[(bi * l + li) * d..][..d], yr, false);
                    }
                });
                Ok(())
            })?;
            Ok((T::to_cpu_storage_owned(y), Shape::from((b, nh, l, d))))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (b, l, nh, d) = self.dims;
        let op = NormRopeBwd { eps: self.eps, cs: self.cs.clone(), dims: self.dims };
        let both = x.apply_op3_no_bwd(w, &dy.contiguous()?, &op)?;
        let dx = both.narrow(0, 0, b * l * nh * d)?.reshape(x.shape())?;
        let dw = both.narrow(0, b * l * nh * d, d)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of [`NormRope`]: un-rotates the gradient, then RMSNorm's backward.
/// Returns a flat buffer: dx in `(B, L, H, D)` order, then dw.
struct NormRopeBwd {
    eps: f64,
    cs: Tensor,
    dims: (usize, usize, usize, usize),
}

impl CustomOp3 for NormRopeBwd {
    fn name(&self) -> &'static str {
        "fused-norm-rope-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, l, nh, d) = self.dims;
        by_dtype!(s1, "norm_rope", |T| {
            let x = slice::<T>(s1, l1, "norm_rope")?;
            let w = slice::<T>(s2, l2, "norm_rope")?;
            let dy = slice::<T>(s3, l3, "norm_rope")?;
            let eps = T::from_f64(self.eps);
            let mut out = vec![zero::<T>(); x.len() + d];
            let dw = with_host::<T, _>(&self.cs, "norm_rope", |cs| {
                // One task per (b, l): dx rows (b, l, 0..H) are contiguous.
                Ok(out[..x.len()]
                    .par_chunks_mut(nh * d)
                    .enumerate()
                    .map(|(bl, dxc)| {
                        let (bi, li) = (bl / l, bl % l);
                        let csr = &cs[bl * d..][..d];
                        let mut dw = vec![0f64; d];
                        let mut g = vec![zero::<T>(); d];
                        for (hi, dxr) in dxc.chunks_exact_mut(d).enumerate() {
                            let xr = &x[bl * nh * d + hi * d..][..d];
                            let dyr = &dy[((bi * nh + hi) * l + li) * d..][..d];
                            // Gradient w.r.t. the normed, weighted vector.
                            rotate(dyr, csr, &mut g, true);
                            let r = inv_rms(xr, eps);
                            let mut dot = 0f64;
                            for j in 0..d {
                                dot += (w[j] * g[j]).to_f64() * xr[j].to_f64();
                                dw[j] += (g[j] * xr[j] * r).to_f64();
                            }
                            let c = T::from_f64(dot / d as f64) * r * r * r;
                            for j in 0..d {
                                dxr[j] = r * w[j] * g[j] - xr[j] * c;
                            }
                        }
                        dw
                    })
                    .reduce(
                        || vec![0f64; d],
                        |mut a, b| {
                            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                            a
                        },
                    ))
            })?;
            for (o, v) in out[x.len()..].iter_mut().zip(dw) {
                *o = T::from_f64(v);
            }
            let len = out.len();
            Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
        })
    }
}

/// Per-head RMSNorm then rotary embedding, from `(B, L, H * D)` (heads side by
/// side, as the projection leaves them) to `(B, H, L, D)`; `cos`/`sin` are
/// `(B, 1, L, D/2)` (see [`super::ops::norm_rope`]).
pub fn norm_rope(
    x: &Tensor,
    n_heads: usize,
    w: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let (b, l, hd) = x.dims3()?;
    let dims = (b, l, n_heads, hd / n_heads.max(1));
    if dims.2 * dims.3 != hd || w.elem_count() != dims.3 {
        return Err(crate::Error::invalid(format!(
            "norm_rope: x of shape {:?} does not split into {n_heads} heads of {}",
            x.dims(),
            w.elem_count()
        )));
    }
    let cs = Tensor::cat(&[cos, sin], D::Minus1)?.to_dtype(x.dtype())?.contiguous()?.detach();
    if cs.dims() != [dims.0, 1, dims.1, dims.3] {
        return Err(crate::Error::invalid(format!(
            "norm_rope: cos/sin of shape {:?} do not fit x of shape {:?}",
            cos.dims(),
            x.dims()
        )));
    }
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, NormRope { eps, cs, dims })?)
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

/// Grouped-query attention with an additive mask (see [`super::ops::attention`]).
/// Inputs q `(B, Hq, L, D)` contiguous; k, v `(B, Hkv, S, D)` with unit stride
/// over D (any other strides, e.g. a narrowed KV cache or a transposed view).
/// `mask` is `(B, L, S)` contiguous, in the inputs' dtype, a constant.
struct Attention {
    mask: Tensor,
    scale: f64,
}

/// Element offsets of a `(B, H, S, D)` view with unit stride over D.
#[derive(Clone, Copy)]
struct View4 {
    start: usize,
    sb: usize,
    sh: usize,
    ss: usize,
}

impl View4 {
    fn of(l: &Layout) -> candle_core::Result<Self> {
        let st = l.stride();
        if st.len() != 4 || (st[3] != 1 && l.dims()[3] > 1) {
            bail!("fused attention: k/v need 4 dims with unit stride over D, found strides {st:?}")
        }
        Ok(Self { start: l.start_offset(), sb: st[0], sh: st[1], ss: st[2] })
    }

    fn at(&self, b: usize, h: usize) -> usize {
        self.start + b * self.sb + h * self.sh
    }
}

/// Scaled, masked scores of one query head then softmax in place: `p (L×S)`.
///
/// # Safety
/// `q` must address `L×D` contiguous elements, `k` an `S×D` matrix with row stride `ss`.
#[allow(clippy::too_many_arguments)]
unsafe fn probs<T: Real>(
    p: &mut [T],
    q: *const T,
    k: *const T,
    ss: usize,
    mask: &[T],
    (l, s, d): (usize, usize, usize),
    scale: T,
) {
    mm((l, s, d), p.as_mut_ptr(), s, false, q, (d, 1), k, (1, ss), scale);
    for (row, mrow) in p.chunks_exact_mut(s).zip(mask.chunks_exact(s)) {
        let mut mx = T::from_f64(f64::NEG_INFINITY);
        for (v, &m) in row.iter_mut().zip(mrow) {
            *v += m;
            mx = mx.fmax(*v);
        }
        let mut sum = zero::<T>();
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        let inv = T::from_f64(1.0) / sum;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, nq, l, d) = l1.shape().dims4()?;
        let (nkv, s) = (l2.dims()[1], l2.dims()[2]);
        let g = nq / nkv;
        let (kv, vv) = (View4::of(l2)?, View4::of(l3)?);
        by_dtype!(s1, "attention", |T| {
            let q = slice::<T>(s1, l1, "attention")?;
            let (k, v) = (s2.as_slice::<T>()?, s3.as_slice::<T>()?);
            let scale = T::from_f64(self.scale);
            let mut out = vec![zero::<T>(); b * l * nq * d];
            let optr = SendPtr(out.as_mut_ptr());
            with_host::<T, _>(&self.mask, "attention", |mask| {
                (0..b * nq).into_par_iter().for_each(|bh| {
                    let (bi, hi) = (bh / nq, bh % nq);
                    let hk = hi / g;
                    let mut p = vec![zero::<T>(); l * s];
                    let o = optr;
                    // SAFETY: q/k/v offsets stay inside their storages (shapes and
                    // strides come from their layouts). Task (b, h) writes only the
                    // D columns of head h in rows (b, 0..L) of `out`, disjoint from
                    // every other task; `out` outlives the loop.
                    unsafe {
                        probs(
                            &mut p,
                            q.as_ptr().add(bh * l * d),
                            k.as_ptr().add(kv.at(bi, hk)),
                            kv.ss,
                            &mask[bi * l * s..][..l * s],
                            (l, s, d),
                            scale,
                        );
                        let dst = o.0.add(bi * l * nq * d + hi * d);
                        mm(
                            (l, d, s),
                            dst,
                            nq * d,
                            false,
                            p.as_ptr(),
                            (s, 1),
                            v.as_ptr().add(vv.at(bi, hk)),
                            (vv.ss, 1),
                            T::from_f64(1.0),
                        );
                    }
                });
                Ok(())
            })?;
            Ok((T::to_cpu_storage_owned(out), Shape::from((b, l, nq * d))))
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _ctx: &Tensor,
        dctx: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = AttentionBwd { mask: self.mask.clone(), scale: self.scale, k: k.clone(), v: v.clone() };
        let all = q.apply_op2_no_bwd(&dctx.contiguous()?, &op)?;
        let (nqe, nke) = (q.elem_count(), k.elem_count());
        let dq = all.narrow(0, 0, nqe)?.reshape(q.shape())?;
        let dk = all.narrow(0, nqe, nke)?.reshape(k.shape())?;
        let dv = all.narrow(0, nqe + nke, nke)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Backward of [`Attention`] over `(q, dctx)`, with k, v and the mask held by
/// the op. Returns a flat buffer `[dq | dk | dv]`, dk and dv contiguous
/// `(B, Hkv, S, D)`. One task per (batch, kv head), looping over its query
/// heads, so dk/dv accumulate without races.
struct AttentionBwd {
    mask: Tensor,
    scale: f64,
    k: Tensor,
    v: Tensor,
}

impl candle_core::CustomOp2 for AttentionBwd {
    fn name(&self) -> &'static str {
        "fused-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, nq, l, d) = l1.shape().dims4()?;
        let (_, nkv, s, _) = self.k.dims4()?;
        let g = nq / nkv;
        let (ks, kl) = self.k.storage_and_layout();
        let (vs, vl) = self.v.storage_and_layout();
        let (Storage::Cpu(ks), Storage::Cpu(vs)) = (&*ks, &*vs) else {
            bail!("fused attention: expected CPU k/v")
        };
        let (kv, vv) = (View4::of(kl)?, View4::of(vl)?);
        by_dtype!(s1, "attention", |T| {
            let q = slice::<T>(s1, l1, "attention")?;
            let dctx = slice::<T>(s2, l2, "attention")?;
            let (k, v) = (ks.as_slice::<T>()?, vs.as_slice::<T>()?);
            let scale = T::from_f64(self.scale);
            let (nqe, nke) = (q.len(), b * nkv * s * d);
            let mut out = vec![zero::<T>(); nqe + 2 * nke];
            let optr = SendPtr(out.as_mut_ptr());
            let one = T::from_f64(1.0);
            with_host::<T, _>(&self.mask, "attention", |mask| {
                (0..b * nkv).into_par_iter().for_each(|bk| {
                    let (bi, hk) = (bk / nkv, bk % nkv);
                    let o = optr;
                    let mut p = vec![zero::<T>(); l * s];
                    let mut dp = vec![zero::<T>(); l * s];
                    // SAFETY: reads stay inside q, dctx, k, v (shapes and strides
                    // from their layouts). Task (b, hk) writes dq of its g query
                    // heads and its own dk, dv blocks: disjoint from other tasks.
                    unsafe {
                        let kp = k.as_ptr().add(kv.at(bi, hk));
                        let vp = v.as_ptr().add(vv.at(bi, hk));
                        let dk = o.0.add(nqe + bk * s * d);
                        let dv = o.0.add(nqe + nke + bk * s * d);
                        for hi in hk * g..(hk + 1) * g {
                            let qp = q.as_ptr().add((bi * nq + hi) * l * d);
                            let dcp = dctx.as_ptr().add(bi * l * nq * d + hi * d);
                            probs(&mut p, qp, kp, kv.ss, &mask[bi * l * s..][..l * s], (l, s, d), scale);
                            // dv += p^T dctx
                            mm((s, d, l), dv, d, true, p.as_ptr(), (1, s), dcp, (nq * d, 1), one);
                            // dp = dctx v^T
                            mm((l, s, d), dp.as_mut_ptr(), s, false, dcp, (nq * d, 1), vp, (1, vv.ss), one);
                            // ds = p * (dp - rowsum(p * dp)) * scale, stored in dp.
                            for (pr, dr) in p.chunks_exact(s).zip(dp.chunks_exact_mut(s)) {
                                let dot = pr.iter().zip(dr.iter()).fold(zero::<T>(), |a, (&x, &y)| a + x * y);
                                for (&pv, dv) in pr.iter().zip(dr.iter_mut()) {
                                    *dv = pv * (*dv - dot) * scale;
                                }
                            }
                            // dq = ds k ; dk += ds^T q
                            mm(
                                (l, d, s),
                                o.0.add((bi * nq + hi) * l * d),
                                d,
                                false,
                                dp.as_ptr(),
                                (s, 1),
                                kp,
                                (kv.ss, 1),
                                one,
                            );
                            mm((s, d, l), dk, d, true, dp.as_ptr(), (1, s), qp, (d, 1), one);
                        }
                    }
                });
                Ok(())
            })?;
            let len = out.len();
            Ok((T::to_cpu_storage_owned(out), Shape::from(len)))
        })
    }
}

/// Fused grouped-query attention (see [`super::ops::attention`]): q `(B, Hq, L, D)`,
/// k/v `(B, Hkv, S, D)`, additive mask broadcastable to `(B, 1, L, S)`.
/// Returns `(B, L, Hq * D)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (b, _, l, d) = q.dims4()?;
    let s = k.dim(2)?;
    let unit_d =
        |t: &Tensor| -> Result<Tensor> { Ok(if t.stride()[3] == 1 { t.clone() } else { t.contiguous()? }) };
    let mask =
        mask.broadcast_as((b, 1, l, s))?.to_dtype(q.dtype())?.contiguous()?.reshape((b, l, s))?.detach();
    let op = Attention { mask, scale: 1.0 / (d as f64).sqrt() };
    Ok(q.contiguous()?.apply_op3(&unit_d(k)?, &unit_d(v)?, op)?)
}

// ---------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------

/// `silu(gate) * up`, elementwise.
struct SwiGlu;

#[inline]
fn sigmoid<T: Real>(x: T) -> T {
    T::from_f64(1.0) / (T::from_f64(1.0) + (-x).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu", |T| {
            let g = slice::<T>(s1, l1, "swiglu")?;
            let u = slice::<T>(s2, l2, "swiglu")?;
            let mut y = vec![zero::<T>(); g.len()];
            y.par_chunks_mut(32 * 1024).zip(g.par_chunks(32 * 1024).zip(u.par_chunks(32 * 1024))).for_each(
                |(y, (g, u))| {
                    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                        *y = g * sigmoid(g) * u;
                    }
                },
            );
            Ok((T::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &SwiGluBwd)?;
        let n = g.elem_count();
        Ok((Some(both.narrow(0, 0, n)?.reshape(g.shape())?), Some(both.narrow(0, n, n)?.reshape(u.shape())?)))
    }
}

/// Backward of [`SwiGlu`]: `[dgate | dup]` with `dgate = dy u s (1 + g (1 - s))`,
/// `dup = dy g s`, `s = sigmoid(g)`.
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "fused-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        by_dtype!(s1, "swiglu", |T| {
            let g = slice::<T>(s1, l1, "swiglu")?;
            let u = slice::<T>(s2, l2, "swiglu")?;
            let dy = slice::<T>(s3, l3, "swiglu")?;
            let n = g.len();
            let mut out = vec![zero::<T>(); 2 * n];
            let (dg, du) = out.split_at_mut(n);
            let c = 32 * 1024;
            dg.par_chunks_mut(c).zip(du.par_chunks_mut(c)).enumerate().for_each(|(i, (dg, du))| {
                let base = i * c;
                for j in 0..dg.len() {
                    let (gv, uv, d) = (g[base + j], u[base + j], dy[base + j]);
                    let s = sigmoid(gv);
                    dg[j] = d * uv * s * (T::from_f64(1.0) + gv * (T::from_f64(1.0) - s));
                    du[j] = d * gv * s;
                }
            });
            Ok((T::to_cpu_storage_owned(out), Shape::from(2 * n)))
        })
    }
}

/// Fused `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)?)
}

// ---------------------------------------------------------------------------
// Log-softmax + gather + entropy
// ---------------------------------------------------------------------------

/// Per row of logits `x (N, V)` and target `t`: `[x_t - lse, H, lse]` with
/// `lse = logsumexp(x)` and `H = -sum p log p = lse - sum p x`, from a max pass
/// and one exp pass; log_softmax is never materialised.
struct LogpEntropy;

/// `(lse, sum_j p_j x_j)` of one row, accumulated in f64.
#[inline]
fn lse_and_mean<T: Real>(x: &[T]) -> (f64, f64) {
    let mx = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |a, &v| a.fmax(v));
    let (mut s, mut t) = (0f64, 0f64);
    for &v in x {
        let z = v - mx;
        let e = z.exp().to_f64();
        s += e;
        // A -inf logit has p = 0 and adds nothing (not 0 * -inf = NaN).
        if e > 0.0 {
            t += e * z.to_f64();
        }
    }
    let lse = mx.to_f64() + s.ln();
    (lse, t / s + mx.to_f64())
}

impl CustomOp2 for LogpEntropy {
    fn name(&self) -> &'static str {
        "fused-logp-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let vocab = *l1.dims().last().unwrap_or(&1);
        let n = l1.shape().elem_count() / vocab.max(1);
        let targets = slice::<u32>(s2, l2, "logprob_entropy")?;
        if targets.len() != n {
            bail!("fused logprob_entropy: {} targets for {n} rows of logits", targets.len())
        }
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("fused logprob_entropy: target {t} outside a vocabulary of {vocab}")
        }
        by_dtype!(s1, "logprob_entropy", |T| {
            let x = slice::<T>(s1, l1, "logprob_entropy")?;
            let mut out = vec![zero::<T>(); 3 * n];
            out.par_chunks_mut(3).zip(x.par_chunks(vocab)).zip(targets.par_iter()).for_each(
                |((o, row), &t)| {
                    let (lse, mean) = lse_and_mean(row);
                    o[0] = T::from_f64(row[t as usize].to_f64() - lse);
                    o[1] = T::from_f64(lse - mean);
                    o[2] = T::from_f64(lse);
                },
            );
            Ok((T::to_cpu_storage_owned(out), Shape::from((n, 3))))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        dres: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let op = LogpEntropyBwd { targets: targets.clone() };
        let dx = x.apply_op3_no_bwd(res, &dres.contiguous()?, &op)?;
        Ok((Some(dx), None))
    }
}

/// Backward of [`LogpEntropy`] over `(x, res, dres)`: with `p = exp(x - lse)`,
/// `dx_j = gl (1[j = t] - p_j) - ge p_j (x_j - lse + H)`.
struct LogpEntropyBwd {
    targets: Tensor,
}

impl CustomOp3 for LogpEntropyBwd {
    fn name(&self) -> &'static str {
        "fused-logp-entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let vocab = *l1.dims().last().unwrap_or(&1);
        by_dtype!(s1, "logprob_entropy", |T| {
            let x = slice::<T>(s1, l1, "logprob_entropy")?;
            let res = slice::<T>(s2, l2, "logprob_entropy")?;
            let dres = slice::<T>(s3, l3, "logprob_entropy")?;
            let mut dx = vec![zero::<T>(); x.len()];
            with_host::<u32, _>(&self.targets, "logprob_entropy", |targets| {
                dx.par_chunks_mut(vocab).zip(x.par_chunks(vocab)).enumerate().for_each(|(i, (dr, xr))| {
                    let (h, lse) = (res[3 * i + 1], res[3 * i + 2]);
                    let (gl, ge) = (dres[3 * i], dres[3 * i + 1]);
                    let shift = h - lse;
                    for (d, &v) in dr.iter_mut().zip(xr) {
                        let p = (v - lse).exp();
                        *d = if p > zero() { -p * (gl + ge * (v + shift)) } else { zero() };
                    }
                    dr[targets[i] as usize] += gl;
                });
                Ok(())
            })?;
            Ok((T::to_cpu_storage_owned(dx), l1.shape().clone()))
        })
    }
}

/// Fused log-prob of `targets` and entropy from logits `(.., V)` in f32/f64.
pub fn logprob_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = logits.contiguous()?;
    let t = targets.flatten_all()?.to_dtype(DType::U32)?.contiguous()?.detach();
    let out = x.apply_op2(&t, LogpEntropy)?;
    let logp = out.narrow(1, 0, 1)?.reshape(targets.shape())?;
    let entropy = out.narrow(1, 1, 1)?.reshape(targets.shape())?;
    Ok((logp, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops;
    use candle_core::{Device, Var};

    /// Max |a - b| relative to max |b| (and at least 1e-30).
    fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    fn randn(shape: &[usize], dtype: DType, seed: u64) -> Var {
        // Deterministic pseudo-random values (the CPU device RNG is not seedable per call).
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let v: Vec<f64> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    }

    /// A random linear functional of `y`, so that every output element gets a distinct gradient.
    fn probe(y: &Tensor, seed: u64) -> Tensor {
        let w = randn(y.dims(), y.dtype(), seed);
        (y * w.as_tensor()).unwrap().sum_all().unwrap()
    }

    /// Compares values and gradients w.r.t. `vars` of `fused` and `reference`.
    fn check(
        vars: &[&Var],
        fused: &dyn Fn() -> Tensor,
        reference: &dyn Fn() -> Tensor,
        tol: f64,
        what: &str,
    ) {
        let (yf, yr) = (fused(), reference());
        assert_eq!(yf.dims(), yr.dims(), "{what}: shape");
        let e = rel_err(&yf, &yr);
        assert!(e < tol, "{what}: value error {e:e}");
        let gf = probe(&yf, 99).backward().unwrap();
        let gr = probe(&yr, 99).backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let (a, b) =
                (gf.get(v.as_tensor()).expect("fused grad"), gr.get(v.as_tensor()).expect("reference grad"));
            let e = rel_err(a, b);
            assert!(e < tol, "{what}: gradient {i} error {e:e}");
        }
    }

    fn tol(dtype: DType) -> f64 {
        if dtype == DType::F64 {
            1e-10
        } else {
            1e-5
        }
    }

    #[test]
    fn linear_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let x = randn(&[2, 7, 12], dtype, 12);
            let w = randn(&[5, 12], dtype, 13);
            check(
                &[&x, &w],
                &|| linear(x.as_tensor(), w.as_tensor()).unwrap(),
                &|| x.as_tensor().broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap(),
                tol(dtype),
                "linear",
            );
        }
    }

    #[test]
    fn rms_norm_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let x = randn(&[3, 5, 16], dtype, 1);
            let w = randn(&[16], dtype, 2);
            check(
                &[&x, &w],
                &|| rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap(),
                &|| ops::rms_norm_composed(x.as_tensor(), w.as_tensor(), 1e-6).unwrap(),
                tol(dtype),
                "rms_norm",
            );
        }
    }

    #[test]
    fn norm_rope_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let (b, l, h, d) = (2, 5, 3, 8);
            let x = randn(&[b, l, h, d], dtype, 3);
            let w = randn(&[d], dtype, 4);
            let ang = randn(&[b, 1, l, d / 2], dtype, 5).as_tensor().affine(3.0, 0.0).unwrap();
            let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
            check(
                &[&x, &w],
                &|| {
                    norm_rope(
                        &x.as_tensor().reshape((b, l, h * d)).unwrap(),
                        h,
                        w.as_tensor(),
                        &cos,
                        &sin,
                        1e-6,
                    )
                    .unwrap()
                },
                &|| {
                    let n = ops::rms_norm_composed(x.as_tensor(), w.as_tensor(), 1e-6)
                        .unwrap()
                        .transpose(1, 2)
                        .unwrap();
                    ops::rope(&n, &cos, &sin).unwrap()
                },
                tol(dtype),
                "norm_rope",
            );
        }
    }

    #[test]
    fn attention_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let (b, nq, nkv, l, d) = (2, 4, 2, 5, 8);
            for (s, offset) in [(5, 0), (7, 2)] {
                let q = randn(&[b, nq, l, d], dtype, 6);
                let k = randn(&[b, nkv, s, d], dtype, 7);
                let v = randn(&[b, l, nkv, d], dtype, 8); // transposed view below
                let v_bhsd = |v: &Var| -> Tensor {
                    let v = v.as_tensor();
                    if s == l {
                        v.transpose(1, 2).unwrap()
                    } else {
                        Tensor::cat(&[v, &v.narrow(1, 0, s - l).unwrap()], 1)
                            .unwrap()
                            .transpose(1, 2)
                            .unwrap()
                    }
                };
                // Causal plus left padding of 2 keys in row 1 (a fully masked query too).
                let pad: Vec<f32> =
                    (0..b * s).map(|i| if i / s == 1 && i % s < 2 { ops::MASKED } else { 0.0 }).collect();
                let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
                let mask = ops::causal_bias(l, s, offset, &Device::Cpu)
                    .unwrap()
                    .broadcast_add(&pad)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                check(
                    &[&q, &k, &v],
                    &|| attention(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask).unwrap(),
                    &|| {
                        ops::attention_composed(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask, nkv)
                            .unwrap()
                    },
                    tol(dtype),
                    "attention",
                );
            }
        }
    }

    #[test]
    fn swiglu_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let g = randn(&[4, 6, 10], dtype, 9);
            let u = randn(&[4, 6, 10], dtype, 10);
            check(
                &[&g, &u],
                &|| swiglu(&g.as_tensor().affine(4.0, 0.0).unwrap(), u.as_tensor()).unwrap(),
                &|| (g.as_tensor().affine(4.0, 0.0).unwrap().silu().unwrap() * u.as_tensor()).unwrap(),
                tol(dtype),
                "swiglu",
            );
        }
    }

    #[test]
    fn logprob_entropy_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let x = randn(&[3, 4, 50], dtype, 11);
            let t =
                Tensor::from_vec((0..12u32).map(|i| (i * 7) % 50).collect::<Vec<_>>(), (3, 4), &Device::Cpu)
                    .unwrap();
            let scaled = || x.as_tensor().affine(5.0, 0.0).unwrap();
            for which in 0..2 {
                check(
                    &[&x],
                    &|| {
                        let (lp, h) = logprob_entropy(&scaled(), &t).unwrap();
                        if which == 0 {
                            lp
                        } else {
                            h
                        }
                    },
                    &|| {
                        let (lp, h) = ops::logprob_entropy_composed(&scaled(), &t).unwrap();
                        if which == 0 {
                            lp
                        } else {
                            h
                        }
                    },
                    tol(dtype),
                    if which == 0 { "logp" } else { "entropy" },
                );
            }
            // Both outputs at once, as the entropy-bonus loss uses them.
            check(
                &[&x],
                &|| {
                    let (lp, h) = logprob_entropy(&scaled(), &t).unwrap();
                    (lp - h.affine(0.3, 0.0).unwrap()).unwrap()
                },
                &|| {
                    let (lp, h) = ops::logprob_entropy_composed(&scaled(), &t).unwrap();
                    (lp - h.affine(0.3, 0.0).unwrap()).unwrap()
                },
                tol(dtype),
                "logp - 0.3 entropy",
            );
        }
    }

    #[test]
    fn out_of_range_target_is_an_error() {
        let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![1u32, 5], 2, &Device::Cpu).unwrap();
        let err = logprob_entropy(&x, &t).unwrap_err().to_string();
        assert!(err.contains("target 5"), "{err}");
    }
}
