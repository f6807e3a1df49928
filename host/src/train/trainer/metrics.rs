//! What a step reports: [`StepMetrics`] (the update's metrics, plus rollout, timing,
//! dynamic-sampling and evaluation figures), one line of `metrics.jsonl` per step, the
//! rollout engine's figures summed over the step's generation batches
//! ([`RolloutFigures`]), and the warnings on their way to the next step's metrics
//! (`Notes`). Depends on `train::update` (its metrics) and `rollout` (the engine's
//! statistics).

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::rollout::stats::{rows_per_call, rows_per_call_tail};
use crate::rollout::{EngineStats, PartialFigures};
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
    /// Under partial rollouts (`rollout.partial`): the staleness of the tokens the update
    /// used (mean, max, histogram), the share drawn by an older policy, the responses
    /// carried over, resumed, recomputed, restarted and dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<PartialFigures>,
    /// `rollout.async`: staleness and waits (absent from synchronous runs).
    #[serde(rename = "async", default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsyncFigures>,
    /// Held-out avg@n when this step evaluated.
    pub eval_avg: Option<f64>,
    /// Held-out pass@n when this step evaluated.
    pub eval_pass: Option<f64>,
}

/// What asynchrony did in a step (`metrics.jsonl`'s `async`, TensorBoard `stapo/async/...`);
/// absent from synchronous runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AsyncFigures {
    /// Policy versions between the weights that sampled each response token this step
    /// trained on and those its update started from: mean over tokens.
    pub staleness_mean: f64,
    /// Their largest value.
    pub staleness_max: u64,
    /// Response tokens per staleness (index 0: on-policy, 1: one version behind).
    pub staleness_hist: Vec<usize>,
    /// Share of the response tokens sampled by an older policy version.
    pub off_policy_token_share: f64,
    /// Seconds the trainer waited for rollouts: a rollout the step drew itself, plus the
    /// time the rollout ahead ran on after the update ended (verl `timing_s/wait_prev_gen`).
    pub wait_rollout_secs: f64,
    /// Seconds the rollout ahead, done, waited for the update and its weights.
    pub wait_weights_secs: f64,
    /// Seconds of the rollout drawn ahead beside the update (0 when none was drawn).
    pub ahead_rollout_secs: f64,
    /// Seconds to copy the weights the rollout ahead samples.
    pub weight_copy_secs: f64,
}

impl AsyncFigures {
    /// The staleness figures of a step whose `tokens` response tokens are all `lag`
    /// versions behind.
    pub(super) fn with_lag(lag: u64, tokens: usize) -> Self {
        let mut hist = vec![0; lag as usize + 1];
        hist[lag as usize] = tokens;
        Self {
            staleness_mean: if tokens > 0 { lag as f64 } else { 0.0 },
            staleness_max: if tokens > 0 { lag } else { 0 },
            staleness_hist: hist,
            off_policy_token_share: if tokens > 0 && lag > 0 { 1.0 } else { 0.0 },
            ..Self::default()
        }
    }

    /// Records the overlap of the update and the rollout ahead: each ran this long.
    pub(super) fn overlap(&mut self, update: Duration, rollout: Duration) {
        self.ahead_rollout_secs = rollout.as_secs_f64();
        self.wait_rollout_secs += rollout.saturating_sub(update).as_secs_f64();
        self.wait_weights_secs = update.saturating_sub(rollout).as_secs_f64();
    }
}

/// The engine's figures over a training step's generation batches, for
/// metrics.jsonl and TensorBoard (`stapo/rollout_engine/...`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutFigures {
    /// Sequences per model call (decode rows and prefill chunks).
    pub rows_per_step: f64,
    /// Model calls over the step's generation batches.
    pub model_calls: usize,
    /// The most cache blocks held at once, and their size in GB.
    pub peak_blocks: usize,
    /// Size of those blocks in GB.
    pub peak_cache_gb: f64,
    /// Sequences preempted over the step.
    pub preemptions: usize,
    /// Tokens looked up in the prefix cache over the step.
    pub prefix_cache_queried_tokens: usize,
    /// Tokens found there (not prefilled).
    pub prefix_cache_hit_tokens: usize,
    /// `prefix_cache_hit_tokens / prefix_cache_queried_tokens` (0 when nothing was looked up).
    pub prefix_cache_hit_rate: f64,
    /// Rows per decode call (every row adding one token) over the step.
    pub rows_per_decode_call: f64,
    /// Rows per decode call over the step's last 10% of decode calls: where the
    /// longest responses run alone.
    pub rows_per_decode_call_last10: f64,
    /// Rows of each decode call of the step (not written).
    #[serde(skip)]
    decode_rows: Vec<u32>,
}

