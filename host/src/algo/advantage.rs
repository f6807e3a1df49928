//! Outcome rewards → per-response advantages, on plain `f32` slices.
//!
//! - GRPO group-relative advantage, DeepSeekMath (Shao et al. 2024, arXiv:2402.03300):
//!   `A_i = (R_i - mean(R)) / (std(R) + 1e-6)` over the G responses of one prompt.
//!   The std is the *sample* (unbiased, `n - 1`) std by default, as verl's
//!   `compute_grpo_outcome_advantage` uses `torch.std`; [`StdKind::Population`] is offered.
//! - Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
//!   `A_i = R_i - mean(R)` (no std division).
//! - DAPO (Yu et al. 2025, arXiv:2503.14476): dynamic sampling (drop groups whose rewards
//!   are all equal, they carry no gradient) and the soft overlong punishment (eq. 13).
//!
//! Groups are given by one id per response ([`contiguous_group_ids`] builds them for the
//! usual layout of G consecutive responses per prompt). Everything here is small (one
//! value per response), so it runs on the host.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::{Error, Result};

/// Added to the std in the GRPO denominator (verl's `epsilon=1e-6`).
pub const GRPO_STD_EPS: f32 = 1e-6;

/// Which advantage estimator turns group rewards into advantages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    /// `(R - mean) / (std + 1e-6)` (DeepSeekMath GRPO).
    Grpo,
    /// `R - mean` (Dr.GRPO: no std normalisation).
    DrGrpo,
}

/// Which standard deviation GRPO divides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdKind {
    /// Sample std, `sqrt(sum (R - mean)^2 / (n - 1))` — `torch.std` default, what verl uses.
    Sample,
    /// Population std, `sqrt(sum (R - mean)^2 / n)` (`torch.std(unbiased=False)`, TRL).
    Population,
}

/// How a binary outcome is mapped to a reward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardScale {
    /// Correct → 1, wrong → 0.
    ZeroOne,
    /// Correct → +1, wrong → -1.
    PlusMinusOne,
}

impl RewardScale {
    /// Maps a reward in `[0, 1]` (1 = correct) to this scale: identity for
    /// [`RewardScale::ZeroOne`], `2r - 1` for [`RewardScale::PlusMinusOne`].
    ///
    /// GRPO advantages are invariant to this affine map (mean and std scale alike);
    /// Dr.GRPO advantages double under `PlusMinusOne`.
    pub fn apply(self, r01: f32) -> f32 {
        match self {
            RewardScale::ZeroOne => r01,
            RewardScale::PlusMinusOne => 2.0 * r01 - 1.0,
        }
    }

    /// The reward of a correct (`true`) or wrong (`false`) answer on this scale.
    pub fn of(self, correct: bool) -> f32 {
        self.apply(if correct { 1.0 } else { 0.0 })
    }
}

/// Advantages for a batch of responses, plus what the metrics need.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    /// One advantage per response, in input order.
    pub values: Vec<f32>,
    /// Number of distinct groups.
    pub n_groups: usize,
    /// Group ids (as given) whose rewards were all equal; their advantages are exactly 0.
    pub zero_variance_groups: Vec<usize>,
}

impl Advantages {
    /// Fraction of groups with zero reward variance (0 when there are no groups).
    pub fn zero_variance_fraction(&self) -> f32 {
        if self.n_groups == 0 {
            0.0
        } else {
            self.zero_variance_groups.len() as f32 / self.n_groups as f32
        }
    }
}

/// Group ids `[0,0,..,0, 1,1,..,1, ..]` for `n` responses laid out as consecutive groups of
/// `group_size`. Errors when `group_size` is 0 or does not divide `n`.
pub fn contiguous_group_ids(n: usize, group_size: usize) -> Result<Vec<usize>> {
    if group_size == 0 || !n.is_multiple_of(group_size) {
        return Err(Error::invalid(format!(
            "group ids: {n} responses cannot be split into groups of {group_size} \
             (expected a positive group size that divides the batch)"
        )));
    }
    Ok((0..n).map(|i| i / group_size).collect())
}

/// Indices of the responses of each group, keyed by group id (ascending).
fn groups_of(n: usize, group_ids: &[usize], what: &str) -> Result<BTreeMap<usize, Vec<usize>>> {
    if group_ids.len() != n {
        return Err(Error::invalid(format!(
            "{what}: {n} rewards but {} group ids (expected one id per response)",
            group_ids.len()
        )));
    }
    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &g) in group_ids.iter().enumerate() {
        groups.entry(g).or_default().push(i);
    }
    Ok(groups)
}

