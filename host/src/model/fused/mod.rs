//! Fused CPU kernels for the Qwen3 forward pass, each with a hand-written backward.
//!
//! candle's op-by-op autograd turns RMSNorm, rotary embedding, masked softmax
//! attention and the vocabulary log-softmax into ten or more full passes over
//! memory each, plus a zero-filled gradient buffer per node in the backward.
//! The ops here do each in one pass per row (rayon-parallel over rows or heads)
//! as candle [`CustomOp2`]/[`CustomOp3`]s whose `bwd` runs another fused kernel.
//! Attention follows FlashAttention (Dao et al., 2022): the backward recomputes
//! the probabilities from q and k instead of storing them, and past
//! [`crate::model::ops::AttnMask::BLOCKWISE_FROM`] queries the forward runs
//! blockwise with an online softmax, keeping only the output and each row's
//! log-sum-exp (no `L × S` tensor at all).
//!
//! Only CPU tensors in f32 or f64 are served ([`supported`]); `model::ops`
//! dispatches every other device and dtype to the composed candle ops, which
//! are also the reference each file's tests check values and gradients against.
//!
//! One file per op: [`linear`](mod@linear), [`norm`] (RMSNorm), [`rope`] (per-head norm +
//! rotary), [`attention`](mod@attention), [`swiglu`](mod@swiglu), [`head`] (log-prob and entropy from
//! logits), [`vocab`] (the same from hidden states, in tiles, no logits kept).
//! This file holds what they share: dtype dispatch, raw slices and the gemm
//! wrappers.

use std::ops::Neg;

use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor, WithDType,
};
use gemm::Parallelism;

/// True when the fused kernels serve `t`: a CPU tensor in f32 or f64, while
/// the kernels in force are [`Kernels::Fused`] (see [`Kernels::current`]:
/// `STAPO_NO_FUSED=1` or `--kernels composed` turn them off for A/B checks).
pub fn supported(t: &Tensor) -> bool {
    supported_on(t.device(), t.dtype())
}

/// [`supported`] for tensors of `dtype` on `device`.
pub fn supported_on(device: &Device, dtype: DType) -> bool {
    device.is_cpu() && matches!(dtype, DType::F32 | DType::F64) && Kernels::current() == Kernels::Fused
}

/// The float types the kernels are written for.
pub(crate) trait Real: WithDType + Neg<Output = Self> {
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn fmax(self, o: Self) -> Self;
    /// `x <- e^x` over a slice: libm's `exp` in f64, [`exp::exp_in_place`]
    /// (vectorised, within a few ulp) in f32.
    fn exp_in_place(xs: &mut [Self]);
}

macro_rules! real {
    ($t:ty, $exp_in_place:expr) => {
        impl Real for $t {
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn fmax(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
            #[inline]
            fn exp_in_place(xs: &mut [Self]) {
                $exp_in_place(xs)
            }
        }
    };
}
real!(f32, exp::exp_in_place);
real!(f64, |xs: &mut [f64]| xs.iter_mut().for_each(|x| *x = x.exp()));

fn zero<T: Real>() -> T {
    T::from_f64(0.0)
}

fn one<T: Real>() -> T {
    T::from_f64(1.0)
}

/// The contiguous slice of `s` that `l` describes.
fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{what}: expected a contiguous tensor"),
    }
}

/// One input of a fused kernel: the CPU storage and layout candle hands over.
#[derive(Clone, Copy)]
struct Input<'a> {
    storage: &'a CpuStorage,
    layout: &'a Layout,
    /// The op, for error messages.
    what: &'static str,
}

impl<'a> Input<'a> {
    /// The contiguous elements the layout describes (an error for a strided view).
    fn data<T: WithDType>(&self) -> candle_core::Result<&'a [T]> {
        slice(self.storage, self.layout, self.what)
    }

    /// The whole storage, for a strided view read through `layout`.
    fn storage<T: WithDType>(&self) -> candle_core::Result<&'a [T]> {
        self.storage.as_slice::<T>()
    }
}

