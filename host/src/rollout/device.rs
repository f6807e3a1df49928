//! One decode step's token draws, with the vocabulary-wide work on the device.
//!
//! [`Sampler::draw`] reads a whole row of logits on the host. On a GPU that
//! means copying `(B, V)` floats per step (256 rows x 151,936 tokens = 155 MB)
//! and walking them on the CPU. [`StepLogits`] keeps the logits where they
//! are: for plain temperature sampling (no top-k/top-p, the RL setting of the
//! paper) and greedy decoding it computes on the device each row's max,
//! softmax sum, entropy term and the tempered mass of blocks of
//! [`BLOCK`] tokens, copies back those `O(B * V / BLOCK)` numbers, picks each
//! row's block on the host with the row's own uniform draw, and copies back
//! only the `BLOCK` logits of the picked blocks. The draw is the same
//! inverse-CDF walk as [`Sampler::draw`] (one uniform per token, same token
//! order), so it picks the same token up to float rounding of the sums.
//!
//! Top-k/top-p/min-p (every filter `Sampler::filters` lists) need a sort of
//! the vocabulary that candle does not offer on the device for rows this long;
//! those rows are copied to the host whole and
//! drawn by [`Sampler::draw`], as are all rows of CPU tensors (where there is
//! no copy to save).

use candle_core::{DType, Tensor, D};
use rand::rngs::StdRng;
use rand::Rng;
use rayon::prelude::*;

use super::sampler::{Sampler, TokenDraw};
use crate::model::budget;
use crate::{Error, Result};

/// Tokens per block of the device-side inverse CDF.
pub const BLOCK: usize = 256;

/// Padding logit for the last block: its tempered weight is exactly 0.
const PAD: f32 = -1e30;

/// The logits of one decode step, `(B, V)`, ready to draw from.
pub enum StepLogits {
    /// Copied to the host whole (CPU tensors, top-k/top-p sampling).
    Host {
        /// The logits, row-major `(B, V)`.
        data: Vec<f32>,
        /// `V`, the vocabulary size.
        vocab: usize,
    },
    /// Kept on the device; only per-row and per-block numbers were copied.
    Device(Blocked),
    /// On CUDA, drawn by the sampling kernel (`model/cuda/sample.cu`), filters
    /// included: only four numbers per row come back.
    #[cfg(feature = "cuda")]
    Kernel(Tensor),
}

/// Device-side state of [`StepLogits::Device`].
pub struct Blocked {
    /// `(B * blocks, BLOCK)` logits minus the row max, padded with [`PAD`].
    shifted: Tensor,
    blocks: usize,
    /// Per row: softmax sum `S = sum exp(d)`, `sum exp(d) d`, argmax.
    sum: Vec<f32>,
    sum_ed: Vec<f32>,
    argmax: Vec<u32>,
    /// Per row and block, the tempered mass `sum exp(d / T)` (`(B, blocks)` flat);
    /// empty for greedy decoding.
    block_mass: Vec<f32>,
}

impl StepLogits {
    /// Prepares `(B, V)` logits for `sampler`: on the device when they live on
    /// one and the sampler needs no sort, else on the host.
    pub fn new(logits: &Tensor, sampler: &Sampler) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda() && crate::model::Kernels::current() == crate::model::Kernels::Fused {
            return Ok(Self::Kernel(logits.to_dtype(DType::F32)?.contiguous()?));
        }
        if logits.device().is_cpu() || filters(sampler, logits.dim(D::Minus1)?) {
            return Self::host(logits);
        }
        Ok(Self::Device(Blocked::new(logits, sampler)?))
    }

    /// The whole logits on the host.
    pub fn host(logits: &Tensor) -> Result<Self> {
        let vocab = logits.dim(D::Minus1)?;
        budget::host_copy();
        Ok(Self::Host { data: logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, vocab })
    }

    /// Draws one token for each `(logits row, generator)` in `rows`, in order.
    pub fn draw(&self, sampler: &Sampler, rows: Vec<(usize, &mut StdRng)>) -> Result<Vec<TokenDraw>> {
        match self {
            Self::Host { data, vocab } => rows
                .into_par_iter()
                .map(|(l, rng)| sampler.draw(&data[l * vocab..(l + 1) * vocab], rng))
                .collect(),
            Self::Device(b) => b.draw(sampler, rows),
            #[cfg(feature = "cuda")]
            Self::Kernel(logits) => kernel_draw(logits, sampler, rows),
        }
    }
}

