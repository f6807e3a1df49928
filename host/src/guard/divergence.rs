//! Divergence: a run whose numbers are finite but no longer healthy. Per step, after the
//! update, [`DivergenceWatch::observe`] looks at
//!
//! - the mean token entropy against `ln(vocab)` (the entropy of the uniform distribution:
//!   a policy near it samples noise), flagged when it reaches `guard.max_entropy_ratio` of
//!   it after the recent steps were below;
//! - the jump of the mean entropy above the median of the last `guard.window` steps, by
//!   more than `guard.entropy_jump` times `ln(vocab)`;
//! - the fall of the mean reward below that median by more than `guard.reward_drop`;
//! - the growth of the trainable weights' norm over the update, past
//!   `guard.weight_norm_growth` times the norm before it;
//! - `guard.max_zero_grad_steps` steps in a row whose gradient norm is 0 although some
//!   advantage is not (the loss has stopped reaching the weights).
//!
//! What happens then is `guard.on_divergence`: `warn` (the default) names the step and the
//! quantity with the step's warnings; `stop` ends the run with that error; `rollback`
//! goes back to the last good checkpoint with the learning rate scaled by
//! `guard.rollback_lr_scale`, at most `guard.max_rollbacks` times, as large pretraining
//! runs recover from loss spikes (OPT-175B's logbook, PaLM's restarts before a spike).
//! Under `stop` and `rollback` a diverged step is never saved as `latest`: its
//! checkpoint is not written, and checkpoints holding the weights that diverged are
//! renamed `diverged-step-NNNNNN` (kept for inspection, out of `latest`'s reach).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::GuardConfig;

/// What a run does when a step diverges (`guard.on_divergence`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDivergence {
    /// A warning naming the step and the quantity; training goes on.
    #[default]
    Warn,
    /// The run ends with an error naming the step and the quantity, without saving it.
    Stop,
    /// Back to the last good checkpoint, the learning rate scaled by
    /// `guard.rollback_lr_scale`.
    Rollback,
}

impl OnDivergence {
    /// `warn`, `stop` or `rollback`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Warn => "warn",
            Self::Stop => "stop",
            Self::Rollback => "rollback",
        }
    }
}

/// What one step shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSigns {
    /// Mean token entropy of the step's responses (nats).
    pub entropy: f64,
    /// Mean reward of the step's responses.
    pub reward: f64,
    /// The model's vocabulary size.
    pub vocab: usize,
    /// Norm of the trainable weights before and after the update.
    pub weight_norm: (f64, f64),
    /// Gradient norm of the update (before clipping).
    pub grad_norm: f64,
    /// Responses whose advantage is not 0 (over all ranks).
    pub nonzero_advantages: usize,
}

/// One quantity out of bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// What was out of bounds, with its value and limit.
    pub what: String,
    /// The first step whose starting weights are suspect: the step itself for what its
    /// rollout showed (sampled from the weights it started with), the next one for the
    /// weights its update produced, the first step of a zero-gradient streak. Checkpoint
    /// `step-N` holds the weights step N starts from, so those before this step are good.
    pub suspect_from: u64,
}

/// The recent history the checks compare against.
#[derive(Debug, Clone, Default)]
pub struct DivergenceWatch {
    entropies: VecDeque<f64>,
    rewards: VecDeque<f64>,
    zero_grad: usize,
}

/// Steps of history a jump needs before it is judged.
const MIN_HISTORY: usize = 3;

fn median(v: &VecDeque<f64>) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().collect();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