/// The contiguous elements of every input, in one element type.
fn data<'a, T: WithDType, const N: usize>(ins: &[Input<'a>; N]) -> candle_core::Result<[&'a [T]; N]> {
    let mut out: [&'a [T]; N] = [&[]; N];
    for (o, i) in out.iter_mut().zip(ins) {
        *o = i.data()?;
    }
    Ok(out)
}

/// A tensor an op holds as a constant (a mask, the targets, k and v in a
/// backward), its storage held for reading.
struct Host<'a> {
    storage: candle_core::StorageRef<'a>,
    layout: &'a Layout,
    what: &'static str,
}

impl<'a> Host<'a> {
    fn of(t: &'a Tensor, what: &'static str) -> candle_core::Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        if !matches!(&*storage, Storage::Cpu(_)) {
            bail!("{what}: expected a CPU tensor")
        }
        Ok(Self { storage, layout, what })
    }

    /// The held tensor as a kernel input.
    fn input(&self) -> Input<'_> {
        match &*self.storage {
            Storage::Cpu(storage) => Input { storage, layout: self.layout, what: self.what },
            _ => unreachable!("checked in Host::of"),
        }
    }
}

/// Runs `f` on the contiguous host data of a CPU tensor (an op's constant input).
fn with_host<T: WithDType, R>(
    t: &Tensor,
    what: &'static str,
    f: impl FnOnce(&[T]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    f(Host::of(t, what)?.input().data::<T>()?)
}

/// A fused CPU kernel over `N` tensors, served to candle as a `CustomOp2` or
/// `CustomOp3` by [`Op`], which matches storages, layouts and the dtype (f32
/// or f64, else an error) once for every kernel.
trait Kernel<const N: usize>: Send + Sync + 'static {
    /// candle's name of the op, which also starts its error messages.
    const NAME: &'static str;

    /// The forward, in the element type `T` of the first input.
    fn fwd<T: Real>(&self, ins: [Input<'_>; N]) -> Out<T>;

    /// The gradients of the inputs, from the output `res` and its gradient `dres`.
    fn bwd(
        &self,
        _ins: [&Tensor; N],
        _res: &Tensor,
        _dres: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; N]> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
}

/// A [`Kernel`] as a candle custom op.
struct Op<K>(K);

/// What a custom op's CPU forward returns.
type CpuOut = candle_core::Result<(CpuStorage, Shape)>;

/// What a [`Kernel`]'s forward returns: the elements and the shape of the output.
type Out<T> = candle_core::Result<(Vec<T>, Shape)>;

/// What a [`Kernel`]'s backward returns: a gradient or `None` per input.
type Grads<const N: usize> = candle_core::Result<[Option<Tensor>; N]>;

impl<K> Op<K> {
    /// Runs the kernel in the dtype of the first storage.
    fn run<const N: usize>(&self, ins: [(&CpuStorage, &Layout); N]) -> CpuOut
    where
        K: Kernel<N>,
    {
        let ins = ins.map(|(storage, layout)| Input { storage, layout, what: K::NAME });
        match ins.first().map(|i| i.storage) {
            Some(CpuStorage::F32(_)) => {
                self.0.fwd::<f32>(ins).map(|(y, s)| (f32::to_cpu_storage_owned(y), s))
            }
            Some(CpuStorage::F64(_)) => {
                self.0.fwd::<f64>(ins).map(|(y, s)| (f64::to_cpu_storage_owned(y), s))
            }
            _ => bail!("{}: only f32 and f64 are supported", K::NAME),
        }
    }
}

impl<K: Kernel<2>> CustomOp2 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CpuOut {
        self.run([(s1, l1), (s2, l2)])
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, res: &Tensor, dres: &Tensor) -> candle_core::Result<Pair> {
        let [da, db] = self.0.bwd([a, b], res, dres)?;
        Ok((da, db))
    }
}

impl<K: Kernel<3>> CustomOp3 for Op<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    #[rustfmt::skip]
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> CpuOut {
        self.run([(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        dres: &Tensor,
    ) -> candle_core::Result<Triple> {
        let [da, db, dc] = self.0.bwd([a, b, c], res, dres)?;
        Ok((da, db, dc))
    }
}

/// The gradients candle's `CustomOp2::bwd` and `CustomOp3::bwd` return.
type Pair = (Option<Tensor>, Option<Tensor>);
type Triple = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// Cuts the flat buffer of a backward kernel into one gradient per tensor of
/// `like`, in order, each with that tensor's element count and shape.
fn split_like<const N: usize>(flat: &Tensor, like: [&Tensor; N]) -> Grads<N> {
    let mut at = 0;
    let mut out: [Option<Tensor>; N] = std::array::from_fn(|_| None);
    for (o, t) in out.iter_mut().zip(like) {
        *o = Some(flat.narrow(0, at, t.elem_count())?.reshape(t.shape())?);
        at += t.elem_count();
    }
    Ok(out)
}

pub mod attention;
#[cfg(feature = "blas")]
mod blas;
pub mod cpu;
pub mod exp;
pub mod gemv;
pub mod head;
mod kernels;
pub mod linear;
pub mod mm_bf16;
pub mod norm;
pub mod roofline;
pub mod rope;
pub mod selfcheck;
pub mod simd;
#[cfg(test)]
mod simd_model_tests;
pub mod swiglu;
#[cfg(test)]
pub(crate) mod test_util;
pub mod vocab;

pub use attention::{attention, attention_blockwise};
pub use head::logprob_entropy;
pub use kernels::Kernels;
pub use linear::linear;
pub use norm::rms_norm;
pub use rope::norm_rope;
pub use swiglu::swiglu;
pub use vocab::{vocab_stats, Tiles};

/// True when the CPU has AVX-512F (checked once, at run time).
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
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
    #[cfg(feature = "blas")]
    if !matches!(par, Parallelism::None)
        && m * n * k >= blas::MIN_MACS
        && blas::serves::<T>((m, n, k), dst_rs, (lhs_rs, lhs_cs), (rhs_rs, rhs_cs))
    {
        blas::gemm((m, n, k), dst, dst_rs, accumulate, lhs, (lhs_rs, lhs_cs), rhs, (rhs_rs, rhs_cs), beta);
        return;
    }
    mm_crate((m, n, k), dst, dst_rs, accumulate, lhs, (lhs_rs, lhs_cs), rhs, (rhs_rs, rhs_cs), beta, par)
}

/// [`mm_par`] on the `gemm` crate, whatever the build.
///
/// # Safety
/// As for [`mm`].
#[allow(clippy::too_many_arguments)]
unsafe fn mm_crate<T: Real>(
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

/// `len` zeros written by every thread: the kernels' outputs, so that the
/// first touch of their pages (the kernel's zeroing, the page faults) and
/// the fill are spread over the cores instead of running on the caller's.
pub(crate) fn par_zeros<T: Real>(len: usize) -> Vec<T> {
    use rayon::prelude::*;
    (0..len).into_par_iter().with_min_len(1 << 16).map(|_| zero::<T>()).collect()
}

/// A copy of `src` made in parallel, in pieces of at least 64K elements.
pub(crate) fn par_copy<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    use rayon::prelude::*;
    src.par_iter().with_min_len(1 << 16).copied().collect()
}

/// Rows per rayon task for row-wise kernels of width `n`: about 32K elements.
fn rows_per_task(n: usize) -> usize {
    (32 * 1024 / n.max(1)).max(1)
}

/// The library that runs the large products ([`product`]): the `gemm` crate
/// (every build), or the system's OpenBLAS (`--features blas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmLib {
    /// The `gemm` crate over rayon's threads.
    Crate,
    /// OpenBLAS, one single-threaded call per rayon thread.
    Blas,
}

impl GemmLib {
    /// The libraries this build has, the crate first.
    pub fn available() -> &'static [GemmLib] {
        if cfg!(feature = "blas") {
            &[GemmLib::Crate, GemmLib::Blas]
        } else {
            &[GemmLib::Crate]
        }
    }

    /// The name in tables.
    pub fn name(self) -> &'static str {
        match self {
            GemmLib::Crate => "gemm crate",
            GemmLib::Blas => "OpenBLAS",
        }
    }

    /// The library that serves the large products of this build.
    pub fn in_use() -> GemmLib {
        if cfg!(feature = "blas") {
            GemmLib::Blas
        } else {
            GemmLib::Crate
        }
    }
}

