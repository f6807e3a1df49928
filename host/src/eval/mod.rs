//! Evaluation: avg@n and pass@k over benchmark files, overall and per source,
//! as in the STAPO paper's tables (avg@32 on AIME/AMC, avg@4 on the rest).
//!
//! pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large
//! Language Models Trained on Code"): `1 - C(n-c, k) / C(n, k)` per problem
//! with `c` correct of `n` samples, averaged over problems. pass@n is always
//! reported; [`EvalReport::with_pass_k`] adds pass@k for a list of k (the
//! usual 1, 4, 16 of n = 32).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::data::{Example, Prompt};
use crate::reward::{self, ExtractMode};
use crate::rollout::{EngineConfig, GenerateOptions, Generator, SamplingParams};
use crate::{Error, Result};

/// One graded sample.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GradedSample {
    /// The problem's id.
    pub id: String,
    /// The benchmark or dataset the problem comes from.
    pub source: String,
    /// Index of the sample among the problem's samples.
    pub sample_index: usize,
    /// The reference answer.
    pub answer: String,
    /// The decoded response.
    pub response: String,
    /// The answer extracted from the response (`None`: none found).
    pub extracted: Option<String>,
    /// True when the extracted answer equals the reference.
    pub correct: bool,
    /// Response length in tokens.
    pub response_len: usize,
    /// True when the response hit `max_new_tokens` without stopping.
    pub truncated: bool,
}

/// Scores of a set of problems.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Scores {
    /// Problems scored.
    pub problems: usize,
    /// Samples drawn per problem (n of avg@n).
    pub samples_per_problem: usize,
    /// Mean accuracy over all samples (avg@n), in [0, 1].
    pub avg: f64,
    /// Unbiased pass@n, in [0, 1].
    pub pass: f64,
    /// Mean response length in tokens.
    pub mean_len: f64,
    /// Unbiased pass@k for each requested k (JSON keys are the k), in [0, 1].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pass_at_k: BTreeMap<usize, f64>,
}

/// An evaluation: overall and per-source scores, and every graded sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvalReport {
    /// Scores over every problem.
    pub overall: Scores,
    /// Scores per source (benchmark).
    pub by_source: BTreeMap<String, Scores>,
    /// Every graded sample (not serialised into the report).
    #[serde(skip)]
    pub samples: Vec<GradedSample>,
}

/// Unbiased pass@k from `n` samples with `c` correct (meaningful for k <= n).
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || n == 0 || c == 0 {
        return 0.0;
    }
    if n - c < k {
        return 1.0;
    }
    // 1 - prod_{i=n-c+1}^{n} (1 - k/i), the numerically stable form.
    1.0 - ((n - c + 1)..=n).map(|i| 1.0 - k as f64 / i as f64).product::<f64>()
}

/// Checks a list of k for pass@k against `n` samples per problem: every k
/// must be in 1..=n (the estimator needs at least k samples).
pub fn check_pass_k(ks: &[usize], n: usize) -> Result<()> {
    match ks.iter().find(|&&k| k == 0 || k > n) {
        Some(k) => Err(Error::invalid(format!(
            "pass@k: k = {k} is not between 1 and the {n} samples per problem (asked for {ks:?})"
        ))),
        None => Ok(()),
    }
}

/// (samples, correct) per problem id.
fn counts<'a>(samples: &[&'a GradedSample]) -> BTreeMap<&'a str, (usize, usize)> {
    let mut by_problem: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for s in samples {
        let e = by_problem.entry(&s.id).or_default();
        e.0 += 1;
        e.1 += usize::from(s.correct);
    }
    by_problem
}

/// Unbiased pass@k for each k, averaged over problems; an error when a
/// problem has fewer than k samples.
pub fn pass_at_ks(samples: &[&GradedSample], ks: &[usize]) -> Result<BTreeMap<usize, f64>> {
    let by_problem = counts(samples);
    if by_problem.is_empty() {
        return Ok(BTreeMap::new());
    }
    let fewest = by_problem.values().map(|v| v.0).min().unwrap_or(0);
    check_pass_k(ks, fewest)?;
    let n_problems = by_problem.len() as f64;
    Ok(ks
        .iter()
        .map(|&k| (k, by_problem.values().map(|&(n, c)| pass_at_k(n, c, k)).sum::<f64>() / n_problems))
        .collect())
}

