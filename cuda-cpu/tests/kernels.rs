//! Every CUDA C kernel of `host/src/model/cuda/` run on the CPU (the
//! `cuda-cpu` emulation) against stapo's CPU path, on shapes chosen to hit
//! the kernels' edges: odd sizes, block boundaries, shared blocks, bf16.
//! One line per case with the largest error relative to the largest value of
//! the reference, then `cuda kernels on the CPU: K passed, F failed`. Exits
//! with 1 when a case fails.

use candle_core::{DType, Device, Tensor, Var};
use cuda_cpu::{PagedShape, SampleParams};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng};
use stapo::model::fused;
use stapo::model::paged_attention::{self, PagedSeq, Tables};
use stapo::rollout::{Sampler, SamplingParams};

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
        let err =
            got.iter()
                .zip(want)
                .fold(0f64, |m, (g, w)| if g.is_finite() { m.max((g - w).abs()) } else { f64::INFINITY });
        let rel = err / scale;
        let ok = rel <= tol && !got.is_empty();
        println!(
            "{kernel:<28} {case:<58} max err {rel:.2e} of max |ref| {scale:.3} (tol {tol:.0e}) {}",
            if ok { "ok" } else { "FAILED" }
        );
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
        self.record(kernel, tol, rel);
    }

    /// Records `same` of `of` exact matches (drawn tokens): all must match.
    fn same(&mut self, kernel: &str, case: &str, same: usize, of: usize) {
        let ok = same == of;
        println!("{kernel:<28} {case:<58} {same} of {of} the same {}", if ok { "ok" } else { "FAILED" });
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }

    fn record(&mut self, kernel: &str, tol: f64, rel: f64) {
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
    rms_norm(&mut report);
    swiglu(&mut report);
    swiglu_rows(&mut report);
    norm_rope(&mut report);
    norm_rope_write_kv(&mut report);
    fused_qkv_rows(&mut report);
    logp_entropy(&mut report);
    sample(&mut report);
    println!();
    for (kernel, tol, worst) in &report.worst {
        println!("{kernel:<28} worst {worst:.2e} (tol {tol:.0e})");
    }
    println!("cuda kernels on the CPU: {} passed, {} failed", report.passed, report.failed);
    if report.failed > 0 {
        std::process::exit(1);
    }
}

/// `x` as a CPU tensor of `shape`.
fn t32(x: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(x, shape, &Device::Cpu).unwrap()
}

/// The values of `t`, as f64.
fn vals(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
}

/// `x` rounded to bf16 and widened back: the values a bf16 kernel sees.
fn bf16_round(x: &[f32]) -> Vec<f32> {
    widen(&to_bf16(x))
}

/// RMSNorm alone and after a residual add, against the fused CPU RMSNorm
/// (`model::fused::rms_norm`): rows of 1, 3 and 7 widths from 16 to 1000
/// (not multiples of the block's threads), in f32 and bf16.
fn rms_norm(report: &mut Report) {
    let eps = 1e-6f32;
    for (rows, n) in [(1usize, 16usize), (3, 257), (7, 1000), (2, 1024), (5, 33)] {
        let mut rng = Rng(100 + n as u64);
        let x = rng.vec(rows * n, 2.0);
        let r = rng.vec(rows * n, 1.0);
        let w = rng.vec(n, 1.5);
        let cpu = |x: &[f32], w: &[f32]| {
            vals(&fused::rms_norm(&t32(x, &[rows, n]), &t32(w, &[n]), f64::from(eps)).unwrap())
        };
        let case = format!("{rows} rows of {n}");
        report.check("rms_norm_f32", &case, &f64s(&cuda_cpu::rms_norm(&x, &w, eps)), &cpu(&x, &w), TOL_F32);
        let (xb, rb, wb) = (to_bf16(&x), to_bf16(&r), to_bf16(&w));
        let got = widen(&cuda_cpu::rms_norm(&xb, &wb, eps));
        report.check("rms_norm_bf16", &case, &f64s(&got), &cpu(&widen(&xb), &widen(&wb)), TOL_BF16);

        let sum: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
        let (h, y) = cuda_cpu::add_rms_norm(&x, &r, &w, eps);
        report.check("add_rms_norm_f32 (sum)", &case, &f64s(&h), &f64s(&sum), TOL_F32);
        report.check("add_rms_norm_f32 (norm)", &case, &f64s(&y), &cpu(&sum, &w), TOL_F32);
        // bf16: the sum is rounded to bf16 (as a bf16 add leaves it) before the norm.
        let sum_b: Vec<f32> = widen(&xb).iter().zip(widen(&rb)).map(|(a, b)| a + b).collect();
        let (h, y) = cuda_cpu::add_rms_norm(&xb, &rb, &wb, eps);
        report.check("add_rms_norm_bf16 (sum)", &case, &f64s(&widen(&h)), &f64s(&sum_b), TOL_BF16);
        let want = cpu(&bf16_round(&sum_b), &widen(&wb));
        report.check("add_rms_norm_bf16 (norm)", &case, &f64s(&widen(&y)), &want, TOL_BF16);
    }
}

