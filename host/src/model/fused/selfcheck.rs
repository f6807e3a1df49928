//! The self-check of the CPU bf16 kernels (`stapo bench kernels`): every
//! path this CPU supports runs its kernels on the product shapes of the
//! 16.8M and 0.6B models, and on ragged shapes that are not a multiple of
//! any tile, against an f64 reference on random data; each row reports the
//! worst relative error, its bound ([`mm_bf16::tolerance`]), the GFLOP/s and
//! whether it passed. It is meant for a machine where only the `stapo`
//! binary runs (the AMX / AVX-512 BF16 host): the same checks as the unit
//! tests, on whichever paths that CPU has.

use std::time::Instant;

use half::bf16;
use rayon::prelude::*;

use super::mm_bf16::{self, reference, rnd};
use super::simd::{self, Path};

/// One checked kernel on one path and shape.
#[derive(Clone, Debug)]
pub struct Row {
    /// The path the kernel ran.
    pub path: Path,
    /// The kernel: `xwt` (bf16 dot products, `x` rounded), `gemv` (f32 `x`,
    /// bf16 weights widened in registers) or `wgemm` (the weights widened
    /// once, f32 gemm: the avx2 path's training products).
    pub kernel: &'static str,
    /// Where the shape comes from (`16.8M q`, `0.6B down`, `ragged`, ...).
    pub what: &'static str,
    /// `(n, o, k)`: `y (n×o) = x (n×k) · w (o×k)^T`.
    pub shape: (usize, usize, usize),
    /// Worst `|y - y64| / Σ|x_c w_c|` over the checked outputs.
    pub max_rel_err: f64,
    /// The bound it is held to.
    pub tolerance: f64,
    /// Achieved GFLOP/s (best of the timed runs).
    pub gflops: f64,
}

impl Row {
    /// True when the error is within the bound (and finite).
    pub fn pass(&self) -> bool {
        self.max_rel_err.is_finite() && self.max_rel_err <= self.tolerance
    }
}

/// The shapes: `(what, (n, o, k))`; `quick` keeps the small and ragged ones.
pub fn shapes(quick: bool) -> Vec<(&'static str, (usize, usize, usize))> {
    let mut s = vec![
        ("ragged", (1, 1, 1)),
        ("ragged", (3, 17, 33)),
        ("ragged", (37, 45, 1030)),
        ("ragged", (97, 130, 95)),
        ("16.8M decode", (8, 1536, 512)),
        ("16.8M q/o", (256, 512, 512)),
    ];
    if !quick {
        s.extend([
            ("16.8M kv", (1024, 256, 512)),
            ("16.8M gate", (1024, 1536, 512)),
            ("16.8M down", (1024, 512, 1536)),
            ("16.8M head", (1024, 8192, 512)),
            ("0.6B decode", (8, 3072, 1024)),
            ("0.6B q", (2048, 2048, 1024)),
            ("0.6B kv", (2048, 1024, 1024)),
            ("0.6B gate", (2048, 3072, 1024)),
            ("0.6B down", (2048, 1024, 3072)),
            ("0.6B head", (64, 151_936, 1024)),
        ]);
    }
    s
}

/// Paths not checked on this CPU, one line each ("amx: not supported by this CPU").
pub fn skipped() -> Vec<String> {
    let f = simd::features();
    let mut out = Vec::new();
    if !f.amx_bf16 {
        out.push("amx: not supported by this CPU".to_string());
    } else if !simd::amx_ready() {
        out.push(
            "amx: supported by this CPU, but the kernel did not permit AMX tiles (arch_prctl)".to_string(),
        );
    }
    if !f.avx512bf16 {
        out.push("avx512bf16: not supported by this CPU".to_string());
    }
    if !f.avx2_fma {
        out.push("avx2: not supported by this CPU".to_string());
    }
    out
}

/// The paths checked here: those this CPU supports (AMX only if permitted).
pub fn paths() -> Vec<Path> {
    simd::supported_paths().into_iter().filter(|p| simd::ready(*p)).collect()
}

