//! The policy side of a run: the master weights, their optimizer, the copy rollouts
//! sample from (`rollout_dtype`), and the frozen reference of a KL penalty. The
//! update runs here ([`update::optimize_on`]), and the rollout copy is refreshed right
//! after it, so that rollouts always sample the policy just trained. Depends on `model`
//! (the policy, its checkpoints and adapters), `train::optim`, `train::update`, `algo`
//! and `dist`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};

use crate::algo::ObjectiveConfig;
use crate::dist::{self, Comm};
use crate::model::{self, checkpoint, peft, LoraConfig, Qwen3, RolloutCopy};
use crate::train::optim::{AdamW, FlatState, Optimizer, ShardMode, ShardedAdamW, INDEX_FILE, PLAIN_FILE};
use crate::train::update::{self, Sequence, UpdateConfig, UpdateOutcome};
use crate::train::RunConfig;
use crate::{Error, Result};

/// The optimizer of one rank: whole, or sharded over the ranks (`shard`).
enum Opt {
    Full(AdamW),
    Sharded(ShardedAdamW),
}

impl Opt {
    fn as_dyn(&mut self) -> &mut dyn Optimizer {
        match self {
            Opt::Full(o) => o,
            Opt::Sharded(o) => o,
        }
    }
}

/// Model, optimizer, rollout copy and reference of one rank.
pub struct PolicyState {
    model: Qwen3,
    opt: Opt,
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
    ///
    /// With `cfg.actor.shard` other than `none` the optimizer holds this rank's range of the
    /// flattened trainable parameters alone ([`ShardedAdamW`], ZeRO-1/2 over `comm`).
    pub fn new(
        cfg: &RunConfig,
        objective: &ObjectiveConfig,
        mut model: Qwen3,
        comm: &dyn Comm,
    ) -> Result<Self> {
        attach_lora(cfg, &mut model)?;
        // With LoRA the reference is the frozen base itself (shared, not reloaded).
        let reference = match &objective.kl {
            Some(kl) if kl.beta != 0.0 && model.has_lora() => Some(model.base_view()),
            Some(kl) if kl.beta != 0.0 => Some(model::load(&cfg.model.path, model.dtype(), model.device())?),
            _ => None,
        };
        let params = model.trainable_params();
        let optim = cfg.actor.optim.clone();
        let opt = match cfg.actor.shard {
            ShardMode::None => Opt::Full(AdamW::new(params, optim)?),
            mode => Opt::Sharded(ShardedAdamW::new(params, optim, mode, comm.rank(), comm.size())?),
        };
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
        match &self.opt {
            Opt::Full(o) => o.n_elements(),
            Opt::Sharded(o) => o.n_elements(),
        }
    }

    /// Bytes of optimizer state this rank holds.
    pub fn optimizer_bytes(&mut self) -> usize {
        self.opt.as_dyn().state_bytes()
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
            update::Policy { model: &self.model, opt: self.opt.as_dyn(), reference: self.reference.as_ref() };
        let outcome = update::optimize_on(comm, policy, seqs, ucfg, lr, pad_id)?;
        if let Some(copy) = &self.rollout_copy {
            copy.refresh(&self.model)?;
        }
        Ok(outcome)
    }

    /// Writes this rank's optimizer shard into `staging` when the optimizer is sharded
    /// (every rank calls it, before rank 0 writes the checkpoint with [`PolicyState::save`]);
    /// nothing otherwise. A failure on any rank fails every rank, naming it.
    pub fn stage_optimizer(&self, comm: &dyn Comm, staging: &Path) -> Result<()> {
        let Opt::Sharded(o) = &self.opt else { return Ok(()) };
        let mine = std::fs::create_dir_all(staging)
            .map_err(|e| Error::io(staging, e))
            .and_then(|_| o.save_shard(staging))
            .err()
            .map(|e| e.to_string());
        let all: Vec<Option<String>> = dist::all_gather_json(comm, &mine)?;
        match all.iter().enumerate().find_map(|(r, e)| e.as_ref().map(|e| (r, e))) {
            Some((r, e)) => Err(Error::invalid(format!("rank {r}: writing its optimizer shard: {e}"))),
            None => Ok(()),
        }
    }

    /// Writes the model (HF files, in the checkpoint's dtype unless the weights in memory
    /// are wider) and the optimizer state into `dir`; `source` is the model folder whose
    /// tokenizer files are copied along. The unsharded optimizer goes to
    /// `optimizer.safetensors`; a sharded one's files, staged by every rank in `staging`
    /// ([`PolicyState::stage_optimizer`]), move into `dir` with their index.
    ///
    /// With LoRA the model files are a peft adapter folder (`adapter_model.safetensors`,
    /// `adapter_config.json` naming `source` as the base), and the optimizer state covers
    /// the adapters.
    pub fn save(&self, dir: &Path, source: &Path, staging: &Path) -> Result<()> {
        if let Some(lora) = &self.lora {
            peft::write_adapter_files(&self.model, lora, dir, &peft::base_name(source), Some(source))?;
            return self.save_optimizer(dir, staging);
        }
        let on_disk = model::parse_dtype(&self.model.config().torch_dtype).unwrap_or(DType::F32);
        let dtype = if on_disk.size_in_bytes() >= self.model.dtype().size_in_bytes() {
            on_disk
        } else {
            self.model.dtype()
        };
        checkpoint::write_model_files(&self.model, dir, dtype, Some(source))?;
        self.save_optimizer(dir, staging)
    }

    fn save_optimizer(&self, dir: &Path, staging: &Path) -> Result<()> {
        let o = match &self.opt {
            Opt::Full(o) => {
                let opt: HashMap<String, Tensor> = o.state_tensors()?.into_iter().collect();
                checkpoint::save_safetensors(&opt, &dir.join(PLAIN_FILE))?;
                return Ok(());
            }
            Opt::Sharded(o) => o,
        };
        let index = o.index();
        for s in &index.shards {
            let from = staging.join(&s.file);
            std::fs::rename(&from, dir.join(&s.file)).map_err(|e| Error::io(&from, e))?;
        }
        let text = serde_json::to_string_pretty(&index).map_err(|e| Error::invalid(e.to_string()))?;
        std::fs::write(dir.join(INDEX_FILE), text).map_err(|e| Error::io(dir.join(INDEX_FILE), e))?;
        // Empty now; a failure to remove it loses nothing.
        let _ = std::fs::remove_dir(staging);
        Ok(())
    }

    /// Restores the optimizer state of checkpoint `dir`, written at `step`: plain or
    /// sharded, by any number of ranks (a sharded state is re-cut to this run's ranks).
    pub fn restore_optimizer(&mut self, dir: &Path, step: u64) -> Result<()> {
        let state = FlatState::open(dir, step)?;
        match &mut self.opt {
            Opt::Sharded(o) => o.load_from(&state),
            Opt::Full(o) => {
                let shapes: Vec<(String, Vec<usize>)> =
                    o.params().map(|(n, v)| (n.to_string(), v.dims().to_vec())).collect();
                let tensors = state.per_param(&shapes)?;
                let file = match &state {
                    FlatState::Shards { .. } => dir.join(INDEX_FILE),
                    FlatState::PerParam { .. } => dir.join(PLAIN_FILE),
                };
                o.load_state(&tensors, state.step(), &file.display().to_string())
            }
        }
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
