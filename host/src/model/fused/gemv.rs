//! `y = x w^T` for a few rows of `x` (decoding: one token per sequence), as a
//! weight-streaming kernel: each row of `w` is read from memory once and
//! dotted with every row of `x` (which stays in cache). gemm's packed kernels
//! are built for large products; at decode shapes (`x` of 1–32 rows) packing
//! and dispatch cost more than the product, and the AVX-512 microkernels that
//! make large products fast make these slower. Each output element is one dot
//! product in a fixed order, so a row's result does not depend on how many
//! other rows share the call.
//!
//! f32 runs 4×4 register tiles of AVX-512 accumulators where the CPU has
//! AVX-512F (checked at run time); everything else runs a portable version of
//! the same loop.

use rayon::prelude::*;

use super::{zero, Real, SendPtr};

/// Largest row count of `x` served here; larger products go to gemm.
pub const MAX_ROWS: usize = 32;

/// Weight rows per rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y (n×o) = x (n×k) · w (o×k)^T`, all contiguous row-major.
pub(crate) fn gemv<T: Real>(x: &[T], w: &[T], y: &mut [T], n: usize, o: usize, k: usize) {
    assert!(x.len() >= n * k && w.len() >= o * k && y.len() >= n * o, "gemv: buffers too small");
    if n == 0 || o == 0 {
        return;
    }
    let yp = SendPtr(y.as_mut_ptr());
    let tasks = o.div_ceil(ROWS_PER_TASK);
    let run = |t: usize| {
        let (o0, o1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(o));
        // SAFETY: task t writes only columns o0..o1 of y, which no other task writes;
        // the buffers' sizes were checked above.
        unsafe { block(x, w, yp, n, o, k, o0, o1) }
    };
    if tasks == 1 || n * o * k < 1 << 16 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Columns `o0..o1` of `y`.
///
/// # Safety
/// `y` addresses `n × o` elements that nobody else writes in columns `o0..o1`.
#[allow(clippy::too_many_arguments)]
unsafe fn block<T: Real>(
    x: &[T],
    w: &[T],
    y: SendPtr<T>,
    n: usize,
    o: usize,
    k: usize,
    o0: usize,
    o1: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == candle_core::DType::F32 && avx512() {
        // SAFETY: T is f32 (checked by dtype), and the CPU has AVX-512F.
        let x = std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len());
        let w = std::slice::from_raw_parts(w.as_ptr() as *const f32, w.len());
        return x86::block_f32(x, w, y.0 as *mut f32, n, o, k, o0, o1);
    }
    portable(x, w, y.0, n, o, k, o0, o1)
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx512f"))
}

/// Lanes of the portable accumulators.
const LANES: usize = 8;

