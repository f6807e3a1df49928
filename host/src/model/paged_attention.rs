//! Fused CPU attention over a paged KV cache: each query reads its
//! sequence's keys and values straight from the pools through the block
//! table (no gather, no copy), one block of keys at a time, with an online
//! softmax (Milakov & Gimelshein 2018; as FlashAttention and vLLM's
//! `paged_attention_v1` kernel). Grouped-query attention: query head `h`
//! reads kv head `h / (Hq / Hkv)`. Sums run in the input's float type (f32
//! or f64); rayon splits the work over tokens x query heads, as
//! [`super::fused::attention()`] does over rows and heads. Inference only: no
//! backward.

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
/// `(T, Hq, D)`. One task per (token, kv head) serves that kv head's `Hq /
/// Hkv` query heads, so each key and value row is read once for all of them
/// (grouped-query attention reads half the cache this way at Qwen3's 2:1).
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
    let t = tb.row.len();
    let g = nq / nkv;
    let mut out = vec![T::from_f64(0.0); t * nq * d];
    let io = Io { q, k, v, tb, t, nq, nkv, d };
    // Task (token, kv head) owns the `g * d` outputs of its query heads: a
    // contiguous chunk of the `(T, Hq, D)` output.
    out.par_chunks_mut(g * d).enumerate().for_each(|(c, acc)| {
        #[cfg(target_arch = "x86_64")]
        if avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { task_avx2(&io, c / nkv, c % nkv, acc) };
        }
        task(&io, c / nkv, c % nkv, acc)
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
unsafe fn task_avx2<T: Real, K: Elem<T>>(io: &Io<'_, T, K>, tok: usize, kvh: usize, acc: &mut [T]) {
    task(io, tok, kvh, acc)
}

/// Most query heads per kv head a task keeps its running maxima and sums for
/// on the stack (Qwen3 has 2; more go to the heap).
const MAX_GROUP: usize = 8;

/// Lanes of the dot products' partial sums (one AVX2 register of f32).
const LANES: usize = 8;

/// Token `tok`'s query heads of kv head `kvh`: `acc` `(g, D)` gets their
/// attention over the token's sequence up to its position, one block of keys
/// at a time with an online softmax.
#[inline(always)]
fn task<T: Real, K: Elem<T>>(io: &Io<'_, T, K>, tok: usize, kvh: usize, acc: &mut [T]) {
    let Io { q, k, v, tb, t, nq, nkv, d } = *io;
    let (g, bs) = (nq / nkv, tb.block_size);
    let scale = T::from_f64(1.0 / (d as f64).sqrt());
    let seq = &tb.seqs[tb.row[tok] as usize];
    let limit = tb.pos[tok] as usize + 1;
    let zero = T::from_f64(0.0);
    let (mut ms, mut ls) = ([T::from_f64(f64::NEG_INFINITY); MAX_GROUP], [zero; MAX_GROUP]);
    let mut heap;
    let (m, l) = if g <= MAX_GROUP {
        (&mut ms[..g], &mut ls[..g])
    } else {
        heap = (vec![T::from_f64(f64::NEG_INFINITY); g], vec![zero; g]);
        (&mut heap.0[..], &mut heap.1[..])
    };
    // Scores of one block, head-major: `(g, bs)`.
    let mut scores = vec![zero; g * bs];
    let qh = |h: usize| &q[((kvh * g + h) * t + tok) * d..][..d];
    for (bi, &blk) in seq.blocks.iter().enumerate() {
        let start = bi * bs;
        if start >= limit {
            break;
        }
        let n = bs.min(limit - start);
        let row = |o: usize| ((blk as usize * bs + o) * nkv + kvh) * d;
        for o in 0..n {
            let kk = &k[row(o)..][..d];
            for h in 0..g {
                scores[h * bs + o] = dot(qh(h), kk) * scale;
            }
        }
        for h in 0..g {
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
        for o in 0..n {
            let vv = &v[row(o)..][..d];
            for h in 0..g {
                let p = scores[h * bs + o];
                for (a, &x) in acc[h * d..(h + 1) * d].iter_mut().zip(vv) {
                    *a += p * x.get();
                }
            }
        }
    }
    for h in 0..g {
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