/// True when every reward of the group is bit-for-bit equal (rewards are discrete, so
/// exact equality is the right test). A group of one response is zero-variance.
fn all_equal(rewards: &[f32], idx: &[usize]) -> bool {
    idx.windows(2).all(|w| rewards[w[0]] == rewards[w[1]])
}

fn check_finite(rewards: &[f32], what: &str) -> Result<()> {
    match rewards.iter().position(|r| !r.is_finite()) {
        Some(i) => {
            Err(Error::invalid(format!("{what}: reward {i} is {} (expected a finite number)", rewards[i])))
        }
        None => Ok(()),
    }
}

/// Group-relative advantages (GRPO or Dr.GRPO) of `rewards`, grouped by `group_ids`.
///
/// Statistics are computed in `f64`. A group whose rewards are all equal (including a
/// group of a single response) gets `A = 0` for every member and is listed in
/// [`Advantages::zero_variance_groups`]. With [`StdKind::Sample`] the std of a group of
/// `n >= 2` divides by `n - 1`.
///
/// Deviation from verl: verl gives a singleton group mean 0 and std 1 (so `A = R`); here a
/// singleton is a zero-variance group (`A = 0`), consistent with [`dynamic_sampling`].
pub fn group_advantages(
    rewards: &[f32],
    group_ids: &[usize],
    estimator: AdvEstimator,
    std_kind: StdKind,
) -> Result<Advantages> {
    check_finite(rewards, "advantages")?;
    let groups = groups_of(rewards.len(), group_ids, "advantages")?;
    let mut values = vec![0f32; rewards.len()];
    let mut zero_variance_groups = Vec::new();
    for (&g, idx) in &groups {
        if all_equal(rewards, idx) {
            zero_variance_groups.push(g);
            continue; // values stay exactly 0
        }
        let n = idx.len() as f64;
        let mean = idx.iter().map(|&i| rewards[i] as f64).sum::<f64>() / n;
        let ss = idx.iter().map(|&i| (rewards[i] as f64 - mean).powi(2)).sum::<f64>();
        let denom = match estimator {
            AdvEstimator::DrGrpo => 1.0,
            AdvEstimator::Grpo => {
                let var = match std_kind {
                    StdKind::Sample => ss / (n - 1.0), // n >= 2 here: a singleton is all-equal
                    StdKind::Population => ss / n,
                };
                var.sqrt() + GRPO_STD_EPS as f64
            }
        };
        for &i in idx {
            values[i] = ((rewards[i] as f64 - mean) / denom) as f32;
        }
    }
    Ok(Advantages { values, n_groups: groups.len(), zero_variance_groups })
}

/// Which responses DAPO's dynamic sampling keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicSampling {
    /// Per response: `true` to keep, `false` when its group is dropped.
    pub keep: Vec<bool>,
    /// Group ids dropped because all their rewards are equal (ascending).
    pub dropped_groups: Vec<usize>,
    /// Number of groups kept.
    pub kept_groups: usize,
}

/// DAPO dynamic sampling: drop every group whose rewards are all equal (accuracy 0 or 1),
/// since its GRPO advantages are all zero. A group of one response counts as all-equal
/// (verl keeps singletons; see [`group_advantages`] for why we do not).
pub fn dynamic_sampling(rewards: &[f32], group_ids: &[usize]) -> Result<DynamicSampling> {
    check_finite(rewards, "dynamic sampling")?;
    let groups = groups_of(rewards.len(), group_ids, "dynamic sampling")?;
    let mut keep = vec![true; rewards.len()];
    let mut dropped_groups = Vec::new();
    for (&g, idx) in &groups {
        if all_equal(rewards, idx) {
            dropped_groups.push(g);
            for &i in idx {
                keep[i] = false;
            }
        }
    }
    let kept_groups = groups.len() - dropped_groups.len();
    Ok(DynamicSampling { keep, dropped_groups, kept_groups })
}

/// DAPO's soft overlong punishment (DAPO eq. 13). Fields left out take DAPO's (20480,
/// 4096, 1.0), which the entry points fit to the run's response budget.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongConfig {
    /// `L_max`: the maximum response length (tokens); beyond it the full penalty applies.
    pub max_len: usize,
    /// `L_cache`: the soft buffer at the end of `L_max` over which the penalty ramps up.
    pub cache_len: usize,
    /// Penalty at (and beyond) `L_max` is `-factor` (DAPO: 1.0).
    pub factor: f32,
}

