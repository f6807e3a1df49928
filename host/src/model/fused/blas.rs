//! The large products on the system's OpenBLAS (`--features blas`): the
//! projections of training and prefill and the head's tiles, where
//! OpenBLAS's kernels for this CPU beat the `gemm` crate's.
//!
//! The library is linked from the system (Debian: `libopenblas-dev`); the
//! default build does not have this module and needs nothing beyond
//! crates.io. OpenBLAS runs single-threaded inside rayon's threads: a
//! product is cut into one piece per thread, rows of the output (or columns,
//! when the output has fewer rows than columns), each one OpenBLAS call, so
//! one thread pool serves the whole step and no second pool of spinning
//! threads competes with it for the cores.

use std::ffi::c_int;
use std::sync::Once;

use candle_core::DType;
use rayon::prelude::*;

use super::{Real, SendPtr};

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

#[link(name = "openblas")]
extern "C" {
    fn cblas_sgemm(
        layout: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn cblas_dgemm(
        layout: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f64,
        a: *const f64,
        lda: c_int,
        b: *const f64,
        ldb: c_int,
        beta: f64,
        c: *mut f64,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
}

/// Products of at least this many multiply-adds go to OpenBLAS: below it a
/// call's set-up (packing both operands per piece) weighs more than the
/// kernels' difference.
pub(super) const MIN_MACS: usize = 1 << 18;

/// One operand as BLAS reads it: row-major with leading dimension `ld`,
/// transposed or not.
#[derive(Clone, Copy)]
struct Operand {
    trans: bool,
    ld: usize,
}

impl Operand {
    /// The BLAS view of a `rows × cols` matrix with strides `(rs, cs)`: one of
    /// them must be 1 (else `None`), the other at least the matrix's width.
    fn of((rows, cols): (usize, usize), (rs, cs): (usize, usize)) -> Option<Self> {
        if cs == 1 && (rs >= cols.max(1) || rows <= 1) {
            Some(Self { trans: false, ld: rs.max(cols).max(1) })
        } else if rs == 1 && (cs >= rows.max(1) || cols <= 1) {
            Some(Self { trans: true, ld: cs.max(rows).max(1) })
        } else {
            None
        }
    }

    fn flag(self) -> c_int {
        if self.trans {
            TRANS
        } else {
            NO_TRANS
        }
    }
}

/// Whether [`gemm`] serves this product: f32 or f64, operands OpenBLAS can
/// read (one unit stride each), sizes within its `int`.
pub(super) fn serves<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst_rs: usize,
    lhs_st: (usize, usize),
    rhs_st: (usize, usize),
) -> bool {
    let fits = |v: usize| c_int::try_from(v).is_ok();
    matches!(T::DTYPE, DType::F32 | DType::F64)
        && [m, n, k, dst_rs, lhs_st.0, lhs_st.1, rhs_st.0, rhs_st.1].into_iter().all(fits)
        && dst_rs >= n
        && Operand::of((m, k), lhs_st).is_some()
        && Operand::of((k, n), rhs_st).is_some()
}

/// `dst (m×n) = beta · lhs (m×k) · rhs (k×n) [+ dst when accumulate]` on
/// OpenBLAS, cut over rayon's threads (see the module docs). Strides are
/// (row, column) in elements; `dst`'s column stride is 1.
///
/// # Safety
/// [`serves`] holds; every pointer addresses the full strided matrix it
/// describes, and `dst` overlaps neither operand nor is written by anyone else.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    lhs_st: (usize, usize),
    rhs: *const T,
    rhs_st: (usize, usize),
    beta: T,
) {
    static SINGLE: Once = Once::new();
    // SAFETY: sets OpenBLAS's thread count before its first product here.
    SINGLE.call_once(|| unsafe { openblas_set_num_threads(1) });
    if m == 0 || n == 0 {
        return;
    }
    let (a, b) = match (Operand::of((m, k), lhs_st), Operand::of((k, n), rhs_st)) {
        (Some(a), Some(b)) => (a, b),
        _ => unreachable!("checked by blas::serves"),
    };
    let threads = rayon::current_num_threads().max(1);
    // Rows of the output per piece (a multiple of 16, OpenBLAS's widest
    // micro-tile), or columns when the output is wider than tall.
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let step = len.div_ceil(threads).next_multiple_of(16).min(len).max(1);
    let (dst, lhs, rhs) = (SendPtr(dst), SendPtr(lhs as *mut T), SendPtr(rhs as *mut T));
    (0..len.div_ceil(step)).into_par_iter().for_each(|p| {
        #[allow(clippy::redundant_locals)]
        let (dst, lhs, rhs) = (dst, lhs, rhs);
        let s = p * step;
        let w = step.min(len - s);
        // SAFETY: piece p reads rows s..s+w of lhs (or columns of rhs) and
        // writes the same rows (columns) of dst, disjoint from every other
        // piece; the offsets stay inside the matrices the caller described.
        unsafe {
            if by_rows {
                one(
                    (w, n, k),
                    dst.0.add(s * dst_rs),
                    dst_rs,
                    accumulate,
                    (lhs.0.add(s * lhs_st.0), a),
                    (rhs.0, b),
                    beta,
                );
            } else {
                one(
                    (m, w, k),
                    dst.0.add(s),
                    dst_rs,
                    accumulate,
                    (lhs.0, a),
                    (rhs.0.add(s * rhs_st.1), b),
                    beta,
                );
            }
        }
    });
}

