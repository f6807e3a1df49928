//! Token masks that decide which response tokens contribute to the loss.
//!
//! - S2T ("silence spurious tokens"), STAPO (2026), the heart of this project:
//!   `I_{i,t} = 0` iff `A_i > 0 && p_{i,t} < tau_p && H_{i,t} < tau_h`, else 1, where
//!   `p = exp(logp of the sampled token)` and `H` the full-vocabulary entropy, both from the
//!   training forward and detached (of the tempered policy when the update divides the
//!   logits by the rollout temperature, as verl does). `tau_h` is either absolute or the
//!   `q`-quantile of `H` over a named population of the mini-batch: the *candidates*
//!   (response tokens with `A > 0 && p < tau_p`, [`QuantileOver::Candidates`]), the paper's
//!   rule (arXiv 2602.15620 §3: "the q-th quantile of entropy, computed dynamically over the
//!   low-probability tokens within correct responses in each mini-batch"; `q = 0.75`,
//!   `tau_p = 0.002`, §4.1), so the bottom `q` share of the candidates by entropy is
//!   silenced; or, as a variant that is not the paper's, every response token
//!   ([`QuantileOver::Response`]).
//! - Top-entropy ("20-Entropy"), Wang et al. 2025, "Beyond the 80/20 Rule" (arXiv:2506.01939):
//!   keep the top `rho` fraction of response tokens by entropy, ranked over the whole
//!   mini-batch, as in `get_global_entropy_top_mask` of the paper's verl fork.
//!
//! Both are decided over the whole mini-batch (call them once per mini-batch, before
//! splitting into micro-batches) and are computed on the host: the decisions need a sort
//! and per-position reporting, and a `(B, T)` f32 copy is cheap next to a forward pass.
//! Masks are 0/1 f32 tensors on the device of the inputs; combine them with
//! [`compose_masks`] (elementwise product).

use super::config::S2tThresholds;
pub use super::config::{QuantileOver, TauH};
use super::{dims_bt, expand_advantages, expect_bt};
use crate::{Error, Result};
use candle_core::{DType, Tensor};

/// What the S2T mask did, for metrics and the silenced-token report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct S2tStats {
    /// Response tokens in the mini-batch (`response_mask == 1`).
    pub n_response: usize,
    /// Response tokens with `A > 0 && p < tau_p`.
    pub n_candidates: usize,
    /// Response tokens with `A < 0 && p < tau_p` (the low-probability tokens S2T never
    /// touches; with [`n_candidates`](Self::n_candidates) the share of low-probability
    /// tokens split by the sign of A).
    pub n_low_p_negative: usize,
    /// How many entropies the quantile `tau_h` was taken over (the whole global
    /// mini-batch's population); `None` for an absolute `tau_h`.
    pub tau_h_population: Option<usize>,
    /// Tokens silenced (`I = 0`).
    pub n_silenced: usize,
    /// The entropy threshold used; `None` for a quantile over an empty population.
    pub tau_h: Option<f32>,
    /// `(b, t)` of every silenced token, row-major order, so callers can report the
    /// token strings (the paper's word clouds).
    pub positions: Vec<(usize, usize)>,
}

impl S2tStats {
    /// Silenced tokens over response tokens (0 when there are none).
    pub fn silenced_ratio(&self) -> f32 {
        ratio(self.n_silenced, self.n_response)
    }
}

/// What the top-entropy mask did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopEntropyStats {
    /// Response tokens in the mini-batch.
    pub n_response: usize,
    /// Tokens kept: `max(1, ceil(rho * n_response))`, or 0 when there are no response tokens.
    pub n_kept: usize,
    /// The smallest kept entropy; `None` when nothing is kept.
    pub threshold: Option<f32>,
}

fn ratio(a: usize, b: usize) -> f32 {
    if b == 0 {
        0.0
    } else {
        a as f32 / b as f32
    }
}

