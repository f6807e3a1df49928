//! The host values scripts hold: handles to state that lives in Rust (a
//! model and its optimizer, a tokenizer, a dataset, a rollout, a run), shared
//! by the bindings and the training loop. Heavy state sits behind
//! `Arc<Mutex<..>>` so a hot reload swaps code, never handles.
//!
//! It imports neither the bindings nor the training loop, so both can use it
//! without importing each other.

use std::ops::Deref;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use candle_core::{Device, Tensor};

use super::error::{host, RhaiResult};
use super::shared_state::{Host, KeptRun};
use crate::algo::{self, AdvEstimator, S2tStats, S2tThresholds, StdKind};
use crate::data::{Dataset, Tokenizer};
use crate::model::Qwen3;
use crate::rollout::RolloutBatch;
use crate::train::spurious::{Region, TokenPoint};
use crate::train::{AdamW, Trainer};
use crate::{Error, Result};

/// A model in memory, with its tokenizer and (once `update` ran) its optimizer.
#[derive(Clone)]
pub struct ModelHandle(pub Arc<Mutex<ModelSlot>>);

/// What a [`ModelHandle`] holds.
pub struct ModelSlot {
    /// The model.
    pub model: Qwen3,
    /// Its tokenizer, when the folder had one.
    pub tokenizer: Option<Tokenizer>,
    /// The folder it was loaded from (its tokenizer files are copied on save).
    pub dir: Option<PathBuf>,
    /// AdamW state, created by the first `update`.
    pub opt: Option<AdamW>,
}

/// A tokenizer.
#[derive(Clone)]
pub struct TokenizerHandle(pub Arc<Tokenizer>);

/// A loaded dataset.
#[derive(Clone)]
pub struct DatasetHandle(pub Arc<Dataset>);

/// A batch of sampled responses, with rewards, advantages and the S2T mask once computed.
#[derive(Clone)]
pub struct RolloutHandle(pub Arc<Mutex<RolloutState>>);

/// What a [`RolloutHandle`] holds.
pub struct RolloutState {
    /// The samples and their prompts.
    pub batch: RolloutBatch,
    /// The tokenizer that decodes the samples' tokens.
    pub tokenizer: Option<Tokenizer>,
    /// One advantage per sample (`advantages(r)`).
    pub advantages: Option<Vec<f32>>,
    /// Per sample, per response token: silenced by S2T (`s2t(r)`).
    pub silenced: Option<Vec<Vec<bool>>>,
    /// The S2T region of the last `s2t(r)` (or of the run's update), for `spurious_plot`.
    pub region: Option<Region>,
    /// For a run's rollout: the positive-advantage token points of its update (p, H and
    /// logit-gradient norm of the training forward), for `spurious_plot(rollout, path)`.
    pub points: Option<Vec<TokenPoint>>,
}

/// A training run (a [`Trainer`]) driven step by step.
#[derive(Clone)]
pub struct RunHandle(pub Arc<HeldRun>);

/// The run behind a [`RunHandle`]. A script that holds its runs itself (`trainer(cfg)`)
/// is ended by a signal wherever it stands, often in the middle of one run's rollout,
/// before its own closing `checkpoint()` calls. So when the script lets go of a run
/// after a stop was requested (a signal, or a time limit that passed), the run is
/// checkpointed at its last completed step, as `train` checkpoints its own, and the host
/// records where ([`Host::kept_runs`]). A step that failed part-way left the run where it
/// stood before that step, so the checkpoint is of a consistent state; a diverged run is
/// not saved.
pub struct HeldRun {
    trainer: Mutex<Trainer>,
    host: Weak<Host>,
}

impl HeldRun {
    /// `trainer`, held by a script running under `host`.
    pub fn new(trainer: Trainer, host: &Arc<Host>) -> Self {
        HeldRun { trainer: Mutex::new(trainer), host: Arc::downgrade(host) }
    }
}

impl Deref for HeldRun {
    type Target = Mutex<Trainer>;
    fn deref(&self) -> &Mutex<Trainer> {
        &self.trainer
    }
}

