//! Every CUDA C kernel of `host/src/model/cuda/` run on the CPU (the
//! `cuda-cpu` emulation) against stapo's CPU path, on shapes chosen to hit
//! the kernels' edges: odd sizes, block boundaries, shared blocks, bf16.
//! One line per case with the largest error relative to the largest value of
//! the reference, then `cuda kernels on the CPU: K passed, F failed`. Exits
//! with 1 when a case fails.

use candle_core::{Device, Tensor};
use cuda_cpu::PagedShape;
use half::bf16;
use stapo::model::paged_attention::{self, PagedSeq, Tables};

/// Tolerances relative to the largest value of the reference.
const TOL_F32: f64 = 1e-5;
const TOL_BF16: f64 = 2e-2;

/// Cases run and failed, and the largest error per kernel.
#[derive(Default)]
struct Report {
    passed: usize,
    failed: usize,
    worst: Vec<(String, f64, f64)>,
}

impl Report {
    /// Records `got` against `want`: the largest `|got - want|` over the
    /// largest `|want|` must stay within `tol`, and every value be finite.
    fn check(&mut self, kernel: &str, case: &str, got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{kernel} {case}: lengths");
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(f64::MIN_POSITIVE);
        let err = got.iter().zip(want).fold(0f64, |m, (g, w)| if g.is_finite() { m.max((g - w).abs()) } else { f64::INFINITY });
        let rel = err / scale;
        let ok = rel <= tol && !got.is_empty();
        println!("{kernel:<28} {case:<58} max err {rel:.2e} of max |ref| {scale:.3} (tol {tol:.0e}) {}", if ok { "ok" } else { "FAILED" });
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
        match self.worst.iter_mut().find(|(k, t, _)| k == kernel && *t == tol) {
            Some(w) => w.2 = w.2.max(rel),
            None => self.worst.push((kernel.to_string(), tol, rel)),
        }
    }
}

/// A deterministic value in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.next() * scale) as f32).collect()
    }
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn f64s<T: Copy + Into<f64>>(x: &[T]) -> Vec<f64> {
    x.iter().map(|&v| v.into()).collect()
}

/// One paged-attention case: sequences (block table, length, new tokens),
/// heads, head dimension, block size and pool blocks.
struct PagedCase {
    name: &'static str,
    seqs: Vec<PagedSeq>,
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    blocks: usize,
}

impl PagedCase {
    fn seq(blocks: &[u32], len: usize, new: usize) -> PagedSeq {
        PagedSeq { blocks: blocks.to_vec(), len, new }
    }
}

/// The paged-attention cases: decode steps and prefill chunks, GQA ratios
/// 1, 2, 3, 4 and 7, head dims 64, 128, 72, 33 and 256, positions at the
/// last slot of a block and the first and second slots of the next,
/// sequences that share their prompt's blocks, tokens counts that are
/// multiples of nothing.
fn paged_cases() -> Vec<PagedCase> {
    let s = PagedCase::seq;
    vec![
        PagedCase {
            name: "decode, 4:4 heads, d 64, bs 16",
            seqs: vec![s(&[3, 0], 17, 1), s(&[1], 5, 1), s(&[2], 1, 1)],
            hq: 4,
            hkv: 4,
            d: 64,
            bs: 16,
            blocks: 4,
        },
        PagedCase {
            // Decoding at positions 15, 16 and 17 of 16-slot blocks.
            name: "block edges bs-1 bs bs+1, 8:2, d 128",
            seqs: vec![s(&[5, 1], 16, 1), s(&[0, 4], 17, 1), s(&[2, 3], 18, 1)],
            hq: 8,
            hkv: 2,
            d: 128,
            bs: 16,
            blocks: 6,
        },
        PagedCase {
            // A prefill chunk of 37 tokens beside two decoding rows.
            name: "prefill 37 + 2 decodes, 6:2, d 72, bs 5",
            seqs: vec![s(&[9, 2, 7, 0, 4, 11, 1, 8, 12], 41, 37), s(&[3, 5], 7, 1), s(&[6, 10], 10, 1)],
            hq: 6,
            hkv: 2,
            d: 72,
            bs: 5,
            blocks: 13,
        },
        PagedCase {
            // Three responses of one prompt: blocks 4 and 1 are shared.
            name: "shared prompt blocks, 8:2, d 64, bs 8",
            seqs: vec![s(&[4, 1, 6], 19, 1), s(&[4, 1, 2], 20, 1), s(&[4, 1, 0, 5], 25, 3)],
            hq: 8,
            hkv: 2,
            d: 64,
            bs: 8,
            blocks: 7,
        },
        PagedCase {
            name: "odd sizes, 7:1, d 33, bs 3",
            seqs: vec![s(&[2, 0, 5, 1], 11, 5), s(&[4, 3], 4, 2)],
            hq: 7,
            hkv: 1,
            d: 33,
            bs: 3,
            blocks: 6,
        },
        PagedCase {
            name: "largest head dim, 4:1, d 256, bs 4",
            seqs: vec![s(&[1, 0, 2], 9, 2)],
            hq: 4,
            hkv: 1,
            d: 256,
            bs: 4,
            blocks: 3,
        },
        PagedCase {
            // A long sequence: many keys per warp, long online softmax.
            name: "one long row, 16:8, d 128, bs 16",
            seqs: vec![s(&(0..20).rev().collect::<Vec<u32>>(), 313, 1)],
            hq: 16,
            hkv: 8,
            d: 128,
            bs: 16,
            blocks: 20,
        },
    ]
}

