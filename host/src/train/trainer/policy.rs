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
use crate::model::{self, checkpoint, peft, LoraConfig, Qwen3, RolloutCopy};
use crate::train::optim::AdamW;
use crate::train::update::{self, Sequence, UpdateConfig, UpdateOutcome};
use crate::{Error, Result};

/// Model, optimizer, rollout copy and reference of one rank.
pub struct PolicyState {
    model: Qwen3,
    opt: AdamW,
    /// The low-precision copy rollouts sample from (`rollout.dtype`).
    rollout_copy: Option<RolloutCopy>,
    reference: Option<Qwen3>,
    /// The run's LoRA settings (`None`: full fine-tuning).
    lora: Option<LoraConfig>,
}

impl PolicyState {
    /// The policy `model` with a fresh optimizer, the rollout copy `cfg` asks for, and
    /// (when `objective` has a KL penalty) the reference: loaded again from `cfg.model.path`, or
    /// with LoRA the frozen base under the adapters ([`Qwen3::base_view`]).
    ///
    /// With `cfg.actor.lora`, fresh adapters go on `model` (seeded by the run's seed) unless it
    /// carries them already (a resumed LoRA checkpoint, whose rank and targets must be the
    /// configuration's); the optimizer then holds the adapters alone, and rollouts sample
    /// a copy with the adapters merged, refreshed after every update.
    pub fn new(cfg: &RunConfig, objective: &ObjectiveConfig, mut model: Qwen3) -> Result<Self> {
        attach_lora(cfg, &mut model)?;
        // With LoRA the reference is the frozen base itself (shared, not reloaded).
        let reference = match &objective.kl {
            Some(kl) if kl.beta != 0.0 && model.has_lora() => Some(model.base_view()),
            Some(kl) if kl.beta != 0.0 => Some(model::load(&cfg.model.path, model.dtype(), model.device())?),
            _ => None,
        };
        let opt = AdamW::new(model.trainable_params(), cfg.actor.optim.clone())?;
        let rollout_copy = rollout_copy(cfg, &model)?;
        Ok(Self { model, opt, rollout_copy, reference, lora: cfg.actor.lora.clone() })
    }

    /// The learning rate the optimizer takes for the run's `lr`: times `lora.lr_scale`
    /// with LoRA ("LoRA Without Regret": about 10x the full fine-tune's).
    pub fn effective_lr(&self, lr: f64) -> f64 {
        self.lora.as_ref().map_or(lr, |l| lr * l.lr_scale)
    }

    /// Parameters the optimizer trains (the adapters alone with LoRA).
    pub fn trainable_count(&self) -> usize {
        self.opt.n_elements()
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
        let lr = self.effective_lr(lr);
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
    ///
    /// With LoRA the model files are a peft adapter folder (`adapter_model.safetensors`,
    /// `adapter_config.json` naming `source` as the base), and the optimizer state covers
    /// the adapters.
    pub fn save(&self, dir: &Path, source: &Path) -> Result<()> {
        if let Some(lora) = &self.lora {
            peft::write_adapter_files(&self.model, lora, dir, &peft::base_name(source), Some(source))?;
            return self.save_optimizer(dir);
        }
        let on_disk = model::parse_dtype(&self.model.config().torch_dtype).unwrap_or(DType::F32);
        let dtype = if on_disk.size_in_bytes() >= self.model.dtype().size_in_bytes() {
            on_disk
        } else {
            self.model.dtype()
        };
        checkpoint::write_model_files(&self.model, dir, dtype, Some(source))?;
        self.save_optimizer(dir)
    }

    fn save_optimizer(&self, dir: &Path) -> Result<()> {
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

/// The copy rollouts sample from: in `rollout_dtype` when it names a dtype other than the
/// master weights'; with LoRA always (in the master's dtype unless told), since sampling
/// merged weights is faster than the unmerged adapter path (docs/lora.md).
fn rollout_copy(cfg: &RunConfig, m: &Qwen3) -> Result<Option<RolloutCopy>> {
    let dt = match &cfg.rollout.dtype {
        Some(name) => model::parse_dtype(name).map_err(|e| Error::Config {
            file: "run config".into(),
            field: "rollout.dtype".into(),
            msg: e.to_string(),
        })?,
        None => m.dtype(),
    };
    (dt != m.dtype() || m.has_lora()).then(|| RolloutCopy::new(m, dt)).transpose()
}

/// Puts the adapters of `cfg.actor.lora` on `m`: fresh ones, or (a resumed checkpoint) checks
/// that those it carries are the configuration's.
fn attach_lora(cfg: &RunConfig, m: &mut Qwen3) -> Result<()> {
    let Some(lora) = &cfg.actor.lora else {
        if m.has_lora() {
            return Err(Error::Config {
                file: "run config".into(),
                field: "actor.lora".into(),
                msg: "the model carries LoRA adapters but the run has no `actor.lora` settings".into(),
            });
        }
        return Ok(());
    };
    if !m.has_lora() {
        return m.add_lora(lora, cfg.seed ^ 0x10ba);
    }
    let have = m.lora_config();
    if have.map(|h| (h.rank, &h.targets)) != Some((lora.rank, &lora.targets)) {
        return Err(Error::Config {
            file: "run config".into(),
            field: "lora".into(),
            msg: format!(
                "the checkpoint's adapters (rank {:?}) differ from the configured rank {} / targets {:?}",
                have.map(|h| h.rank),
                lora.rank,
                lora.targets
            ),
        });
    }
    Ok(())
}
