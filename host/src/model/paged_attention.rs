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
use rayon::prelude::*;

use super::fused::Real;
use crate::{Error, Result};

/// One sequence of a [`super::Qwen3::decode_paged`] call: its block table, its
/// length after the call (cached tokens plus `new`), and how many tokens the
/// call adds (their slots must already be in `blocks`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedSeq {
    pub blocks: Vec<u32>,
    pub len: usize,
    pub new: usize,
}

/// The block tables of a call and where each new token sits.
pub struct Tables<'a> {
    pub seqs: &'a [PagedSeq],
    /// Per token: its sequence.
    pub row: &'a [u32],
    /// Per token: its position (it sees keys `0..=pos` of its sequence).
    pub pos: &'a [u32],
    pub block_size: usize,
}

/// Attention of `q` `(1, Hq, T, D)` over pools `k`, `v` `(slots, Hkv, D)`
/// (contiguous, CPU, f32 or f64); returns `(1, T, Hq * D)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, tables: &Tables) -> Result<Tensor> {
    let (_, nq, t, d) = q.dims4()?;
    let q = q.contiguous()?;
    let out = match q.dtype() {
        candle_core::DType::F32 => {
            Tensor::from_vec(run::<f32>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?
        }
        candle_core::DType::F64 => {
            Tensor::from_vec(run::<f64>(&q, k, v, tables, nq)?, (1, t, nq * d), q.device())?
        }
        other => return Err(Error::invalid(format!("paged attention: no CPU kernel for {other:?}"))),
    };
    Ok(out)
}

/// The contiguous CPU data of `t`.
fn host<T: WithDType>(t: &Tensor, what: &str, f: impl FnOnce(&[T]) -> Result<Vec<T>>) -> Result<Vec<T>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(Error::invalid(format!("paged attention: {what} is not on the CPU")));
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        return Err(Error::invalid(format!("paged attention: {what} is not contiguous")));
    };
    f(&cpu.as_slice::<T>()?[a..b])
}

fn run<T: Real>(q: &Tensor, k: &Tensor, v: &Tensor, tables: &Tables, nq: usize) -> Result<Vec<T>> {
    let (nkv, d) = (k.dim(1)?, k.dim(2)?);
    if nkv == 0 || !nq.is_multiple_of(nkv) || v.dims() != k.dims() || q.dim(3)? != d {
        return Err(Error::invalid(format!(
            "paged attention: q {:?} against pools k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    host::<T>(q, "q", |qs| {
        host::<T>(k, "k pool", |ks| host::<T>(v, "v pool", |vs| Ok(kernel(qs, ks, vs, tables, nq, nkv, d))))
    })
}

/// The kernel proper: `q` `(Hq, T, D)`, pools `(slots, Hkv, D)`; returns
/// `(T, Hq, D)`.
fn kernel<T: Real>(q: &[T], k: &[T], v: &[T], tb: &Tables, nq: usize, nkv: usize, d: usize) -> Vec<T> {
    let t = tb.row.len();
    let (g, bs) = (nq / nkv, tb.block_size);
    let scale = T::from_f64(1.0 / (d as f64).sqrt());
    let mut out = vec![T::from_f64(0.0); t * nq * d];
    out.par_chunks_mut(d).enumerate().for_each(|(c, acc)| {
        let (tok, h) = (c / nq, c % nq);
        let seq = &tb.seqs[tb.row[tok] as usize];
        let limit = tb.pos[tok] as usize + 1;
        let kvh = h / g;
        let qv = &q[(h * t + tok) * d..(h * t + tok + 1) * d];
        let (mut m, mut l) = (T::from_f64(f64::NEG_INFINITY), T::from_f64(0.0));
        let mut scores = vec![T::from_f64(0.0); bs];
        for (bi, &blk) in seq.blocks.iter().enumerate() {
            let start = bi * bs;
            if start >= limit {
                break;
            }
            let n = bs.min(limit - start);
            let base = blk as usize * bs;
            let mut bm = T::from_f64(f64::NEG_INFINITY);
            for (o, s) in scores[..n].iter_mut().enumerate() {
                let kk = &k[((base + o) * nkv + kvh) * d..][..d];
                *s = qv.iter().zip(kk).fold(T::from_f64(0.0), |a, (&x, &y)| a + x * y) * scale;
                bm = bm.fmax(*s);
            }
            let m_new = m.fmax(bm);
            // exp(-inf) = 0 on the first block: nothing accumulated yet.
            let corr = (m - m_new).exp();
            l *= corr;
            for a in acc.iter_mut() {
                *a *= corr;
            }
            for (o, &s) in scores[..n].iter().enumerate() {
                let p = (s - m_new).exp();
                l += p;
                let vv = &v[((base + o) * nkv + kvh) * d..][..d];
                for (a, &x) in acc.iter_mut().zip(vv) {
                    *a += p * x;
                }
            }
            m = m_new;
        }
        let inv = T::from_f64(1.0) / l;
        for a in acc.iter_mut() {
            *a *= inv;
        }
    });
    out
}
