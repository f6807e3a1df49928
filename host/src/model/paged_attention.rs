//! Fused CPU attention over a paged KV cache: each query reads its
//! sequence's keys and values straight from the pools through the block
//! table (no gather, no copy), one block of keys at a time, with an online
//! softmax (Milakov & Gimelshein 2018; as FlashAttention and vLLM's
//! `paged_attention_v1` kernel). Grouped-query attention: query head `h`
//! reads kv head `h / (Hq / Hkv)`. Sums run in the input's float type (f32
//! or f64); rayon splits the work over tokens (and kv heads when the tokens
//! are too few to keep every thread busy), as
//! [`super::fused::attention()`] does over rows and heads. Inference only: no
//! backward.

use std::ops::Range;

use candle_core::{Storage, Tensor, WithDType};
use half::bf16;
use rayon::prelude::*;

use super::fused::Real;
use crate::{Error, Result};

/// One sequence of a [`super::paged::decode_paged`] call: its block table, its
/// length after the call (cached tokens plus `new`), and how many tokens the
/// call adds (their slots must already be in `blocks`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSeq {
    /// The sequence's block table: block ids in order of position.
    pub blocks: Vec<u32>,
    /// Length after the call: cached tokens plus `new`.
    pub len: usize,
    /// Tokens the call adds.
    pub new: usize,
}

/// The block tables of a call and where each new token sits.
pub struct Tables<'a> {
    /// The sequences of the call.
    pub seqs: &'a [PagedSeq],
    /// Per token: its sequence.
    pub row: &'a [u32],
    /// Per token: its position (it sees keys `0..=pos` of its sequence).
    pub pos: &'a [u32],
    /// Tokens per cache block.
    pub block_size: usize,
}

