//! `exp` over a slice of f32, eight lanes at a time on AVX2 + FMA.
//!
//! The update's elementwise passes call `exp` once per SwiGLU activation (the
//! forward and its backward), per attention score and per vocabulary logit:
//! about 130 million calls an update at the bundled model's shape with the
//! quickstart's batch, where glibc's scalar `expf` took 5% of the update's CPU
//! time. This is Cephes' `expf` (Moshier; the reduction `x = n ln 2 + r` with
//! `ln 2` split in two, a degree-6 polynomial for `e^r` on `|r| <= ln 2 / 2`,
//! `2^n` put in the exponent bits), as the SSE/AVX `exp_ps` of `avx_mathfun`
//! and Eigen's `pexp` write it: within 2 ulp of the exact value. A block of
//! eight with any lane outside `[-87, 88]` (where the result is denormal or
//! infinite) or not a number takes the scalar `f32::exp`, so the edge cases are
//! the scalar ones exactly.

/// `x = exp(x)` for every element.
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time).
        unsafe { x86::exp_in_place(xs) };
        return;
    }
    for x in xs {
        *x = x.exp();
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// The constants of Cephes' `expf`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = C1 + C2`, `C1` exact in few bits so that `n * C1` is exact.
const C1: f32 = 0.693_359_4;
const C2: f32 = -2.121_944_4e-4;
/// The polynomial: `e^r = 1 + r + r^2 (P5 + r (P4 + r (P3 + r (P2 + r (P1 + r P0)))))`
/// (Cephes' last coefficient, 5.0000001201e-1, is 0.5 in f32).
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
/// The inputs the vector path serves; outside, the scalar `exp`.
const LO: f32 = -87.0;
const HI: f32 = 88.0;

/// The vector path's arithmetic on one value, for the tests and the scalar tail's
/// reference.
#[cfg(test)]
fn exp_poly(x: f32) -> f32 {
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * C1 - n * C2;
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let e = p.mul_add(r * r, r + 1.0);
    e * f32::from_bits((((n as i32) + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{C1, C2, HI, LO, LOG2E, P};

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_in_place(xs: &mut [f32]) {
        let mut blocks = xs.chunks_exact_mut(8);
        let (lo, hi) = (_mm256_set1_ps(LO), _mm256_set1_ps(HI));
        for b in &mut blocks {
            let x = _mm256_loadu_ps(b.as_ptr());
            // In range (ordered comparisons: a NaN lane fails both).
            let inside =
                _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, lo), _mm256_cmp_ps::<_CMP_LE_OQ>(x, hi));
            if _mm256_movemask_ps(inside) != 0xff {
                for v in b.iter_mut() {
                    *v = v.exp();
                }
                continue;
            }
            _mm256_storeu_ps(b.as_mut_ptr(), exp8(x));
        }
        for v in blocks.into_remainder() {
            *v = v.exp();
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C1), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C2), r);
        let mut p = _mm256_set1_ps(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(pow2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `a` and the f64 value `exact`.
    fn ulps(a: f32, exact: f64) -> f64 {
        let e = exact as f32;
        let ulp = (f32::from_bits(e.to_bits() + 1) - e) as f64;
        (a as f64 - exact).abs() / ulp
    }

    #[test]
    fn within_two_ulp_of_the_exact_exp_over_the_whole_range() {
        // Every 97th f32 bit pattern from -87 to 88 (about 20 million values), in blocks
        // that take the vector path, against f64's exp rounded to f32.
        let mut xs = Vec::new();
        let (lo, hi) = (LO.to_bits(), HI.to_bits());
        // Negative floats: bit patterns from -0 (0x8000_0000) up to LO's.
        xs.extend((0x8000_0000u32..=lo).step_by(97).map(f32::from_bits));
        xs.extend((0u32..=hi).step_by(97).map(f32::from_bits));
        xs.truncate(xs.len() / 8 * 8);
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        let mut worst = (0.0, 0.0f32);
        for (&x, &y) in xs.iter().zip(&ys) {
            let u = ulps(y, (x as f64).exp());
            if u > worst.0 {
                worst = (u, x);
            }
            // The scalar model of the vector arithmetic gives the same bits up to FMA rounding.
            assert!(ulps(exp_poly(x), (x as f64).exp()) <= 2.0, "exp_poly({x})");
        }
        assert!(worst.0 <= 2.0, "worst {} ulp at {}", worst.0, worst.1);
    }

    #[test]
    fn edge_cases_are_the_scalar_ones() {
        let xs = [
            f32::NEG_INFINITY,
            -200.0,
            -103.0,
            -87.5,
            -87.0,
            -0.0,
            0.0,
            88.0,
            88.5,
            89.0,
            f32::INFINITY,
            f32::NAN,
            1e-30,
            -1e-30,
            0.5,
            1.0,
            -1.0,
        ];
        // Each value among ordinary ones, in a block of eight and in the tail.
        for (i, &x) in xs.iter().enumerate() {
            for len in [8usize, 9, 16, 3] {
                let mut v: Vec<f32> = (0..len).map(|k| (k as f32) * 0.25 - 1.0).collect();
                let at = (i * 5) % len;
                v[at] = x;
                let input = v.clone();
                exp_in_place(&mut v);
                for (k, (&a, &x)) in v.iter().zip(&input).enumerate() {
                    if (LO..=HI).contains(&x) {
                        assert!(ulps(a, (x as f64).exp()) <= 2.0, "exp({x}) = {a} at {k} of {len}");
                    } else {
                        assert_eq!(a.to_bits(), x.exp().to_bits(), "exp({x}) at {k} of {len}");
                    }
                }
            }
        }
        assert_eq!(exp_in_place_one(0.0), 1.0);
        assert_eq!(exp_in_place_one(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_in_place_one(f32::INFINITY), f32::INFINITY);
        assert!(exp_in_place_one(f32::NAN).is_nan());
    }

    fn exp_in_place_one(x: f32) -> f32 {
        let mut v = [x; 8];
        exp_in_place(&mut v);
        assert!(v.iter().all(|a| a.to_bits() == v[0].to_bits()));
        v[0]
    }
}