/// SwiGLU against the fused CPU kernel (`model::fused::swiglu`): sizes below
/// a block, odd, and past the grid's first pass.
fn swiglu(report: &mut Report) {
    for n in [1usize, 31, 1000, 4099, 70_000] {
        let mut rng = Rng(200 + n as u64);
        let g = rng.vec(n, 6.0);
        let u = rng.vec(n, 2.0);
        let want = vals(&fused::swiglu(&t32(&g, &[n]), &t32(&u, &[n])).unwrap());
        let case = format!("{n} elements");
        report.check("swiglu_f32", &case, &f64s(&cuda_cpu::swiglu(&g, &u)), &want, TOL_F32);
        let (gb, ub) = (to_bf16(&g), to_bf16(&u));
        let want = vals(&fused::swiglu(&t32(&widen(&gb), &[n]), &t32(&widen(&ub), &[n])).unwrap());
        report.check("swiglu_bf16", &case, &f64s(&widen(&cuda_cpu::swiglu(&gb, &ub))), &want, TOL_BF16);
    }
}

/// SwiGLU over the rows of one product over `[Wgate; Wup]` (each row's
/// gate, then its up) against the fused CPU kernel on the two halves copied
/// out: one row and several, odd widths, rows wider than a block.
fn swiglu_rows(report: &mut Report) {
    for (rows, cols) in [(1usize, 1usize), (3, 31), (7, 1000), (2, 4099), (5, 3)] {
        let mut rng = Rng(250 + (rows * cols) as u64);
        let gu = rng.vec(rows * 2 * cols, 6.0);
        let half = |gu: &[f32], at: usize| -> Vec<f32> {
            (0..rows).flat_map(|r| gu[r * 2 * cols + at..r * 2 * cols + at + cols].to_vec()).collect()
        };
        let cpu = |gu: &[f32]| {
            let n = [rows, cols];
            vals(&fused::swiglu(&t32(&half(gu, 0), &n), &t32(&half(gu, cols), &n)).unwrap())
        };
        let case = format!("{rows} rows of gate and up of {cols}");
        report.check(
            "swiglu_f32 (fused gate/up rows)",
            &case,
            &f64s(&cuda_cpu::swiglu_rows(&gu, cols)),
            &cpu(&gu),
            TOL_F32,
        );
        let gb = to_bf16(&gu);
        let got = widen(&cuda_cpu::swiglu_rows(&gb, cols));
        report.check("swiglu_bf16 (fused gate/up rows)", &case, &f64s(&got), &cpu(&widen(&gb)), TOL_BF16);
    }
}