/// Attention of `q` `(1, Hq, T, D)` over pools `k`, `v` `(slots, Hkv, D)`
/// (contiguous, CPU, f32 or f64); returns `(1, T, Hq * D)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, tables: &Tables) -> Result<Tensor> {
    use candle_core::DType::{BF16, F32, F64};
    let (_, nq, t, d) = q.dims4()?;
    let q = q.contiguous()?;
    if k.dtype() != v.dtype() {
        return Err(Error::invalid(format!(
            "paged attention: key pool in {:?}, value pool in {:?}",
            k.dtype(),
            v.dtype()
        )));
    }
    let out = match (q.dtype(), k.dtype()) {
        (F32, F32) => Tensor::from_vec(run::<f32, f32>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?,
        (F32, BF16) => Tensor::from_vec(run::<f32, bf16>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?,
        (F64, F64) => Tensor::from_vec(run::<f64, f64>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?,
        (F64, BF16) => Tensor::from_vec(run::<f64, bf16>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?,
        (a, b) => {
            return Err(Error::invalid(format!(
                "paged attention: no CPU kernel for q in {a:?} over pools in {b:?}"
            )))
        }
    };
    Ok(out)
}

/// An element of the KV pools, read as the queries' float type `T`: the
/// same type, or bf16 widened (a pool kept in bf16 to halve the cache's
/// bytes, `rollout.engine.kv_cache_dtype`).
pub(crate) trait Elem<T>: WithDType {
    fn get(self) -> T;
}

impl<T: Real> Elem<T> for T {
    #[inline(always)]
    fn get(self) -> T {
        self
    }
}

impl Elem<f32> for bf16 {
    #[inline(always)]
    fn get(self) -> f32 {
        // bf16 is the top half of an f32: a shift widens it exactly.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Elem<f64> for bf16 {
    #[inline(always)]
    fn get(self) -> f64 {
        f64::from(f32::from_bits((self.to_bits() as u32) << 16))
    }
}

/// The contiguous CPU data of `t`.
fn host<T: WithDType, R>(t: &Tensor, what: &str, f: impl FnOnce(&[T]) -> Result<Vec<R>>) -> Result<Vec<R>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::invalid(format!("paged attention: {what} is not on the CPU")));
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        return Err(Error::invalid(format!("paged attention: {what} is not contiguous")));
    };
    f(&cpu.as_slice::<T>()?[a..b])
}

fn run<T: Real, K: Elem<T>>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    tables: &Tables,
    nq: usize,
) -> Result<Vec<T>> {
    let (nkv, d) = (k.dim(1)?, k.dim(2)?);
    if nkv == 0 || !nq.is_multiple_of(nkv) || v.dims() != k.dims() || q.dim(3)? != d {
        return Err(Error::invalid(format!(
            "paged attention: q {:?} against pools k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    host::<T, T>(q, "q", |qs| {
        host::<K, T>(k, "k pool", |ks| {
            host::<K, T>(v, "v pool", |vs| Ok(kernel(qs, ks, vs, tables, nq, nkv, d)))
        })
    })
}

/// The kernel proper: `q` `(Hq, T, D)`, pools `(slots, Hkv, D)`; returns
/// `(T, Hq, D)`. A task serves one token and a run of its kv heads, with
/// each kv head's `Hq / Hkv` query heads, so each key and value row is read
/// once for all of them (grouped-query attention reads half the cache this
/// way at Qwen3's 2:1).
///
/// Decoding long sequences streams the whole cache from memory every step,
/// so the kernel is bound by memory bandwidth, not arithmetic. A slot holds
/// its kv heads side by side (`(Hkv, D)`), so a task that takes all of a
/// token's kv heads reads each block as one contiguous run of memory, which
/// the hardware prefetchers stream at full bandwidth; a task per kv head
/// reads a `D`-wide stripe out of every `Hkv * D` and gets well under half
/// of it (13.0 GB/s sequential against 5.7 GB/s of used bytes for a 1-in-4
/// stripe, one core of this project's 2-core EPYC). So there is one task per
/// token whenever the tokens alone keep every thread busy, and one per
/// (token, kv head) otherwise (a single long sequence decoding). Either
/// split gives the same bits: each query head's sums run in the same order.
///
/// On x86-64 with AVX2 and FMA (checked once at run time) the same loop is
/// compiled for those features: 8-lane dot products and updates in `ymm`
/// registers instead of the SSE2 baseline's 4.
fn kernel<T: Real, K: Elem<T>>(
    q: &[T],
    k: &[K],
    v: &[K],
    tb: &Tables,
    nq: usize,
    nkv: usize,
    d: usize,
) -> Vec<T> {
    kernel_split(q, k, v, tb, (nq, nkv, d), heads_per_task(tb.row.len(), nkv))
}

/// Kv heads per task: all of them when the tokens alone give every thread
/// [`TASKS_PER_THREAD`] tasks, else one.
fn heads_per_task(tokens: usize, nkv: usize) -> usize {
    if tokens >= TASKS_PER_THREAD * rayon::current_num_threads() {
        nkv
    } else {
        1
    }
}

/// Tasks per thread that keep the threads evenly busy (sequences of unequal
/// lengths make unequal tasks).
const TASKS_PER_THREAD: usize = 4;

/// [`kernel`] with `span` kv heads per task (a divisor of `Hkv`).
fn kernel_split<T: Real, K: Elem<T>>(
    q: &[T],
    k: &[K],
    v: &[K],
    tb: &Tables,
    (nq, nkv, d): (usize, usize, usize),
    span: usize,
) -> Vec<T> {
    let t = tb.row.len();
    let g = nq / nkv;
    debug_assert!(span > 0 && nkv.is_multiple_of(span));
    let mut out = vec![T::from_f64(0.0); t * nq * d];
    let io = Io { q, k, v, tb, t, nq, nkv, d };
    let parts = nkv / span;
    // Task (token, run of kv heads) owns the `span * g * d` outputs of its
    // query heads: a contiguous chunk of the `(T, Hq, D)` output.
    out.par_chunks_mut(span * g * d).enumerate().for_each(|(c, acc)| {
        let heads = (c % parts) * span..(c % parts + 1) * span;
        #[cfg(target_arch = "x86_64")]
        if avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { task_avx2(&io, c / parts, heads, acc) };
        }
        task(&io, c / parts, heads, acc)
    });
    out
}

/// The inputs of one [`kernel`] call.
struct Io<'a, T, K> {
    q: &'a [T],
    k: &'a [K],
    v: &'a [K],
    tb: &'a Tables<'a>,
    t: usize,
    nq: usize,
    nkv: usize,
    d: usize,
}

/// True when the CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
}

/// [`task`] compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<T: Real, K: Elem<T>>(io: &Io<'_, T, K>, tok: usize, heads: Range<usize>, acc: &mut [T]) {
    task(io, tok, heads, acc)
}

/// Most query heads a task keeps its running maxima and sums for on the
/// stack (Qwen3 up to 14B has at most 40; more go to the heap).
const MAX_HEADS: usize = 64;

/// Lanes of the dot products' partial sums (one AVX2 register of f32).
const LANES: usize = 8;

/// Outputs of a head that the value pass keeps in registers at once (four
/// AVX2 registers of f32).
const CHUNK: usize = 32;

