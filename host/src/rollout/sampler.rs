//! Per-row token sampling on the host: temperature, top-k, top-p (nucleus),
//! min-p, greedy, and the statistics RL needs at each position.
//!
//! Works on one row of logits as a `&[f32]` (the decode step copies the
//! `(B, vocab)` logits to the host once). Order of the transforms follows
//! Hugging Face's `generate` warpers: temperature, then top-k, then top-p, then
//! min-p, the survivors renormalised. Top-p keeps the smallest prefix of the
//! tokens sorted by probability whose cumulative mass is `>= top_p` (at least
//! one token); min-p keeps the tokens with probability `>= min_p` times the
//! most likely one's (HF's `MinPLogitsWarper`).
//!
//! When neither filter is on, no sort happens: one pass finds the max, one
//! accumulates the softmax sums, and sampling walks the cumulative mass in
//! token order. With top-p on, the vocabulary is not fully sorted either: the
//! top 64 tokens are selected (O(V)) and sorted, then 4x more until their mass
//! reaches `top_p`.

use std::cmp::Ordering;

use rand::rngs::StdRng;
use rand::Rng;

use super::SamplingParams;
use crate::seed::splitmix64;
use crate::{Error, Result};

/// One sampled token and the statistics recorded for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenDraw {
    /// The token id.
    pub id: u32,
    /// Log-probability of `id` under the distribution it was drawn from: the
    /// tempered softmax restricted to the top-k / top-p survivors and
    /// renormalised over them. 0 for greedy decoding (a point mass).
    pub logprob: f32,
    /// Log-probability of `id` under the untempered model, `log_softmax(logits)[id]`
    /// over the full vocabulary (temperature 1, no filter): pi_old in the PPO ratio.
    pub logprob_raw: f32,
    /// Shannon entropy (nats) of the untempered full-vocabulary distribution
    /// `softmax(logits)`: the H_t of STAPO's S2T mask.
    pub entropy: f32,
}

/// The sampling transform of one [`SamplingParams`]: its temperature and filters
/// (top-k, top-p, min-p), read from the parameters it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampler {
    params: SamplingParams,
}

/// Tokens selected and sorted before top-p first checks the mass it has.
const TOP_P_FIRST: usize = 64;

/// Descending by logit, then ascending by id: a total order, so ties break the
/// same way on every run.
fn by_logit_desc(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
}

/// Seed of the generator of one response, from the run's seed, the prompt's
/// index and the sample's index in its group. A response's tokens therefore do
/// not depend on which other prompts share its batch, on chunking, or on when
/// other rows finish.
pub fn row_seed(seed: u64, prompt_index: usize, sample_index: usize) -> u64 {
    splitmix64(splitmix64(splitmix64(seed) ^ prompt_index as u64) ^ sample_index as u64)
}

/// Full-vocabulary statistics of a row of logits.
struct RawStats {
    max: f32,
    argmax: usize,
    /// `sum_i exp(l_i - max)`.
    sum: f64,
    ln_sum: f64,
    entropy: f32,
    /// `exp(l_i - max)` of every token, when asked for (see [`RawStats::with_exps`]).
    exps: Vec<f32>,
}

impl RawStats {
    fn new(logits: &[f32]) -> Result<Self> {
        Self::with_exps(logits, false)
    }

    /// [`RawStats::new`], keeping each token's `exp(l_i - max)` when `keep`:
    /// at temperature 1 these are exactly the weights of the inverse-CDF walk,
    /// which then need not compute them again.
    fn with_exps(logits: &[f32], keep: bool) -> Result<Self> {
        let (mut max, mut argmax) = (f32::NEG_INFINITY, 0);
        for (i, &l) in logits.iter().enumerate() {
            if l > max {
                (max, argmax) = (l, i);
            }
        }
        if !max.is_finite() {
            return Err(Error::invalid(format!("sampling: logits have no finite maximum (found {max})")));
        }
        // H = ln S - sum_i e_i d_i / S with d_i = l_i - max, e_i = exp(d_i), S = sum_i e_i.
        let (mut sum, mut sum_ed) = (0f64, 0f64);
        let mut exps = Vec::with_capacity(if keep { logits.len() } else { 0 });
        for &l in logits {
            let d = l - max;
            let e = d.exp();
            if keep {
                exps.push(e);
            }
            sum += e as f64;
            if e > 0.0 {
                sum_ed += (e * d) as f64;
            }
        }
        if !sum.is_finite() {
            return Err(Error::invalid("sampling: logits contain NaN".to_string()));
        }
        let ln_sum = sum.ln();
        Ok(Self { max, argmax, sum, ln_sum, entropy: (ln_sum - sum_ed / sum) as f32, exps })
    }

