//! What an update consumes: one scored [`Sequence`] per sampled response (prompt and
//! response ids, the rollout's log-probs, reward, group). Depends on `rollout` only
//! (for [`Sample`], which a sequence is made from).

use serde::{Deserialize, Serialize};

use crate::rollout::Sample;

/// One sampled response with its prompt and reward, as the update consumes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The response's token ids, stop token included.
    pub response_ids: Vec<u32>,
    /// Log-probs of the response tokens under the sampling policy at T = 1
    /// (used when old log-probs come from the rollout).
    pub rollout_logprobs: Option<Vec<f32>>,
    /// Raw reward (1 correct, 0 wrong) before the objective's reward scale.
    pub reward: f32,
    /// GRPO group (responses to the same prompt share it).
    pub group: usize,
    /// True when generation hit the token limit.
    pub truncated: bool,
}

impl Sequence {
    /// A sampled response with its `reward` (the sample's own reward field is
    /// the caller's to check); the rollout's T = 1 log-probs come along.
    pub fn from_sample(s: &Sample, reward: f32) -> Self {
        Sequence {
            prompt_ids: s.prompt_ids.clone(),
            response_ids: s.response_ids.clone(),
            rollout_logprobs: Some(s.old_logprobs.clone()),
            reward,
            group: s.group,
            truncated: s.truncated,
        }
    }
}