/// Token `tok`'s query heads of kv heads `heads`: `acc` `(heads, g, D)` gets
/// their attention over the token's sequence up to its position, one block
/// of keys at a time with an online softmax. The key pass reads a block in
/// memory order (slot by slot, and in a slot kv head by kv head), which
/// brings the block in from memory; the value pass then goes kv head by kv
/// head, each head's outputs held in registers over the block's slots.
#[inline(always)]
fn task<T: Real, K: Elem<T>>(io: &Io<'_, T, K>, tok: usize, heads: Range<usize>, acc: &mut [T]) {
    let Io { q, k, v, tb, t, nq, nkv, d } = *io;
    let (g, bs) = (nq / nkv, tb.block_size);
    // Query heads of the task, in output order: `heads.start * g ..`.
    let nh = heads.len() * g;
    let q0 = heads.start * g;
    let scale = T::from_f64(1.0 / (d as f64).sqrt());
    let seq = &tb.seqs[tb.row[tok] as usize];
    let limit = tb.pos[tok] as usize + 1;
    let zero = T::from_f64(0.0);
    let (mut ms, mut ls) = ([T::from_f64(f64::NEG_INFINITY); MAX_HEADS], [zero; MAX_HEADS]);
    let mut heap;
    let (m, l) = if nh <= MAX_HEADS {
        (&mut ms[..nh], &mut ls[..nh])
    } else {
        heap = (vec![T::from_f64(f64::NEG_INFINITY); nh], vec![zero; nh]);
        (&mut heap.0[..], &mut heap.1[..])
    };
    // Scores of one block, head-major: `(nh, bs)`.
    let mut scores = vec![zero; nh * bs];
    // Query head `h` of the task (global head `q0 + h`).
    let qh = |h: usize| &q[((q0 + h) * t + tok) * d..][..d];
    for (bi, &blk) in seq.blocks.iter().enumerate() {
        let start = bi * bs;
        if start >= limit {
            break;
        }
        let n = bs.min(limit - start);
        let row = |o: usize, kvh: usize| ((blk as usize * bs + o) * nkv + kvh) * d;
        for o in 0..n {
            for (j, kvh) in heads.clone().enumerate() {
                let kk = &k[row(o, kvh)..][..d];
                for h in j * g..(j + 1) * g {
                    scores[h * bs + o] = dot(qh(h), kk) * scale;
                }
            }
        }
        for h in 0..nh {
            let s = &mut scores[h * bs..h * bs + n];
            let m_new = s.iter().fold(m[h], |a, &x| a.fmax(x));
            // exp(-inf) = 0 on the first block: nothing accumulated yet.
            let corr = (m[h] - m_new).exp();
            l[h] *= corr;
            for a in acc[h * d..(h + 1) * d].iter_mut() {
                *a *= corr;
            }
            for x in s.iter_mut() {
                *x = (*x - m_new).exp();
                l[h] += *x;
            }
            m[h] = m_new;
        }
        // Values: a head's outputs, [`CHUNK`] at a time, stay in registers
        // over the block's slots.
        for (j, kvh) in heads.clone().enumerate() {
            for h in j * g..(j + 1) * g {
                let p = &scores[h * bs..h * bs + n];
                let out = &mut acc[h * d..(h + 1) * d];
                let mut c0 = 0;
                while c0 + CHUNK <= d {
                    let mut r: [T; CHUNK] = out[c0..c0 + CHUNK].try_into().expect("CHUNK outputs");
                    for (o, &p) in p.iter().enumerate() {
                        let vv = &v[row(o, kvh) + c0..][..CHUNK];
                        for i in 0..CHUNK {
                            r[i] += p * vv[i].get();
                        }
                    }
                    out[c0..c0 + CHUNK].copy_from_slice(&r);
                    c0 += CHUNK;
                }
                for (o, &p) in p.iter().enumerate() {
                    for (a, &x) in out[c0..].iter_mut().zip(&v[row(o, kvh) + c0..row(o, kvh) + d]) {
                        *a += p * x.get();
                    }
                }
            }
        }
    }
    for h in 0..nh {
        let inv = T::from_f64(1.0) / l[h];
        for a in acc[h * d..(h + 1) * d].iter_mut() {
            *a *= inv;
        }
    }
}

