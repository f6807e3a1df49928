//! Sampling parameters, as a script or a config file gives them. The serde names are
//! vLLM's (`max_tokens`, `stop`), the ones scripts write.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How to sample responses. Missing fields take their [`Default`] value when
/// deserialised (`n` 8, temperature 1.0, top-p 1.0: the STAPO paper's rollout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Samples per prompt (the GRPO group size G).
    pub n: usize,
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose
    /// probability sums to at least `top_p` (1.0 = off).
    pub top_p: f64,
    /// Keep only the `k` most likely tokens (None = off).
    pub top_k: Option<usize>,
    /// Min-p sampling (HF's `MinPLogitsWarper`, vLLM's `min_p`): after temperature,
    /// top-k and top-p, keep the tokens whose probability is at least `min_p` times
    /// the most likely token's (0 = off).
    pub min_p: f64,
    /// Longest response (serde name `max_tokens`, as vLLM); a response that reaches it is
    /// marked truncated.
    #[serde(rename = "max_tokens")]
    pub max_new_tokens: usize,
    /// Tokens that end a response (e.g. `<|im_end|>`); included in the response.
    /// The model's `eos_token_id` is always a stop token unless `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a response when its decoded text contains them; the
    /// response ends with the token that completed the string (serde name `stop`, as vLLM).
    #[serde(rename = "stop")]
    pub stop_strings: Vec<String>,
    /// Do not stop at the model's `eos_token_id` (benchmarks); the other stop
    /// tokens and strings still apply.
    pub ignore_eos: bool,
    /// Seed of the run. Each response draws from its own generator seeded by
    /// (seed, prompt index, sample index), see [`super::row_seed`].
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of one response per prompt.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { n: 1, temperature: 0.0, max_new_tokens, ..Self::default() }
    }

    /// True when tokens are chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field against what sampling accepts for a vocabulary of `vocab` tokens.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        // A config error naming the field, which a section prefixes (`rollout.sampling.min_p`).
        let bad = |field: &str, msg: String| {
            Err(Error::Config { file: "sampling params".into(), field: field.into(), msg })
        };
        if self.n == 0 {
            return bad("n", "expected at least 1 sample per prompt, found 0".into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", format!("expected a finite value >= 0, found {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("expected a value in (0, 1], found {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return bad("min_p", format!("expected a value in [0, 1], found {}", self.min_p));
        }
        if self.top_k == Some(0) {
            return bad("top_k", "expected at least 1 (or none), found 0".into());
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "expected at least 1, found 0".into());
        }
        if let Some(&t) = self.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            return bad("stop_token_ids", format!("token {t} is outside the vocabulary of {vocab}"));
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return bad(
                "stop_strings",
                "found an empty string, which would stop every response at once".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_json_takes_defaults_and_unknown_fields_are_rejected() {
        let p: SamplingParams = serde_json::from_str(r#"{"n": 4, "top_p": 0.9}"#).expect("parse");
        assert_eq!(p, SamplingParams { n: 4, top_p: 0.9, ..SamplingParams::default() });
        let p: SamplingParams = serde_json::from_str(r#"{"max_tokens": 4, "stop": ["x"]}"#).expect("parse");
        assert_eq!((p.max_new_tokens, p.stop_strings), (4, vec!["x".to_string()]));
        assert!(serde_json::from_str::<SamplingParams>(r#"{"max_new_tokens": 4}"#).is_err());
    }

    #[test]
    fn validate_names_the_field() {
        let cases = [
            (SamplingParams { n: 0, ..Default::default() }, "`n`"),
            (SamplingParams { temperature: -1.0, ..Default::default() }, "`temperature`"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "`top_p`"),
            (SamplingParams { top_k: Some(0), ..Default::default() }, "`top_k`"),
            (SamplingParams { min_p: -0.1, ..Default::default() }, "`min_p`"),
            (SamplingParams { min_p: 1.5, ..Default::default() }, "`min_p`"),
            (SamplingParams { min_p: f64::NAN, ..Default::default() }, "`min_p`"),
            (SamplingParams { max_new_tokens: 0, ..Default::default() }, "`max_new_tokens`"),
            (SamplingParams { stop_token_ids: vec![100], ..Default::default() }, "`stop_token_ids`"),
            (SamplingParams { stop_strings: vec![String::new()], ..Default::default() }, "`stop_strings`"),
        ];
        for (p, field) in cases {
            let err = p.validate(100).expect_err(field).to_string();
            assert!(err.contains(field), "{err}");
        }
        SamplingParams::default().validate(100).expect("defaults are valid");
    }
}
