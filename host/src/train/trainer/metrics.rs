//! What a step reports: [`StepMetrics`] (the update's metrics, plus rollout, timing,
//! dynamic-sampling and evaluation figures), one line of `metrics.jsonl` per step, and
//! the warnings on their way to the next step's metrics (`Notes`). Depends on
//! `train::update` (its metrics) and `rollout` (the engine's figures).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::rollout::RolloutFigures;
use crate::train::update::UpdateMetrics;

/// Per-step metrics: the update's, plus rollout and timing figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The step these metrics belong to (0 for the first).
    pub step: u64,
    /// The learning rate the step's update used.
    pub lr: f64,
    /// The update's metrics (flattened into the same JSON object).
    #[serde(flatten)]
    pub update: UpdateMetrics,
    /// Most frequently silenced tokens this step, as text.
    pub silenced_tokens_text: Vec<(String, usize)>,
    /// A few silenced tokens of this step in their response (`…12+7=1⟦9⟧\n\boxed…`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub silenced_examples: Vec<String>,
    /// Wall-clock seconds of the step's rollouts (every generation batch).
    pub rollout_secs: f64,
    /// Wall-clock seconds of the update and its metrics.
    pub update_secs: f64,
    /// Response tokens sampled per second over all ranks.
    pub rollout_tokens_per_sec: f64,
    /// The rollout engine's rows per step, cache blocks and preemptions (this rank's).
    #[serde(default)]
    pub rollout_engine: RolloutFigures,
    /// Prompt batches generated this step (more than 1 when dynamic sampling refilled).
    #[serde(default)]
    pub gen_batches: usize,
    /// Groups dynamic sampling dropped before the update (all rewards equal).
    #[serde(default)]
    pub groups_dropped: usize,
    /// Held-out avg@n when this step evaluated.
    pub eval_avg: Option<f64>,
    /// Held-out pass@n when this step evaluated.
    pub eval_pass: Option<f64>,
}

/// Warnings on their way to the next step's metrics (the library prints nothing).
#[derive(Default)]
pub(super) struct Notes {
    /// Not yet reported (data lines skipped at load, ...).
    pub(super) pending: Vec<String>,
    /// Reported once already (settings that cannot take effect).
    pub(super) warned: HashSet<String>,
}

impl Notes {
    /// Adds `note` to `out` unless it was reported before.
    pub(super) fn once(&mut self, note: String, out: &mut Vec<String>) {
        if self.warned.insert(note.clone()) {
            out.push(note);
        }
    }
}