/// [`StepLogits::draw`] by the sampling kernel: each row's uniform number is
/// drawn here from the row's generator, as [`Sampler::draw`] draws it (none
/// for greedy decoding), so a row draws the host's token.
#[cfg(feature = "cuda")]
fn kernel_draw(
    logits: &Tensor,
    sampler: &Sampler,
    rows: Vec<(usize, &mut StdRng)>,
) -> Result<Vec<TokenDraw>> {
    use crate::model::cuda_ops::{sample, SampleParams};
    let (n, vocab) = logits.dims2()?;
    let idx: Vec<u32> = rows.iter().map(|(r, _)| *r as u32).collect();
    let p = sampler.params();
    let greedy = p.temperature == 0.0;
    let uniforms: Vec<f64> =
        rows.into_iter().map(|(_, rng)| if greedy { 0.0 } else { rng.random::<f64>() }).collect();
    let all_in_order = idx.len() == n && idx.iter().enumerate().all(|(i, &r)| r as usize == i);
    let picked = if all_in_order {
        logits.clone()
    } else {
        logits.index_select(&Tensor::from_vec(idx.clone(), idx.len(), logits.device())?, 0)?
    };
    let params = SampleParams {
        inv_t: if greedy { 0.0 } else { (1.0 / p.temperature) as f32 },
        top_k: p.top_k.filter(|&k| k < vocab).unwrap_or(0),
        top_p: p.top_p,
        min_p: p.min_p,
    };
    sample(&picked, &uniforms, params)?
        .into_iter()
        .zip(idx)
        .map(|([logprob, logprob_raw, entropy, id], r)| {
            if id < 0.0 {
                return Err(Error::invalid(format!(
                    "sampling: logits of row {r} contain NaN or no finite maximum"
                )));
            }
            Ok(TokenDraw { id: id as u32, logprob, logprob_raw, entropy })
        })
        .collect()
}

/// Whether a filter (the sampler's list: top-k, top-p, ...) removes tokens: then the
/// vocabulary must be sorted, on the host. Asked of the sampler, so that a filter added
/// there cannot be dropped here.
fn filters(s: &Sampler, vocab: usize) -> bool {
    s.temperature() != 0.0 && s.filters(vocab)
}

impl Blocked {
    /// The device pass over `(B, V)` logits. Works on any device (the tests run
    /// it on the CPU against [`Sampler::draw`]).
    pub fn new(logits: &Tensor, sampler: &Sampler) -> Result<Self> {
        let (b, v) = logits.dims2()?;
        if filters(sampler, v) {
            return Err(Error::invalid(
                "device sampling: rows with a top-k/top-p/min-p filter must be drawn on the host",
            ));
        }
        let blocks = v.div_ceil(BLOCK);
        let l = logits.to_dtype(DType::F32)?;
        let d = l.broadcast_sub(&l.max_keepdim(D::Minus1)?)?;
        let argmax = first_max(&d)?;
        let d = match blocks * BLOCK - v {
            0 => d,
            pad => Tensor::cat(&[d, Tensor::full(PAD, (b, pad), l.device())?], D::Minus1)?,
        };
        let e = d.exp()?;
        let sum = e.sum(D::Minus1)?;
        // exp(d) * d with d clamped, so that a -inf logit adds 0 rather than NaN
        // (the host sampler skips e == 0 terms for the same reason).
        let sum_ed = (&e * d.clamp(PAD, 0f32)?)?.sum(D::Minus1)?;
        let block_mass = if sampler.temperature() == 0.0 {
            Vec::new()
        } else {
            let w =
                if sampler.temperature() == 1.0 { e } else { (&d * (1.0 / sampler.temperature()))?.exp()? };
            budget::host_copy();
            w.reshape((b, blocks, BLOCK))?.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?
        };
        // The sums, the sums of e * d and the argmaxes.
        (0..3).for_each(|_| budget::host_copy());
        Ok(Self {
            shifted: d.reshape((b * blocks, BLOCK))?,
            blocks,
            sum: sum.to_vec1::<f32>()?,
            sum_ed: sum_ed.to_vec1::<f32>()?,
            argmax: argmax.flatten_all()?.to_vec1::<u32>()?,
            block_mass,
        })
    }

