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
//! One file per op: [`linear`], [`norm`] (RMSNorm), [`rope`] (per-head norm +
//! rotary), [`attention`], [`swiglu`], [`head`] (log-prob and entropy from
//! logits), [`vocab`] (the same from hidden states, in tiles, no logits kept).
//! This file holds what they share: dtype dispatch, raw slices and the gemm
//! wrappers.

use std::ops::Neg;

use candle_core::{bail, CpuStorage, DType, Device, Layout, Storage, Tensor, WithDType};
use gemm::Parallelism;

/// True when the fused kernels serve `t`: a CPU tensor in f32 or f64, unless
/// the environment sets `STAPO_NO_FUSED=1` (for A/B benchmarks and debugging).
pub fn supported(t: &Tensor) -> bool {
    supported_on(t.device(), t.dtype())
}

/// [`supported`] for tensors of `dtype` on `device`.
pub fn supported_on(device: &Device, dtype: DType) -> bool {
    static DISABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let disabled = *DISABLED.get_or_init(|| std::env::var("STAPO_NO_FUSED").is_ok_and(|v| v == "1"));
    !disabled && device.is_cpu() && matches!(dtype, DType::F32 | DType::F64)
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

fn one<T: Real>() -> T {
    T::from_f64(1.0)
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

pub mod attention;
pub mod head;
pub mod linear;
pub mod norm;
pub mod rope;
pub mod swiglu;
#[cfg(test)]
pub(crate) mod test_util;
pub mod vocab;

pub use attention::{attention, attention_blockwise};
pub use head::logprob_entropy;
pub use linear::linear;
pub use norm::rms_norm;
pub use rope::norm_rope;
pub use swiglu::swiglu;
pub use vocab::{vocab_stats, Tiles};

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