/// The portable loop: per output element, `LANES` partial sums then a fixed-order reduction.
///
/// # Safety
/// As for [`block`].
#[allow(clippy::too_many_arguments)]
unsafe fn portable<T: Real>(x: &[T], w: &[T], y: *mut T, n: usize, o: usize, k: usize, o0: usize, o1: usize) {
    let kv = k - k % LANES;
    for j in o0..o1 {
        let wr = &w[j * k..(j + 1) * k];
        for i in 0..n {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [zero::<T>(); LANES];
            for c in (0..kv).step_by(LANES) {
                for l in 0..LANES {
                    acc[l] += xr[c + l] * wr[c + l];
                }
            }
            let mut s = zero::<T>();
            for a in acc {
                s += a;
            }
            for c in kv..k {
                s += xr[c] * wr[c];
            }
            *y.add(i * o + j) = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 4 weight rows × 4 `x` rows per register tile (16 accumulators).
    const TILE: usize = 4;

    /// Elements ahead of the current one at which the weight rows are prefetched.
    const PREFETCH: usize = 1024;

    /// # Safety
    /// The CPU has AVX-512F; `y` as for [`super::block`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block_f32(
        x: &[f32],
        w: &[f32],
        y: *mut f32,
        n: usize,
        o: usize,
        k: usize,
        o0: usize,
        o1: usize,
    ) {
        let mut j = o0;
        while j < o1 {
            let c = (o1 - j).min(TILE);
            let mut i = 0;
            while i < n {
                let r = (n - i).min(TILE);
                match (r, c) {
                    (4, 4) => tile::<4, 4>(x, w, y, o, k, i, j),
                    (4, 3) => tile::<4, 3>(x, w, y, o, k, i, j),
                    (4, 2) => tile::<4, 2>(x, w, y, o, k, i, j),
                    (4, 1) => tile::<4, 1>(x, w, y, o, k, i, j),
                    (3, 4) => tile::<3, 4>(x, w, y, o, k, i, j),
                    (3, 3) => tile::<3, 3>(x, w, y, o, k, i, j),
                    (3, 2) => tile::<3, 2>(x, w, y, o, k, i, j),
                    (3, 1) => tile::<3, 1>(x, w, y, o, k, i, j),
                    (2, 4) => tile::<2, 4>(x, w, y, o, k, i, j),
                    (2, 3) => tile::<2, 3>(x, w, y, o, k, i, j),
                    (2, 2) => tile::<2, 2>(x, w, y, o, k, i, j),
                    (2, 1) => tile::<2, 1>(x, w, y, o, k, i, j),
                    (1, 4) => tile::<1, 4>(x, w, y, o, k, i, j),
                    (1, 3) => tile::<1, 3>(x, w, y, o, k, i, j),
                    (1, 2) => tile::<1, 2>(x, w, y, o, k, i, j),
                    _ => tile::<1, 1>(x, w, y, o, k, i, j),
                }
                i += r;
            }
            j += c;
        }
    }

    /// `y[i0+a][j0+b] = x[i0+a] · w[j0+b]` for `a < R`, `b < C`, 16 lanes at a
    /// time (the last partial chunk masked), then one 16-lane reduction each.
    ///
    /// # Safety
    /// As for [`block_f32`]; rows `i0..i0+R` of x and `j0..j0+C` of w exist.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: &[f32],
        w: &[f32],
        y: *mut f32,
        o: usize,
        k: usize,
        i0: usize,
        j0: usize,
    ) {
        let xp = x.as_ptr().add(i0 * k);
        let wp = w.as_ptr().add(j0 * k);
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let kv = k - k % 16;
        let mut c = 0;
        while c < kv {
            let mut wv = [_mm512_setzero_ps(); C];
            for (b, v) in wv.iter_mut().enumerate() {
                // The weights come from memory once: ask for them ahead of use.
                // A prefetch is a hint that never faults; past a row's end it
                // fetches the next rows (the next tile's), past w's end nothing useful.
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(b * k + c + PREFETCH) as *const i8);
                *v = _mm512_loadu_ps(wp.add(b * k + c));
            }
            for (a, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(xp.add(a * k + c));
                for (b, s) in row.iter_mut().enumerate() {
                    *s = _mm512_fmadd_ps(xv, wv[b], *s);
                }
            }
            c += 16;
        }
        if kv < k {
            let m: __mmask16 = (1u32 << (k - kv)) as u16 - 1;
            let mut wv = [_mm512_setzero_ps(); C];
            for (b, v) in wv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_ps(m, wp.add(b * k + kv));
            }
            for (a, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(m, xp.add(a * k + kv));
                for (b, s) in row.iter_mut().enumerate() {
                    *s = _mm512_fmadd_ps(xv, wv[b], *s);
                }
            }
        }
        for (a, row) in acc.iter().enumerate() {
            for (b, s) in row.iter().enumerate() {
                *y.add((i0 + a) * o + j0 + b) = _mm512_reduce_add_ps(*s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a plain f64 dot product, for every tile remainder and k tail.
    #[test]
    fn gemv_matches_reference() {
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f64 / (1u64 << 31) as f64) - 0.5
        };
        for &(n, o, k) in &[(1, 1, 1), (3, 7, 17), (5, 130, 64), (8, 67, 33), (32, 9, 100), (13, 200, 515)] {
            let x: Vec<f64> = (0..n * k).map(|_| rnd()).collect();
            let w: Vec<f64> = (0..o * k).map(|_| rnd()).collect();
            let want: Vec<f64> =
                (0..n * o).map(|e| (0..k).map(|c| x[(e / o) * k + c] * w[(e % o) * k + c]).sum()).collect();
            let mut y64 = vec![0f64; n * o];
            gemv(&x, &w, &mut y64, n, o, k);
            let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
            let mut y32 = vec![0f32; n * o];
            gemv(&x32, &w32, &mut y32, n, o, k);
            for e in 0..n * o {
                assert!((y64[e] - want[e]).abs() < 1e-12, "f64 ({n},{o},{k}) [{e}]");
                assert!(
                    (y32[e] as f64 - want[e]).abs() < 1e-5 * (k as f64).sqrt(),
                    "f32 ({n},{o},{k}) [{e}]"
                );
            }
            // One row alone gives the same bits as inside the batch.
            let mut one = vec![0f32; o];
            gemv(&x32[(n - 1) * k..], &w32, &mut one, 1, o, k);
            assert_eq!(&one[..], &y32[(n - 1) * o..], "row independence ({n},{o},{k})");
        }
    }

    /// The portable loop against the dispatched one (AVX-512 where present).
    #[test]
    fn portable_matches_dispatch() {
        let (n, o, k) = (6, 70, 77);
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let w: Vec<f32> = (0..o * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
        let mut a = vec![0f32; n * o];
        let mut b = vec![0f32; n * o];
        gemv(&x, &w, &mut a, n, o, k);
        // SAFETY: b holds n×o elements and is written by this call only.
        unsafe { portable(&x, &w, b.as_mut_ptr(), n, o, k, 0, o) };
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-4, "{p} vs {q}");
        }
    }
}