    /// See [`StepLogits::draw`].
    pub fn draw(&self, sampler: &Sampler, rows: Vec<(usize, &mut StdRng)>) -> Result<Vec<TokenDraw>> {
        let stats = |r: usize| -> Result<(f64, f32)> {
            let s = self.sum[r] as f64;
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::invalid(format!(
                    "sampling: logits of row {r} contain NaN or no finite maximum"
                )));
            }
            let ln_s = s.ln();
            Ok((ln_s, (ln_s - self.sum_ed[r] as f64 / s) as f32))
        };
        if sampler.temperature() == 0.0 {
            // The argmax has d = 0, so its log-prob is -ln S.
            return rows
                .into_iter()
                .map(|(r, _)| {
                    let (ln_s, entropy) = stats(r)?;
                    Ok(TokenDraw { id: self.argmax[r], logprob: 0.0, logprob_raw: -ln_s as f32, entropy })
                })
                .collect();
        }
        // Pick each row's block: the first whose cumulative mass exceeds u * total.
        let mut picks = Vec::with_capacity(rows.len());
        for (r, rng) in rows {
            let mass = &self.block_mass[r * self.blocks..(r + 1) * self.blocks];
            let total: f64 = mass.iter().map(|&m| m as f64).sum();
            let target = rng.random::<f64>() * total;
            let (mut cum, mut block) = (0f64, None);
            for (k, &m) in mass.iter().enumerate() {
                if cum + m as f64 > target {
                    block = Some(k);
                    break;
                }
                cum += m as f64;
            }
            // Rounding left the target past the last block: take the last with mass.
            let block = match block {
                Some(k) => k,
                None => {
                    let k = mass.iter().rposition(|&m| m > 0.0).unwrap_or(0);
                    cum -= mass[k..].iter().map(|&m| m as f64).sum::<f64>();
                    k
                }
            };
            picks.push((r, block, cum, target, total));
        }
        let idx: Vec<u32> = picks.iter().map(|&(r, k, ..)| (r * self.blocks + k) as u32).collect();
        let idx = Tensor::from_vec(idx, picks.len(), self.shifted.device())?;
        budget::host_copy();
        let chosen = self.shifted.index_select(&idx, 0)?.to_vec2::<f32>()?;
        let inv_t = (1.0 / sampler.temperature()) as f32;
        picks
            .into_iter()
            .zip(chosen)
            .map(|((r, k, mut cum, target, total), d)| {
                let (ln_s, entropy) = stats(r)?;
                // The same walk as the host sampler, inside the block.
                let (mut pick, mut last_positive) = (None, None);
                for (j, &dj) in d.iter().enumerate() {
                    let w = (dj * inv_t).exp() as f64;
                    if w > 0.0 {
                        last_positive = Some(j);
                    }
                    cum += w;
                    if cum > target {
                        pick = Some(j);
                        break;
                    }
                }
                let j = match pick.or(last_positive) {
                    Some(j) => j,
                    None => return Err(Error::invalid(format!("sampling: row {r} has no token with mass"))),
                };
                Ok(TokenDraw {
                    id: (k * BLOCK + j) as u32,
                    logprob: ((d[j] * inv_t) as f64 - total.ln()) as f32,
                    logprob_raw: (d[j] as f64 - ln_s) as f32,
                    entropy,
                })
            })
            .collect()
    }
}