fn paged_attention(report: &mut Report) {
    let dev = Device::Cpu;
    for (ci, c) in paged_cases().iter().enumerate() {
        let (mut row, mut pos) = (vec![], vec![]);
        for (r, s) in c.seqs.iter().enumerate() {
            for p in s.len - s.new..s.len {
                row.push(r as u32);
                pos.push(p as u32);
            }
        }
        let t = row.len();
        let slots = c.blocks * c.bs;
        let mut rng = Rng(1 + ci as u64);
        let q = rng.vec(c.hq * t * c.d, 1.0);
        // Keys larger than the queries: sharp and flat softmaxes both occur.
        let k = rng.vec(slots * c.hkv * c.d, 3.0);
        let v = rng.vec(slots * c.hkv * c.d, 1.0);
        let tables: Vec<&[u32]> = c.seqs.iter().map(|s| s.blocks.as_slice()).collect();
        let shape = PagedShape { tokens: t, hq: c.hq, hkv: c.hkv, d: c.d, block_size: c.bs };
        let tb = Tables { seqs: &c.seqs, row: &row, pos: &pos, block_size: c.bs };
        let pool = |x: &[f32]| Tensor::from_slice(x, (slots, c.hkv, c.d), &dev).unwrap();
        let pool_b = |x: &[bf16]| Tensor::from_slice(x, (slots, c.hkv, c.d), &dev).unwrap();
        let cpu = |q: &[f32], k: &Tensor, v: &Tensor| -> Vec<f64> {
            let q = Tensor::from_slice(q, (1, c.hq, t, c.d), &dev).unwrap();
            let out = paged_attention::attention(&q, k, v, &tb).expect("the CPU path");
            f64s(&out.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        };
        let name = format!("{} ({t} tokens)", c.name);

        // f32 queries over f32 pools.
        let got: Vec<f32> = cuda_cpu::paged_attention(&q, &k, &v, &row, &pos, &tables, shape);
        report.check("paged_attention_f32", &name, &f64s(&got), &cpu(&q, &pool(&k), &pool(&v)), TOL_F32);

        // f32 queries over bf16 pools: the same bf16 values on both sides, f32 sums.
        let (kb, vb) = (to_bf16(&k), to_bf16(&v));
        let got: Vec<f32> = cuda_cpu::paged_attention(&q, &kb, &vb, &row, &pos, &tables, shape);
        let want = cpu(&q, &pool_b(&kb), &pool_b(&vb));
        report.check("paged_attention_f32_bf16kv", &name, &f64s(&got), &want, TOL_F32);

        // bf16 queries over bf16 pools, bf16 output; the CPU path takes the same
        // bf16 queries widened to f32.
        let qb = to_bf16(&q);
        let got: Vec<bf16> = cuda_cpu::paged_attention(&qb, &kb, &vb, &row, &pos, &tables, shape);
        let want = cpu(&widen(&qb), &pool_b(&kb), &pool_b(&vb));
        report.check("paged_attention_bf16", &name, &f64s(&widen(&got)), &want, TOL_BF16);
    }
}

fn main() {
    let mut report = Report::default();
    paged_attention(&mut report);
    println!();
    for (kernel, tol, worst) in &report.worst {
        println!("{kernel:<28} worst {worst:.2e} (tol {tol:.0e})");
    }
    println!("cuda kernels on the CPU: {} passed, {} failed", report.passed, report.failed);
    if report.failed > 0 {
        std::process::exit(1);
    }
}
