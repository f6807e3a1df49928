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
//! AVX-512F (checked at run time), else the AVX2 + FMA tiles of
//! [`super::simd`] where it has those; everything else runs a portable
//! version of the same loop. At 8–32 rows the weights come from L3 or memory while the
//! arithmetic is cheap, so two things matter: the rows of `x`, re-read for
//! every tile of weight rows, are read from a cache-line-aligned copy (an
//! unaligned 64-byte load straddles two lines), and the next tile's weight
//! rows are prefetched evenly over the current tile's steps. Neither changes
//! the arithmetic: the results are the same bits as without them.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::avx512;
use super::{zero, Real, SendPtr};

/// Largest row count of `x` served here; larger products go to gemm.
pub const MAX_ROWS: usize = 32;

/// Largest row count of `x` that a bf16 weight under f32 `x` serves from its
/// decoding kernel (`simd::gemv_w`); a larger product widens the
/// weight to f32 (a pass that writes twice the weight's bytes) for gemm,
/// or takes the CPU's bf16 dot products ([`super::mm_bf16`]). Twice
/// [`MAX_ROWS`], because that widening costs more than gemm saves over the
/// streaming kernel up to the engine's default 64 decoding rows
/// (`rollout::config::CPU_MAX_ROWS`): at the 0.6B shape in bf16 a rollout
/// of up to 64 rows ran at 57 tok/s with this cap, 37 with a cap of 32
/// (`stapo bench rollout --lengths lognormal:30:300 --prompts 6 --max-new 300
/// --paged-only --dtype bfloat16`, 2-core AVX2 machine, 2026-12-05).
pub const MAX_ROWS_BF16: usize = 64;

/// Weight rows per rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y (n×o) = x (n×k) · w (o×k)^T`, all contiguous row-major.
pub(crate) fn gemv<T: Real>(x: &[T], w: &[T], y: &mut [T], n: usize, o: usize, k: usize) {
    assert!(x.len() >= n * k && w.len() >= o * k && y.len() >= n * o, "gemv: buffers too small");
    if n == 0 || o == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == candle_core::DType::F32 && avx512() {
        // SAFETY: T is f32 (checked by dtype).
        let (x, w, y) = unsafe {
            (
                std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()),
                std::slice::from_raw_parts(w.as_ptr() as *const f32, w.len()),
                std::slice::from_raw_parts_mut(y.as_mut_ptr() as *mut f32, y.len()),
            )
        };
        // The rows of x are read once per tile of weight rows: from a
        // cache-line-aligned copy, so that no load of them straddles two lines.
        let xa = x86::AlignedRows::new(x, n, k);
        let yp = SendPtr(y.as_mut_ptr());
        // SAFETY: each task writes only columns o0..o1 of y (see `par_tasks`),
        // the buffers' sizes were checked above, and the CPU has AVX-512F.
        par_tasks(n, o, k, &|o0, o1| {
            let y = yp;
            unsafe { x86::block_f32(&xa, w, y.0, n, o, k, o0, o1) }
        });
        return;
    }
    if T::DTYPE == candle_core::DType::F32 && super::simd::path() == super::simd::Path::Avx2 {
        // SAFETY: T is f32 (checked by dtype).
        let (x, w, y) = unsafe {
            (
                std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()),
                std::slice::from_raw_parts(w.as_ptr() as *const f32, w.len()),
                std::slice::from_raw_parts_mut(y.as_mut_ptr() as *mut f32, y.len()),
            )
        };
        return super::simd::gemv_w(x, w, y, n, o, k);
    }
    let yp = SendPtr(y.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: as above, and the CPU has AVX2 and FMA.
        par_tasks(n, o, k, &|o0, o1| {
            let y = yp;
            unsafe { portable_avx2(x, w, y.0, n, o, k, o0, o1) }
        });
        return;
    }
    // SAFETY: as above.
    par_tasks(n, o, k, &|o0, o1| {
        let y = yp;
        unsafe { portable(x, w, y.0, n, o, k, o0, o1) }
    });
}

/// True when the CPU has AVX2 and FMA (checked once, at run time).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
}

/// [`portable`] compiled for AVX2 + FMA: the same arithmetic in the same
/// order (so the same bits), with 8-lane `ymm` registers instead of SSE2's 4.
///
/// # Safety
/// As for [`portable`], and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn portable_avx2<T: Real>(
    x: &[T],
    w: &[T],
    y: *mut T,
    n: usize,
    o: usize,
    k: usize,
    o0: usize,
    o1: usize,
) {
    portable(x, w, y, n, o, k, o0, o1)
}