fn host_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The `q`-quantile of `values` with linear interpolation, as `torch.quantile(x, q)`
/// (`interpolation='linear'`): sort ascending into `x[0..n]`, let `pos = q * (n - 1)`,
/// `lo = floor(pos)`, `hi = ceil(pos)`; the result is `x[lo] + (pos - lo) * (x[hi] - x[lo])`
/// (computed in f64, returned as f32). `None` for an empty slice. NaNs sort last
/// (`f32::total_cmp`); `q` is clamped to `[0, 1]`.
pub fn quantile_linear(values: &[f32], q: f32) -> Option<f32> {
    if values.is_empty() {
        return None;
    }
    let mut x = values.to_vec();
    x.sort_by(|a, b| a.total_cmp(b));
    let n = x.len();
    let pos = (q.clamp(0.0, 1.0) as f64) * (n - 1) as f64;
    let lo = (pos.floor() as usize).min(n - 1);
    let hi = (pos.ceil() as usize).min(n - 1);
    let frac = pos - lo as f64;
    let v = x[lo] as f64 + frac * (x[hi] as f64 - x[lo] as f64);
    Some(v as f32)
}

/// The S2T mask of STAPO: 0 at the spurious tokens, 1 everywhere else.
///
/// - `logp` `(B, T)`: log-prob of each sampled token under the training forward (detached
///   here); `p = exp(logp)`.
/// - `entropy` `(B, T)`: full-vocabulary entropy at each position (detached here).
/// - `advantages` `(B,)` or `(B, T)`.
/// - `response_mask` `(B, T)`: 1 on response tokens; only these can be candidates.
///
/// A token is a candidate when `response_mask == 1 && A > 0 && p < tau_p`, and is silenced
/// when, in addition, `H < tau_h` (strict: a token at exactly `tau_h` is kept). With
/// [`TauH::Quantile`] the threshold is [`quantile_linear`] of the entropies of its
/// population:
/// - `over: response`: every response token's entropy, so a candidate is silenced when it
///   is not among the `1 - q` share of highest-entropy positions of the mini-batch, however
///   few candidates there are;
/// - `over: candidates`: the candidates' entropies, so with strict `<` at most a fraction
///   `q` of the candidates is silenced (a single candidate never is).
///
/// With an empty population nothing is silenced and `tau_h` is reported as `None`.
///
/// The returned mask is not multiplied by `response_mask`; combine with [`compose_masks`].
pub fn s2t_mask(
    logp: &Tensor,
    entropy: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    tau_p: f32,
    tau_h: TauH,
) -> Result<(Tensor, S2tStats)> {
    S2tThresholds { tau_p, tau_h }.validate()?;
    let (b, l) = dims_bt(logp, "s2t: logp")?;
    expect_bt(entropy, "s2t: entropy", b, l)?;
    expect_bt(response_mask, "s2t: response_mask", b, l)?;
    let adv = expand_advantages(advantages, b, l)?;

    let lp = host_vec(logp)?;
    let h = host_vec(entropy)?;
    let a = host_vec(&adv)?;
    let m = host_vec(response_mask)?;

    let mut stats = S2tStats { n_response: m.iter().filter(|&&x| x > 0.5).count(), ..Default::default() };
    let candidates = candidate_positions(&lp, &a, &m, tau_p);
    stats.n_candidates = candidates.len();
    stats.n_low_p_negative =
        (0..lp.len()).filter(|&i| m[i] > 0.5 && a[i] < 0.0 && lp[i].exp() < tau_p).count();
    stats.tau_h = match tau_h {
        TauH::Abs(v) => Some(v),
        TauH::Quantile { q, over } => {
            let pop = population(&candidates, &h, &m, over);
            stats.tau_h_population = Some(pop.len());
            quantile_linear(&pop, q)
        }
    };
    let mut keep = vec![1f32; b * l];
    if let Some(th) = stats.tau_h {
        for &i in &candidates {
            if h[i] < th {
                keep[i] = 0.0;
                stats.positions.push((i / l, i % l));
            }
        }
    }
    stats.n_silenced = stats.positions.len();
    let mask = Tensor::from_vec(keep, (b, l), logp.device())?;
    Ok((mask, stats))
}

/// Row-major positions of the S2T candidates: response tokens with `A > 0 && p < tau_p`.
fn candidate_positions(lp: &[f32], a: &[f32], m: &[f32], tau_p: f32) -> Vec<usize> {
    (0..lp.len()).filter(|&i| m[i] > 0.5 && a[i] > 0.0 && lp[i].exp() < tau_p).collect()
}