impl Drop for HeldRun {
    fn drop(&mut self) {
        let Some(host) = self.host.upgrade() else { return };
        if !host.cancelled() && host.deadline_passed().is_none() {
            return;
        }
        let kept = match self.trainer.get_mut() {
            Ok(t) => {
                let run_dir = t.run_dir().to_path_buf();
                let steps = t.step_count();
                let checkpoint = t.save_on_exit().map(|p| p.map(|p| p.display().to_string()));
                KeptRun { run_dir, steps, checkpoint: checkpoint.map_err(|e| e.to_string()) }
            }
            // A panic in the middle of a call on it: nothing consistent to save.
            Err(p) => KeptRun {
                run_dir: p.get_ref().run_dir().to_path_buf(),
                steps: p.get_ref().step_count(),
                checkpoint: Err("a call on the run panicked; its last checkpoint stays the latest".into()),
            },
        };
        host.record_kept(kept);
    }
}

/// Locks a handle's mutex; a poisoned lock (a panic in an earlier call) is a host error.
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> RhaiResult<MutexGuard<'a, T>> {
    m.lock().map_err(|_| host(format!("{what} is unusable after an earlier failure")))
}

impl RolloutState {
    /// A freshly sampled (unscored) batch.
    pub fn new(batch: RolloutBatch, tokenizer: Option<Tokenizer>) -> Self {
        RolloutState { batch, tokenizer, advantages: None, silenced: None, region: None, points: None }
    }

    /// Rewards of every sample, or an error naming the first unscored one.
    pub fn rewards(&self) -> Result<Vec<f32>> {
        let s = &self.batch.samples;
        s.iter()
            .enumerate()
            .map(|(i, s)| {
                s.reward
                    .ok_or_else(|| Error::invalid(format!("sample {i} has no reward; call score(r) first")))
            })
            .collect()
    }

    /// Forgets advantages and mask (after the rewards changed).
    pub fn clear_derived(&mut self) {
        self.advantages = None;
        self.silenced = None;
        self.region = None;
        self.points = None;
    }

    /// Computes and stores the group advantages of the scored batch.
    pub fn compute_advantages(&mut self, est: AdvEstimator, std: StdKind) -> Result<Vec<f32>> {
        let r = self.rewards()?;
        let groups: Vec<usize> = self.batch.samples.iter().map(|s| s.group).collect();
        let a = algo::group_advantages(&r, &groups, est, std)?;
        self.advantages = Some(a.values.clone());
        Ok(a.values)
    }

    /// Applies STAPO's S2T mask with the rollout's own per-token p and H (the
    /// policy at sampling time, which the first update epoch sees) and stores
    /// which tokens are silenced. Computes GRPO advantages first if none are stored.
    pub fn compute_s2t(&mut self, th: S2tThresholds) -> Result<S2tStats> {
        if self.advantages.is_none() {
            self.compute_advantages(AdvEstimator::Grpo, StdKind::Sample)?;
        }
        let adv = self.advantages.clone().unwrap_or_default();
        let samples = &self.batch.samples;
        let t = samples.iter().map(|s| s.response_ids.len()).max().unwrap_or(0).max(1);
        let rows = |f: &dyn Fn(&crate::rollout::Sample) -> Vec<f32>| -> Result<Tensor> {
            let flat: Vec<f32> = samples
                .iter()
                .flat_map(|s| {
                    let v = f(s);
                    let pad = t - v.len();
                    v.into_iter().chain(std::iter::repeat_n(0.0, pad))
                })
                .collect();
            Ok(Tensor::from_vec(flat, (samples.len(), t), &Device::Cpu)?)
        };
        let logp = rows(&|s| s.old_logprobs.clone())?;
        let ent = rows(&|s| s.entropies.clone())?;
        let resp = rows(&|s| vec![1.0; s.response_ids.len()])?;
        let a = Tensor::from_vec(adv.clone(), (adv.len(),), &Device::Cpu)?;
        let (_mask, stats) = algo::s2t_mask(&logp, &ent, &a, &resp, th.tau_p, th.tau_h)?;
        let mut silenced: Vec<Vec<bool>> =
            samples.iter().map(|s| vec![false; s.response_ids.len()]).collect();
        for &(b, p) in &stats.positions {
            if let Some(x) = silenced.get_mut(b).and_then(|r| r.get_mut(p)) {
                *x = true;
            }
        }
        self.silenced = Some(silenced);
        self.region = stats.tau_h.map(|tau_h| Region { tau_p: th.tau_p, tau_h });
        Ok(stats)
    }
}
