//! `e^x` over whole f32 slices, eight lanes at a time on AVX2 + FMA.
//!
//! glibc's `expf` is a scalar call per element: SwiGLU's sigmoid (every
//! element of the MLP's width, forward and backward) and attention's softmax
//! call it tens of millions of times an update. Here the exponential is plain
//! arithmetic that the compiler vectorises: Cephes' `expf` (range reduction
//! by `ln 2` in two parts, a degree-6 polynomial, the power of two written
//! into the exponent bits), within a few ulp of `expf` over the normal
//! range. Results under `e^-86.6` (2.4e-38, the smallest power of two the
//! reduction writes without a subnormal) are 0, over `e^88.7` infinite; NaN
//! stays NaN.

/// Below this the result is 0.
const LO: f32 = -86.6;
/// Above this the result is infinite.
const HI: f32 = 88.7;
/// `1.5 · 2^23`: adding and subtracting it rounds an f32 of magnitude under
/// 2^22 to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// `ln 2` in two parts (Cephes' C1, C2): `n · LN2_HI` is exact for the `n` here.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for `e^r - 1 - r` over `r²`, `|r| <= ln 2 / 2`, highest degree first.
const P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `e^x` of one value; see the module docs for the range.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // NaN stays NaN through `clamp` and the comparisons below.
    let xc = x.clamp(LO, HI);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    // n as an integer from t's low mantissa bits (a float-to-int cast would
    // not vectorise: Rust's saturates, element by element).
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    // 2^n as 2^(n - 1) · 2: n runs from -125 to 128, n + 126 from 1 to 254.
    let scale = f32::from_bits((ni.wrapping_add(126) << 23) as u32);
    let e = y * scale * 2.0;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        e
    }
}

/// `x <- e^x` for every element of `xs`.
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        unsafe { exp_avx2(xs) };
        return;
    }
    exp_loop(xs);
}

#[inline(always)]
fn exp_loop(xs: &mut [f32]) {
    for x in xs {
        *x = exp(*x);
    }
}

/// [`exp_loop`] compiled for AVX2 + FMA, so that it runs eight lanes wide.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(xs: &mut [f32]) {
    exp_loop(xs);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64's `exp` over the whole normal range, both ends, the
    /// special values and every path (the vectorised loop and one value):
    /// within 4 ulp (relative 2.4e-7), and exactly 0 / inf / NaN outside.
    #[test]
    fn exp_matches_f64_within_a_few_ulp() {
        let mut xs: Vec<f32> = (0..200_001).map(|i| LO + (HI - LO) * i as f32 / 200_000.0).collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, -0.34657, 0.34657, 88.0, -86.0, 10.0, -10.0]);
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        let mut worst = 0f64;
        for (&x, &y) in xs.iter().zip(&ys) {
            let want = (x as f64).exp();
            let err = ((y as f64) - want).abs() / want;
            worst = worst.max(err);
            assert_eq!(y, exp(x), "the vectorised loop and one value differ at {x}");
        }
        assert!(worst < 4.0 * f32::EPSILON as f64 / 2.0, "worst relative error {worst:e}");
        let mut edge = [-87.0f32, -1e9, f32::NEG_INFINITY, 88.8, 1e9, f32::INFINITY, f32::NAN];
        exp_in_place(&mut edge);
        assert_eq!(&edge[..6], &[0.0, 0.0, 0.0, f32::INFINITY, f32::INFINITY, f32::INFINITY]);
        assert!(edge[6].is_nan());
    }
}
