//! One response being generated ([`Row`]: its generator and draws so far) and
//! when a response ends ([`StopRules`]): what the engine keeps per sequence.
//! A row's generator is rebuilt from its seed and the numbers it has drawn, so
//! an unfinished response can leave the engine between calls and a checkpoint
//! ([`CarriedResponse`]) and continue exactly where it stopped.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

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
    /// The seed of `rng` and the numbers drawn from it so far.
    seed: u64,
    draws: u64,
    pub(super) ids: Vec<u32>,
    logprobs: Vec<f32>,
    old_logprobs: Vec<f32>,
    entropies: Vec<f32>,
    /// The policy version that drew each token (empty when the caller tracks none).
    versions: Vec<u64>,
    pub(super) done: bool,
}

/// An unfinished response outside the engine: its tokens, their log-probs,
/// entropies and policy versions, and where its generator stands (`seed`,
/// `draws`: the numbers drawn so far). Saved with a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CarriedResponse {
    /// The seed of the response's generator (`rollout::row_seed`).
    pub seed: u64,
    /// Numbers the generator has drawn (one per token sampled at a temperature above 0).
    pub draws: u64,
    /// The tokens drawn so far.
    pub ids: Vec<u32>,
    /// Per token: the log-prob under the distribution it was sampled from.
    pub logprobs: Vec<f32>,
    /// Per token: the untempered log-prob of the policy version that drew it.
    pub old_logprobs: Vec<f32>,
    /// Per token: the untempered distribution's entropy.
    pub entropies: Vec<f32>,
    /// Per token: the policy version that drew it.
    pub versions: Vec<u64>,
}

impl CarriedResponse {
    /// A response not begun, drawing from `seed`.
    pub fn fresh(seed: u64) -> Self {
        Self { seed, ..Self::default() }
    }
}

impl Row {
    /// An empty response of prompt `prompt_index` (local), sample
    /// `sample_index`, drawing from a generator seeded with `seed`, with room
    /// for `cap` tokens.
    pub(super) fn new(prompt_index: usize, sample_index: usize, seed: u64, cap: usize) -> Self {
        // Reserve a little: most responses end long before `max_new_tokens`.
        let cap = cap.min(256);
        Self {
            prompt_index,
            sample_index,
            rng: StdRng::seed_from_u64(seed),
            seed,
            draws: 0,
            ids: Vec::with_capacity(cap),
            logprobs: Vec::with_capacity(cap),
            old_logprobs: Vec::with_capacity(cap),
            entropies: Vec::with_capacity(cap),
            versions: Vec::new(),
            done: false,
        }
    }

    /// Response `c` continued: its generator seeded again and advanced past the
    /// numbers it had drawn.
    pub(super) fn resume(prompt_index: usize, sample_index: usize, c: CarriedResponse) -> Self {
        let mut rng = StdRng::seed_from_u64(c.seed);
        for _ in 0..c.draws {
            let _: f64 = rng.random();
        }
        Self {
            prompt_index,
            sample_index,
            rng,
            seed: c.seed,
            draws: c.draws,
            ids: c.ids,
            logprobs: c.logprobs,
            old_logprobs: c.old_logprobs,
            entropies: c.entropies,
            versions: c.versions,
            done: false,
        }
    }

    /// Moves the unfinished response out of the engine.
    pub(super) fn carry(&mut self) -> CarriedResponse {
        CarriedResponse {
            seed: self.seed,
            draws: self.draws,
            ids: std::mem::take(&mut self.ids),
            logprobs: std::mem::take(&mut self.logprobs),
            old_logprobs: std::mem::take(&mut self.old_logprobs),
            entropies: std::mem::take(&mut self.entropies),
            versions: std::mem::take(&mut self.versions),
        }
    }

    /// Appends a draw; `drew`: it took a number from the generator (not
    /// greedy); `version`: the policy version that drew it, when tracked.
    pub(super) fn push(&mut self, d: TokenDraw, drew: bool, version: Option<u64>) {
        self.ids.push(d.id);
        self.logprobs.push(d.logprob);
        self.old_logprobs.push(d.logprob_raw);
        self.entropies.push(d.entropy);
        self.draws += u64::from(drew);
        if let Some(v) = version {
            self.versions.push(v);
        }
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
            versions: std::mem::take(&mut self.versions),
            finish,
            truncated: finish == Finish::Length,
            reward: None,
        }
    }
}