impl DivergenceWatch {
    /// Checks step `step`'s `signs` against the limits of `limits` and the recent steps,
    /// then adds it to them.
    pub fn observe(&mut self, step: u64, signs: &StepSigns, limits: &GuardConfig) -> Vec<Finding> {
        let mut out = Vec::new();
        let uniform = (signs.vocab.max(2) as f64).ln();
        let ratio = signs.entropy / uniform;
        if limits.max_entropy_ratio > 0.0 && ratio >= limits.max_entropy_ratio {
            // A model that starts near uniform is not diverging: only a rise to it counts.
            let was_below =
                !self.entropies.is_empty() && median(&self.entropies) / uniform < limits.max_entropy_ratio;
            if was_below {
                out.push(Finding {
                    what: format!(
                        "mean entropy {:.3} is {:.2} of ln(vocab) = {uniform:.3} (the uniform \
                         distribution's; guard.max_entropy_ratio = {})",
                        signs.entropy, ratio, limits.max_entropy_ratio
                    ),
                    suspect_from: step,
                });
            }
        }
        if self.entropies.len() >= MIN_HISTORY {
            let (h, r) = (median(&self.entropies), median(&self.rewards));
            if limits.entropy_jump > 0.0 && signs.entropy - h > limits.entropy_jump * uniform {
                out.push(Finding {
                    what: format!(
                        "mean entropy jumped to {:.3} from a median of {h:.3} over the last {} steps \
                         (more than guard.entropy_jump = {} x ln(vocab))",
                        signs.entropy,
                        self.entropies.len(),
                        limits.entropy_jump
                    ),
                    suspect_from: step,
                });
            }
            if limits.reward_drop > 0.0 && r - signs.reward > limits.reward_drop {
                out.push(Finding {
                    what: format!(
                        "mean reward fell to {:.3} from a median of {r:.3} over the last {} steps \
                         (more than guard.reward_drop = {})",
                        signs.reward,
                        self.rewards.len(),
                        limits.reward_drop
                    ),
                    suspect_from: step,
                });
            }
        }
        let (before, after) = signs.weight_norm;
        if limits.weight_norm_growth > 0.0 && before > 0.0 && after > limits.weight_norm_growth * before {
            out.push(Finding {
                what: format!(
                    "the weights' norm grew from {before:.4e} to {after:.4e} in one update ({:.3e} x; \
                     guard.weight_norm_growth = {})",
                    after / before,
                    limits.weight_norm_growth
                ),
                suspect_from: step + 1,
            });
        }
        if signs.grad_norm == 0.0 && signs.nonzero_advantages > 0 {
            self.zero_grad += 1;
        } else {
            self.zero_grad = 0;
        }
        if limits.max_zero_grad_steps > 0 && self.zero_grad >= limits.max_zero_grad_steps {
            out.push(Finding {
                what: format!(
                    "gradient norm 0 for {} step(s) in a row although {} response(s) had a non-zero \
                     advantage (guard.max_zero_grad_steps = {})",
                    self.zero_grad, signs.nonzero_advantages, limits.max_zero_grad_steps
                ),
                suspect_from: (step + 1).saturating_sub(self.zero_grad as u64),
            });
        }
        let window = limits.window.max(1);
        for (q, v) in [(&mut self.entropies, signs.entropy), (&mut self.rewards, signs.reward)] {
            q.push_back(v);
            while q.len() > window {
                q.pop_front();
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> GuardConfig {
        GuardConfig::default()
    }

    fn signs(entropy: f64, reward: f64) -> StepSigns {
        StepSigns {
            entropy,
            reward,
            vocab: 100,
            weight_norm: (10.0, 10.01),
            grad_norm: 0.5,
            nonzero_advantages: 4,
        }
    }

    #[test]
    fn healthy_steps_pass_and_each_quantity_is_named() {
        let mut w = DivergenceWatch::default();
        for _ in 0..4 {
            assert!(w.observe(0, &signs(0.5, 0.6), &limits()).is_empty());
        }
        // ln(100) = 4.605: 4.3 is 0.93 of it, and a jump of 3.8 > 0.25 x 4.605.
        let f = w.observe(0, &signs(4.3, 0.6), &limits());
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f[0].what.contains("0.93 of ln(vocab) = 4.605"), "{}", f[0].what);
        assert!(f[1].what.contains("jumped to 4.300 from a median of 0.500"), "{}", f[1].what);
        let mut w = DivergenceWatch::default();
        for _ in 0..3 {
            w.observe(0, &signs(0.5, 0.8), &limits());
        }
        let f = w.observe(0, &signs(0.5, 0.2), &limits());
        assert!(f.len() == 1 && f[0].what.contains("reward fell to 0.200 from a median of 0.800"), "{f:?}");
        let mut s = signs(0.5, 0.8);
        s.weight_norm = (10.0, 16.0);
        let f = w.observe(7, &s, &limits());
        assert!(f.len() == 1 && f[0].suspect_from == 8 && f[0].what.contains("1.600e0 x"), "{f:?}");
    }

    #[test]
    fn a_model_that_starts_uniform_is_not_flagged_and_zero_gradients_count_in_a_row() {
        let mut w = DivergenceWatch::default();
        for _ in 0..5 {
            assert!(w.observe(0, &signs(4.5, 0.0), &limits()).is_empty());
        }
        let mut s = signs(0.5, 0.5);
        s.grad_norm = 0.0;
        let mut w = DivergenceWatch::default();
        assert!(w.observe(4, &s, &limits()).is_empty());
        assert!(w.observe(5, &s, &limits()).is_empty());
        let f = w.observe(6, &s, &limits());
        assert!(f.len() == 1 && f[0].what.contains("gradient norm 0 for 3 step(s)"), "{f:?}");
        // The weights the streak started from are suspect.
        assert_eq!(f[0].suspect_from, 4);
        // No advantage, no learning signal: a zero gradient is expected.
        s.nonzero_advantages = 0;
        assert!(w.observe(7, &s, &limits()).is_empty());
    }
}
