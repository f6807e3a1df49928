//! Evaluation: avg@n and pass@k over benchmark files, overall and per source,
//! as in the STAPO paper's tables (avg@32 on AIME/AMC, avg@4 on the rest).
//!
//! pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large
//! Language Models Trained on Code"): `1 - C(n-c, k) / C(n, k)` per problem
//! with `c` correct of `n` samples, averaged over problems.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::data::{Example, PromptTemplate, Tokenizer};
use crate::model::Qwen3;
use crate::reward::{self, ExtractMode};
use crate::rollout::{self, GenerateHooks, SamplingParams};
use crate::{Error, Result};

/// One graded sample.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GradedSample {
    pub id: String,
    pub source: String,
    pub sample_index: usize,
    pub answer: String,
    pub response: String,
    pub extracted: Option<String>,
    pub correct: bool,
    pub response_len: usize,
    pub truncated: bool,
}

/// Scores of a set of problems.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Scores {
    pub problems: usize,
    pub samples_per_problem: usize,
    /// Mean accuracy over all samples (avg@n), in [0, 1].
    pub avg: f64,
    /// Unbiased pass@n, in [0, 1].
    pub pass: f64,
    /// Mean response length in tokens.
    pub mean_len: f64,
}

/// An evaluation: overall and per-source scores, and every graded sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvalReport {
    pub overall: Scores,
    pub by_source: BTreeMap<String, Scores>,
    #[serde(skip)]
    pub samples: Vec<GradedSample>,
}

/// Unbiased pass@k from `n` samples with `c` correct.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || n == 0 {
        return 0.0;
    }
    if n - c < k {
        return 1.0;
    }
    // 1 - prod_{i=n-c+1}^{n} (1 - k/i), the numerically stable form.
    1.0 - ((n - c + 1)..=n).map(|i| 1.0 - k as f64 / i as f64).product::<f64>()
}

/// Scores of graded samples grouped by problem id.
pub fn score(samples: &[&GradedSample]) -> Scores {
    let mut by_problem: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for s in samples {
        let e = by_problem.entry(&s.id).or_default();
        e.0 += 1;
        e.1 += usize::from(s.correct);
    }
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
    }
}

/// Samples `params.n` responses per example and grades them. `batch_prompts`
/// bounds how many prompts are decoded together; `progress` is called with
/// the number of problems done.
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    model: &Qwen3,
    tokenizer: &Tokenizer,
    examples: &[Example],
    template: &PromptTemplate,
    params: &SamplingParams,
    mode: ExtractMode,
    batch_prompts: usize,
    progress: &dyn Fn(usize),
) -> Result<EvalReport> {
    if examples.is_empty() {
        return Err(Error::invalid("evaluate: no examples"));
    }
    let decode = |ids: &[u32]| tokenizer.decode(ids, true).unwrap_or_default();
    let mut graded = Vec::with_capacity(examples.len() * params.n);
    let mut done = 0;
    for chunk in examples.chunks(batch_prompts.max(1)) {
        let prompts: Vec<Vec<u32>> = chunk
            .iter()
            .map(|e| tokenizer.encode(&template.render(&e.problem), false))
            .collect::<Result<_>>()?;
        let samples = rollout::generate_with(
            model,
            &prompts,
            params,
            tokenizer.pad_id(),
            &decode,
            &GenerateHooks::default(),
        )?;
        for s in samples {
            let ex = &chunk[s.prompt_index];
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
        done += chunk.len();
        progress(done);
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
    crate::util::write_file_atomically(path, text.as_bytes())
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