/// Runs `run(o0, o1)` over tasks of [`ROWS_PER_TASK`] weight rows, in
/// parallel unless the product is small. Tasks cover disjoint column ranges.
fn par_tasks(n: usize, o: usize, k: usize, run: &(dyn Fn(usize, usize) + Sync)) {
    let tasks = o.div_ceil(ROWS_PER_TASK);
    let one = |t: usize| run(t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(o));
    if tasks == 1 || n * o * k < 1 << 16 {
        (0..tasks).for_each(one);
    } else {
        (0..tasks).into_par_iter().for_each(one);
    }
}

/// Lanes of the portable accumulators.
const LANES: usize = 8;

/// The portable loop: per output element, `LANES` partial sums then a fixed-order reduction.
///
/// # Safety
/// As for [`block`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
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

    /// f32s per cache line (and per AVX-512 register).
    const LINE: usize = 16;

    /// Up to this many rows of `x`, the next tile is prefetched into L2 (see [`Ahead::to_l2`]).
    const L2_PREFETCH_ROWS: usize = 8;

    /// A copy of the rows of `x` starting on cache-line boundaries, each row
    /// padded with zeros to a whole number of lines.
    pub struct AlignedRows {
        buf: Vec<f32>,
        offset: usize,
        /// Elements from one row to the next.
        pub stride: usize,
    }

    impl AlignedRows {
        /// Copies the `n` rows of `k` elements of `x`.
        pub fn new(x: &[f32], n: usize, k: usize) -> Self {
            let stride = k.next_multiple_of(LINE);
            let mut buf = vec![0f32; n * stride + LINE];
            // f32s are 4-byte aligned, so some offset below LINE reaches a line boundary.
            let offset = (LINE - (buf.as_ptr() as usize / 4) % LINE) % LINE;
            for (i, row) in x[..n * k].chunks_exact(k.max(1)).enumerate() {
                buf[offset + i * stride..offset + i * stride + k].copy_from_slice(row);
            }
            Self { buf, offset, stride }
        }

        fn ptr(&self) -> *const f32 {
            self.buf[self.offset..].as_ptr()
        }
    }

    /// Columns `o0..o1` of `y`, a tile of [`TILE`] weight rows at a time: each
    /// tile is dotted with every row of `x`, reading the weight rows from
    /// memory once (then from L1). While a tile runs, the next tile's weight
    /// rows are prefetched, spread evenly over its steps, so that the memory
    /// reads overlap the arithmetic at any row count instead of arriving in
    /// bursts.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `w` holds `o × k` elements; `y` addresses `n × o`
    /// elements that nobody else writes in columns `o0..o1`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block_f32(
        x: &AlignedRows,
        w: &[f32],
        y: *mut f32,
        n: usize,
        o: usize,
        k: usize,
        o0: usize,
        o1: usize,
    ) {
        let steps = (k / LINE).max(1) * n.div_ceil(TILE);
        // The first tile has no earlier tile to be prefetched during: ask for
        // all of its lines at once, so that they arrive together rather than
        // one demand miss after another.
        let first = w.as_ptr().wrapping_add(o0 * k);
        for line in 0..((o1.min(o0 + TILE) - o0) * k).div_ceil(LINE) {
            // A hint that never faults.
            _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add(line * LINE) as *const i8);
        }
        let mut j = o0;
        while j < o1 {
            let c = (o1 - j).min(TILE);
            let next = (j + c).min(o)..(j + c + TILE).min(o);
            let ahead = Ahead {
                ptr: w.as_ptr().wrapping_add(next.start * k),
                lines: (next.len() * k).div_ceil(LINE),
                steps,
                to_l2: n <= L2_PREFETCH_ROWS,
            };
            let mut i = 0;
            while i < n {
                let r = (n - i).min(TILE);
                let s0 = (i / TILE) * (k / LINE).max(1);
                let t = Tile { x: x.ptr(), xs: x.stride, w: w.as_ptr(), y, o, k, i0: i, j0: j };
                match (r, c) {
                    (4, 4) => t.run::<4, 4>(&ahead, s0),
                    (4, 3) => t.run::<4, 3>(&ahead, s0),
                    (4, 2) => t.run::<4, 2>(&ahead, s0),
                    (4, 1) => t.run::<4, 1>(&ahead, s0),
                    (3, 4) => t.run::<3, 4>(&ahead, s0),
                    (3, 3) => t.run::<3, 3>(&ahead, s0),
                    (3, 2) => t.run::<3, 2>(&ahead, s0),
                    (3, 1) => t.run::<3, 1>(&ahead, s0),
                    (2, 4) => t.run::<2, 4>(&ahead, s0),
                    (2, 3) => t.run::<2, 3>(&ahead, s0),
                    (2, 2) => t.run::<2, 2>(&ahead, s0),
                    (2, 1) => t.run::<2, 1>(&ahead, s0),
                    (1, 4) => t.run::<1, 4>(&ahead, s0),
                    (1, 3) => t.run::<1, 3>(&ahead, s0),
                    (1, 2) => t.run::<1, 2>(&ahead, s0),
                    _ => t.run::<1, 1>(&ahead, s0),
                }
                i += r;
            }
            j += c;
        }
    }

    /// The weight lines to prefetch while one tile of weight rows runs over
    /// all rows of `x`: `lines` lines from `ptr`, spread over `steps` steps of
    /// 16 elements.
    struct Ahead {
        ptr: *const f32,
        lines: usize,
        steps: usize,
        /// Prefetch into L2 rather than L1: at few rows of `x` a tile runs
        /// briefly, so its prefetches come fast, and into L1 they would
        /// exhaust its fill buffers and stall the loop (measured at 8 rows;
        /// at 32 rows L1 did as well or better).
        to_l2: bool,
    }

    /// One register tile: rows `i0..` of `x` (row stride `xs`) against weight
    /// rows `j0..` (row stride `k`), into `y` (row stride `o`).
    struct Tile {
        x: *const f32,
        xs: usize,
        w: *const f32,
        y: *mut f32,
        o: usize,
        k: usize,
        i0: usize,
        j0: usize,
    }

    impl Tile {
        /// `y[i0+a][j0+b] = x[i0+a] · w[j0+b]` for `a < R`, `b < C`, 16 lanes
        /// at a time (the last partial chunk masked), then one 16-lane
        /// reduction each. `s0` is the number of steps of the tile's earlier
        /// row groups (where its share of `ahead` starts).
        ///
        /// # Safety
        /// As for [`block_f32`]; rows `i0..i0+R` of x and `j0..j0+C` of w exist.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const R: usize, const C: usize>(&self, ahead: &Ahead, s0: usize) {
            let Self { x, xs, w, y, o, k, i0, j0 } = *self;
            let xp = x.add(i0 * xs);
            let wp = w.add(j0 * k);
            // Lines of `ahead` issued so far, and the remainder of the even
            // spread (Bresenham): one line every `steps / lines` steps.
            let mut issued = s0 * ahead.lines / ahead.steps;
            let mut due = s0 * ahead.lines % ahead.steps;
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let kv = k - k % 16;
            let mut c = 0;
            while c < kv {
                due += ahead.lines;
                while due >= ahead.steps {
                    // A hint that never faults.
                    let line = ahead.ptr.wrapping_add(issued * LINE) as *const i8;
                    if ahead.to_l2 {
                        _mm_prefetch::<_MM_HINT_T2>(line);
                    } else {
                        _mm_prefetch::<_MM_HINT_T0>(line);
                    }
                    issued += 1;
                    due -= ahead.steps;
                }
                let mut wv = [_mm512_setzero_ps(); C];
                for (b, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(wp.add(b * k + c));
                }
                for (a, row) in acc.iter_mut().enumerate() {
                    let xv = _mm512_load_ps(xp.add(a * xs + c));
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
                    let xv = _mm512_maskz_loadu_ps(m, xp.add(a * xs + kv));
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

    /// The same bits wherever `x` starts relative to a cache line (the AVX-512
    /// path copies it to aligned rows), for row lengths on and off the line size.
    #[test]
    fn gemv_does_not_depend_on_alignment() {
        for &(n, o, k) in &[(5, 37, 64), (32, 70, 77), (9, 8, 512)] {
            let x: Vec<f32> = (0..n * k + 16).map(|i| ((i * 29 % 89) as f32 - 44.0) / 44.0).collect();
            let w: Vec<f32> = (0..o * k + 16).map(|i| ((i * 31 % 83) as f32 - 41.0) / 41.0).collect();
            let mut first = vec![0f32; n * o];
            gemv(&x[..n * k], &w[..o * k], &mut first, n, o, k);
            for shift in 1..16 {
                let xs = &x[shift..shift + n * k];
                let mut want = vec![0f32; n * o];
                gemv(xs, &w[..o * k], &mut want, n, o, k);
                let mut got = vec![0f32; n * o];
                gemv(xs, &w[..o * k], &mut got, n, o, k);
                assert_eq!(got, want, "x shifted by {shift} ({n},{o},{k})");
                let ws = w[shift..shift + o * k].to_vec();
                let mut a = vec![0f32; n * o];
                gemv(&x[..n * k], &ws, &mut a, n, o, k);
                let mut b = vec![0f32; n * o];
                gemv(&x[..n * k], &w[shift..shift + o * k], &mut b, n, o, k);
                assert_eq!(a, b, "w shifted by {shift} ({n},{o},{k})");
            }
            assert!(first.iter().all(|v| v.is_finite()));
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