/// `c (m×n) = op(a) · op(b)` over all of rayon's threads on `lib`, all
/// row-major and contiguous: `a` is `m×k` (stored `k×m` when `trans_a`), `b`
/// is `k×n` (stored `n×k` when `trans_b`). The projections' products as the
/// kernels call them, for benchmarks and tests; an error for a library this
/// build lacks or operands that do not match.
pub fn product<T: WithDType>(
    lib: GemmLib,
    (trans_a, trans_b): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &[T],
    b: &[T],
    c: &mut [T],
) -> crate::Result<()> {
    if a.len() != m * k || b.len() != k * n || c.len() != m * n {
        return Err(crate::Error::invalid(format!(
            "product: a ({}), b ({}) and c ({}) do not match ({m}, {n}, {k})",
            a.len(),
            b.len(),
            c.len()
        )));
    }
    match T::DTYPE {
        // SAFETY: T is f32 (f64) in its arm, so the slices reinterpret to themselves.
        DType::F32 => unsafe {
            let f = |s: &[T]| std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len());
            let c = std::slice::from_raw_parts_mut(c.as_mut_ptr() as *mut f32, c.len());
            product_t::<f32>(lib, (trans_a, trans_b), (m, n, k), f(a), f(b), c)
        },
        // SAFETY: as above.
        DType::F64 => unsafe {
            let f = |s: &[T]| std::slice::from_raw_parts(s.as_ptr() as *const f64, s.len());
            let c = std::slice::from_raw_parts_mut(c.as_mut_ptr() as *mut f64, c.len());
            product_t::<f64>(lib, (trans_a, trans_b), (m, n, k), f(a), f(b), c)
        },
        d => Err(crate::Error::invalid(format!("product: {d:?} is not served"))),
    }
}

