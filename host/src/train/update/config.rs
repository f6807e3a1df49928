//! What an update consumes and how it runs: the scored [`Sequence`]s, where the old
//! log-probs come from ([`OldLogp`]), the resolved [`UpdateConfig`] and the user-facing
//! [`UpdateOptions`] it is built from.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::RolloutCorrection;
use crate::algo::ObjectiveConfig;
use crate::rollout::Sample;
use crate::{Error, Result};

/// One sampled response with its prompt and reward, as the update consumes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    pub prompt_ids: Vec<u32>,
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

/// Where the old-policy log-probs (the PPO ratio's denominator) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogp {
    /// A no-grad forward of the policy before the update (verl's default).
    Recompute,
    /// The log-probs recorded while sampling.
    Rollout,
}

/// How one update runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateConfig {
    /// The objective, masks and advantages.
    pub objective: ObjectiveConfig,
    /// PPO epochs over the batch.
    pub epochs: usize,
    /// Sequences per optimizer step (0 = the whole batch).
    pub mini_batch: usize,
    /// Sequences per forward/backward (0 = the mini-batch); gradients accumulate.
    pub micro_batch: usize,
    /// Tokens per forward/backward (0 = no budget; verl's `ppo_max_token_len_per_gpu` with
    /// `use_dynamic_bsz`): each mini-batch's sequences sorted by length and cut into
    /// micro-batches of at most this many tokens, prompt + response with padding counted
    /// (and at most `micro_batch` sequences when that is set), each padded to its own longest
    /// prompt and response. The loss normalisers stay the mini-batch's: the gradients are
    /// those of the padded path up to float summation order.
    #[serde(default)]
    pub max_tokens_per_micro: usize,
    /// Old-policy log-probs.
    pub old_logp: OldLogp,
    /// Shuffle sequences between epochs (seeded).
    pub shuffle: bool,
    pub seed: u64,
    /// The logits are divided by this in every forward of the update (old log-probs and
    /// training), as verl does with the rollout temperature so that the ratio is
    /// on-policy at T != 1; p and H of the S2T rule are then the tempered policy's.
    #[serde(default = "one")]
    pub temperature: f64,
    /// Record each response token's logit-gradient norm (first epoch) and the per-step
    /// shares of silenced and top-0.01% tokens; costs one softmax over the logits.
    #[serde(default)]
    pub token_grad_norms: bool,
    /// The rollout correction (token-TIS, seq-MIS; `auto` counts as off here: the trainer
    /// resolves it from the rollout copy's dtype).
    #[serde(default)]
    pub rollout_correction: RolloutCorrection,
}

fn one() -> f64 {
    1.0
}

impl Default for UpdateConfig {
    fn default() -> Self {
        Self {
            objective: ObjectiveConfig::default(),
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            max_tokens_per_micro: 0,
            old_logp: OldLogp::Recompute,
            shuffle: false,
            seed: 0,
            temperature: 1.0,
            token_grad_norms: false,
            rollout_correction: RolloutCorrection::default(),
        }
    }
}

impl UpdateConfig {
    /// The one constructor of every entry point (the trainer, `stapo update`, the `update`
    /// script binding): sequences are shuffled between epochs exactly when there are
    /// several epochs.
    pub fn new(
        objective: ObjectiveConfig,
        epochs: usize,
        mini_batch: usize,
        micro_batch: usize,
        old_logp: OldLogp,
        seed: u64,
    ) -> Self {
        UpdateConfig {
            objective,
            epochs,
            mini_batch,
            micro_batch,
            max_tokens_per_micro: 0,
            old_logp,
            shuffle: epochs > 1,
            seed,
            temperature: 1.0,
            token_grad_norms: false,
            rollout_correction: RolloutCorrection::default(),
        }
    }

    /// The same, with micro-batches cut by a token budget (see
    /// [`UpdateConfig::max_tokens_per_micro`]; 0: none).
    pub fn with_max_tokens_per_micro(self, max_tokens_per_micro: usize) -> Self {
        UpdateConfig { max_tokens_per_micro, ..self }
    }

    /// The same, with the logits divided by `temperature` (see [`UpdateConfig::temperature`]).
    pub fn with_temperature(self, temperature: f64) -> Self {
        UpdateConfig { temperature, ..self }
    }
}

/// The options of a single update as a user gives them (the `update` script binding's
/// map, `stapo update`'s flags): a named objective preset with `key = value` overrides.
/// Missing fields take their defaults; unknown fields are an error naming them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpdateOptions {
    /// Objective preset (`algo::PRESETS`: grpo, dapo, gspo, sapo, entropy20, justrl, stapo, drgrpo).
    pub objective: String,
    /// `key = value` overrides of the preset (see `ObjectiveConfig::set`).
    pub set: BTreeMap<String, String>,
    /// Learning rate of the step (paper: 1e-6).
    pub lr: f64,
    /// PPO epochs, sequences per optimizer step (0 = all), per forward (0 = mini-batch).
    pub epochs: usize,
    pub mini_batch: usize,
    pub micro_batch: usize,
    /// Tokens per forward/backward, padding counted (0 = no budget; see
    /// [`UpdateConfig::max_tokens_per_micro`]).
    pub max_tokens_per_micro: usize,
    pub old_logp: OldLogp,
    pub seed: u64,
    /// The rollout's sampling temperature: the update divides the logits by it (verl).
    pub temperature: f64,
    /// The rollout's response budget (`max_tokens`): sizes DAPO's overlong buffer and
    /// Dr.GRPO's normaliser when the preset's are in force ([`ObjectiveConfig::fit_to_run`]).
    pub max_tokens: Option<usize>,
    /// The rollout correction (`auto`, the default, is off here: which copy sampled the
    /// rollouts is not known; give token_tis or seq_mis to apply one).
    pub rollout_correction: RolloutCorrection,
}

impl Default for UpdateOptions {
    fn default() -> Self {
        UpdateOptions {
            objective: "stapo".into(),
            set: BTreeMap::new(),
            lr: 1e-6,
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            max_tokens_per_micro: 0,
            old_logp: OldLogp::Recompute,
            seed: 0,
            temperature: 1.0,
            max_tokens: None,
            rollout_correction: RolloutCorrection::default(),
        }
    }
}

impl UpdateOptions {
    /// The update configuration: the preset, its overrides (validated), [`UpdateConfig::new`].
    /// With `max_tokens`, also returns the notes of [`ObjectiveConfig::fit_to_run`].
    pub fn to_config(&self) -> Result<(UpdateConfig, Vec<String>)> {
        let mut objective = ObjectiveConfig::with_overrides(&self.objective, &self.set)?;
        let notes = match self.max_tokens {
            Some(n) => objective.fit_to_run(n),
            None => Vec::new(),
        };
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::Config {
                file: "update options".into(),
                field: "temperature".into(),
                msg: format!("expected a number > 0, found {}", self.temperature),
            });
        }
        let cfg = UpdateConfig::new(
            objective,
            self.epochs,
            self.mini_batch,
            self.micro_batch,
            self.old_logp,
            self.seed,
        )
        .with_temperature(self.temperature)
        .with_max_tokens_per_micro(self.max_tokens_per_micro);
        let (rollout_correction, _) =
            self.rollout_correction.resolve(false, self.temperature, self.old_logp)?;
        Ok((UpdateConfig { rollout_correction, ..cfg }, notes))
    }
}
