//! Configuration glue: what the trainer checks and loads from its [`RunConfig`] before
//! and outside a step: the device of this rank, the model in the configured dtype, that
//! the ranks can share the step's prompts, and an evaluation's sampling. Depends on
//! `model` (loading, devices), `dist` (ranks) and the run configuration.

use std::path::Path;

use crate::dist::{self, Comm};
use crate::model::{self, Qwen3};
use crate::train::RunConfig;
use crate::{Error, Result};

/// The device of this rank: under several ranks a bare `cuda` means the GPU
/// numbered by the rank's index on its host.
pub(super) fn rank_device(name: &str, comm: &dyn Comm) -> Result<candle_core::Device> {
    if comm.size() > 1 && name.trim() == "cuda" {
        return model::parse_device(&format!("cuda:{}", dist::local_rank()));
    }
    model::parse_device(name)
}

/// The model of `dir` in the dtype and on the device `cfg` names, for this rank.
pub(super) fn load_model(cfg: &RunConfig, dir: &Path, comm: &dyn Comm) -> Result<Qwen3> {
    let device = rank_device(&cfg.model.device, comm)?;
    let dtype = model::parse_dtype(&cfg.model.dtype)?;
    model::load(dir, dtype, &device)
}

/// Checks that every rank of `comm` gets at least one of the step's prompts, and that
/// one-step-off training over several ranks splits them into roles (`roles`).
pub(super) fn check_ranks(cfg: &RunConfig, comm: &dyn Comm, roles: bool) -> Result<()> {
    if cfg.data.prompts_per_step < comm.size() {
        return Err(Error::Config {
            file: "run config".into(),
            field: "data.prompts_per_step".into(),
            msg: format!(
                "{} prompts per step cannot be shared by {} ranks (each needs at least one)",
                cfg.data.prompts_per_step,
                comm.size()
            ),
        });
    }
    if cfg.rollout.asynchronous.enabled() && comm.size() > 1 && !roles {
        return Err(Error::Config {
            file: "run config".into(),
            field: "rollout.async.staleness".into(),
            msg: format!(
                "one-step-off training runs its rollout in a second thread of one process; with {} \
                 ranks the rollout's collectives would interleave with the update's: run one process, \
                 staleness 0, or split the ranks into rollout and trainer roles \
                 (rollout.async.roles.rollout_ranks)",
                comm.size()
            ),
        });
    }
    if cfg.rollout.partial.enable && comm.size() > 1 {
        return Err(Error::Config {
            file: "run config".into(),
            field: "rollout.partial.enable".into(),
            msg: format!(
                "partial rollouts run in one process; this run has {} ranks (turn them off, or run one rank)",
                comm.size()
            ),
        });
    }
    Ok(())
}

/// Checks an evaluation's sampling: temperature finite and >= 0, top_p in (0, 1].
pub(super) fn check_eval_sampling(temperature: f64, top_p: f64) -> Result<()> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(Error::invalid(format!(
            "evaluate: `temperature`: expected a finite value >= 0, found {temperature}"
        )));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(Error::invalid(format!("evaluate: `top_p`: expected a value in (0, 1], found {top_p}")));
    }
    Ok(())
}
