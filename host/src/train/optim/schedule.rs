//! Learning-rate schedules: constant, linear or cosine decay, each after a linear
//! warm-up (the STAPO paper: constant with 10 warm-up steps).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A learning-rate schedule: a multiplier of the base learning rate as a function
/// of the step index. Every kind starts with a linear warm-up.
///
/// Serialised with a `kind` tag, e.g.
/// `{"kind": "cosine", "warmup_steps": 10, "total_steps": 500, "min_lr_ratio": 0.1}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LrSchedule {
    /// Warm-up, then the base learning rate for ever.
    Constant {
        /// Steps of linear warm-up (0 for none).
        #[serde(default)]
        warmup_steps: u64,
    },
    /// Warm-up, then linear decay to `min_lr_ratio * base` at `total_steps`, flat after.
    Linear {
        /// Steps of linear warm-up (0 for none).
        #[serde(default)]
        warmup_steps: u64,
        /// The step at which the decay reaches its floor.
        total_steps: u64,
        /// The floor, as a fraction of the base learning rate.
        #[serde(default)]
        min_lr_ratio: f64,
    },
    /// Warm-up, then half-cosine decay to `min_lr_ratio * base` at `total_steps`, flat after.
    Cosine {
        /// Steps of linear warm-up (0 for none).
        #[serde(default)]
        warmup_steps: u64,
        /// The step at which the decay reaches its floor.
        total_steps: u64,
        /// The floor, as a fraction of the base learning rate.
        #[serde(default)]
        min_lr_ratio: f64,
    },
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule::Constant { warmup_steps: 0 }
    }
}

impl LrSchedule {
    /// The learning rate for the step with 0-based index `step` (the number of
    /// optimizer steps already taken).
    ///
    /// Warm-up gives step `s < warmup` the factor `(s + 1) / warmup`, so the first
    /// step already moves the weights and step `warmup - 1` uses the full rate
    /// (Hugging Face's `get_*_schedule_with_warmup` uses `s / warmup`, wasting step 0).
    /// After warm-up, `progress = (s - warmup) / (total - warmup)` clamped to [0, 1]:
    /// linear gives `min + (1 - min)(1 - progress)`, cosine
    /// `min + (1 - min)(1 + cos(pi * progress)) / 2`.
    pub fn lr_at(&self, base_lr: f64, step: u64) -> f64 {
        let warmup = match *self {
            LrSchedule::Constant { warmup_steps }
            | LrSchedule::Linear { warmup_steps, .. }
            | LrSchedule::Cosine { warmup_steps, .. } => warmup_steps,
        };
        if step < warmup {
            return base_lr * (step + 1) as f64 / warmup as f64;
        }
        let factor = match *self {
            LrSchedule::Constant { .. } => 1.0,
            LrSchedule::Linear { total_steps, min_lr_ratio, .. } => {
                let p = progress(step, warmup, total_steps);
                min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - p)
            }
            LrSchedule::Cosine { total_steps, min_lr_ratio, .. } => {
                let p = progress(step, warmup, total_steps);
                min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        };
        base_lr * factor
    }

    /// Checks that `min_lr_ratio` is in [0, 1] and `total_steps >= warmup_steps`.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| {
            Err(Error::Config { file: "lr schedule".into(), field: field.into(), msg })
        };
        match *self {
            LrSchedule::Constant { .. } => Ok(()),
            LrSchedule::Linear { warmup_steps, total_steps, min_lr_ratio }
            | LrSchedule::Cosine { warmup_steps, total_steps, min_lr_ratio } => {
                if !(0.0..=1.0).contains(&min_lr_ratio) {
                    return bad("min_lr_ratio", format!("expected a value in [0, 1], found {min_lr_ratio}"));
                }
                if total_steps < warmup_steps {
                    return bad(
                        "total_steps",
                        format!("expected at least warmup_steps ({warmup_steps}), found {total_steps}"),
                    );
                }
                Ok(())
            }
        }
    }
}

/// Fraction of the decay phase done at `step`, in [0, 1]; 1 from `total` on
/// (so a schedule with `total == warmup` goes straight to its floor).
fn progress(step: u64, warmup: u64, total: u64) -> f64 {
    if step >= total {
        return 1.0;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    (step.saturating_sub(warmup) as f64 / span).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        let c = LrSchedule::Constant { warmup_steps: 10 };
        close(c.lr_at(1.0, 0), 0.1);
        close(c.lr_at(1.0, 4), 0.5);
        close(c.lr_at(1.0, 9), 1.0);
        close(c.lr_at(2.0, 1000), 2.0);
        close(LrSchedule::default().lr_at(3.0, 0), 3.0);
        // Decay from step 10 to 110 (progress = (s - 10) / 100), floor 0.1.
        let l = LrSchedule::Linear { warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1 };
        close(l.lr_at(1.0, 0), 0.1);
        close(l.lr_at(1.0, 10), 1.0);
        close(l.lr_at(1.0, 60), 0.1 + 0.9 * 0.5);
        close(l.lr_at(1.0, 110), 0.1);
        close(l.lr_at(1.0, 500), 0.1);
        let k = LrSchedule::Cosine { warmup_steps: 10, total_steps: 110, min_lr_ratio: 0.1 };
        close(k.lr_at(1.0, 10), 1.0);
        // progress 0.25: 0.1 + 0.9 * (1 + cos(pi/4)) / 2
        close(k.lr_at(1.0, 35), 0.1 + 0.45 * (1.0 + std::f64::consts::FRAC_1_SQRT_2));
        close(k.lr_at(1.0, 60), 0.55);
        close(k.lr_at(1.0, 110), 0.1);
        close(k.lr_at(1.0, 111), 0.1);
        // No warm-up, zero-length decay: straight to the floor.
        close(LrSchedule::Linear { warmup_steps: 0, total_steps: 0, min_lr_ratio: 0.5 }.lr_at(1.0, 0), 0.5);

        let json = r#"{"kind":"cosine","warmup_steps":10,"total_steps":110,"min_lr_ratio":0.1}"#;
        assert_eq!(serde_json::from_str::<LrSchedule>(json).unwrap(), k);
        let back: LrSchedule = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        assert_eq!(
            serde_json::from_str::<LrSchedule>(r#"{"kind":"constant"}"#).unwrap(),
            LrSchedule::default()
        );
        assert!(LrSchedule::Linear { warmup_steps: 10, total_steps: 5, min_lr_ratio: 0.0 }
            .validate()
            .is_err());
        assert!(LrSchedule::Cosine { warmup_steps: 0, total_steps: 5, min_lr_ratio: 1.5 }
            .validate()
            .is_err());
    }
}
