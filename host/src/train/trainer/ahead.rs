//! One-step-off asynchronous training (`rollout.async`, verl's `one_step_off_policy`):
//! the rollout drawn one step ahead (`Ahead`), the thread pools the two roles run in
//! (`Pools`), the check that no update trains on a rollout older than the run allows
//! (`check_staleness`); what a step reports about it is `metrics.rs`'s `AsyncFigures`.
//! Depends on `rollout` (the sampling settings), `data` (the epoch order) and the
//! trainer's dynamic-sampling part (the batch a rollout gathers).
//!
//! Policy versions count updates: version v is the weights after v steps, so step k's
//! update turns version k into version k+1. A synchronous step k samples version k. Under
//! `staleness: 1` the rollout of step k+1 starts when the update of step k starts, in a
//! second thread, on a copy of version k (the weights update k-1 produced, copied before
//! update k changes them); step k+1 then trains on it from version k+1: one version
//! behind. Step 0 rolls out synchronously (nothing is ahead yet), and so does a step
//! whose rollout ahead was given up (a signal, a failure, sampling settings that changed,
//! a resumed run).

use super::dynamic::StepBatch;
use super::plan::StepPlan;
use crate::data::SamplerState;
use crate::rollout::SamplingParams;
use crate::train::AsyncConfig;
use crate::{Error, Result};

/// The rollout of the next step, drawn while this step's update ran.
#[derive(Debug)]
pub(super) struct Ahead {
    pub(super) batch: StepBatch,
    /// The policy version (updates applied) of the weights that sampled it.
    pub(super) version: u64,
    /// The sampling it was drawn with (its seed aside: each step's seed comes from the step).
    pub(super) sampling: SamplingParams,
    /// Whether it was gathered with dynamic sampling.
    pub(super) dynamic_sampling: bool,
    /// The epoch order before its prompts were drawn: what a checkpoint saves (a resumed
    /// run draws the same prompts again) and what a rollout given up puts back.
    pub(super) sampler_before: SamplerState,
    /// Warnings of its gathering (dynamic sampling), for the step that trains on it.
    pub(super) warnings: Vec<String>,
}

impl Ahead {
    /// Whether the rollout was drawn as `plan` says (the sampling, its seed aside, and
    /// dynamic sampling).
    pub(super) fn drawn_with(&self, plan: &StepPlan) -> bool {
        drawn_with(&self.sampling, self.dynamic_sampling, plan)
    }
}

/// Whether a rollout drawn with `sampling` (its seed aside) and `dynamic_sampling` is
/// what `plan` asks for.
pub(super) fn drawn_with(sampling: &SamplingParams, dynamic_sampling: bool, plan: &StepPlan) -> bool {
    let (mut a, mut b) = (sampling.clone(), plan.sampling.clone());
    (a.seed, b.seed) = (0, 0);
    a == b && dynamic_sampling == plan.objective.dynamic_sampling
}

/// Checks that the rollout a step trains on is at most `allowed` policy versions behind:
/// `step`'s update starts from version `step`, the rollout was sampled by `version`.
/// Returns the lag.
pub(super) fn check_staleness(step: u64, version: u64, allowed: u32) -> Result<u64> {
    let lag = step.checked_sub(version).ok_or_else(|| {
        Error::invalid(format!(
            "step {step}: its rollout claims policy version {version}, newer than the policy"
        ))
    })?;
    if lag > u64::from(allowed) {
        return Err(Error::invalid(format!(
            "step {step}: its rollout was sampled by policy version {version}, {lag} versions behind; \
             rollout.async.staleness allows {allowed}"
        )));
    }
    Ok(lag)
}

/// The thread pools of the two roles while they run side by side (`None`: the process's
/// pool).
#[derive(Debug, Default)]
pub(super) struct Pools {
    rollout: Option<rayon::ThreadPool>,
    train: Option<rayon::ThreadPool>,
}

impl Pools {
    /// The pools `cfg` asks for.
    pub(super) fn new(cfg: &AsyncConfig) -> Result<Self> {
        let pool = |n: usize, field: &str| -> Result<Option<rayon::ThreadPool>> {
            if n == 0 || !cfg.enabled() {
                return Ok(None);
            }
            rayon::ThreadPoolBuilder::new().num_threads(n).build().map(Some).map_err(|e| Error::Config {
                file: "run config".into(),
                field: format!("rollout.async.{field}"),
                msg: format!("cannot start {n} threads: {e}"),
            })
        };
        Ok(Self {
            rollout: pool(cfg.rollout_threads, "rollout_threads")?,
            train: pool(cfg.train_threads, "train_threads")?,
        })
    }

    /// Runs `f` in the rollout's pool.
    pub(super) fn rollout<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.rollout {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// Runs `f` in the update's pool.
    pub(super) fn train<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.train {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_never_trains_on_a_rollout_older_than_allowed() {
        assert_eq!(check_staleness(5, 5, 0).unwrap(), 0);
        assert_eq!(check_staleness(5, 4, 1).unwrap(), 1);
        assert_eq!(check_staleness(5, 5, 1).unwrap(), 0);
        let e = check_staleness(5, 4, 0).unwrap_err().to_string();
        assert!(e.contains("1 versions behind") && e.contains("allows 0"), "{e}");
        let e = check_staleness(5, 3, 1).unwrap_err().to_string();
        assert!(e.contains("version 3, 2 versions behind"), "{e}");
        assert!(check_staleness(3, 4, 1).is_err());
    }
}