/// One single-threaded OpenBLAS call.
///
/// # Safety
/// As for [`gemm`], for this piece.
unsafe fn one<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    ldc: usize,
    accumulate: bool,
    (a, oa): (*const T, Operand),
    (b, ob): (*const T, Operand),
    alpha: T,
) {
    let i = |v: usize| v as c_int;
    let (m, n, k, lda, ldb, ldc) = (i(m), i(n), i(k), i(oa.ld), i(ob.ld), i(ldc));
    let (ta, tb) = (oa.flag(), ob.flag());
    // SAFETY: T is f32 or f64 (`serves`), so the casts keep the element type.
    unsafe {
        match T::DTYPE {
            DType::F32 => cblas_sgemm(
                ROW_MAJOR,
                ta,
                tb,
                m,
                n,
                k,
                alpha.to_f64() as f32,
                a as *const f32,
                lda,
                b as *const f32,
                ldb,
                if accumulate { 1.0 } else { 0.0 },
                dst as *mut f32,
                ldc,
            ),
            DType::F64 => cblas_dgemm(
                ROW_MAJOR,
                ta,
                tb,
                m,
                n,
                k,
                alpha.to_f64(),
                a as *const f64,
                lda,
                b as *const f64,
                ldb,
                if accumulate { 1.0 } else { 0.0 },
                dst as *mut f64,
                ldc,
            ),
            _ => unreachable!("checked by blas::serves"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{mm_par, product, GemmLib};
    use super::*;
    use crate::model::fused::mm_bf16::rnd;

    /// `op(a) · op(b)` in f64, as [`product`] defines it.
    fn reference(
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        a: &[f64],
        b: &[f64],
    ) -> (Vec<f64>, Vec<f64>) {
        let (mut c, mut abs) = (vec![0f64; m * n], vec![0f64; m * n]);
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let x = if ta { a[p * m + i] } else { a[i * k + p] };
                    let y = if tb { b[j * k + p] } else { b[p * n + j] };
                    c[i * n + j] += x * y;
                    abs[i * n + j] += (x * y).abs();
                }
            }
        }
        (c, abs)
    }

    /// OpenBLAS and the gemm crate give the same products, each within f32's
    /// (f64's) accumulation bound `k · 2^-23 · Σ|a b|` of the f64 product:
    /// every transpose of the update's products (`x wᵀ`, `dy w`, `dyᵀ x`),
    /// shapes that cut into pieces by rows and by columns, pieces that do
    /// not divide the rows (not a multiple of 16), depth 1, and products
    /// below [`MIN_MACS`].
    #[test]
    fn openblas_products_match_the_gemm_crate_and_f64() {
        let mut seed = 48u64;
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (37, 21, 1), (600, 96, 192), (96, 600, 300), (1030, 33, 65)]
        {
            for trans in [(false, true), (false, false), (true, false), (true, true)] {
                let a64: Vec<f64> = (0..m * k).map(|_| rnd(&mut seed)).collect();
                let b64: Vec<f64> = (0..k * n).map(|_| rnd(&mut seed)).collect();
                let (want, abs) = reference(trans, (m, n, k), &a64, &b64);
                let check = |got: &[f64], unit: f64, what: &str| {
                    for (i, (g, (w, s))) in got.iter().zip(want.iter().zip(&abs)).enumerate() {
                        let bound = (k as f64 + 2.0) * unit * s.max(f64::MIN_POSITIVE);
                        assert!((g - w).abs() <= bound, "{what} ({m},{n},{k}) {trans:?} [{i}]: {g} vs {w}");
                    }
                };
                for lib in [GemmLib::Blas, GemmLib::Crate] {
                    let mut c = vec![0f64; m * n];
                    product(lib, trans, (m, n, k), &a64, &b64, &mut c).unwrap();
                    check(&c, f64::EPSILON, &format!("{} f64", lib.name()));
                    let (a32, b32): (Vec<f32>, Vec<f32>) =
                        (a64.iter().map(|&v| v as f32).collect(), b64.iter().map(|&v| v as f32).collect());
                    let mut c32 = vec![0f32; m * n];
                    product(lib, trans, (m, n, k), &a32, &b32, &mut c32).unwrap();
                    // The operands' rounding to f32 counts as one more step of the bound.
                    let c32: Vec<f64> = c32.iter().map(|&v| v as f64).collect();
                    check(&c32, f32::EPSILON as f64, &format!("{} f32", lib.name()));
                }
            }
        }
    }

    /// Through the kernels' wrapper: a product added into what the output
    /// holds, scaled, with a row stride wider than the output (a block of
    /// columns of a larger matrix): OpenBLAS as the gemm crate, within f32's
    /// rounding, and the columns outside the block untouched.
    #[test]
    fn openblas_accumulates_into_strided_outputs() {
        let (m, n, k, ld) = (700, 40, 64, 57);
        let mut seed = 9u64;
        let a: Vec<f32> = (0..m * k).map(|_| rnd(&mut seed) as f32).collect();
        let b: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
        let init: Vec<f32> = (0..m * ld).map(|_| rnd(&mut seed) as f32).collect();
        let run = |par: gemm::Parallelism, blas: bool| {
            let mut c = init.clone();
            // SAFETY: a is m×k, b is n×k read as its transpose, c is m rows of ld ≥ n.
            unsafe {
                if blas {
                    assert!(serves::<f32>((m, n, k), ld, (k, 1), (1, k)) && m * n * k >= MIN_MACS);
                }
                mm_par((m, n, k), c.as_mut_ptr(), ld, true, a.as_ptr(), (k, 1), b.as_ptr(), (1, k), 0.5, par)
            }
            c
        };
        let with_blas = run(gemm::Parallelism::Rayon(2), true);
        let with_crate = run(gemm::Parallelism::None, false);
        for (i, (x, y)) in with_blas.iter().zip(&with_crate).enumerate() {
            let (r, col) = (i / ld, i % ld);
            if col >= n {
                assert_eq!(x.to_bits(), init[i].to_bits(), "[{r},{col}] outside the block changed");
            } else {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "[{r},{col}]: {x} vs {y}");
            }
        }
    }

    /// Operands without a unit stride are not served (the crate takes them).
    #[test]
    fn operands_without_a_unit_stride_are_left_to_the_crate() {
        assert!(serves::<f32>((4, 4, 4), 4, (4, 1), (1, 4)));
        assert!(!serves::<f32>((4, 4, 4), 4, (8, 2), (4, 1)));
        assert!(!serves::<f32>((4, 4, 4), 3, (4, 1), (4, 1)));
    }
}