/// The entropies of a quantile's population, row-major: the candidates' or every
/// response token's.
fn population(candidates: &[usize], h: &[f32], m: &[f32], over: QuantileOver) -> Vec<f32> {
    match over {
        QuantileOver::Candidates => candidates.iter().map(|&i| h[i]).collect(),
        QuantileOver::Response => (0..h.len()).filter(|&i| m[i] > 0.5).map(|i| h[i]).collect(),
    }
}

/// The entropies of the `tau_h` quantile's population (`over`) in a `(B, T)` batch,
/// row-major. A data-parallel update gathers them from every rank so that the quantile
/// is taken over the whole global mini-batch, then applies it with [`TauH::Abs`]: the
/// same mask as [`s2t_mask`] with [`TauH::Quantile`] over the whole mini-batch at once.
pub fn s2t_population_entropies(
    logp: &Tensor,
    entropy: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    tau_p: f32,
    over: QuantileOver,
) -> Result<Vec<f32>> {
    let (b, l) = dims_bt(logp, "s2t: logp")?;
    expect_bt(entropy, "s2t: entropy", b, l)?;
    expect_bt(response_mask, "s2t: response_mask", b, l)?;
    let adv = expand_advantages(advantages, b, l)?;
    let (lp, h) = (host_vec(logp)?, host_vec(entropy)?);
    let (a, m) = (host_vec(&adv)?, host_vec(response_mask)?);
    Ok(population(&candidate_positions(&lp, &a, &m, tau_p), &h, &m, over))
}

/// The 20-Entropy mask: 1 on the `k = max(1, ceil(rho * n))` response tokens of highest
/// entropy in the mini-batch (`n` = response tokens), 0 elsewhere (including non-response
/// positions). `ceil` is computed as in the paper's code, `floor(n * rho + 0.9999)`, so
/// that `rho` stored as f32 (0.2 → 0.2000000030) does not round `n * rho` up.
///
/// Ties: an exact top-k (never more than k tokens); among equal entropies the earlier
/// position in row-major order wins (the paper uses `torch.topk`, whose tie order is
/// unspecified). With no response tokens the mask is all zero.
pub fn top_entropy_mask(
    entropy: &Tensor,
    response_mask: &Tensor,
    rho: f32,
) -> Result<(Tensor, TopEntropyStats)> {
    if !(rho > 0.0 && rho <= 1.0) {
        return Err(Error::invalid(format!("top-entropy: rho = {rho}, expected a number in (0, 1]")));
    }
    let (b, l) = dims_bt(entropy, "top-entropy: entropy")?;
    expect_bt(response_mask, "top-entropy: response_mask", b, l)?;
    let h = host_vec(entropy)?;
    let m = host_vec(response_mask)?;
    let mut idx: Vec<usize> = (0..b * l).filter(|&i| m[i] > 0.5).collect();
    let n = idx.len();
    let k = if n == 0 { 0 } else { ((n as f64 * rho as f64 + 0.9999).floor() as usize).clamp(1, n) };
    // Stable sort, descending entropy: equal entropies keep row-major order.
    idx.sort_by(|&x, &y| h[y].total_cmp(&h[x]));
    let mut keep = vec![0f32; b * l];
    for &i in &idx[..k] {
        keep[i] = 1.0;
    }
    let threshold = if k == 0 { None } else { Some(h[idx[k - 1]]) };
    let mask = Tensor::from_vec(keep, (b, l), entropy.device())?;
    Ok((mask, TopEntropyStats { n_response: n, n_kept: k, threshold }))
}