/// Scores of graded samples grouped by problem id.
pub fn score(samples: &[&GradedSample]) -> Scores {
    let by_problem = counts(samples);
    let n_problems = by_problem.len();
    if n_problems == 0 {
        return Scores::default();
    }
    let n = by_problem.values().map(|v| v.0).max().unwrap_or(0);
    Scores {
        problems: n_problems,
        samples_per_problem: n,
        avg: samples.iter().filter(|s| s.correct).count() as f64 / samples.len() as f64,
        pass: by_problem.values().map(|&(n, c)| pass_at_k(n, c, n)).sum::<f64>() / n_problems as f64,
        mean_len: samples.iter().map(|s| s.response_len as f64).sum::<f64>() / samples.len() as f64,
        pass_at_k: BTreeMap::new(),
    }
}

impl EvalReport {
    /// Adds unbiased pass@k for each k in `ks` to the overall and per-source
    /// scores; an error names a k above the samples per problem.
    pub fn with_pass_k(mut self, ks: &[usize]) -> Result<Self> {
        let all: Vec<&GradedSample> = self.samples.iter().collect();
        self.overall.pass_at_k = pass_at_ks(&all, ks)?;
        for (source, scores) in &mut self.by_source {
            let mine: Vec<&GradedSample> = self.samples.iter().filter(|s| &s.source == source).collect();
            scores.pass_at_k = pass_at_ks(&mine, ks)?;
        }
        Ok(self)
    }
}

/// Samples `params.n` responses per example with `generator` (model,
/// tokenizer, prompt template) on the rollout engine with `engine`'s settings
/// (the run's `rollout.engine`: cache budget, rows, block size), all examples
/// in one rollout so that the engine keeps its rows full, and grades them.
/// `progress` is called with the number of tokens sampled so far.
pub fn evaluate(
    generator: &Generator,
    examples: &[Example],
    params: &SamplingParams,
    mode: ExtractMode,
    engine: &EngineConfig,
    progress: &dyn Fn(usize),
) -> Result<EvalReport> {
    if examples.is_empty() {
        return Err(Error::invalid("evaluate: no examples"));
    }
    let prompts: Vec<Prompt> = examples.iter().map(|e| e.prompt()).collect();
    let opts = GenerateOptions { engine: *engine, progress: Some(progress), ..GenerateOptions::default() };
    let mut samples = generator.generate(&prompts, params, &opts)?.samples;
    // The engine returns responses as they end; grade them in (problem, sample) order.
    samples.sort_by_key(|s| (s.prompt_index, s.sample_index));
    let mut graded = Vec::with_capacity(samples.len());
    for s in samples {
        let ex = &examples[s.prompt_index];
        let v = reward::verify(&ex.answer, &s.text, mode);
        graded.push(GradedSample {
            id: ex.id.clone(),
            source: ex.source.clone(),
            sample_index: s.sample_index,
            answer: ex.answer.clone(),
            response_len: s.response_ids.len(),
            truncated: s.truncated,
            response: s.text,
            extracted: v.extracted,
            correct: v.correct,
        });
    }
    let all: Vec<&GradedSample> = graded.iter().collect();
    let mut by_source: BTreeMap<String, Vec<&GradedSample>> = BTreeMap::new();
    for s in &graded {
        by_source.entry(s.source.clone()).or_default().push(s);
    }
    Ok(EvalReport {
        overall: score(&all),
        by_source: by_source.into_iter().map(|(k, v)| (k, score(&v))).collect(),
        samples: graded,
    })
}

