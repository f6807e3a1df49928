//! A micro-benchmark of this CPU's arithmetic peaks on the paths of
//! [`super::simd`], for the roofline line of `stapo bench`: f32 FMA from
//! registers, and the bf16-weight inner loop (widen 8 bf16 by a shift, one
//! f32 FMA) from an L1-resident buffer, each on every rayon thread at once.
//! It follows the usual peak-FLOP probes (independent accumulator chains, so
//! that FMA latency is hidden and only throughput counts).

use std::time::Instant;

use half::bf16;
use rayon::prelude::*;

use super::simd::{self, Path};

/// Measured peaks, in GFLOP/s (an FMA counts 2), over all rayon threads.
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    /// f32 FMA from registers.
    pub f32_fma: f64,
    /// bf16 weights widened in registers, times an f32 vector, f32 FMA (L1 data).
    pub bf16_weights: f64,
    /// AVX-512 BF16 `vdpbf16ps` from registers; `None` without it.
    pub avx512bf16: Option<f64>,
    /// AMX `tdpbf16ps` on register tiles; `None` without it (or its permission).
    pub amx: Option<f64>,
}

/// Runs both probes for about `millis` ms each on every rayon thread.
pub fn measure(millis: u64) -> Peaks {
    let threads = rayon::current_num_threads().max(1);
    let run = |probe: fn(u64) -> (f64, f64)| -> f64 {
        let flops_secs: Vec<(f64, f64)> = (0..threads).into_par_iter().map(|_| probe(millis)).collect();
        flops_secs.iter().map(|(f, s)| f / s).sum::<f64>() / 1e9
    };
    let has_avx512bf16 = simd::features().avx512bf16;
    let has_amx = simd::features().amx_bf16 && simd::amx_ready();
    Peaks {
        f32_fma: run(fma_probe),
        bf16_weights: run(bf16_probe),
        avx512bf16: has_avx512bf16.then(|| run(avx512bf16_probe)),
        amx: has_amx.then(|| run(amx_probe)),
    }
}

/// `(flops, seconds)` of `vdpbf16ps` on 8 independent accumulators.
fn avx512bf16_probe(millis: u64) -> (f64, f64) {
    spin_probe(millis, 8.0 * super::mm_bf16::AVX512BF16_FLOPS_PER_OP, super::mm_bf16::avx512bf16_spin)
}

/// `(flops, seconds)` of `tdpbf16ps` on four independent C tiles.
fn amx_probe(millis: u64) -> (f64, f64) {
    spin_probe(millis, 4.0 * super::mm_bf16::AMX_FLOPS_PER_OP, super::mm_bf16::amx_spin)
}

/// Calls `spin(ROUND)` for about `millis` ms; `per_round` FLOPs per round.
fn spin_probe(millis: u64, per_round: f64, spin: fn(u64) -> bool) -> (f64, f64) {
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed().as_millis() < millis as u128 {
        if !spin(ROUND as u64) {
            return (0.0, 1.0);
        }
        rounds += ROUND as u64;
    }
    (rounds as f64 * per_round, start.elapsed().as_secs_f64())
}

/// The line `stapo bench` prints.
pub fn line(p: &Peaks) -> String {
    let opt = |v: Option<f64>| v.map_or("n/a (not on this CPU)".to_string(), |g| format!("{g:.0} GFLOP/s"));
    format!(
        "roofline ({} path, {} threads): f32 FMA {:.0} GFLOP/s, bf16-weight FMA {:.0} GFLOP/s, avx512_bf16 vdpbf16ps {}, amx tdpbf16ps {} (measured)",
        simd::path().name(),
        rayon::current_num_threads(),
        p.f32_fma,
        p.bf16_weights,
        opt(p.avx512bf16),
        opt(p.amx)
    )
}

/// `(flops, seconds)` of repeated FMAs on 8 independent accumulators.
fn fma_probe(millis: u64) -> (f64, f64) {
    let start = Instant::now();
    let mut acc = [[1f32; 8]; 8];
    let (a, b) = (std::hint::black_box(0.999_f32), std::hint::black_box(1e-4_f32));
    let mut rounds = 0u64;
    while start.elapsed().as_millis() < millis as u128 {
        rounds += 1;
        fma_rounds(&mut acc, a, b);
    }
    std::hint::black_box(acc);
    (rounds as f64 * ROUND * 64.0 * 2.0, start.elapsed().as_secs_f64())
}

/// Inner iterations per timed round.
const ROUND: f64 = 4096.0;

fn fma_rounds(acc: &mut [[f32; 8]; 8], a: f32, b: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd::path() == Path::Avx2 {
        // SAFETY: the CPU has AVX2 + FMA (the path says so).
        return unsafe { x86::fma_rounds(acc, a, b) };
    }
    for _ in 0..ROUND as usize {
        for r in acc.iter_mut() {
            for v in r.iter_mut() {
                *v = v.mul_add(a, b);
            }
        }
    }
}

/// `(flops, seconds)` of the bf16-weight gemv loop over a 16 KiB weight row.
fn bf16_probe(millis: u64) -> (f64, f64) {
    let k = 8192;
    let w: Vec<bf16> = (0..k).map(|i| bf16::from_f32((i % 7) as f32 * 0.01)).collect();
    let x: Vec<f32> = (0..4 * k).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut y = [0f32; 4];
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed().as_millis() < millis as u128 {
        rounds += 1;
        // One weight row against 4 rows of x on the dispatched kernel, one thread.
        // SAFETY: y holds 4 × 1 outputs, written by this call only.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if simd::path() == Path::Avx2 {
                simd::avx2_block(&x, &w, y.as_mut_ptr(), (4, 1, k));
                continue;
            }
            simd::portable(&x, &w, y.as_mut_ptr(), (4, 1, k), (0, 1));
        }
    }
    std::hint::black_box(y);
    (rounds as f64 * 4.0 * k as f64 * 2.0, start.elapsed().as_secs_f64())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_rounds(acc: &mut [[f32; 8]; 8], a: f32, b: f32) {
        let (va, vb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let mut r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(acc[i].as_ptr()));
        for _ in 0..super::ROUND as usize {
            for v in r.iter_mut() {
                *v = _mm256_fmadd_ps(*v, va, vb);
            }
        }
        for (i, v) in r.iter().enumerate() {
            _mm256_storeu_ps(acc[i].as_mut_ptr(), *v);
        }
    }
}

#[cfg(test)]
mod tests {
    /// Both probes give a positive, finite rate (their values are machine
    /// facts, checked only for sanity: f32 FMA at least one scalar FMA per ns
    /// across the threads).
    #[test]
    fn bf16_simd_roofline_measures() {
        let p = super::measure(20);
        println!("{}", super::line(&p));
        assert!(p.f32_fma.is_finite() && p.f32_fma > 1.0, "{p:?}");
        assert!(p.bf16_weights.is_finite() && p.bf16_weights > 0.1, "{p:?}");
    }
}
