//! `stapo bench gemm`: the large products of one update at the shape and
//! batch given, on each library this build has (the `gemm` crate; the
//! system's OpenBLAS with `--features blas`), side by side: best wall time,
//! process CPU time per product, GFLOP/s of each, and the largest difference
//! between the libraries' results relative to the product's largest value.

use std::time::Instant;

use stapo::model::fused::{product, GemmLib};
use stapo::model::Config;

use super::bench_common::{cpu_seconds, BenchArgs};

/// One product of the update: `c (m×n) = op(a) · op(b)`, a transposed when
/// `ta` (stored `k×m`), b when `tb` (stored `n×k`).
struct Shape {
    name: String,
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    /// How many times one update runs it (every layer, every pass).
    count: usize,
}

/// The products of one full update over `rows` tokens, `head_rows` of them
/// through the head: every projection forward (old-policy and gradient
/// forwards), its `dx = dy w` and `dw = dyᵀ x`, and the head's forward.
fn shapes(cfg: &Config, rows: usize, head_rows: usize) -> Vec<Shape> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim);
    let layers = cfg.num_hidden_layers;
    // (name, out, in, projections of this size per layer)
    let projections =
        [("q", q, h, 1), ("k, v", kv, h, 2), ("o", h, q, 1), ("gate, up", i, h, 2), ("down", h, i, 1)];
    let mut out = Vec::new();
    for (name, o, k, per) in projections {
        let count = per * layers;
        let s = |name: String, ta, tb, m, n, k, count| Shape { name, ta, tb, m, n, k, count };
        out.push(s(format!("{name}: y = x wT"), false, true, rows, o, k, 2 * count));
        out.push(s(format!("{name}: dx = dy w"), false, false, rows, k, o, count));
        out.push(s(format!("{name}: dw = dyT x"), true, false, o, k, rows, count));
    }
    out.push(Shape {
        name: "head: logits = h wT".into(),
        ta: false,
        tb: true,
        m: head_rows,
        n: cfg.vocab_size,
        k: h,
        count: 3,
    });
    out
}

/// Deterministic values in [-0.5, 0.5).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

pub fn run(cfg: &Config, a: &BenchArgs, seq: usize) -> anyhow::Result<()> {
    let resp = a.response.unwrap_or(seq / 2).clamp(1, seq.saturating_sub(1).max(1));
    let (rows, head_rows) = (a.batch * seq, a.batch * resp);
    let libs = GemmLib::available();
    let reps = a.reps.max(1);
    println!(
        "the update's products in f32 over {rows} tokens ({head_rows} through the head), {} rayon threads; \
         best wall time and mean process CPU time of {reps} after a warm-up; in use: {}",
        rayon::current_num_threads(),
        GemmLib::in_use().name()
    );
    let cpu_now = || cpu_seconds().unwrap_or(0.0);
    print!("{:<22} {:>22} {:>6}", "product", "m x n x k", "calls");
    for lib in libs {
        print!(" | {:>10} {:>8} {:>8} {:>9}", lib.name(), "GFLOP/s", "cpu ms", "GF/cpu-s");
    }
    println!("{}", if libs.len() > 1 { " | max diff" } else { "" });
    let mut totals = vec![(0f64, 0f64); libs.len()];
    let mut flops_total = 0f64;
    for (idx, s) in shapes(cfg, rows, head_rows).iter().enumerate() {
        let x = values(s.m * s.k, 2 * idx as u64);
        let y = values(s.k * s.n, 2 * idx as u64 + 1);
        let flops = 2.0 * (s.m * s.n * s.k) as f64;
        flops_total += flops * s.count as f64;
        print!("{:<22} {:>22} {:>6}", s.name, format!("{}x{}x{}", s.m, s.n, s.k), s.count);
        let mut results: Vec<Vec<f32>> = Vec::new();
        for (lib, total) in libs.iter().zip(totals.iter_mut()) {
            let mut c = vec![0f32; s.m * s.n];
            product(*lib, (s.ta, s.tb), (s.m, s.n, s.k), &x, &y, &mut c)?;
            let (mut best, mut cpu) = (f64::INFINITY, 0f64);
            for _ in 0..reps {
                let (c0, t0) = (cpu_now(), Instant::now());
                product(*lib, (s.ta, s.tb), (s.m, s.n, s.k), &x, &y, &mut c)?;
                best = best.min(t0.elapsed().as_secs_f64());
                cpu += cpu_now() - c0;
            }
            let cpu = cpu / reps as f64;
            total.0 += best * s.count as f64;
            total.1 += cpu * s.count as f64;
            let per_cpu = if cpu > 0.0 { format!("{:.1}", flops / cpu / 1e9) } else { "-".into() };
            print!(" | {:>7.2} ms {:>8.1} {:>8.1} {per_cpu:>9}", best * 1e3, flops / best / 1e9, cpu * 1e3);
            results.push(c);
        }
        if let [first, rest @ ..] = results.as_slice() {
            let scale = first.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
            let diff = rest
                .iter()
                .flat_map(|r| r.iter().zip(first).map(|(a, b)| (a - b).abs()))
                .fold(0f32, f32::max);
            if !rest.is_empty() {
                print!(" | {:.1e}", diff / scale);
            }
        }
        println!();
    }
    for (lib, (wall, cpu)) in libs.iter().zip(&totals) {
        println!(
            "{}: one update's products {:.0} ms wall (best), {:.0} ms CPU, {:.1} GFLOP/s, {:.1} GFLOP per CPU-second",
            lib.name(),
            wall * 1e3,
            cpu * 1e3,
            flops_total / wall / 1e9,
            if *cpu > 0.0 { flops_total / cpu / 1e9 } else { 0.0 }
        );
    }
    Ok(())
}
