//! One response being generated ([`Row`]: its generator and draws so far) and
//! when a response ends ([`StopRules`]): what the engine keeps per sequence.

use rand::rngs::StdRng;

use super::batch::{Finish, Sample};
use super::sampler::TokenDraw;
use super::SamplingParams;

/// When a response ends.
pub(super) struct StopRules {
    eos: Option<u32>,
    tokens: Vec<u32>,
    strings: Vec<String>,
    /// Tokens decoded from the end of a response to look for stop strings.
    window: usize,
}

impl StopRules {
    pub(super) fn new(params: &SamplingParams, eos: Option<u32>) -> Self {
        let longest = params.stop_strings.iter().map(String::len).max().unwrap_or(0);
        // A stop string completed by the newest token lies within its last
        // `len` tokens if every token decodes to at least one byte; the margin
        // covers tokens that decode to nothing (e.g. skipped special tokens).
        Self {
            eos,
            tokens: params.stop_token_ids.clone(),
            strings: params.stop_strings.clone(),
            window: 2 * longest + 8,
        }
    }

    /// Whether `ids` (a response so far) has just been ended by its last token.
    /// Only the tail is decoded, so the check costs O(window) per token rather
    /// than O(length).
    pub(super) fn check(&self, ids: &[u32], decode: &dyn Fn(&[u32]) -> String) -> Option<Finish> {
        let &last = ids.last()?;
        if Some(last) == self.eos {
            return Some(Finish::Eos);
        }
        if self.tokens.contains(&last) {
            return Some(Finish::Stop);
        }
        if !self.strings.is_empty() {
            let text = decode(&ids[ids.len().saturating_sub(self.window)..]);
            if self.strings.iter().any(|s| text.contains(s.as_str())) {
                return Some(Finish::StopString);
            }
        }
        None
    }
}

/// One response being generated.
pub(super) struct Row {
    prompt_index: usize,
    sample_index: usize,
    pub(super) rng: StdRng,
    pub(super) ids: Vec<u32>,
    logprobs: Vec<f32>,
    old_logprobs: Vec<f32>,
    entropies: Vec<f32>,
    pub(super) done: bool,
}

impl Row {
    /// An empty response of prompt `prompt_index` (local), sample
    /// `sample_index`, drawing from `rng`, with room for `cap` tokens.
    pub(super) fn new(prompt_index: usize, sample_index: usize, rng: StdRng, cap: usize) -> Self {
        // Reserve a little: most responses end long before `max_new_tokens`.
        let cap = cap.min(256);
        Self {
            prompt_index,
            sample_index,
            rng,
            ids: Vec::with_capacity(cap),
            logprobs: Vec::with_capacity(cap),
            old_logprobs: Vec::with_capacity(cap),
            entropies: Vec::with_capacity(cap),
            done: false,
        }
    }

    pub(super) fn push(&mut self, d: TokenDraw) {
        self.ids.push(d.id);
        self.logprobs.push(d.logprob);
        self.old_logprobs.push(d.logprob_raw);
        self.entropies.push(d.entropy);
    }

    /// Moves the response out into a [`Sample`].
    pub(super) fn finish(
        &mut self,
        finish: Finish,
        prompt: &[u32],
        decode: &dyn Fn(&[u32]) -> String,
    ) -> Sample {
        self.done = true;
        let response_ids = std::mem::take(&mut self.ids);
        Sample {
            group: self.prompt_index,
            prompt_index: self.prompt_index,
            sample_index: self.sample_index,
            prompt_ids: prompt.to_vec(),
            text: decode(&response_ids),
            response_ids,
            logprobs: std::mem::take(&mut self.logprobs),
            old_logprobs: std::mem::take(&mut self.old_logprobs),
            entropies: std::mem::take(&mut self.entropies),
            finish,
            truncated: finish == Finish::Length,
            reward: None,
        }
    }
}