/// Runs every kernel of every path in [`paths`] on [`shapes`]`(quick)`;
/// `reps` timed runs each (the best counts). Rows in path order.
pub fn run(quick: bool, reps: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut seed = 0x5eed_u64;
    for (what, (n, o, k)) in shapes(quick) {
        let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
        let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
        let check = sample_rows(n, &mut seed);
        let refs: Vec<(Vec<f64>, Vec<f64>)> = check.par_iter().map(|&i| reference(&x, &w, i, o, k)).collect();
        for path in paths() {
            // What the model runs on this path for this shape (see `linear`):
            // decoding rows take the gemv, larger products the bf16 dot
            // products or, on avx2, the widened weight and f32 gemm. The
            // portable loop is slow and checked on the small shapes only.
            let decode = n <= super::gemv::MAX_ROWS_BF16;
            let (kernel, round_x) = match path {
                p if p.bf16_dot() => ("xwt", true),
                Path::Avx2 if !decode => ("wgemm", false),
                Path::Portable if !quick && n * o * k > 1 << 24 => continue,
                _ => ("gemv", false),
            };
            let mut best = f64::INFINITY;
            let mut y = Vec::new();
            for _ in 0..reps.max(1) {
                let t = Instant::now();
                y = if path.bf16_dot() {
                    mm_bf16::xwt(path, &x, &w, (n, o, k))
                } else if kernel == "wgemm" {
                    super::linear::x_wt(&x, &simd::widen(&w), (n, o, k))
                } else {
                    let mut y = vec![0f32; n * o];
                    simd::gemv_w_on(path, &x, &w, &mut y, (n, o, k));
                    y
                };
                best = best.min(t.elapsed().as_secs_f64());
            }
            let mut err = 0f64;
            for (&i, (s, a)) in check.iter().zip(&refs) {
                for j in 0..o {
                    let e = (y[i * o + j] as f64 - s[j]).abs() / a[j].max(f64::MIN_POSITIVE);
                    // NaN propagates as a failure (`f64::max` would drop it).
                    err = if err.is_nan() || e.is_nan() { f64::NAN } else { err.max(e) };
                }
            }
            rows.push(Row {
                path,
                kernel,
                what,
                shape: (n, o, k),
                max_rel_err: err,
                tolerance: mm_bf16::tolerance(k, round_x),
                gflops: 2.0 * (n * o * k) as f64 / best / 1e9,
            });
        }
    }
    rows.sort_by_key(|r| paths().iter().position(|p| *p == r.path));
    rows
}

/// The table `stapo bench kernels` prints: a header and one line per row.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<11} {:<6} {:<13} {:>22} {:>12} {:>10} {:>9}  pass\n",
        "path", "kernel", "shape of", "n x o x k", "max rel err", "tolerance", "GFLOP/s"
    );
    for r in rows {
        let (n, o, k) = r.shape;
        s += &format!(
            "{:<11} {:<6} {:<13} {:>22} {:>12.3e} {:>10.3e} {:>9.1}  {}\n",
            r.path.name(),
            r.kernel,
            r.what,
            format!("{n} x {o} x {k}"),
            r.max_rel_err,
            r.tolerance,
            r.gflops,
            if r.pass() { "ok" } else { "FAIL" }
        );
    }
    s
}

/// Rows of `y` checked against f64: first, last, middle and five others.
fn sample_rows(n: usize, seed: &mut u64) -> Vec<usize> {
    let mut r = vec![0, n - 1, n / 2];
    for _ in 0..5 {
        r.push(((rnd(seed) + 0.5) * n as f64) as usize % n);
    }
    r.sort_unstable();
    r.dedup();
    r
}

#[cfg(test)]
mod tests {
    /// The quick self-check passes on every path this CPU has (here at least
    /// avx2 and portable), and each path ran every shape.
    #[test]
    fn bf16_selfcheck_quick_passes() {
        let rows = super::run(true, 1);
        println!("{}", super::table(&rows));
        for s in super::skipped() {
            println!("{s}");
        }
        let paths = super::paths();
        assert!(paths.contains(&super::Path::Portable));
        assert_eq!(rows.len(), paths.len() * super::shapes(true).len());
        if paths.contains(&super::Path::Avx2) {
            assert!(rows.iter().any(|r| r.kernel == "wgemm") && rows.iter().any(|r| r.kernel == "gemv"));
        }
        for r in &rows {
            assert!(r.pass(), "{r:?}");
            assert!(r.gflops > 0.0, "{r:?}");
        }
    }
}
