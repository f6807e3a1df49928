//! The step plan: what a step may change relative to the configuration ([`StepPlan`]:
//! sampling, learning rate, objective; hooks decide it), the configuration's own plan
//! for a step, and the per-step seed (`mix`). Depends on `algo` (the objective),
//! `rollout` (the sampling), `seed` and the run configuration.

use serde::{Deserialize, Serialize};

use crate::algo::ObjectiveConfig;
use crate::rollout::SamplingParams;
use crate::train::RunConfig;

/// What a step may change relative to the configuration (hooks decide it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    /// How this step's rollouts sample.
    pub sampling: SamplingParams,
    /// This step's learning rate.
    pub lr: f64,
    /// This step's objective (loss, mask and S2T thresholds, aggregation).
    pub objective: ObjectiveConfig,
}

impl StepPlan {
    /// The configuration's plan for step `step`: its sampling, the learning rate of its
    /// schedule at `step`, and `objective` (the run's, S2T thresholds as last set).
    pub fn from_config(cfg: &RunConfig, objective: &ObjectiveConfig, step: u64) -> Self {
        let optim = &cfg.actor.optim;
        StepPlan {
            sampling: cfg.rollout.sampling.clone(),
            lr: optim.schedule.lr_at(optim.lr, step),
            objective: objective.clone(),
        }
    }
}

/// The per-step seed: output `step` of the SplitMix64 stream seeded with `seed`.
pub(super) fn mix(seed: u64, step: u64) -> u64 {
    crate::seed::splitmix64(seed.wrapping_add(step.wrapping_mul(crate::seed::SPLITMIX64_GAMMA)))
}