/// Writes one JSON line per graded sample, atomically.
pub fn write_samples(path: &Path, samples: &[GradedSample]) -> Result<()> {
    let mut text = String::new();
    for s in samples {
        text.push_str(&serde_json::to_string(s).map_err(|e| Error::invalid(e.to_string()))?);
        text.push('\n');
    }
    crate::files::write_file_atomically(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_matches_the_combinatorial_formula() {
        // n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        // k = n: any correct sample passes.
        assert_eq!(pass_at_k(8, 1, 8), 1.0);
        assert_eq!(pass_at_k(8, 0, 8), 0.0);
        // k = 1 equals the mean accuracy: c/n.
        assert!((pass_at_k(8, 3, 1) - 3.0 / 8.0).abs() < 1e-12);
        // n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
        assert!((pass_at_k(5, 2, 3) - 0.9).abs() < 1e-12);
        // No correct sample: 0 for every k, also k > n.
        assert_eq!(pass_at_k(2, 0, 4), 0.0);
    }

    /// 1 - C(n-c, k) / C(n, k) by exact integer binomials.
    fn pass_by_binomials(n: u64, c: u64, k: u64) -> f64 {
        let binom = |n: u64, k: u64| -> f64 {
            if k > n {
                return 0.0;
            }
            (0..k).fold(1.0, |acc, j| acc * (n - j) as f64 / (j + 1) as f64)
        };
        1.0 - binom(n - c, k) / binom(n, k)
    }

    #[test]
    fn pass_at_k_for_several_k_matches_binomials() {
        for (n, c) in [(32, 0), (32, 1), (32, 5), (32, 31), (32, 32), (16, 3)] {
            for k in [1, 4, 16] {
                let got = pass_at_k(n, c, k);
                let want = pass_by_binomials(n as u64, c as u64, k as u64);
                assert!((got - want).abs() < 1e-12, "n={n} c={c} k={k}: {got} != {want}");
            }
        }
    }

    #[test]
    fn report_adds_pass_at_k_overall_and_by_source() {
        // Problem a: 1 of 4 correct; b: 0 of 4; c (source y): 2 of 4.
        let mut s = Vec::new();
        for (id, source, correct) in [("a", "x", 1), ("b", "x", 0), ("c", "y", 2)] {
            for i in 0..4 {
                s.push(g(id, source, i < correct));
            }
        }
        let refs: Vec<&GradedSample> = s.iter().collect();
        let by_source = [("x", &s[..8]), ("y", &s[8..])]
            .into_iter()
            .map(|(k, v)| (k.to_string(), score(&v.iter().collect::<Vec<_>>())))
            .collect();
        let rep = EvalReport { overall: score(&refs), by_source, samples: s.clone() };
        let rep = rep.with_pass_k(&[1, 2, 4]).unwrap_or_else(|e| panic!("{e}"));
        // pass@1 = mean accuracy; pass@2 of (4, 1) = 1/2, of (4, 2) = 1 - 1/6; pass@4 = pass@n.
        let o = &rep.overall.pass_at_k;
        assert!((o[&1] - 3.0 / 12.0).abs() < 1e-12);
        assert!((o[&2] - (0.5 + 0.0 + 5.0 / 6.0) / 3.0).abs() < 1e-12);
        assert!((o[&4] - rep.overall.pass).abs() < 1e-12);
        assert!((rep.by_source["x"].pass_at_k[&2] - 0.25).abs() < 1e-12);
        assert!((rep.by_source["y"].pass_at_k[&1] - 0.5).abs() < 1e-12);
        // Written to eval.jsonl and read back with the k as keys.
        let json = serde_json::to_value(&rep.overall).unwrap_or_default();
        assert!((json["pass_at_k"]["2"].as_f64().unwrap_or(f64::NAN) - o[&2]).abs() < 1e-12);
        let back: Scores = serde_json::from_value(json).unwrap_or_default();
        assert_eq!(&back, &rep.overall);
        // k above the samples per problem, or 0, is an error naming it.
        let rep2 = EvalReport { overall: score(&refs), by_source: BTreeMap::new(), samples: s };
        let err = rep2.with_pass_k(&[1, 8]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("k = 8") && err.contains("4 samples"), "{err}");
        assert!(check_pass_k(&[0], 4).is_err());
        assert!(check_pass_k(&[1, 4], 4).is_ok());
    }

    fn g(id: &str, source: &str, correct: bool) -> GradedSample {
        GradedSample {
            id: id.into(),
            source: source.into(),
            sample_index: 0,
            answer: String::new(),
            response: String::new(),
            extracted: None,
            correct,
            response_len: 10,
            truncated: false,
        }
    }

    #[test]
    fn scores_average_over_samples_and_pass_over_problems() {
        let s = [g("a", "x", true), g("a", "x", false), g("b", "x", false), g("b", "x", false)];
        let refs: Vec<&GradedSample> = s.iter().collect();
        let sc = score(&refs);
        assert_eq!(sc.problems, 2);
        assert_eq!(sc.samples_per_problem, 2);
        assert!((sc.avg - 0.25).abs() < 1e-12);
        assert!((sc.pass - 0.5).abs() < 1e-12);
    }
}