/// Per row, the lowest index where `d` (logits minus the row's max) is 0: the host
/// sampler's argmax (the first maximum). CUDA's `argmax` reduction returns any of
/// tied maxima, and ties are common in bf16 logits (the device check of 2026-12-04 had 32 of
/// 256 greedy rows differ from the host), so the index is taken as the minimum of
/// `index + 2^24 * (d != 0)`, exact in f32 for vocabularies below 2^24.
fn first_max(d: &Tensor) -> Result<Tensor> {
    let v = d.dim(D::Minus1)?;
    let not_max = d.ne(0f32)?.to_dtype(DType::F32)?.affine(16_777_216.0, 0.0)?;
    let index = Tensor::arange(0u32, v as u32, d.device())?.to_dtype(DType::F32)?;
    Ok(not_max.broadcast_add(&index)?.min_keepdim(D::Minus1)?.to_dtype(DType::U32)?)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use rand::SeedableRng;

    use super::*;
    use crate::rollout::SamplingParams;

    fn sampler(temperature: f64) -> Sampler {
        Sampler::new(&SamplingParams { temperature, ..SamplingParams::default() })
    }

    /// Rows of random logits, one with a huge spread, one with exact ties, over
    /// a vocabulary that is not a multiple of [`BLOCK`].
    fn logits(v: usize) -> Vec<Vec<f32>> {
        let mut rng = StdRng::seed_from_u64(11);
        let mut rows: Vec<Vec<f32>> = (0..5)
            .map(|s| (0..v).map(|_| rng.random::<f32>() * (2.0 + 3.0 * s as f32) - 4.0).collect())
            .collect();
        rows.push((0..v).map(|i| if i % 97 == 0 { 3.0 } else { -2.0 }).collect());
        rows
    }

    fn tensor(rows: &[Vec<f32>]) -> Tensor {
        let v = rows[0].len();
        Tensor::from_vec(rows.concat(), (rows.len(), v), &Device::Cpu).expect("tensor")
    }

    /// The blocked draw picks the same tokens with the same statistics as the
    /// host sampler, row by row, over many draws (same seeds).
    #[test]
    fn blocked_draws_match_the_host_sampler() {
        for v in [1000, 3 * BLOCK, 7] {
            let rows = logits(v);
            let t = tensor(&rows);
            for temp in [1.0, 0.7, 1.3, 0.0] {
                let s = sampler(temp);
                let blocked = Blocked::new(&t, &s).expect("blocked");
                let mut host_rngs: Vec<StdRng> =
                    (0..rows.len()).map(|r| StdRng::seed_from_u64(r as u64)).collect();
                let mut dev_rngs = host_rngs.clone();
                for _ in 0..50 {
                    let got =
                        blocked.draw(&s, dev_rngs.iter_mut().enumerate().collect()).expect("blocked draw");
                    for (r, g) in got.iter().enumerate() {
                        let want = s.draw(&rows[r], &mut host_rngs[r]).expect("host draw");
                        assert_eq!(g.id, want.id, "v {v} T {temp} row {r}");
                        for (a, b, what) in [
                            (g.logprob, want.logprob, "logprob"),
                            (g.logprob_raw, want.logprob_raw, "logprob_raw"),
                            (g.entropy, want.entropy, "entropy"),
                        ] {
                            assert!((a - b).abs() < 1e-4, "v {v} T {temp} row {r} {what}: {a} vs {b}");
                        }
                    }
                }
            }
        }
    }

    /// Greedy rows take the first of tied maxima, as the host sampler does, whatever
    /// the device's argmax reduction would return.
    #[test]
    fn first_max_is_the_lowest_tied_index() {
        let d = Tensor::new(
            &[[-1f32, 0.0, -3.0, 0.0], [-2.0, -1.0, -5.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
            &Device::Cpu,
        )
        .expect("tensor");
        let got =
            first_max(&d).expect("first max").flatten_all().expect("flat").to_vec1::<u32>().expect("vec");
        assert_eq!(got, vec![1, 3, 0]);
    }

    #[test]
    fn rows_are_drawn_in_the_order_asked() {
        let rows = logits(600);
        let t = tensor(&rows);
        let s = sampler(1.0);
        let blocked = Blocked::new(&t, &s).expect("blocked");
        let mut a = StdRng::seed_from_u64(3);
        let mut b = StdRng::seed_from_u64(4);
        let got = blocked.draw(&s, vec![(4, &mut a), (1, &mut b)]).expect("draw");
        let want4 = s.draw(&rows[4], &mut StdRng::seed_from_u64(3)).expect("draw");
        let want1 = s.draw(&rows[1], &mut StdRng::seed_from_u64(4)).expect("draw");
        assert_eq!((got[0].id, got[1].id), (want4.id, want1.id));
    }

    #[test]
    fn filtered_sampling_stays_on_the_host() {
        let t = tensor(&logits(300));
        let s = Sampler::new(&SamplingParams { top_p: 0.9, ..SamplingParams::default() });
        assert!(Blocked::new(&t, &s).is_err());
        assert!(matches!(StepLogits::new(&t, &s).expect("step"), StepLogits::Host { .. }));
        assert!(matches!(StepLogits::new(&t, &sampler(1.0)).expect("step"), StepLogits::Host { .. }));
    }

    /// Min-p goes through the filter path: not on the device, and the host rows of
    /// [`StepLogits`] draw only the hand-computed kept set (probabilities 0.5, 0.3,
    /// 0.15, 0.05 with min_p 0.2: the first three).
    #[test]
    fn min_p_rows_draw_the_kept_set_on_the_host() {
        let row: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let t = tensor(&[row.clone(), row]);
        let s = Sampler::new(&SamplingParams { min_p: 0.2, ..SamplingParams::default() });
        assert!(Blocked::new(&t, &s).is_err());
        let step = StepLogits::new(&t, &s).expect("step");
        assert!(matches!(step, StepLogits::Host { .. }));
        let (mut a, mut b) = (StdRng::seed_from_u64(1), StdRng::seed_from_u64(2));
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            for d in step.draw(&s, vec![(0, &mut a), (1, &mut b)]).expect("draw") {
                seen[d.id as usize] += 1;
                let want = [0.5f64, 0.3, 0.15][d.id as usize] / 0.95;
                assert!((d.logprob as f64 - want.ln()).abs() < 1e-5, "{d:?}");
            }
        }
        assert!(seen[..3].iter().all(|&c| c > 0) && seen[3] == 0, "{seen:?}");
    }

    #[test]
    fn nan_logits_are_an_error() {
        let mut rows = logits(300);
        rows[2][17] = f32::NAN;
        let t = tensor(&rows);
        let s = sampler(1.0);
        let blocked = Blocked::new(&t, &s).expect("blocked");
        let mut rng = StdRng::seed_from_u64(0);
        let err = blocked.draw(&s, vec![(2, &mut rng)]).expect_err("NaN row");
        assert!(err.to_string().contains("row 2"), "{err}");
    }
}