fn product_t<T: Real>(
    lib: GemmLib,
    (trans_a, trans_b): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &[T],
    b: &[T],
    c: &mut [T],
) -> crate::Result<()> {
    let a_st = if trans_a { (1, m) } else { (k, 1) };
    let b_st = if trans_b { (1, k) } else { (n, 1) };
    let one = T::from_f64(1.0);
    match lib {
        // SAFETY: the lengths were checked against (m, n, k) by `product`.
        GemmLib::Crate => unsafe {
            mm_crate(
                (m, n, k),
                c.as_mut_ptr(),
                n,
                false,
                a.as_ptr(),
                a_st,
                b.as_ptr(),
                b_st,
                one,
                all_threads(),
            )
        },
        #[cfg(feature = "blas")]
        // SAFETY: as above; `serves` is checked first.
        GemmLib::Blas if blas::serves::<T>((m, n, k), n, a_st, b_st) => unsafe {
            blas::gemm((m, n, k), c.as_mut_ptr(), n, false, a.as_ptr(), a_st, b.as_ptr(), b_st, one)
        },
        GemmLib::Blas => {
            return Err(crate::Error::invalid(format!(
                "product: OpenBLAS does not serve ({m}, {n}, {k}) in this build (`--features blas`)"
            )))
        }
    }
    Ok(())
}