impl RolloutFigures {
    /// Adds one rollout's figures.
    pub fn add(&mut self, s: &EngineStats) {
        let calls = self.model_calls + s.model_calls;
        self.rows_per_step =
            (self.rows_per_step * self.model_calls as f64 + s.rows_fed as f64) / calls.max(1) as f64;
        self.model_calls = calls;
        if s.peak_cache_bytes() as f64 / 1e9 > self.peak_cache_gb {
            self.peak_cache_gb = s.peak_cache_bytes() as f64 / 1e9;
        }
        self.peak_blocks = self.peak_blocks.max(s.peak_blocks.max(s.peak_reserved_blocks));
        self.preemptions += s.preemptions;
        self.prefix_cache_queried_tokens += s.prefix_cache_queried_tokens;
        self.prefix_cache_hit_tokens += s.prefix_cache_hit_tokens;
        self.prefix_cache_hit_rate =
            self.prefix_cache_hit_tokens as f64 / self.prefix_cache_queried_tokens.max(1) as f64;
        self.decode_rows.extend_from_slice(&s.decode_rows);
        self.rows_per_decode_call = rows_per_call(&self.decode_rows);
        self.rows_per_decode_call_last10 = rows_per_call_tail(&self.decode_rows, 0.1);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rollouts' figures, summed by hand: rows per call over all calls,
    /// the larger peak, preemptions and prefix-cache tokens added.
    #[test]
    fn rollout_figures_add_up_over_the_step() {
        let a = EngineStats {
            model_calls: 4,
            rows_fed: 10,
            preemptions: 1,
            block_size: 16,
            bytes_per_token: 1000,
            peak_blocks: 30,
            prefix_cache_queried_tokens: 100,
            prefix_cache_hit_tokens: 48,
            ..EngineStats::default()
        };
        let b = EngineStats {
            model_calls: 6,
            rows_fed: 30,
            preemptions: 2,
            block_size: 16,
            bytes_per_token: 1000,
            peak_blocks: 10,
            peak_reserved_blocks: 50,
            prefix_cache_queried_tokens: 60,
            ..EngineStats::default()
        };
        let mut f = RolloutFigures::default();
        f.add(&a);
        f.add(&b);
        assert_eq!(f.model_calls, 10);
        assert!((f.rows_per_step - 4.0).abs() < 1e-12, "40 rows over 10 calls: {f:?}");
        assert_eq!(f.peak_blocks, 50, "the static policy's reservation counts");
        assert!((f.peak_cache_gb - 50.0 * 16.0 * 1000.0 / 1e9).abs() < 1e-15);
        assert_eq!(f.preemptions, 3);
        assert_eq!((f.prefix_cache_queried_tokens, f.prefix_cache_hit_tokens), (160, 48));
        assert!((f.prefix_cache_hit_rate - 48.0 / 160.0).abs() < 1e-12);
        let mut none = RolloutFigures::default();
        none.add(&EngineStats::default());
        assert_eq!((none.rows_per_step, none.prefix_cache_hit_rate), (0.0, 0.0));
    }

    #[test]
    fn waits_split_the_overlap_between_the_two_roles() {
        let mut f = AsyncFigures::with_lag(1, 10);
        assert_eq!((f.staleness_mean, f.staleness_max, f.off_policy_token_share), (1.0, 1, 1.0));
        assert_eq!(f.staleness_hist, [0, 10]);
        f.wait_rollout_secs = 0.5; // a rollout drawn synchronously first
        f.overlap(Duration::from_secs(3), Duration::from_secs(5));
        assert_eq!((f.wait_rollout_secs, f.wait_weights_secs, f.ahead_rollout_secs), (2.5, 0.0, 5.0));
        f.overlap(Duration::from_secs(5), Duration::from_secs(3));
        assert_eq!((f.wait_rollout_secs, f.wait_weights_secs), (2.5, 2.0));
        let on = AsyncFigures::with_lag(0, 4);
        assert_eq!((on.staleness_hist.as_slice(), on.off_policy_token_share), (&[4][..], 0.0));
    }
}