impl Default for OverlongConfig {
    fn default() -> Self {
        OverlongConfig { max_len: 20480, cache_len: 4096, factor: 1.0 }
    }
}

impl OverlongConfig {
    /// Checks `0 < cache_len <= max_len` and a finite, non-negative factor.
    pub fn validate(&self) -> Result<()> {
        if self.cache_len == 0 || self.cache_len > self.max_len {
            return Err(Error::invalid(format!(
                "overlong: cache_len {} must be in 1..={} (max_len)",
                self.cache_len, self.max_len
            )));
        }
        if !self.factor.is_finite() || self.factor < 0.0 {
            return Err(Error::invalid(format!(
                "overlong: factor {} must be a finite number >= 0",
                self.factor
            )));
        }
        Ok(())
    }

    /// The additive reward for a response of `len` tokens:
    /// `0` if `len <= L_max - L_cache`; `(L_max - L_cache - len) / L_cache * factor` inside
    /// the buffer (`L_max - L_cache < len <= L_max`, from just below 0 down to `-factor`);
    /// `-factor` beyond `L_max`.
    pub fn penalty(&self, len: usize) -> f32 {
        let expected = self.max_len.saturating_sub(self.cache_len);
        if len <= expected {
            0.0
        } else if len <= self.max_len {
            -((len - expected) as f32) / self.cache_len as f32 * self.factor
        } else {
            -self.factor
        }
    }