    fn logprob(&self, logits: &[f32], id: usize) -> f32 {
        ((logits[id] - self.max) as f64 - self.ln_sum) as f32
    }
}

impl Sampler {
    /// The transform of `params` (its temperature, top-k, top-p and min-p).
    pub fn new(params: &SamplingParams) -> Self {
        Self { params: params.clone() }
    }

    /// The sampling parameters whose transform this is.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The softmax temperature (0: greedy).
    pub fn temperature(&self) -> f64 {
        self.params.temperature
    }

    /// True when a filter (top-k, top-p, min-p) removes tokens: the one list of
    /// the filters, which the device path (`device.rs`) asks too.
    pub(super) fn filters(&self, vocab: usize) -> bool {
        self.params.top_p < 1.0 || self.params.top_k.is_some_and(|k| k < vocab) || self.params.min_p > 0.0
    }

    /// `1 / T` in f32 (the per-token math runs in f32, sums in f64).
    fn inv_t(&self) -> f32 {
        (1.0 / self.params.temperature) as f32
    }

    /// Tempered log-weight `(l - max) / T` of a token; 0 for the most likely.
    fn log_weight(&self, l: f32, max: f32) -> f32 {
        (l - max) * self.inv_t()
    }

    /// Unnormalised tempered probability `exp((l - max) / T)` of a token. At
    /// T = 1 this is bit for bit the term of the raw softmax sum.
    fn weight(&self, l: f32, max: f32) -> f64 {
        self.log_weight(l, max).exp() as f64
    }

    /// The surviving candidates of top-k/top-p/min-p, most likely first, and
    /// their total tempered weight. Only called when [`Self::filters`].
    fn candidates(&self, logits: &[f32], max: f32) -> (Vec<u32>, f64) {
        let v = logits.len();
        let cmp = by_logit_desc(logits);
        let mut pool: Vec<u32> = (0..v as u32).collect();
        let k = self.params.top_k.unwrap_or(v).min(v);
        if k < v {
            pool.select_nth_unstable_by(k - 1, &cmp);
            pool.truncate(k);
        }
        let total: f64 = pool.iter().map(|&i| self.weight(logits[i as usize], max)).sum();
        // Top-p's target is a share of the top-k survivors' mass, taken before min-p cuts.
        let target = self.params.top_p * total;
        if self.params.min_p > 0.0 {
            // Min-p: tempered probability >= min_p x the most likely token's, whose weight
            // is exactly 1, so weight >= min_p. The kept set is a prefix of the sorted
            // order, so cutting it first and top-p's prefix after keeps HF's set.
            pool.retain(|&i| self.weight(logits[i as usize], max) >= self.params.min_p);
        }
        if self.params.top_p >= 1.0 {
            pool.sort_unstable_by(&cmp);
            let total = pool.iter().map(|&i| self.weight(logits[i as usize], max)).sum();
            return (pool, total);
        }
        let mut s = TOP_P_FIRST.min(pool.len());
        loop {
            if s < pool.len() {
                pool.select_nth_unstable_by(s - 1, &cmp);
            }
            pool[..s].sort_unstable_by(&cmp);
            let mut cum = 0f64;
            for j in 0..s {
                cum += self.weight(logits[pool[j] as usize], max);
                if cum >= target {
                    pool.truncate(j + 1);
                    return (pool, cum);
                }
            }
            if s == pool.len() {
                // Min-p cut first, or rounding left the pool a hair short of the target: keep it all.
                return (pool, cum);
            }
            s = (s * 4).min(pool.len());
        }
    }