/// Rotary tables `(B, L, D/2)` of positions `pos` (as the model's, with base 1e6).
fn rotary(pos: &[usize], d: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut c, mut s) = (vec![], vec![]);
    for &p in pos {
        for j in 0..d / 2 {
            let a = p as f64 / 1e6f64.powf(2.0 * j as f64 / d as f64);
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    (c, s)
}

/// The fused CPU norm + rope (`model::fused::norm_rope`) of `x` `(B, L, H, D)`:
/// `(B, H, L, D)`.
fn cpu_norm_rope(
    x: &[f32],
    w: &[f32],
    cs: (&[f32], &[f32]),
    (b, l, h, d): (usize, usize, usize, usize),
) -> Vec<f64> {
    let cos = t32(cs.0, &[b, 1, l, d / 2]);
    let sin = t32(cs.1, &[b, 1, l, d / 2]);
    vals(&fused::norm_rope(&t32(x, &[b, l, h * d]), h, &t32(w, &[d]), (&cos, &sin), 1e-6).unwrap())
}

/// Per-head RMSNorm + rotary embedding against the fused CPU kernel: head
/// dims 64, 128, 72, 6 and 512 (several pairs per thread), 1 to 5 heads.
fn norm_rope(report: &mut Report) {
    for (b, l, h, d) in
        [(1usize, 1usize, 4usize, 64usize), (2, 5, 3, 128), (1, 13, 2, 72), (3, 2, 5, 6), (1, 3, 2, 512)]
    {
        let mut rng = Rng(300 + d as u64);
        let x = rng.vec(b * l * h * d, 2.0);
        let w = rng.vec(d, 1.5);
        let pos: Vec<usize> = (0..b * l).map(|i| 7 * i + 3).collect();
        let (c, s) = rotary(&pos, d);
        let case = format!("B {b}, L {l}, {h} heads of {d}");
        let want = cpu_norm_rope(&x, &w, (&c, &s), (b, l, h, d));
        let got = cuda_cpu::norm_rope(&x, &w, &c, &s, (b, l, h, d), 1e-6);
        report.check("norm_rope_f32", &case, &f64s(&got), &want, TOL_F32);
        let (xb, wb, cb, sb) = (to_bf16(&x), to_bf16(&w), to_bf16(&c), to_bf16(&s));
        let want = cpu_norm_rope(&widen(&xb), &widen(&wb), (&widen(&cb), &widen(&sb)), (b, l, h, d));
        let got = widen(&cuda_cpu::norm_rope(&xb, &wb, &cb, &sb, (b, l, h, d), 1e-6));
        report.check("norm_rope_bf16", &case, &f64s(&got), &want, TOL_BF16);
    }
}

/// Keys normed, rotated and written with the values into their cache slots,
/// against the fused CPU norm + rope and a write by hand; the whole pools are
/// compared, so a write to a wrong slot fails too. Slots scattered over
/// blocks, the last slot of a block and the first of the next, f32 and bf16
/// pools.
fn norm_rope_write_kv(report: &mut Report) {
    for (t, h, d, slots_in_pool, slots) in [
        (3usize, 2usize, 64usize, 48usize, vec![15u32, 16, 40]),
        (5, 8, 128, 64, vec![7, 8, 9, 63, 0]),
        (1, 1, 72, 10, vec![9]),
        (4, 3, 6, 12, vec![2, 3, 4, 11]),
    ] {
        let mut rng = Rng(400 + d as u64);
        let k = rng.vec(t * h * d, 2.0);
        let v = rng.vec(t * h * d, 1.0);
        let w = rng.vec(d, 1.5);
        let pos: Vec<usize> = slots.iter().map(|&s| s as usize * 3 + 1).collect();
        let (c, s) = rotary(&pos, d);
        let pool0 = rng.vec(slots_in_pool * h * d, 1.0);
        // The expected pools: the roped keys `(1, H, T, D)` and the values at each token's slot.
        let expect = |k: &[f32], v: &[f32], w: &[f32], cs: (&[f32], &[f32]), pool: &[f32]| {
            let roped = cpu_norm_rope(k, w, cs, (1, t, h, d));
            let (mut pk, mut pv): (Vec<f64>, Vec<f64>) = (f64s(pool), f64s(pool));
            for (tok, &slot) in slots.iter().enumerate() {
                for hh in 0..h {
                    for j in 0..d {
                        let dst = (slot as usize * h + hh) * d + j;
                        pk[dst] = roped[(hh * t + tok) * d + j];
                        pv[dst] = f64::from(v[(tok * h + hh) * d + j]);
                    }
                }
            }
            (pk, pv)
        };
        let case = format!("{t} tokens, {h} heads of {d}, slots {slots:?}");
        let (mut pk, mut pv) = (pool0.clone(), pool0.clone());
        cuda_cpu::norm_rope_write_kv(&k, &v, &w, &c, &s, &slots, (&mut pk, &mut pv), (h, d), 1e-6);
        let (wk, wv) = expect(&k, &v, &w, (&c, &s), &pool0);
        report.check("norm_rope_write_kv_f32 (k)", &case, &f64s(&pk), &wk, TOL_F32);
        report.check("norm_rope_write_kv_f32 (v)", &case, &f64s(&pv), &wv, TOL_F32);

        let pool_b = to_bf16(&pool0);
        let (mut pk, mut pv) = (pool_b.clone(), pool_b.clone());
        cuda_cpu::norm_rope_write_kv(&k, &v, &w, &c, &s, &slots, (&mut pk, &mut pv), (h, d), 1e-6);
        let (wk, wv) = expect(&k, &v, &w, (&c, &s), &widen(&pool_b));
        report.check("norm_rope_write_kv_f32_bf16pool (k)", &case, &f64s(&widen(&pk)), &wk, TOL_BF16);
        report.check("norm_rope_write_kv_f32_bf16pool (v)", &case, &f64s(&widen(&pv)), &wv, TOL_BF16);

        let (kb, vb, wb, cb, sb) = (to_bf16(&k), to_bf16(&v), to_bf16(&w), to_bf16(&c), to_bf16(&s));
        let (mut pk, mut pv) = (pool_b.clone(), pool_b.clone());
        cuda_cpu::norm_rope_write_kv(&kb, &vb, &wb, &cb, &sb, &slots, (&mut pk, &mut pv), (h, d), 1e-6);
        let (wk, wv) =
            expect(&widen(&kb), &widen(&vb), &widen(&wb), (&widen(&cb), &widen(&sb)), &widen(&pool_b));
        report.check("norm_rope_write_kv_bf16 (k)", &case, &f64s(&widen(&pk)), &wk, TOL_BF16);
        report.check("norm_rope_write_kv_bf16 (v)", &case, &f64s(&widen(&pv)), &wv, TOL_BF16);
    }
}

/// The queries' norm + rope and the keys' with the cache write, each read
/// from the rows of one product over `[Wq; Wk; Wv]` `(T, (Hq + 2 Hkv) D)`
/// by offset and row stride (no copy of q, k or v out of it), against the
/// fused CPU norm + rope of the q, k and v copied out and a write by hand:
/// head dims 6, 72, 128 and 256, odd numbers of heads, grouped queries,
/// scattered slots, f32 and bf16.
fn fused_qkv_rows(report: &mut Report) {
    for (t, hq, hkv, d, slots_in_pool, slots) in [
        (3usize, 4usize, 2usize, 64usize, 40usize, vec![7u32, 8, 31]),
        (1, 3, 1, 6, 5, vec![4]),
        (5, 7, 1, 72, 20, vec![0, 19, 3, 4, 5]),
        (2, 5, 5, 128, 8, vec![6, 1]),
        (4, 2, 1, 256, 9, vec![8, 2, 3, 0]),
    ] {
        let stride = (hq + 2 * hkv) * d;
        let mut rng = Rng(600 + d as u64 + t as u64);
        let qkv = rng.vec(t * stride, 2.0);
        let (wq, wk) = (rng.vec(d, 1.5), rng.vec(d, 1.5));
        let pos: Vec<usize> = slots.iter().map(|&s| s as usize * 5 + 2).collect();
        let (c, s) = rotary(&pos, d);
        let pool0 = rng.vec(slots_in_pool * hkv * d, 1.0);
        // The columns [at, at + w) of every row, copied out.
        let cols = |x: &[f32], at: usize, w: usize| -> Vec<f32> {
            (0..t).flat_map(|r| x[r * stride + at..r * stride + at + w].to_vec()).collect()
        };
        let (kq, kk, kv) = (0, hq * d, (hq + hkv) * d);
        let expect = |x: &[f32], wq: &[f32], wk: &[f32], cs: (&[f32], &[f32]), pool: &[f32]| {
            let q = cpu_norm_rope(&cols(x, kq, hq * d), wq, cs, (1, t, hq, d));
            let roped = cpu_norm_rope(&cols(x, kk, hkv * d), wk, cs, (1, t, hkv, d));
            let v = cols(x, kv, hkv * d);
            let (mut pk, mut pv): (Vec<f64>, Vec<f64>) = (f64s(pool), f64s(pool));
            for (tok, &slot) in slots.iter().enumerate() {
                for hh in 0..hkv {
                    for j in 0..d {
                        let dst = (slot as usize * hkv + hh) * d + j;
                        pk[dst] = roped[(hh * t + tok) * d + j];
                        pv[dst] = f64::from(v[(tok * hkv + hh) * d + j]);
                    }
                }
            }
            (q, pk, pv)
        };
        let case = format!("{t} tokens, {hq} query and {hkv} kv heads of {d}, slots {slots:?}");
        let got_q = cuda_cpu::norm_rope_rows(&qkv, (kq, stride), &wq, &c, &s, (1, t, hq, d), 1e-6);
        let (mut pk, mut pv) = (pool0.clone(), pool0.clone());
        let at = (kk, kv, stride);
        cuda_cpu::norm_rope_write_kv_rows(&qkv, at, &wk, &c, &s, &slots, (&mut pk, &mut pv), (hkv, d), 1e-6);
        let (wantq, wantk, wantv) = expect(&qkv, &wq, &wk, (&c, &s), &pool0);
        report.check("norm_rope_f32 (q of fused q/k/v rows)", &case, &f64s(&got_q), &wantq, TOL_F32);
        report.check("norm_rope_write_kv_f32 (k of fused rows)", &case, &f64s(&pk), &wantk, TOL_F32);
        report.check("norm_rope_write_kv_f32 (v of fused rows)", &case, &f64s(&pv), &wantv, TOL_F32);

        let (xb, wqb, wkb, cb, sb) = (to_bf16(&qkv), to_bf16(&wq), to_bf16(&wk), to_bf16(&c), to_bf16(&s));
        let pool_b = to_bf16(&pool0);
        let got_q = widen(&cuda_cpu::norm_rope_rows(&xb, (kq, stride), &wqb, &cb, &sb, (1, t, hq, d), 1e-6));
        let (mut pk, mut pv) = (pool_b.clone(), pool_b.clone());
        cuda_cpu::norm_rope_write_kv_rows(
            &xb,
            at,
            &wkb,
            &cb,
            &sb,
            &slots,
            (&mut pk, &mut pv),
            (hkv, d),
            1e-6,
        );
        let (wantq, wantk, wantv) =
            expect(&widen(&xb), &widen(&wqb), &widen(&wkb), (&widen(&cb), &widen(&sb)), &widen(&pool_b));
        report.check("norm_rope_bf16 (q of fused q/k/v rows)", &case, &f64s(&got_q), &wantq, TOL_BF16);
        report.check(
            "norm_rope_write_kv_bf16 (k of fused rows)",
            &case,
            &f64s(&widen(&pk)),
            &wantk,
            TOL_BF16,
        );
        report.check(
            "norm_rope_write_kv_bf16 (v of fused rows)",
            &case,
            &f64s(&widen(&pv)),
            &wantv,
            TOL_BF16,
        );
    }
}

/// The log-softmax statistics and their backward, a vocabulary tile at a
/// time (tiles of 1, 37, 256 columns and the whole row), against the fused
/// CPU kernel (`model::fused::logprob_entropy`) and its autograd backward.
fn logp_entropy(report: &mut Report) {
    for (rows, vocab, scale) in [(3usize, 50usize, 5.0f64), (5, 1000, 3.0), (2, 4099, 20.0), (1, 7, 1.0)] {
        let mut rng = Rng(500 + vocab as u64);
        let mut x = rng.vec(rows * vocab, scale);
        // A masked logit (-inf: probability 0) in the first row.
        x[vocab / 2] = f32::NEG_INFINITY;
        let targets: Vec<u32> =
            (0..rows).map(|r| ((r * 7919 + 3) % vocab) as u32).filter(|&t| t as usize != vocab / 2).collect();
        let targets = if targets.len() == rows { targets } else { (0..rows as u32).collect() };
        let gl = rng.vec(rows, 1.0);
        let ge = rng.vec(rows, 1.0);
        let dres: Vec<f32> = (0..rows).flat_map(|r| [gl[r], ge[r], 0.0]).collect();
        // The CPU path, forward and backward.
        let cpu = |x: &[f32]| -> (Vec<f64>, Vec<f64>) {
            let xv = Var::from_tensor(&t32(x, &[rows, vocab])).unwrap();
            let tt = Tensor::from_slice(&targets, rows, &Device::Cpu).unwrap();
            let (lp, ent) = fused::logprob_entropy(xv.as_tensor(), &tt).unwrap();
            let loss = ((lp * t32(&gl, &[rows])).unwrap().sum_all().unwrap()
                + (ent.clone() * t32(&ge, &[rows])).unwrap().sum_all().unwrap())
            .unwrap();
            let grads = loss.backward().unwrap();
            let lp = fused::logprob_entropy(xv.as_tensor(), &tt).unwrap().0;
            let fwd: Vec<f64> = vals(&lp).into_iter().zip(vals(&ent)).flat_map(|(a, b)| [a, b]).collect();
            (fwd, vals(grads.get(xv.as_tensor()).unwrap()))
        };
        let pick = |out: &[f32]| -> Vec<f64> {
            (0..rows).flat_map(|r| [f64::from(out[3 * r]), f64::from(out[3 * r + 1])]).collect()
        };
        let (want, want_dx) = cpu(&x);
        let xb = to_bf16(&x);
        let (want_b, want_dx_b) = cpu(&widen(&xb));
        for tile in [1usize, 37, 256, vocab] {
            if tile == 1 && vocab > 100 {
                continue; // one launch per column: slow in the emulator, covered by the small rows
            }
            let case = format!("{rows} rows of {vocab}, tiles of {tile}");
            let out = cuda_cpu::logp_entropy(&x, vocab, &targets, tile);
            report.check("logp_entropy_f32 (fwd)", &case, &f64s(&pick(&out)), &want, TOL_F32);
            let dx = cuda_cpu::logp_entropy_bwd(&x, vocab, &targets, &out, &dres, tile);
            report.check("logp_entropy_f32 (bwd)", &case, &f64s(&dx), &want_dx, TOL_F32);
            let out = cuda_cpu::logp_entropy(&xb, vocab, &targets, tile);
            report.check("logp_entropy_bf16 (fwd)", &case, &f64s(&pick(&out)), &want_b, TOL_BF16);
            let dx = cuda_cpu::logp_entropy_bwd(&xb, vocab, &targets, &out, &dres, tile);
            report.check("logp_entropy_bf16 (bwd)", &case, &f64s(&widen(&dx)), &want_dx_b, TOL_BF16);
        }
    }
}

/// On-device sampling against the host sampler (`rollout::Sampler::draw`):
/// each row's uniform number is the one the host draws from the same
/// generator, so both must pick the same token; log-probs, raw log-probs and
/// entropies within f32 rounding. Temperatures 1, 0.7 and 0 (greedy), top-k,
/// top-p, min-p and their mix, ties (equal logits), a masked token.
fn sample(report: &mut Report) {
    let (rows, vocab) = (24usize, 1000usize);
    let mut rng = Rng(600);
    let mut logits = rng.vec(rows * vocab, 4.0);
    // Ties: in row 1, 40 tokens share the largest logit; row 2 is flat.
    for i in 0..40 {
        logits[vocab + i * 7] = 9.0;
    }
    logits[2 * vocab..3 * vocab].fill(0.5);
    logits[3 * vocab + 5] = f32::NEG_INFINITY;
    let settings: [(f64, Option<usize>, f64, f64); 9] = [
        (1.0, None, 1.0, 0.0),
        (0.7, None, 1.0, 0.0),
        (0.0, None, 1.0, 0.0),
        (1.0, Some(50), 1.0, 0.0),
        (0.8, None, 0.9, 0.0),
        (1.0, None, 1.0, 0.05),
        (0.6, Some(20), 0.8, 0.1),
        (1.3, Some(1), 1.0, 0.0),
        (1.0, Some(999), 0.5, 0.0),
    ];
    for (si, &(temperature, top_k, top_p, min_p)) in settings.iter().enumerate() {
        let sampler =
            Sampler::new(&SamplingParams { temperature, top_p, top_k, min_p, ..SamplingParams::default() });
        for round in 0..3u64 {
            let mut gens: Vec<StdRng> =
                (0..rows).map(|r| StdRng::seed_from_u64(1000 * si as u64 + 100 * round + r as u64)).collect();
            // The uniform number the host draws (greedy draws none).
            let uniforms: Vec<f64> = gens.iter().map(|g| g.clone().random::<f64>()).collect();
            let params = SampleParams {
                inv_t: if temperature == 0.0 { 0.0 } else { (1.0 / temperature) as f32 },
                top_k: top_k.unwrap_or(0),
                top_p,
                min_p,
            };
            let out = cuda_cpu::sample(&logits, vocab, &uniforms, params);
            let (mut want, mut got, mut same) = (vec![], vec![], 0usize);
            for (r, g) in gens.iter_mut().enumerate() {
                let d = sampler.draw(&logits[r * vocab..(r + 1) * vocab], g).expect("host draw");
                same += usize::from(f64::from(d.id) == f64::from(out[4 * r + 3]));
                want.extend([f64::from(d.logprob), f64::from(d.logprob_raw), f64::from(d.entropy)]);
                got.extend(out[4 * r..4 * r + 3].iter().map(|&v| f64::from(v)));
            }
            let case =
                format!("T {temperature}, top-k {top_k:?}, top-p {top_p}, min-p {min_p}, round {round}");
            report.same("sample_rows (ids)", &case, same, rows);
            report.check("sample_rows (logprobs)", &case, &got, &want, TOL_F32);
        }
    }
}