    /// Adds [`OverlongConfig::penalty`] of each response length to its reward, in place.
    pub fn apply(&self, rewards: &mut [f32], lens: &[usize]) -> Result<()> {
        self.validate()?;
        if rewards.len() != lens.len() {
            return Err(Error::invalid(format!(
                "overlong: {} rewards but {} lengths (expected one length per response)",
                rewards.len(),
                lens.len()
            )));
        }
        for (r, &l) in rewards.iter_mut().zip(lens) {
            *r += self.penalty(l);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol, "index {i}: {x} vs {y}");
        }
    }

    #[test]
    fn grpo_sample_std_by_hand() {
        // Group 0: R = [1, 0, 0, 1]; mean 0.5; deviations ±0.5; ss = 4 * 0.25 = 1.
        // sample std = sqrt(1/3) = 0.5773503; A = ±0.5 / (0.5773503 + 1e-6) = ±0.8660239.
        // Group 1: R = [1, 0, 0, 0]; mean 0.25; deviations 0.75, -0.25 x3;
        // ss = 0.5625 + 3 * 0.0625 = 0.75; sample std = sqrt(0.25) = 0.5;
        // A = 0.75/0.500001 = 1.4999970, -0.25/0.500001 = -0.4999990.
        let r = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0];
        let ids = contiguous_group_ids(8, 4).unwrap();
        let a = group_advantages(&r, &ids, AdvEstimator::Grpo, StdKind::Sample).unwrap();
        let s = (0.5 / ((1f64 / 3.0).sqrt() + 1e-6)) as f32; // 0.8660239
        close(&a.values, &[s, -s, -s, s, 1.499_997, -0.499_999, -0.499_999, -0.499_999], 1e-6);
        assert_eq!(a.n_groups, 2);
        assert!(a.zero_variance_groups.is_empty());
    }

    #[test]
    fn grpo_population_std_by_hand() {
        // R = [1, 0, 0, 1]: population std = sqrt(1/4) = 0.5; A = ±0.5/0.500001 = ±0.999998.
        let r = [1.0, 0.0, 0.0, 1.0];
        let a = group_advantages(&r, &[7, 7, 7, 7], AdvEstimator::Grpo, StdKind::Population).unwrap();
        close(&a.values, &[0.999998, -0.999998, -0.999998, 0.999998], 1e-6);
    }

    #[test]
    fn dr_grpo_no_std() {
        // R = [1, 0, 0, 0]: mean 0.25 → A = [0.75, -0.25, -0.25, -0.25], whatever the std kind.
        let r = [1.0, 0.0, 0.0, 0.0];
        for k in [StdKind::Sample, StdKind::Population] {
            let a = group_advantages(&r, &[0; 4], AdvEstimator::DrGrpo, k).unwrap();
            close(&a.values, &[0.75, -0.25, -0.25, -0.25], 0.0);
        }
        // ±1 scale doubles Dr.GRPO advantages: R = [1, -1, -1, -1], mean -0.5 → [1.5, -0.5 ..].
        let r: Vec<f32> = [1.0, 0.0, 0.0, 0.0].iter().map(|&x| RewardScale::PlusMinusOne.apply(x)).collect();
        let a = group_advantages(&r, &[0; 4], AdvEstimator::DrGrpo, StdKind::Sample).unwrap();
        close(&a.values, &[1.5, -0.5, -0.5, -0.5], 0.0);
    }

    #[test]
    fn zero_variance_groups_are_zero_and_counted() {
        // Groups (non-contiguous ids): 3 → all 1; 5 → all 0 (rewards 0.1 to catch inexact
        // means: 0.1*3/3 need not be exactly 0.1 in float); 9 → mixed; 4 → singleton.
        let r = [1.0, 0.1, 1.0, 0.1, 0.0, 1.0, 0.1, 0.5];
        let ids = [3, 5, 3, 5, 9, 9, 5, 4];
        let a = group_advantages(&r, &ids, AdvEstimator::Grpo, StdKind::Sample).unwrap();
        // Group 9: R = [0, 1], mean 0.5, sample std = sqrt(0.5/1) = 0.7071068;
        // A = ∓0.5/0.7071078 = ∓0.7071058.
        close(&a.values, &[0.0, 0.0, 0.0, 0.0, -0.7071058, 0.7071058, 0.0, 0.0], 1e-6);
        assert!(a.values.iter().enumerate().all(|(i, v)| i == 4 || i == 5 || *v == 0.0));
        assert_eq!(a.zero_variance_groups, vec![3, 4, 5]);
        assert_eq!(a.n_groups, 4);
        assert!((a.zero_variance_fraction() - 0.75).abs() < 1e-7);
    }

    #[test]
    fn dynamic_sampling_drops_all_equal_groups() {
        let r = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0];
        let ids = contiguous_group_ids(6, 2).unwrap(); // groups: [1,1] [0,1] [0,0]
        let d = dynamic_sampling(&r, &ids).unwrap();
        assert_eq!(d.keep, vec![false, false, true, true, false, false]);
        assert_eq!(d.dropped_groups, vec![0, 2]);
        assert_eq!(d.kept_groups, 1);
    }

    #[test]
    fn overlong_shaping_by_hand() {
        // DAPO paper numbers: L_max = 20480, L_cache = 4096 → expected length 16384.
        let o = OverlongConfig { max_len: 20480, cache_len: 4096, factor: 1.0 };
        assert_eq!(o.penalty(0), 0.0);
        assert_eq!(o.penalty(16384), 0.0); // boundary: len <= L_max - L_cache → 0
                                           // 16384 + 1024: (16384 - 17408)/4096 = -0.25
        assert_eq!(o.penalty(17408), -0.25);
        assert_eq!(o.penalty(18432), -0.5);
        assert_eq!(o.penalty(20480), -1.0); // end of the buffer: -factor
        assert_eq!(o.penalty(25000), -1.0); // beyond: -factor
                                            // factor 0.5, small numbers: L_max 10, L_cache 4 → expected 6; len 7 → -1/4*0.5.
        let o = OverlongConfig { max_len: 10, cache_len: 4, factor: 0.5 };
        let mut r = [1.0, 1.0, 0.0, 0.0];
        o.apply(&mut r, &[6, 7, 10, 11]).unwrap();
        close(&r, &[1.0, 0.875, -0.5, -0.5], 0.0);
        assert!(o.apply(&mut r, &[1, 2]).is_err());
        assert!(OverlongConfig { max_len: 4, cache_len: 5, factor: 1.0 }.validate().is_err());
        assert!(OverlongConfig { max_len: 4, cache_len: 0, factor: 1.0 }.validate().is_err());
    }

    #[test]
    fn reward_scale_and_input_errors() {
        assert_eq!(RewardScale::ZeroOne.of(true), 1.0);
        assert_eq!(RewardScale::ZeroOne.of(false), 0.0);
        assert_eq!(RewardScale::PlusMinusOne.of(true), 1.0);
        assert_eq!(RewardScale::PlusMinusOne.of(false), -1.0);
        assert!(contiguous_group_ids(7, 2).is_err());
        assert!(contiguous_group_ids(4, 0).is_err());
        let e = group_advantages(&[1.0, 0.0], &[0], AdvEstimator::Grpo, StdKind::Sample);
        assert!(e.is_err());
        let e = group_advantages(&[1.0, f32::NAN], &[0, 0], AdvEstimator::Grpo, StdKind::Sample);
        assert!(format!("{}", e.unwrap_err()).contains("reward 1"));
    }
}