/// Elementwise product of 0/1 masks of one shape (response mask × S2T × user mask ...):
/// a token is kept only when every mask keeps it.
pub fn compose_masks(masks: &[&Tensor]) -> Result<Tensor> {
    let (first, rest) = masks
        .split_first()
        .ok_or_else(|| Error::invalid("compose_masks: expected at least one mask, found none"))?;
    let mut out = first.to_dtype(DType::F32)?;
    for (i, m) in rest.iter().enumerate() {
        if m.dims() != out.dims() {
            return Err(Error::invalid(format!(
                "compose_masks: mask {} has shape {:?}, expected {:?} like mask 0",
                i + 1,
                m.dims(),
                out.dims()
            )));
        }
        out = out.mul(&m.to_dtype(DType::F32)?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::config::TAU_P_DEFAULT;
    use candle_core::Device;

    fn t2(v: &[f32], b: usize, l: usize) -> Tensor {
        Tensor::from_slice(v, (b, l), &Device::Cpu).unwrap()
    }
    fn v(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    // ln(0.001) = -6.9077553: p = 0.001 < tau_p = 0.002 (low probability).
    // ln(0.5) = -0.6931472: p = 0.5 (not low).
    const LOW: f32 = -6.907_755_3;
    const HIGH: f32 = -std::f32::consts::LN_2;

    /// A quantile over the candidates (stapo's earlier rule).
    fn cand(q: f32) -> TauH {
        TauH::Quantile { q, over: QuantileOver::Candidates }
    }
    /// A quantile over every response token (the paper's reading).
    fn resp(q: f32) -> TauH {
        TauH::Quantile { q, over: QuantileOver::Response }
    }

    #[test]
    fn s2t_needs_all_three_conditions() {
        // One sequence per case, T = 1; absolute tau_h = 1.0.
        //   A>0? p<tau_p? H<tau_h?   silenced?
        // 0  no     no      no        no
        // 1  yes    no      no        no   (each condition alone: rows 1,2,3)
        // 2  no     yes     no        no
        // 3  no     no      yes       no
        // 4  yes    yes     no        no   (any two alone: rows 4,5,6)
        // 5  yes    no      yes       no
        // 6  no     yes     yes       no
        // 7  yes    yes     yes       YES
        // 8  yes    yes     yes       no: not a response token (response_mask = 0)
        // 9  A = 0  yes     yes       no: A > 0 is strict
        let adv = Tensor::new(&[-1f32, 1., -1., -1., 1., 1., -1., 1., 1., 0.], &Device::Cpu).unwrap();
        let lp = t2(&[HIGH, HIGH, LOW, HIGH, LOW, HIGH, LOW, LOW, LOW, LOW], 10, 1);
        let h = t2(&[2., 2., 2., 0.5, 2., 0.5, 0.5, 0.5, 0.5, 0.5], 10, 1);
        let rm = t2(&[1., 1., 1., 1., 1., 1., 1., 1., 0., 1.], 10, 1);
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, TauH::Abs(1.0)).unwrap();
        assert_eq!(v(&m), vec![1., 1., 1., 1., 1., 1., 1., 0., 1., 1.]);
        assert_eq!(s.n_response, 9);
        assert_eq!(s.n_candidates, 2); // rows 4 and 7
        assert_eq!(s.n_low_p_negative, 2); // rows 2 and 6 (row 9 has A = 0)
        assert_eq!(s.tau_h_population, None); // absolute tau_h
        assert_eq!(s.n_silenced, 1);
        assert_eq!(s.positions, vec![(7, 0)]);
        assert_eq!(s.tau_h, Some(1.0));
        // H == tau_h is not silenced (strict <).
        let (m, _) = s2t_mask(&lp, &h, &adv, &rm, 0.002, TauH::Abs(0.5)).unwrap();
        assert_eq!(v(&m), vec![1.; 10]);
    }

    #[test]
    fn s2t_quantile_by_hand() {
        // B = 2, T = 4, per-sequence advantages A = [+1, +1]; response_mask drops (1, 3).
        // Candidates (p < 0.002, response): (0,0) H=0.1, (0,1) H=0.9, (0,3) H=0.5,
        // (1,0) H=0.3, (1,2) H=0.7; (1,3) has H=0.05 but is padding; (0,2), (1,1) high p.
        // Sorted candidate H: [0.1, 0.3, 0.5, 0.7, 0.9], n = 5.
        // q = 0.75: pos = 0.75 * 4 = 3 → tau_h = x[3] = 0.7. Silenced (H < 0.7): 0.1, 0.3, 0.5
        // → positions (0,0), (0,3), (1,0); 0.7 itself is kept.
        let lp = t2(&[LOW, LOW, HIGH, LOW, LOW, HIGH, LOW, LOW], 2, 4);
        let h = t2(&[0.1, 0.9, 0.0, 0.5, 0.3, 0.0, 0.7, 0.05], 2, 4);
        let rm = t2(&[1., 1., 1., 1., 1., 1., 1., 0.], 2, 4);
        let adv = Tensor::new(&[1f32, 1.], &Device::Cpu).unwrap();
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(0.75)).unwrap();
        assert_eq!(s.n_candidates, 5);
        assert_eq!(s.tau_h_population, Some(5));
        assert!((s.tau_h.unwrap() - 0.7).abs() < 1e-7);
        assert_eq!(s.positions, vec![(0, 0), (0, 3), (1, 0)]);
        assert_eq!(v(&m), vec![0., 1., 1., 0., 0., 1., 1., 1.]);
        assert!((s.silenced_ratio() - 3.0 / 7.0).abs() < 1e-7);
        // q = 0.6: pos = 2.4 → 0.5 + 0.4 * (0.7 - 0.5) = 0.58; silenced H < 0.58: 0.1, 0.3, 0.5.
        let (_, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(0.6)).unwrap();
        assert!((s.tau_h.unwrap() - 0.58).abs() < 1e-6);
        assert_eq!(s.n_silenced, 3);
        // q = 0.3: pos = 1.2 → 0.3 + 0.2 * 0.2 = 0.34; silenced: 0.1, 0.3.
        let (_, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(0.3)).unwrap();
        assert!((s.tau_h.unwrap() - 0.34).abs() < 1e-6);
        assert_eq!(s.positions, vec![(0, 0), (1, 0)]);
        // Per-token (B, T) advantages: make sequence 1 negative → candidates 0.1, 0.9, 0.5;
        // q = 0.75: pos = 1.5 → 0.5 + 0.5 * (0.9 - 0.5) = 0.7; silenced 0.1, 0.5.
        let adv_bt = t2(&[1., 1., 1., 1., -1., -1., -1., -1.], 2, 4);
        let (_, s) = s2t_mask(&lp, &h, &adv_bt, &rm, 0.002, cand(0.75)).unwrap();
        assert_eq!(s.n_candidates, 3);
        assert!((s.tau_h.unwrap() - 0.7).abs() < 1e-6);
        assert_eq!(s.positions, vec![(0, 0), (0, 3)]);
    }

    #[test]
    fn s2t_response_quantile_by_hand() {
        // The hand example above with tau_h over every response token: the 7 response
        // entropies sorted [0.0, 0.0, 0.1, 0.3, 0.5, 0.7, 0.9]; q = 0.8: pos = 0.8 * 6 = 4.8
        // → 0.5 + 0.8 * (0.7 - 0.5) = 0.66. Candidates below it: 0.1, 0.5, 0.3.
        let lp = t2(&[LOW, LOW, HIGH, LOW, LOW, HIGH, LOW, LOW], 2, 4);
        let h = t2(&[0.1, 0.9, 0.0, 0.5, 0.3, 0.0, 0.7, 0.05], 2, 4);
        let rm = t2(&[1., 1., 1., 1., 1., 1., 1., 0.], 2, 4);
        let adv = Tensor::new(&[1f32, 1.], &Device::Cpu).unwrap();
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, resp(0.8)).unwrap();
        assert!((s.tau_h.unwrap() - 0.66).abs() < 1e-6);
        assert_eq!((s.n_candidates, s.tau_h_population), (5, Some(7)));
        assert_eq!(s.positions, vec![(0, 0), (0, 3), (1, 0)]);
        assert_eq!(v(&m), vec![0., 1., 1., 0., 0., 1., 1., 1.]);

        // What a quantile over the candidates alone misses: one candidate, (0, 2), at
        // near-zero entropy among confident high-entropy-elsewhere tokens. Response entropies sorted
        // [0.05, 0.5, 1.0, 1.5, 2.0, 3.0]; q = 0.8: pos = 4.0 → tau_h = 2.0 > 0.05: silenced.
        let lp = t2(&[HIGH, HIGH, LOW, HIGH, HIGH, HIGH], 1, 6);
        let h = t2(&[1.0, 2.0, 0.05, 0.5, 3.0, 1.5], 1, 6);
        let rm = t2(&[1.; 6], 1, 6);
        let adv = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, resp(0.8)).unwrap();
        assert_eq!((s.n_candidates, s.tau_h_population, s.tau_h), (1, Some(6), Some(2.0)));
        assert_eq!(v(&m), vec![1., 1., 0., 1., 1., 1.]);
        // Over the candidates the population is that one token: tau_h = its own entropy,
        // and H < H is false, so nothing is silenced, at any q.
        for q in [0.75, 0.8, 1.0] {
            let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(q)).unwrap();
            assert_eq!((s.n_candidates, s.tau_h_population, s.tau_h), (1, Some(1), Some(0.05)));
            assert_eq!((s.n_silenced, v(&m)), (0, vec![1.; 6]));
        }
        // Two more candidates: (0, 1) at exactly tau_h = 2.0 (kept: strict <) and (0, 4)
        // at 3.0, among the top 20% (kept). The response population, and so tau_h, is
        // unchanged by which tokens are candidates.
        let lp = t2(&[HIGH, LOW, LOW, HIGH, LOW, HIGH], 1, 6);
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, resp(0.8)).unwrap();
        assert_eq!((s.n_candidates, s.tau_h), (3, Some(2.0)));
        assert_eq!(v(&m), vec![1., 1., 0., 1., 1., 1.]);
        // An empty response: nothing silenced, no threshold.
        let (m, s) = s2t_mask(&lp, &h, &adv, &t2(&[0.; 6], 1, 6), 0.002, resp(0.8)).unwrap();
        assert_eq!((s.tau_h, s.tau_h_population, s.n_silenced), (None, Some(0), 0));
        assert_eq!(v(&m), vec![1.; 6]);
    }

    /// The paper's rule (§3, §4.1: `TauH::PAPER`, the 0.75-quantile of the candidates'
    /// entropies, strict `<`) by hand for 0, 1, 2, 3, 4 and 9 candidates and with ties:
    /// about floor(0.75 n) candidates are silenced and a lone candidate is kept. Every
    /// row interleaves non-candidates (high p, or A <= 0) at near-zero entropy: they are
    /// neither in the population nor silenced.
    #[test]
    fn s2t_paper_rule_by_candidate_count() {
        // (candidate entropies in row order, tau_h by hand, entropies silenced)
        let cases: [(&[f32], Option<f32>, &[f32]); 9] = [
            (&[], None, &[]),
            // n = 1: pos = 0 → tau_h = 0.4; 0.4 < 0.4 is false.
            (&[0.4], Some(0.4), &[]),
            // n = 2: [0.2, 0.6], pos = 0.75 → 0.2 + 0.75 * 0.4 = 0.5.
            (&[0.6, 0.2], Some(0.5), &[0.2]),
            // n = 3: [0.1, 0.3, 0.8], pos = 1.5 → 0.3 + 0.5 * 0.5 = 0.55.
            (&[0.3, 0.8, 0.1], Some(0.55), &[0.3, 0.1]),
            // n = 4: [0.1, 0.2, 0.4, 0.8], pos = 2.25 → 0.4 + 0.25 * 0.4 = 0.5.
            (&[0.8, 0.1, 0.4, 0.2], Some(0.5), &[0.1, 0.4, 0.2]),
            // n = 9: [0.1 .. 0.9], pos = 6 → x[6] = 0.7: six silenced = floor(6.75).
            (&[0.9, 0.5, 0.1, 0.7, 0.3, 0.8, 0.2, 0.6, 0.4], Some(0.7), &[0.5, 0.1, 0.3, 0.2, 0.6, 0.4]),
            // Ties: all equal → tau_h = 0.3, nothing is strictly below it.
            (&[0.3, 0.3, 0.3, 0.3], Some(0.3), &[]),
            // Ties at the quantile: [0.1, 0.5, 0.5, 0.5], pos = 2.25 → 0.5: only 0.1.
            (&[0.5, 0.1, 0.5, 0.5], Some(0.5), &[0.1]),
            // Ties below it: [0.2, 0.2, 0.6, 0.6], pos = 2.25 → 0.6: both 0.2s.
            (&[0.6, 0.2, 0.6, 0.2], Some(0.6), &[0.2, 0.2]),
        ];
        for (cands, want_tau, want_silenced) in cases {
            // Row: [non-candidate (high p), candidate, non-candidate (A < 0 token)...] per
            // candidate, with per-token advantages so the A <= 0 tokens can sit in the row.
            let (mut lp, mut h, mut adv) = (vec![HIGH, LOW], vec![0.01f32, 0.02], vec![1f32, -1.]);
            for &c in cands {
                lp.extend([LOW, HIGH]);
                h.extend([c, 0.0]);
                adv.extend([1., 1.]);
            }
            let l = lp.len();
            let (lp, h, adv, rm) = (t2(&lp, 1, l), t2(&h, 1, l), t2(&adv, 1, l), t2(&vec![1.; l], 1, l));
            let (m, s) = s2t_mask(&lp, &h, &adv, &rm, TAU_P_DEFAULT, TauH::PAPER).unwrap();
            let what = format!("{} candidates {cands:?}", cands.len());
            assert_eq!((s.n_candidates, s.tau_h_population), (cands.len(), Some(cands.len())), "{what}");
            match (s.tau_h, want_tau) {
                (Some(got), Some(want)) => assert!((got - want).abs() < 1e-6, "{what}: tau_h {got}"),
                (got, want) => assert_eq!(got, want, "{what}"),
            }
            let silenced: Vec<f32> = s.positions.iter().map(|&(_, t)| v(&h)[t]).collect();
            assert_eq!(silenced, want_silenced, "{what}");
            // Distinct entropies: exactly floor(0.75 n) silenced; ties at the threshold are kept.
            let floor = (cands.len() as f32 * 0.75).floor() as usize;
            let distinct = cands.iter().all(|a| cands.iter().filter(|&b| b == a).count() == 1);
            if distinct {
                assert_eq!(s.n_silenced, floor, "{what}");
            } else {
                assert!(s.n_silenced < floor, "{what}");
            }
            let kept = v(&m).iter().filter(|&&x| x == 1.0).count();
            assert_eq!(kept, l - want_silenced.len(), "{what}");
        }
    }

    /// The data-parallel route: each row of the hand example on its own "rank", the
    /// population's entropies gathered (candidates or response tokens), the quantile
    /// taken over all of them and applied with `TauH::Abs` gives the whole-batch mask
    /// and threshold.
    #[test]
    fn s2t_split_over_ranks_equals_whole_batch() {
        let lp = t2(&[LOW, LOW, HIGH, LOW, LOW, HIGH, LOW, LOW], 2, 4);
        let h = t2(&[0.1, 0.9, 0.0, 0.5, 0.3, 0.0, 0.7, 0.05], 2, 4);
        let rm = t2(&[1., 1., 1., 1., 1., 1., 1., 0.], 2, 4);
        let adv = Tensor::new(&[1f32, 1.], &Device::Cpu).unwrap();
        let row = |t: &Tensor, i: usize| t.narrow(0, i, 1).unwrap();
        let cases = [
            (QuantileOver::Candidates, 0.75, vec![0.1, 0.9, 0.5, 0.3, 0.7]),
            (QuantileOver::Response, 0.8, vec![0.1, 0.9, 0.0, 0.5, 0.3, 0.0, 0.7]),
        ];
        for (over, q, want) in cases {
            let (whole, ws) = s2t_mask(&lp, &h, &adv, &rm, 0.002, TauH::Quantile { q, over }).unwrap();
            let mut gathered = Vec::new();
            for i in 0..2 {
                gathered.extend(
                    s2t_population_entropies(
                        &row(&lp, i),
                        &row(&h, i),
                        &row(&adv, i),
                        &row(&rm, i),
                        0.002,
                        over,
                    )
                    .unwrap(),
                );
            }
            assert_eq!(gathered, want, "{over:?}");
            assert_eq!(Some(gathered.len()), ws.tau_h_population);
            let th = quantile_linear(&gathered, q).unwrap();
            assert_eq!(Some(th), ws.tau_h);
            let mut parts = Vec::new();
            for i in 0..2 {
                let (m, _) =
                    s2t_mask(&row(&lp, i), &row(&h, i), &row(&adv, i), &row(&rm, i), 0.002, TauH::Abs(th))
                        .unwrap();
                parts.extend(v(&m));
            }
            assert_eq!(parts, v(&whole), "{over:?}");
        }
    }

    #[test]
    fn s2t_no_candidates_silences_nothing() {
        let lp = t2(&[HIGH, LOW], 1, 2);
        let h = t2(&[0.0, 0.0], 1, 2);
        let rm = t2(&[1., 1.], 1, 2);
        let adv = Tensor::new(&[-1f32], &Device::Cpu).unwrap();
        let (m, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(0.75)).unwrap();
        assert_eq!(v(&m), vec![1., 1.]);
        assert_eq!((s.n_candidates, s.n_silenced, s.tau_h), (0, 0, None));
        // A single candidate is never silenced by a quantile threshold (H < H is false).
        let adv = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let (_, s) = s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(1.0)).unwrap();
        assert_eq!((s.n_candidates, s.n_silenced), (1, 0));
        // Bad inputs.
        assert!(s2t_mask(&lp, &h, &adv, &rm, 0.0, TauH::Abs(1.0)).is_err());
        assert!(s2t_mask(&lp, &h, &adv, &rm, 0.002, cand(1.5)).is_err());
        let bad = t2(&[1., 1., 1.], 1, 3);
        let e = s2t_mask(&lp, &bad, &adv, &rm, 0.002, TauH::Abs(1.0)).unwrap_err();
        assert!(format!("{e}").contains("entropy"));
    }

    #[test]
    fn quantile_matches_torch_linear() {
        // torch.quantile([3, 1, 2, 4], 0.5) = 2.5 (pos 1.5 between 2 and 3).
        assert_eq!(quantile_linear(&[3., 1., 2., 4.], 0.5), Some(2.5));
        assert_eq!(quantile_linear(&[3., 1., 2., 4.], 0.0), Some(1.0));
        assert_eq!(quantile_linear(&[3., 1., 2., 4.], 1.0), Some(4.0));
        // pos = 0.75 * 3 = 2.25 → 3 + 0.25 * 1 = 3.25
        assert_eq!(quantile_linear(&[3., 1., 2., 4.], 0.75), Some(3.25));
        assert_eq!(quantile_linear(&[7.], 0.3), Some(7.0));
        assert_eq!(quantile_linear(&[], 0.3), None);
    }

    #[test]
    fn top_entropy_keeps_top_fraction() {
        // 10 response tokens (one padding position with the largest H, never kept).
        // rho = 0.2: k = floor(10 * 0.2 + 0.9999) = 2 → the two largest H: 0.9 and 0.8.
        let h = t2(&[0.1, 0.9, 0.2, 0.3, 5.0, 0.8, 0.4, 0.5, 0.6, 0.7, 0.05, 0.0], 2, 6);
        let rm = t2(&[1., 1., 1., 1., 0., 1., 1., 1., 1., 1., 1., 0.], 2, 6);
        let (m, s) = top_entropy_mask(&h, &rm, 0.2).unwrap();
        assert_eq!(v(&m), vec![0., 1., 0., 0., 0., 1., 0., 0., 0., 0., 0., 0.]);
        assert_eq!((s.n_response, s.n_kept, s.threshold), (10, 2, Some(0.8)));
        // rho = 0.25: 10 * 0.25 = 2.5 → ceil 3: 0.9, 0.8, 0.7.
        let (m, s) = top_entropy_mask(&h, &rm, 0.25).unwrap();
        assert_eq!(s.n_kept, 3);
        assert_eq!(v(&m).iter().sum::<f32>(), 3.0);
        assert_eq!(v(&m)[9], 1.0);
        // Ties: H all equal, rho 0.2 of 5 → k = 1, the first position wins.
        let h = t2(&[1.; 5], 1, 5);
        let rm = t2(&[1.; 5], 1, 5);
        let (m, _) = top_entropy_mask(&h, &rm, 0.2).unwrap();
        assert_eq!(v(&m), vec![1., 0., 0., 0., 0.]);
        // No response tokens: all zero.
        let (m, s) = top_entropy_mask(&h, &t2(&[0.; 5], 1, 5), 0.2).unwrap();
        assert_eq!(v(&m), vec![0.; 5]);
        assert_eq!((s.n_kept, s.threshold), (0, None));
        assert!(top_entropy_mask(&h, &rm, 0.0).is_err());
    }

    #[test]
    fn compose_is_elementwise_product() {
        let a = t2(&[1., 1., 0., 1.], 2, 2);
        let b = t2(&[1., 0., 1., 1.], 2, 2);
        let c = t2(&[1., 1., 1., 0.], 2, 2);
        assert_eq!(v(&compose_masks(&[&a, &b, &c]).unwrap()), vec![1., 0., 0., 0.]);
        assert!(compose_masks(&[]).is_err());
        assert!(compose_masks(&[&a, &t2(&[1.; 3], 1, 3)]).is_err());
    }
}
