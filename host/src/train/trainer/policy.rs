//! The policy side of a run: the master weights, their optimizer, the copy rollouts
//! sample from (`rollout_dtype`), and the frozen reference of a KL penalty. The
//! update runs here ([`update::optimize_on`]), and the rollout copy is refreshed right
//! after it, so that rollouts always sample the policy just trained.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};

use super::RunConfig;
use crate::algo::ObjectiveConfig;
use crate::dist::Comm;
use crate::model::{self, checkpoint, Qwen3, RolloutCopy};
use crate::train::optim::AdamW;
use crate::train::update::{self, Sequence, UpdateConfig, UpdateOutcome};
use crate::{Error, Result};

/// Model, optimizer, rollout copy and reference of one rank.
pub struct PolicyState {
    model: Qwen3,
    opt: AdamW,
    /// The low-precision copy rollouts sample from (`rollout_dtype`).
    rollout_copy: Option<RolloutCopy>,
    reference: Option<Qwen3>,
}

impl PolicyState {
    /// The policy `model` with a fresh optimizer, the rollout copy `cfg` asks for, and
    /// (when `objective` has a KL penalty) the reference loaded again from `cfg.model`.
    pub fn new(cfg: &RunConfig, objective: &ObjectiveConfig, model: Qwen3) -> Result<Self> {
        let reference = match &objective.kl {
            Some(kl) if kl.beta != 0.0 => Some(model::load(&cfg.model, model.dtype(), model.device())?),
            _ => None,
        };
        let opt = AdamW::new(model.params(), cfg.adamw.clone())?;
        let rollout_copy = rollout_copy(cfg, &model)?;
        Ok(Self { model, opt, rollout_copy, reference })
    }

    /// The master weights (what the update trains).
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }

    /// The weights rollouts and evaluation sample from: the `rollout_dtype` copy when
    /// there is one, else the master weights.
    pub fn sampling_model(&self) -> &Qwen3 {
        self.rollout_copy.as_ref().map_or(&self.model, |c| c.model())
    }

    /// Whether rollouts sample from a copy in another dtype than the master weights.
    pub fn samples_from_copy(&self) -> bool {
        self.rollout_copy.is_some()
    }

    /// One update on `seqs` as one rank of `comm`, then the rollout copy refreshed.
    pub fn update(
        &mut self,
        comm: &dyn Comm,
        seqs: &[Sequence],
        ucfg: &UpdateConfig,
        lr: f64,
        pad_id: u32,
    ) -> Result<UpdateOutcome> {
        let policy =
            update::Policy { model: &self.model, opt: &mut self.opt, reference: self.reference.as_ref() };
        let outcome = update::optimize_on(comm, policy, seqs, ucfg, lr, pad_id)?;
        if let Some(copy) = &self.rollout_copy {
            copy.refresh(&self.model)?;
        }
        Ok(outcome)
    }

    /// Writes the model (HF files, in the checkpoint's dtype unless the weights in memory
    /// are wider) and `optimizer.safetensors` into `dir`; `source` is the model folder
    /// whose tokenizer files are copied along.
    pub fn save(&self, dir: &Path, source: &Path) -> Result<()> {
        let on_disk = model::parse_dtype(&self.model.config().torch_dtype).unwrap_or(DType::F32);
        let dtype = if on_disk.size_in_bytes() >= self.model.dtype().size_in_bytes() {
            on_disk
        } else {
            self.model.dtype()
        };
        checkpoint::write_model_files(&self.model, dir, dtype, Some(source))?;
        let opt: HashMap<String, Tensor> = self.opt.state_tensors()?.into_iter().collect();
        candle_core::safetensors::save(&opt, dir.join("optimizer.safetensors"))?;
        Ok(())
    }

    /// Restores the optimizer state of checkpoint `dir`, written at `step`.
    pub fn restore_optimizer(&mut self, dir: &Path, step: u64) -> Result<()> {
        let path = dir.join("optimizer.safetensors");
        let tensors =
            candle_core::safetensors::load(&path, self.model.device()).map_err(|e| Error::Config {
                file: path.display().to_string(),
                field: "<safetensors>".into(),
                msg: format!("unreadable optimizer state: {e}"),
            })?;
        self.opt.load_state(&tensors, step, &path.display().to_string())
    }
}

/// The low-precision copy rollouts sample from, when `rollout_dtype` names a dtype other
/// than the master weights'.
fn rollout_copy(cfg: &RunConfig, m: &Qwen3) -> Result<Option<RolloutCopy>> {
    let Some(name) = &cfg.rollout_dtype else { return Ok(None) };
    let dt = model::parse_dtype(name).map_err(|e| Error::Config {
        file: "run config".into(),
        field: "rollout_dtype".into(),
        msg: e.to_string(),
    })?;
    (dt != m.dtype()).then(|| RolloutCopy::new(m, dt)).transpose()
}