    /// The distribution tokens are drawn from: `(id, probability)` for every
    /// token with non-zero probability after temperature and filtering. Greedy
    /// gives the argmax with probability 1. For inspection and tests; sampling
    /// does not build it.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f64)>> {
        let stats = RawStats::new(logits)?;
        if self.params.temperature == 0.0 {
            return Ok(vec![(stats.argmax as u32, 1.0)]);
        }
        let (ids, total) = if self.filters(logits.len()) {
            self.candidates(logits, stats.max)
        } else {
            let ids: Vec<u32> = (0..logits.len() as u32).collect();
            let total = logits.iter().map(|&l| self.weight(l, stats.max)).sum();
            (ids, total)
        };
        Ok(ids.into_iter().map(|i| (i, self.weight(logits[i as usize], stats.max) / total)).collect())
    }

    /// Draws one token from `logits` (one row, the full vocabulary) with `rng`,
    /// returning it with its sampling log-prob, raw log-prob and entropy.
    pub fn draw(&self, logits: &[f32], rng: &mut StdRng) -> Result<TokenDraw> {
        let plain_t1 = self.params.temperature == 1.0 && !self.filters(logits.len());
        let stats = RawStats::with_exps(logits, plain_t1)?;
        let done = |id: usize, logprob: f64| TokenDraw {
            id: id as u32,
            logprob: logprob as f32,
            logprob_raw: stats.logprob(logits, id),
            entropy: stats.entropy,
        };
        if self.params.temperature == 0.0 {
            return Ok(done(stats.argmax, 0.0));
        }
        let max = stats.max;
        // Inverse-CDF draw: the first token whose cumulative weight exceeds u * total.
        let u: f64 = rng.random();
        if self.filters(logits.len()) {
            let (ids, total) = self.candidates(logits, max);
            let target = u * total;
            let mut cum = 0f64;
            let mut pick = ids[ids.len() - 1] as usize;
            for &i in &ids {
                cum += self.weight(logits[i as usize], max);
                if cum > target {
                    pick = i as usize;
                    break;
                }
            }
            return Ok(done(pick, self.log_weight(logits[pick], max) as f64 - total.ln()));
        }
        let total: f64 = if self.params.temperature == 1.0 {
            stats.sum
        } else {
            logits.iter().map(|&l| self.weight(l, max)).sum()
        };
        let target = u * total;
        let (mut cum, mut pick, mut last_positive) = (0f64, None, stats.argmax);
        for (i, &l) in logits.iter().enumerate() {
            // At T = 1, `weight` is bit for bit the kept term of the raw sum.
            let w = if plain_t1 { stats.exps[i] as f64 } else { self.weight(l, max) };
            if w > 0.0 {
                last_positive = i;
            }
            cum += w;
            if cum > target {
                pick = Some(i);
                break;
            }
        }
        let pick = pick.unwrap_or(last_positive);
        Ok(done(pick, self.log_weight(logits[pick], max) as f64 - total.ln()))
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn sampler(temperature: f64, top_p: f64, top_k: Option<usize>) -> Sampler {
        Sampler::new(&SamplingParams { temperature, top_p, top_k, ..SamplingParams::default() })
    }

    fn with_min_p(min_p: f64, s: Sampler) -> Sampler {
        Sampler::new(&SamplingParams { min_p, ..s.params().clone() })
    }

    fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    /// Empirical frequencies of `draws` draws, checking each draw's logprob
    /// against the expected distribution.
    fn frequencies(s: &Sampler, logits: &[f32], expect: &[f64], draws: usize) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(7);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..draws {
            let d = s.draw(logits, &mut rng).expect("draw");
            counts[d.id as usize] += 1;
            assert!((d.logprob as f64 - expect[d.id as usize].ln()).abs() < 1e-5, "{d:?} vs {expect:?}");
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    fn assert_close(found: &[f64], expect: &[f64], tol: f64) {
        for (f, e) in found.iter().zip(expect) {
            assert!((f - e).abs() < tol, "found {found:?}, expected {expect:?}");
        }
    }

    #[test]
    fn raw_logprob_and_entropy_match_softmax() {
        let logits = [0.3f32, -1.2, 2.5, 0.0, -30.0];
        let p = softmax(&logits.iter().map(|&x| x as f64).collect::<Vec<_>>());
        let h: f64 = -p.iter().map(|q| q * q.ln()).sum::<f64>();
        let mut rng = StdRng::seed_from_u64(1);
        for s in [sampler(1.0, 1.0, None), sampler(0.5, 0.8, Some(3)), sampler(0.0, 1.0, None)] {
            let d = s.draw(&logits, &mut rng).expect("draw");
            assert!((d.logprob_raw as f64 - p[d.id as usize].ln()).abs() < 1e-6);
            assert!((d.entropy as f64 - h).abs() < 1e-6);
        }
    }

    /// At temperature 1 the walk reads the exps kept by the raw statistics:
    /// the same token and log-prob as the walk that computes each weight (a
    /// copy of the draw's loop), over many draws on a long row with -inf logits.
    #[test]
    fn kept_exps_draw_what_computed_weights_draw() {
        let s = sampler(1.0, 1.0, None);
        let logits: Vec<f32> = (0..5000)
            .map(|i| if i % 97 == 3 { f32::NEG_INFINITY } else { ((i * 7919 % 1013) as f32 - 500.0) / 90.0 })
            .collect();
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = logits.iter().map(|&l| s.weight(l, max)).sum();
        let (mut a, mut b) = (StdRng::seed_from_u64(3), StdRng::seed_from_u64(3));
        for _ in 0..300 {
            let d = s.draw(&logits, &mut a).expect("draw");
            let target = b.random::<f64>() * total;
            let (mut cum, mut pick) = (0f64, None);
            for (i, &l) in logits.iter().enumerate() {
                cum += s.weight(l, max);
                if cum > target {
                    pick = Some(i);
                    break;
                }
            }
            let pick = pick.expect("a target below the total");
            assert_eq!(d.id as usize, pick);
            assert_eq!(d.logprob, (s.log_weight(logits[pick], max) as f64 - total.ln()) as f32);
        }
    }

    #[test]
    fn temperature_frequencies_match_softmax() {
        let logits = [1.0f32, 2.0, 0.5];
        for t in [1.0, 0.7, 1.5] {
            let expect = softmax(&logits.iter().map(|&x| x as f64 / t).collect::<Vec<_>>());
            let found = frequencies(&sampler(t, 1.0, None), &logits, &expect, 20_000);
            assert_close(&found, &expect, 0.015);
        }
    }

    #[test]
    fn top_k_and_top_p_renormalise_the_survivors() {
        // Probabilities 0.5, 0.3, 0.2 at temperature 1.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let found = frequencies(&sampler(1.0, 1.0, Some(2)), &logits, &[0.625, 0.375, 1.0], 20_000);
        assert_close(&found, &[0.625, 0.375, 0.0], 0.015);
        // top-p 0.7: 0.5 < 0.7 <= 0.8, so the first two survive.
        let found = frequencies(&sampler(1.0, 0.7, None), &logits, &[0.625, 0.375, 1.0], 20_000);
        assert_close(&found, &[0.625, 0.375, 0.0], 0.015);
        // top-p 0.5 keeps exactly the first (cumulative 0.5 >= 0.5).
        let found = frequencies(&sampler(1.0, 0.5, None), &logits, &[1.0, 1.0, 1.0], 1000);
        assert_close(&found, &[1.0, 0.0, 0.0], 1e-12);
    }

    /// Min-p on a hand-computed distribution: probabilities 0.5, 0.3, 0.15, 0.05 with
    /// min_p 0.2 keep the tokens with p >= 0.2 x 0.5 = 0.1, the first three, renormalised
    /// over 0.95; after top-p 0.7 (first two) min-p 0.5 (p >= 0.25) keeps the same two.
    #[test]
    fn min_p_keeps_tokens_above_its_share_of_the_top() {
        let probs = [0.5f64, 0.3, 0.15, 0.05];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let s = with_min_p(0.2, sampler(1.0, 1.0, None));
        let want = [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95];
        let got = s.distribution(&logits).expect("distribution");
        assert_eq!(got.iter().map(|&(id, _)| id).collect::<Vec<_>>(), vec![0, 1, 2]);
        for (&(_, q), w) in got.iter().zip(want) {
            assert!((q - w).abs() < 1e-6, "{got:?}");
        }
        let found = frequencies(&s, &logits, &[want[0], want[1], want[2], 1.0], 20_000);
        assert_close(&found, &[want[0], want[1], want[2], 0.0], 0.015);
        // At temperature 0.5 the probabilities are 25:9:2.25:0.25 / 36.5, and min_p 0.2
        // (>= 5/36.5) keeps the first two.
        let s = with_min_p(0.2, sampler(0.5, 1.0, None));
        let ids: Vec<u32> = s.distribution(&logits).expect("distribution").iter().map(|d| d.0).collect();
        assert_eq!(ids, vec![0, 1]);
        let s = with_min_p(0.5, sampler(1.0, 0.7, None));
        let got = s.distribution(&logits).expect("distribution");
        assert_eq!(got.iter().map(|&(id, _)| id).collect::<Vec<_>>(), vec![0, 1]);
        // min_p 0 is off (no filter); 1 keeps only the top.
        assert!(!with_min_p(0.0, sampler(1.0, 1.0, None)).filters(4));
        let top = with_min_p(1.0, sampler(1.0, 1.0, None)).distribution(&logits).expect("d");
        assert_eq!(top, vec![(0, 1.0)]);
    }

    #[test]
    fn tiny_top_p_and_top_k_one_are_greedy() {
        let mut rng = StdRng::seed_from_u64(3);
        let logits: Vec<f32> = (0..500).map(|_| rng.random::<f32>() * 4.0).collect();
        let argmax = sampler(0.0, 1.0, None).draw(&logits, &mut rng).expect("draw");
        assert_eq!(argmax.logprob, 0.0);
        for s in [sampler(1.0, 1e-6, None), sampler(1.3, 1.0, Some(1)), sampler(0.7, 0.9, Some(1))] {
            for _ in 0..50 {
                let d = s.draw(&logits, &mut rng).expect("draw");
                assert_eq!(d.id, argmax.id);
                assert!(d.logprob.abs() < 1e-6);
                assert_eq!((d.logprob_raw, d.entropy), (argmax.logprob_raw, argmax.entropy));
            }
        }
    }

    #[test]
    fn top_p_with_many_survivors_matches_a_full_sort() {
        let mut rng = StdRng::seed_from_u64(4);
        let logits: Vec<f32> = (0..3000).map(|_| rng.random::<f32>() * 0.5).collect();
        for (t, top_p, top_k) in
            [(1.0, 0.999, None), (0.8, 0.5, None), (1.2, 0.9, Some(700)), (1.0, 1.0, Some(10))]
        {
            let s = sampler(t, top_p, top_k);
            let got = s.distribution(&logits).expect("distribution");
            // Reference: sort everything, cut at top-k, then the top-p prefix.
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            order.truncate(top_k.unwrap_or(order.len()));
            let p = softmax(&order.iter().map(|&i| logits[i] as f64 / t).collect::<Vec<_>>());
            let (mut cum, mut keep) = (0.0, p.len());
            for (j, q) in p.iter().enumerate() {
                cum += q;
                if cum >= top_p {
                    keep = j + 1;
                    break;
                }
            }
            assert_eq!(got.len(), keep, "T={t} top_p={top_p} top_k={top_k:?}");
            let mass: f64 = p[..keep].iter().sum();
            for (j, &(id, q)) in got.iter().enumerate() {
                assert_eq!(id as usize, order[j]);
                assert!((q / (p[j] / mass) - 1.0).abs() < 1e-5, "{q} vs {}", p[j] / mass);
            }
            // A draw's logprob is the log of its probability in that distribution.
            let d = s.draw(&logits, &mut rng).expect("draw");
            let q = got.iter().find(|(id, _)| *id == d.id).expect("drawn token survives").1;
            assert!((d.logprob as f64 - q.ln()).abs() < 1e-5);
        }
    }

    #[test]
    fn non_finite_logits_are_an_error() {
        let mut rng = StdRng::seed_from_u64(0);
        let s = sampler(1.0, 1.0, None);
        assert!(s.draw(&[f32::NEG_INFINITY; 3], &mut rng).is_err());
        assert!(s.draw(&[0.0, f32::NAN, 1.0], &mut rng).is_err());
        assert!(s.draw(&[], &mut rng).is_err());
    }

    #[test]
    fn row_seeds_differ_across_prompts_and_samples() {
        let seeds = [row_seed(0, 0, 0), row_seed(0, 0, 1), row_seed(0, 1, 0), row_seed(1, 0, 0)];
        for i in 0..seeds.len() {
            for j in i + 1..seeds.len() {
                assert_ne!(seeds[i], seeds[j]);
            }
        }
    }
}