/// `sum_i a_i b_i` as [`LANES`] partial sums (independent chains the
/// compiler keeps in one vector register) added in a fixed order.
#[inline(always)]
fn dot<T: Real, K: Elem<T>>(a: &[T], b: &[K]) -> T {
    let mut acc = [T::from_f64(0.0); LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i].get();
        }
    }
    let mut s = acc.iter().fold(T::from_f64(0.0), |s, &x| s + x);
    for (&x, &y) in ar.iter().zip(br) {
        s += x * y.get();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic value in [-1, 1).
    fn rnd(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// Softmax attention of every token over its sequence up to its position,
    /// in f64, reading the pools through the block tables one key at a time.
    fn reference<K: Elem<f32> + Copy>(
        q: &[f32],
        k: &[K],
        v: &[K],
        tb: &Tables,
        (nq, nkv, d): (usize, usize, usize),
    ) -> Vec<f64> {
        let (t, g, bs) = (tb.row.len(), nq / nkv, tb.block_size);
        let mut out = vec![0.0; t * nq * d];
        for tok in 0..t {
            let seq = &tb.seqs[tb.row[tok] as usize];
            let keys = tb.pos[tok] as usize + 1;
            for h in 0..nq {
                let kvh = h / g;
                let slot = |p: usize| ((seq.blocks[p / bs] as usize * bs + p % bs) * nkv + kvh) * d;
                let qh = &q[(h * t + tok) * d..][..d];
                let s: Vec<f64> = (0..keys)
                    .map(|p| {
                        let dot: f64 =
                            (0..d).map(|i| f64::from(qh[i]) * f64::from(k[slot(p) + i].get())).sum();
                        dot / (d as f64).sqrt()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                for (p, x) in s.iter().enumerate() {
                    let w = (x - mx).exp() / z;
                    for i in 0..d {
                        out[(tok * nq + h) * d + i] += w * f64::from(v[slot(p) + i].get());
                    }
                }
            }
        }
        out
    }

    /// Three sequences of ragged lengths in scattered blocks of a 4-slot
    /// block size: two decoding one token, one prefilling five.
    fn case() -> (Vec<PagedSeq>, Vec<u32>, Vec<u32>) {
        let seqs = vec![
            PagedSeq { blocks: vec![7, 2, 9], len: 10, new: 1 },
            PagedSeq { blocks: vec![0], len: 3, new: 1 },
            PagedSeq { blocks: vec![4, 1, 8, 3], len: 13, new: 5 },
        ];
        let mut row = vec![0, 1];
        let mut pos = vec![9, 2];
        for p in 8..13 {
            row.push(2);
            pos.push(p);
        }
        (seqs, row, pos)
    }

    /// A task per token and a task per (token, kv head) read the blocks in
    /// another order but sum every head in the same order: the same bits,
    /// and both within f32 rounding of the f64 softmax, for f32 and bf16
    /// pools and for 1 to 4 query heads per kv head.
    #[test]
    fn every_split_gives_the_same_bits_as_the_f64_reference() {
        let (seqs, row, pos) = case();
        let tb = Tables { seqs: &seqs, row: &row, pos: &pos, block_size: 4 };
        let (slots, d) = (10 * 4, 20);
        for (nq, nkv) in [(4, 4), (8, 4), (6, 2), (4, 1)] {
            let mut seed = (nq * 31 + nkv) as u64;
            let t = row.len();
            let q: Vec<f32> = (0..nq * t * d).map(|_| rnd(&mut seed) as f32).collect();
            let k: Vec<f32> = (0..slots * nkv * d).map(|_| (2.0 * rnd(&mut seed)) as f32).collect();
            let v: Vec<f32> = (0..slots * nkv * d).map(|_| rnd(&mut seed) as f32).collect();
            let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
            let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let want = reference(&q, &k, &v, &tb, (nq, nkv, d));
            let want_b = reference(&q, &kb, &vb, &tb, (nq, nkv, d));
            let spans: Vec<usize> = (1..=nkv).filter(|s| nkv.is_multiple_of(*s)).collect();
            let first = kernel_split(&q, &k, &v, &tb, (nq, nkv, d), spans[0]);
            let first_b = kernel_split(&q, &kb, &vb, &tb, (nq, nkv, d), spans[0]);
            for &span in &spans {
                let got = kernel_split(&q, &k, &v, &tb, (nq, nkv, d), span);
                let got_b = kernel_split(&q, &kb, &vb, &tb, (nq, nkv, d), span);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&first), "f32 pools, {nq}:{nkv} heads, {span} kv heads per task");
                assert_eq!(
                    bits(&got_b),
                    bits(&first_b),
                    "bf16 pools, {nq}:{nkv} heads, {span} kv heads per task"
                );
                for (got, want) in [(&got, &want), (&got_b, &want_b)] {
                    let worst =
                        got.iter().zip(want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max);
                    assert!(worst < 1e-5, "{nq}:{nkv} heads, span {span}: off by {worst}");
                }
            }
            // The chosen split is one of these.
            let chosen = kernel(&q, &k, &v, &tb, nq, nkv, d);
            assert_eq!(chosen, first, "{nq}:{nkv} heads");
        }
    }

    /// Tokens few enough to leave threads idle get a task per kv head.
    #[test]
    fn few_tokens_split_over_kv_heads() {
        let threads = rayon::current_num_threads();
        assert_eq!(heads_per_task(1, 8), 1);
        assert_eq!(heads_per_task(TASKS_PER_THREAD * threads - 1, 8), 1);
        assert_eq!(heads_per_task(TASKS_PER_THREAD * threads, 8), 8);
    }
}
