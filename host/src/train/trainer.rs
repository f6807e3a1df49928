//! The RL training loop's state and one step of it: sample prompts, roll out
//! groups, score them with the math checker, update the policy, log metrics,
//! checkpoint. Scripts (or the CLI) drive it step by step and decide sampling,
//! thresholds and learning rate per step; everything that must survive a hot
//! reload or a crash (model, optimizer moments, data order, step counter)
//! lives here.
//!
//! A run folder holds `run_config.json` (the resolved configuration),
//! `metrics.jsonl` (one line per step), `checkpoints/step-NNNNNN/` (HF model
//! folder + `optimizer.safetensors` + `trainer_state.json`, each written
//! atomically) and `checkpoints/latest`. With each checkpoint it also draws
//! `curves.png`/`.svg`, `spurious.png`/`.svg` (STAPO's token scatter, see
//! [`Trainer::plot`]) and writes `silenced_tokens.tsv` (token, count, contexts). Every random choice is seeded from
//! `(seed, step)`, so a resumed run reproduces the uninterrupted one.
//!
//! The trainer is composed of parts, one file each under `train/trainer/`:
//!
//! - `policy.rs`: [`PolicyState`] (model, optimizer, rollout copy, reference; the update
//!   runs there);
//! - `prompts.rs`: [`PromptSource`] (data, epoch sampler, tokenizer, template);
//! - `folder.rs`: [`RunFolder`] (every file of the run folder and TensorBoard);
//! - `plan.rs`: the step plan ([`StepPlan`]) and the per-step seeds;
//! - `roller.rs`: a step's rollouts (`Roller`: prompts drawn, rolled out, scored);
//! - `dynamic.rs`: dynamic sampling (the groups with mixed rewards gathered over
//!   generation batches);
//! - `partial.rs`: partial rollouts (`rollout.partial`): the groups in flight between
//!   steps (`PartialSource`), saved with each checkpoint;
//! - `ahead.rs`: one-step-off training (`rollout.async`): the next step's rollout drawn
//!   in a second thread beside the update, the staleness check, the async metrics;
//! - `roles.rs`: rollout ranks and trainer ranks (`rollout.async.roles`): the job's
//!   ranks split into the two roles, the groups sent to the trainers, the weights back;
//! - `metrics.rs`: what a step reports ([`StepMetrics`]) and the warnings on their way;
//! - `setup.rs`: configuration glue (device and model of a rank, checks of the config);
//!
//! and the spurious-token log ([`SpuriousLog`], `train/spurious.rs`). This file holds the
//! [`Trainer`] itself: building or resuming it, the step that drives the parts, evaluation
//! and checkpoints. It depends on every part, on `rollout`, `eval`, `reward`, `guard`,
//! `dist` and `train::update`; the configuration tree is [`RunConfig`] (`train/config.rs`).

mod ahead;
mod dynamic;
mod folder;
mod metrics;
mod partial;
mod plan;
mod policy;
mod prompts;
mod roles;
mod roller;
mod setup;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::algo::{ObjectiveConfig, S2tThresholds};
use crate::data::{Example, Tokenizer};
use crate::dist::{self, Comm};
use crate::eval::{self, EvalReport};
use crate::guard::divergence::{Finding, StepSigns};
use crate::guard::folder::{claim_new_run_folder, remove_leftovers};
use crate::guard::{check_folder_finite, signal, DivergenceWatch, NonFiniteStreak, OnDivergence, RunLock};
use crate::model::{Qwen3, RolloutCopy};
use crate::rollout::{PromptInfo, RolloutBatch};
use crate::train::spurious::{SpuriousLog, SpuriousPoints};
use crate::train::update::{self, Sequence, UpdateConfig, UpdateMetrics, UpdateRecord};
use crate::train::RunConfig;
use crate::{Error, Result};
use ahead::{Ahead, Pools};
use dynamic::{Gathered, StepBatch};
pub use folder::RunFolder;
use folder::TrainerState;
use metrics::Notes;
pub use metrics::{AsyncFigures, RolloutFigures, StepMetrics};
use partial::PartialSource;
use plan::mix;
pub use plan::StepPlan;
pub use policy::PolicyState;
pub use prompts::PromptSource;
use roles::Roles;
use roller::Roller;
use setup::{check_eval_sampling, check_ranks, load_model};

/// A training run in progress, composed of its parts: the policy (model, optimizer,
/// rollout copy, reference), the prompt source (data, sampler, tokenizer, template), the
/// run folder (files, TensorBoard, evaluations) and the spurious-token log; plus where
/// the run stands (step, last rollout and update, notes not yet reported).
pub struct Trainer {
    cfg: RunConfig,
    objective: ObjectiveConfig,
    policy: PolicyState,
    prompts: PromptSource,
    folder: RunFolder,
    spurious: SpuriousLog,
    step: u64,
    /// The ranks of a data-parallel run ([`dist::Local`] for one process).
    comm: Arc<dyn Comm>,
    last: LastStep,
    notes: Notes,
    /// Steps in a row that skipped their update for a non-finite value.
    streak: NonFiniteStreak,
    /// The recent steps the divergence checks compare against.
    watch: DivergenceWatch,
    /// The trainable weights' norm after the last update (`None`: not measured yet).
    weight_norm: Option<f64>,
    /// The step that diverged under `guard.on_divergence` `stop` or `rollback` (it is
    /// never saved).
    diverged: Option<u64>,
    /// The factor on every step's learning rate (each rollback multiplies it by
    /// `guard.rollback_lr_scale`), and the rollbacks so far.
    lr_scale: f64,
    rollbacks: usize,
    /// The groups in flight between steps under partial rollouts (`rollout.partial`).
    partial: Option<PartialSource>,
    /// `rollout.async`: the next step's rollout, drawn beside this step's update.
    ahead: Option<Ahead>,
    /// `rollout.async`: the copy of the weights the rollout drawn ahead samples.
    behind: Option<RolloutCopy>,
    /// `rollout.async`: the thread pools of the rollout and the update.
    pools: Pools,
    /// `rollout.async.roles`: this rank's role in a job split into rollout and trainer
    /// ranks (`comm` is then the group of its role).
    roles: Option<Roles>,
    /// The step the run ends before (no rollout is drawn ahead for it); `None`: unknown.
    final_step: Option<u64>,
    /// The run folder's lock (rank 0, which writes it), released on drop or exit.
    _lock: Option<RunLock>,
}

/// How [`Trainer::resume_with`] resumes a run.
#[derive(Debug, Clone, Default)]
pub struct ResumeOptions {
    /// A configuration that differs from the run's `run_config.json`, to continue under.
    pub changed: Option<RunConfig>,
    /// Cut a damaged `metrics.jsonl` back to its last whole step (`--repair-metrics`).
    pub repair_metrics: bool,
}

/// What the latest step and evaluation produced, for the REPL and scripts.
#[derive(Default)]
struct LastStep {
    rollout: Option<RolloutBatch>,
    /// What the last update used, one entry per sample of `rollout`.
    update: Option<UpdateRecord>,
    /// The policy version that sampled `rollout`.
    version: Option<u64>,
    eval: Option<EvalReport>,
}

impl Trainer {
    /// Starts a run writing into `run_dir` (created; must be new, empty or a stapo run
    /// folder that holds no run yet), on the process's world ([`dist::world`]: one
    /// process, or every rank under `mpirun`). The folder is locked while the trainer
    /// lives ([`RunLock`]).
    pub fn new(cfg: RunConfig, run_dir: &Path) -> Result<Self> {
        Self::new_on(dist::world(), cfg, run_dir)
    }

    /// [`Trainer::new`] as one rank of `comm` (every rank calls it with the same
    /// arguments); rank 0 alone creates and writes the run folder.
    pub fn new_on(comm: Arc<dyn Comm>, cfg: RunConfig, run_dir: &Path) -> Result<Self> {
        cfg.validate()?;
        let lock = dist::on_root(&*comm, || {
            claim_new_run_folder(run_dir)?;
            let lock = RunLock::acquire(run_dir)?;
            let removed = remove_leftovers(run_dir)?;
            let restarted = RunFolder::create(run_dir, &cfg)?;
            Ok((lock, removed, restarted))
        })?;
        let m = load_model(&cfg, &cfg.model.path, &*comm)?;
        let mut t = Self::assemble(comm, cfg, m, run_dir, None)?;
        if let Some((lock, removed, restarted)) = lock {
            t._lock = Some(lock);
            t.note_leftovers(&removed);
            t.notes.pending.extend(restarted);
        }
        Ok(t)
    }

    /// Reports what [`remove_leftovers`] removed, with the next step's warnings.
    fn note_leftovers(&mut self, removed: &[PathBuf]) {
        if !removed.is_empty() {
            let names: Vec<String> = removed.iter().map(|p| p.display().to_string()).collect();
            self.notes
                .pending
                .push(format!("removed what an interrupted process left half-written: {}", names.join(", ")));
        }
    }

    /// Continues the run in `run_dir` from its latest checkpoint, on the process's
    /// world. The checkpoint does not depend on the number of ranks that wrote it.
    pub fn resume(run_dir: &Path) -> Result<Self> {
        Self::resume_on(dist::world(), run_dir)
    }

    /// [`Trainer::resume`] as one rank of `comm`.
    pub fn resume_on(comm: Arc<dyn Comm>, run_dir: &Path) -> Result<Self> {
        Self::resume_with(comm, run_dir, ResumeOptions::default())
    }

    /// [`Trainer::resume_on`] with options: `opts.changed`, a configuration that differs
    /// from the run's `run_config.json` (see [`RunConfig::differences`]): the run continues
    /// under it from the latest checkpoint, and rank 0 records it as `run_config.json`,
    /// keeping the old file as `run_config-step-NNNNNN.json` (`None`: the saved
    /// configuration); `opts.repair_metrics`: a damaged line of `metrics.jsonl` cuts the
    /// file back to the last whole step before it (else it is an error naming the line).
    ///
    /// A run that ended before its first checkpoint resumes from step 0: it starts again
    /// in its folder ([`Trainer::new_on`]) under its saved configuration, or `changed`.
    pub fn resume_with(comm: Arc<dyn Comm>, run_dir: &Path, opts: ResumeOptions) -> Result<Self> {
        let ResumeOptions { changed, repair_metrics } = opts;
        if crate::guard::folder::holds_unsaved_run(run_dir) {
            let cfg = match changed {
                Some(cfg) => {
                    let keep = run_dir.join("run_config-step-000000.json");
                    dist::on_root(&*comm, || {
                        std::fs::copy(run_dir.join("run_config.json"), &keep)
                            .map(|_| ())
                            .map_err(|e| Error::io(&keep, e))
                    })?;
                    cfg
                }
                None => RunFolder::read_config(run_dir)?,
            };
            return Self::new_on(comm, cfg, run_dir);
        }
        let ckpt = RunFolder::latest_checkpoint(run_dir)?;
        // Locked before anything is changed or removed: a live run in this folder wins.
        let locked = dist::on_root(&*comm, || Ok((RunLock::acquire(run_dir)?, remove_leftovers(run_dir)?)))?;
        let cfg = match changed {
            Some(cfg) => {
                cfg.validate()?;
                let step = RunFolder::read_state(&ckpt)?.step;
                dist::on_root(&*comm, || RunFolder::replace_config(run_dir, &cfg, step))?;
                cfg
            }
            None => RunFolder::read_config(run_dir)?,
        };
        let m = load_model(&cfg, &ckpt, &*comm)?;
        let state = RunFolder::read_state(&ckpt)?;
        let mut t = Self::assemble(comm.clone(), cfg, m, run_dir, Some(&state))?;
        t.policy.restore_optimizer(&ckpt, state.step)?;
        // Metrics logged after the checkpoint belong to steps that will run again.
        let cut = dist::on_root(&*comm, || t.folder.drop_metrics_from(state.step, repair_metrics))?;
        t.notes.pending.extend(cut.flatten());
        if let Some((lock, removed)) = locked {
            t._lock = Some(lock);
            t.note_leftovers(&removed);
        }
        Ok(t)
    }

    fn assemble(
        comm: Arc<dyn Comm>,
        cfg: RunConfig,
        m: Qwen3,
        run_dir: &Path,
        state: Option<&TrainerState>,
    ) -> Result<Self> {
        cfg.validate()?;
        let objective = cfg.actor.objective.clone();
        // Under roles, the rest of the trainer sees the group of this rank's role.
        let (mut roles, comm) = roles::split(comm, &cfg)?;
        check_ranks(&cfg, &*comm, roles.is_some())?;
        // NCCL for gradients when the model is on a GPU (collective: every rank is here).
        let comm = dist::for_device(comm, m.device())?;
        let (prompts, mut pending) = PromptSource::load(&cfg, state.map(|s| s.sampler))?;
        crate::rollout::check_vocab(&m, prompts.tokenizer())?;
        prompts.check_lengths(
            &m,
            cfg.rollout.sampling.max_new_tokens,
            if cfg.evaluation.every > 0 { cfg.evaluation.sampling.max_new_tokens } else { 0 },
        )?;
        pending.extend(crate::guard::take_notes());
        let policy = PolicyState::new(&cfg, &objective, m, &*comm)?;
        if let Some(r) = roles.as_mut() {
            r.keep_copy(policy.model(), policy.sampling_model().dtype())?;
        }
        let spurious = state.map_or_else(SpuriousLog::default, |s| {
            SpuriousLog::restore(&s.silenced_totals, s.silenced_contexts.clone())
        });
        let carried = state.and_then(|s| s.partial.clone());
        let partial = match (cfg.rollout.partial.enable, carried) {
            (true, Some(p)) => Some(PartialSource::restore(p)?),
            (true, None) => Some(PartialSource::default()),
            (false, Some(p)) => {
                pending.push(format!(
                    "rollout.partial is off: the {} group(s) the checkpoint carried in flight are dropped",
                    p.groups_in_flight()
                ));
                None
            }
            (false, None) => None,
        };
        Ok(Self {
            objective,
            policy,
            prompts,
            folder: RunFolder::open(run_dir, state.map(|s| s.step)),
            spurious,
            step: state.map_or(0, |s| s.step),
            last: LastStep::default(),
            notes: Notes { pending, warned: HashSet::new() },
            streak: NonFiniteStreak::default(),
            watch: DivergenceWatch::default(),
            weight_norm: None,
            diverged: None,
            lr_scale: state.map_or(1.0, |s| s.lr_scale),
            rollbacks: state.map_or(0, |s| s.rollbacks),
            partial,
            ahead: None,
            behind: None,
            pools: Pools::new(&cfg.rollout.asynchronous)?,
            roles,
            final_step: None,
            _lock: None,
            cfg,
            comm,
        })
    }

    /// The ranks this run trains on.
    pub fn comm(&self) -> &Arc<dyn Comm> {
        &self.comm
    }

    /// The run's configuration (eval sampling as last set).
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }
    /// The policy being trained (the master weights).
    pub fn model(&self) -> &Qwen3 {
        self.policy.model()
    }
    /// The weights rollouts and evaluation sample from: the `rollout_dtype` copy
    /// when there is one, else the master weights.
    pub fn sampling_model(&self) -> &Qwen3 {
        self.policy.sampling_model()
    }
    /// The run's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.prompts.tokenizer()
    }
    /// Steps completed.
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// The run folder.
    pub fn run_dir(&self) -> &Path {
        self.folder.path()
    }
    /// The scored samples of the last step (`None` before the first).
    pub fn last_rollout(&self) -> Option<&RolloutBatch> {
        self.last.rollout.as_ref()
    }
    /// What the last update used (advantages, kept and silenced tokens, thresholds),
    /// one entry per sample of [`Trainer::last_rollout`].
    pub fn last_update(&self) -> Option<&UpdateRecord> {
        self.last.update.as_ref()
    }
    /// (step, avg@n, pass@n) of every held-out evaluation so far.
    pub fn eval_history(&self) -> &[(u64, f64, f64)] {
        self.folder.evals()
    }
    /// The report of the last evaluation (`None` before the first).
    pub fn last_eval(&self) -> Option<&EvalReport> {
        self.last.eval.as_ref()
    }
    /// Silenced tokens over the whole run, most frequent first.
    pub fn silenced_totals(&self) -> Vec<(String, usize)> {
        self.spurious.totals()
    }

    /// Up to three readable contexts (`…left⟦token⟧right…`) of a silenced token string.
    pub fn silenced_contexts(&self, token: &str) -> &[String] {
        self.spurious.contexts(token)
    }

    /// The token points `spurious.png` draws (see [`Trainer::plot`]).
    pub fn spurious_points(&self) -> &SpuriousPoints {
        self.spurious.points()
    }

    /// Tells the trainer the run ends before step `steps`, so that under `rollout.async` no
    /// rollout is drawn ahead for a step that will not run.
    pub fn set_final_step(&mut self, steps: u64) {
        self.final_step = Some(steps);
    }

    /// The policy version (updates applied) that sampled the last step's rollout.
    pub fn last_rollout_version(&self) -> Option<u64> {
        self.last.version
    }

    /// The configuration's plan for the next step (schedules applied).
    pub fn default_plan(&self) -> StepPlan {
        StepPlan::from_config(&self.cfg, &self.objective, self.step)
    }

    /// Sets the S2T thresholds of the objective used by later default plans; an error when
    /// the objective has no S2T mask (thresholds never switch it on).
    pub fn set_thresholds(&mut self, t: S2tThresholds) -> Result<()> {
        if self.objective.mask.s2t().is_none() {
            return Err(Error::invalid(format!(
                "set_thresholds: the objective (preset `{}`, mask {}) has no S2T mask; thresholds apply to S2T only",
                self.cfg.actor.preset,
                self.objective.mask.name()
            )));
        }
        t.validate()?;
        self.objective.mask = t.into();
        Ok(())
    }

    /// One RL step under `plan`. `progress` receives rollout tokens so far; `cancel` set
    /// abandons the rollout in progress. A step that fails before its update (a rollout
    /// cancelled or failed) leaves the run where it stood: the prompts it drew are drawn
    /// again by the next step, so a run stopped there and resumed reproduces the
    /// uninterrupted one.
    pub fn step(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<StepMetrics> {
        if self.rolls_out() {
            return self.rollout_rank_step(plan, progress, cancel);
        }
        // A rollout drawn ahead holds prompts drawn after the step's own: a failed step gives
        // both back, and the step runs again rolling out its prompts itself.
        let sampler = self.ahead.as_ref().map_or_else(|| self.prompts.sampler_state(), |a| a.sampler_before);
        let step = self.step;
        let in_flight = self.partial.clone();
        let r = self.step_inner(plan, progress, cancel);
        if let Some(roles) = self.roles.as_mut().filter(|_| r.is_err() && self.step == step) {
            roles.give_up_ahead();
        }
        if let Some(roles) = &self.roles {
            // The outcome and the new weights to the rollout ranks.
            let sent = roles.publish(&r, self.step, self.policy.model());
            if r.is_ok() {
                sent?;
            }
        }
        if r.is_err() && self.step == step {
            self.ahead = None;
            self.prompts.restore_sampler(sampler)?;
            self.partial = in_flight;
        }
        r
    }

    /// Whether the run stops before its next step: `Some(sig)` when `flag` (the preemption
    /// flag, [`signal`]) is set on any rank of the job, `sig` the signal this rank stops
    /// for (its own, else one another rank received, which it adopts; 0: the flags were
    /// set without a signal); `None`: the run goes on. Every rank of a data-parallel job or
    /// of one split into rollout and trainer ranks calls it between the same two steps
    /// (one small collective over all of them) and gets the same answer, so they all stop
    /// at that step boundary: none is left waiting for a step's messages or collectives
    /// that the others never start.
    pub fn stop_requested(&self, flag: &AtomicBool) -> Result<Option<i32>> {
        let world = self.roles.as_ref().map_or(&self.comm, Roles::world);
        let [a, b, c] = signal::received_counts();
        let [up, a, b, c] =
            dist::sum_f64(&**world, [f64::from(u8::from(flag.load(Ordering::SeqCst))), a, b, c])?;
        if up == 0.0 {
            return Ok(None);
        }
        Ok(Some(signal::adopt_received(&[a, b, c]).unwrap_or(0)))
    }

    /// Whether this rank is a rollout rank of a job split into roles.
    fn rolls_out(&self) -> bool {
        self.roles.as_ref().is_some_and(Roles::rolls_out)
    }

    /// A step on a rollout rank (`rollout.async.roles`): the step's groups generated
    /// under the weights it holds and sent to the trainers (unless they were drawn ahead
    /// during the last step under this plan), under `staleness: 1` the next step's groups
    /// generated and sent too, then the step's outcome and the new weights received from
    /// trainer 0. Returns the step's metrics as the trainers logged them.
    fn rollout_rank_step(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&AtomicBool>,
    ) -> Result<StepMetrics> {
        // The epoch order before the step's prompts (drawn ahead or not): a step that fails
        // leaves it there, as on the trainers, so that the next step draws them again.
        let start = match self.roles.as_ref().and_then(|r| r.sent_ahead.as_ref()) {
            Some(a) => a.sampler_before,
            None => self.prompts.sampler_state(),
        };
        let step = self.step;
        let r = self.rollout_rank_step_inner(plan, progress, cancel);
        if r.is_err() && self.step == step {
            if let Some(roles) = self.roles.as_mut() {
                roles.sent_ahead = None;
            }
            self.prompts.restore_sampler(start)?;
        }
        r
    }

    fn rollout_rank_step_inner(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&AtomicBool>,
    ) -> Result<StepMetrics> {
        let step = self.step;
        let draws_ahead = self.draws_ahead();
        let Self { cfg, prompts, comm, roles, notes, .. } = self;
        let roles = roles.as_mut().ok_or_else(|| Error::invalid("roles: not a rollout rank"))?;
        let mut failed = false;
        match roles.sent_ahead.take() {
            Some(a) if a.serves(plan) => {}
            other => {
                if let Some(a) = other {
                    prompts.restore_sampler(a.sampler_before)?;
                }
                let mut warnings = std::mem::take(&mut notes.pending);
                let mut r =
                    Roller { cfg, prompts, comm: &**comm, model: roles.model()?, step, partial: None };
                let batch = r.gather(plan, progress, cancel, &mut warnings);
                failed = batch.is_err();
                roles.send(&**comm, batch.map(Some), step, prompts.sampler_state(), warnings)?;
            }
        }
        if draws_ahead && !failed {
            let before = prompts.sampler_state();
            let mut warnings = Vec::new();
            let mut r =
                Roller { cfg, prompts, comm: &**comm, model: roles.model()?, step: step + 1, partial: None };
            let got = r.gather(plan, None, cancel, &mut warnings);
            // Given up on every rollout rank when it failed on one; a cancellation on any
            // (a stop on its way) is no failure to report.
            let cancelled = cancel.is_some_and(|c| c.load(Ordering::SeqCst));
            let [failures, cancels] =
                dist::sum_f64(&**comm, [f64::from(u8::from(got.is_err())), f64::from(u8::from(cancelled))])?;
            let given_up = failures > 0.0;
            if let Err(e) = &got {
                if cancels == 0.0 {
                    notes.pending.push(format!(
                        "rollout.async: the rollout of step {} drawn ahead failed ({e}); that step rolls \
                         out again when it runs",
                        step + 1
                    ));
                }
            }
            let batch = if given_up { Ok(None) } else { got.map(Some) };
            roles.send(&**comm, batch, step, prompts.sampler_state(), warnings)?;
            roles.sent_ahead(plan, before, given_up);
        }
        let (steps, m) = roles.receive_outcome()?;
        self.step = steps;
        m
    }

    fn step_inner(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<StepMetrics> {
        let step = self.step;
        // Like verl's val_before_train: the curve of held-out accuracy starts at step 0.
        if step == 0
            && self.cfg.evaluation.every > 0
            && self.prompts.has_test()
            && self.folder.evals().is_empty()
        {
            self.evaluate(None)?;
        }
        let mut warnings = std::mem::take(&mut self.notes.pending);
        let t0 = Instant::now();
        let (batch, version) = self.take_rollout(plan, progress, cancel, &mut warnings)?;
        let asynchronous = &self.cfg.rollout.asynchronous;
        let lag = ahead::check_staleness(step, version, asynchronous.staleness)?;
        let mut figures = asynchronous.enabled().then(|| {
            let mut f = AsyncFigures::with_lag(lag, batch.local_tokens);
            // A rollout drawn now, not ahead, is waited for whole.
            f.wait_rollout_secs = if version == step { t0.elapsed().as_secs_f64() } else { 0.0 };
            f
        });
        let Gathered { examples, texts: prompt_texts, samples, .. } = batch.kept;
        let seqs: Vec<Sequence> =
            samples.iter().map(|s| Sequence::from_sample(s, s.reward.unwrap_or(0.0))).collect();

        let t1 = Instant::now();
        signal::reached("update", step);
        let watch_norm = self.cfg.guard.weight_norm_growth > 0.0;
        let norm_before = match self.weight_norm {
            Some(n) => n,
            None if watch_norm => self.trainable_norm()?,
            None => 0.0,
        };
        let ucfg = self.update_config(plan, lag, &mut warnings)?;
        let outcome = self.update_step(plan, &seqs, &ucfg, cancel, figures.as_mut(), &mut warnings)?;
        let objective = ucfg.actor.objective;
        self.weight_norm = if watch_norm { Some(self.trainable_norm()?) } else { None };
        // A skipped update left the weights as they were; too many in a row stop the run
        // (after this step's metrics are logged).
        let stop =
            self.streak.observe(step, &outcome.metrics.skip_reasons, self.cfg.guard.max_nonfinite_steps);
        let mut um = outcome.metrics;
        let groups_dropped =
            self.batch_figures(&batch.all_seqs, &seqs, &objective, batch.groups_dropped, &mut um)?;
        warnings.append(&mut um.warnings);
        um.warnings = warnings;
        let ents = samples.iter().flat_map(|s| s.entropies.iter());
        let nonzero_adv = outcome.record.advantages.iter().filter(|a| **a != 0.0).count();
        let [n_tokens, ent_sum, ent_count, nonzero_adv] = dist::sum_f64(
            &*self.comm,
            [
                batch.local_tokens as f64,
                ents.clone().map(|&h| h as f64).sum::<f64>(),
                ents.count() as f64,
                nonzero_adv as f64,
            ],
        )?;
        if um.response_tokens == 0 {
            // Nothing reached the update (e.g. dynamic sampling dropped every
            // group): report the policy's entropy from the rollout instead.
            um.entropy = (ent_sum / ent_count.max(1.0)) as f32;
        }
        let update_secs = t1.elapsed().as_secs_f64();
        let silenced =
            self.spurious.add(self.prompts.tokenizer(), &um.silenced_token_ids, &samples, &outcome.record);
        let prompts_info = examples
            .iter()
            .zip(&prompt_texts)
            .map(|(e, t)| PromptInfo { id: e.id.clone(), text: t.clone(), answer: Some(e.answer.clone()) })
            .collect();
        self.last.rollout = Some(RolloutBatch::new(samples, prompts_info));
        self.last.update = Some(outcome.record);
        self.last.version = Some(version);
        self.step += 1;

        let signs = StepSigns {
            entropy: um.entropy as f64,
            reward: um.reward_mean as f64,
            vocab: self.policy.model().config().vocab_size,
            weight_norm: (norm_before, self.weight_norm.unwrap_or(0.0)),
            grad_norm: um.grad_norm as f64,
            nonzero_advantages: nonzero_adv as usize,
        };
        let findings = self.watch.observe(step, &signs, &self.cfg.guard);
        let mode = self.cfg.guard.on_divergence;
        if !findings.is_empty() {
            let list: Vec<&str> = findings.iter().map(|f| f.what.as_str()).collect();
            match mode {
                OnDivergence::Warn => um.warnings.push(format!(
                    "divergence at step {step}: {} (guard.on_divergence = warn: training goes on; \
                     `stop` or `rollback` act on it)",
                    list.join("; ")
                )),
                _ => self.diverged = Some(step),
            }
        }
        let mut m = StepMetrics {
            step,
            lr: plan.lr * self.lr_scale,
            update: um,
            silenced_tokens_text: silenced.tokens,
            silenced_examples: silenced.examples,
            rollout_secs: batch.rollout_secs,
            update_secs,
            rollout_tokens_per_sec: n_tokens / batch.rollout_secs.max(1e-9),
            rollout_engine: batch.engine.clone(),
            gen_batches: batch.gen_batches,
            groups_dropped,
            partial: batch.partial.clone(),
            asynchronous: figures,
            eval_avg: None,
            eval_pass: None,
        };
        self.finish_step(&mut m)?;
        if let Some(e) = stop {
            return Err(e);
        }
        if self.diverged.is_some() {
            self.on_divergence(step, &findings, &mut m)?;
        }
        Ok(m)
    }

    /// The norm of the trainable weights.
    fn trainable_norm(&self) -> Result<f64> {
        let mut sq = 0f64;
        for (_, v) in self.policy.model().trainable_params() {
            let t = v.as_tensor().to_dtype(candle_core::DType::F32)?;
            sq += t.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        Ok(sq.sqrt())
    }

    /// A step that diverged under `stop` or `rollback`: the checkpoints holding suspect
    /// weights are set aside (`diverged-step-NNNNNN`, `latest` back at the last good one),
    /// then the run stops with an error naming the step and the quantities, or goes back
    /// to the last good checkpoint with the learning rate scaled.
    fn on_divergence(&mut self, step: u64, findings: &[Finding], m: &mut StepMetrics) -> Result<()> {
        let guard = self.cfg.guard.clone();
        let list: Vec<&str> = findings.iter().map(|f| f.what.as_str()).collect();
        let what = format!("step {step} diverged: {}", list.join("; "));
        // Checkpoint step-N holds the weights step N starts from: good below the first
        // suspect step.
        let suspect = findings.iter().map(|f| f.suspect_from).min().unwrap_or(step);
        let good_max = suspect.checked_sub(1);
        let dir = self.run_dir().to_path_buf();
        let good = good_max.and_then(|g| RunFolder::newest_checkpoint_upto(&dir, g));
        dist::on_root(&*self.comm, || RunFolder::set_aside_after(&dir, good))?;
        let resume = match good {
            Some(g) => format!(
                "the last good checkpoint is step-{g:06} (`latest`; stapo run --resume {} continues from it)",
                dir.display()
            ),
            None => format!(
                "no checkpoint holds weights from before it (start the run again, or stapo run --resume {} \
                 from step 0)",
                dir.display()
            ),
        };
        let stop = |why: String| Err(Error::invalid(format!("{what}; {why}; {resume}")));
        match (guard.on_divergence, good) {
            (OnDivergence::Warn, _) => Ok(()),
            (OnDivergence::Stop, _) => stop("stopping the run (guard.on_divergence = stop)".into()),
            (OnDivergence::Rollback, None) => {
                stop("nothing to roll back to (guard.on_divergence = rollback)".into())
            }
            (OnDivergence::Rollback, Some(_)) if self.rollbacks >= guard.max_rollbacks => stop(format!(
                "stopping the run after {} rollback(s) (guard.max_rollbacks = {})",
                self.rollbacks, guard.max_rollbacks
            )),
            (OnDivergence::Rollback, Some(g)) => {
                let lr_scale = self.lr_scale * guard.rollback_lr_scale;
                let rollbacks = self.rollbacks + 1;
                let comm = self.comm.clone();
                self._lock = None;
                let mut t = Trainer::resume_on(comm, &dir)?;
                t.lr_scale = lr_scale;
                t.rollbacks = rollbacks;
                t.final_step = self.final_step;
                let note = format!(
                    "{what}; rolled back to step-{g:06} with the learning rate scaled by {lr_scale} \
                     (rollback {rollbacks} of at most {}, guard.rollback_lr_scale = {})",
                    guard.max_rollbacks, guard.rollback_lr_scale
                );
                m.update.warnings.push(note);
                *self = t;
                Ok(())
            }
        }
    }

    /// The step that diverged under `guard.on_divergence` `stop` (never saved), if any.
    pub fn diverged(&self) -> Option<u64> {
        self.diverged
    }

    /// The factor on the learning rate after rollbacks (1 without any).
    pub fn lr_scale(&self) -> f64 {
        self.lr_scale
    }

    /// The checkpoint a run ending now leaves to resume from, written unless `latest`
    /// already holds this step; `None` when there is none (no step completed, or the
    /// run diverged and no good checkpoint exists).
    pub fn save_on_exit(&mut self) -> Result<Option<PathBuf>> {
        let dir = self.run_dir().to_path_buf();
        if self.step == 0 {
            return Ok(None);
        }
        if self.diverged.is_some() || RunFolder::latest_step(&dir) == Some(self.step) {
            return Ok(
                RunFolder::latest_step(&dir).map(|s| dir.join("checkpoints").join(format!("step-{s:06}")))
            );
        }
        self.checkpoint().map(Some)
    }

    /// After a step: the held-out evaluation when one is due, the metrics line, the
    /// checkpoint when one is due.
    fn finish_step(&mut self, m: &mut StepMetrics) -> Result<()> {
        let every = self.cfg.evaluation.every as u64;
        if every > 0 && self.step.is_multiple_of(every) && self.prompts.has_test() {
            let r = self.evaluate(None)?;
            m.eval_avg = Some(r.overall.avg);
            m.eval_pass = Some(r.overall.pass);
        }
        dist::on_root(&*self.comm, || self.folder.log_step(m))?;
        let save_every = self.cfg.checkpoint.save_every as u64;
        if save_every > 0 && self.step.is_multiple_of(save_every) && self.diverged.is_none() {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// An error for what only the trainer ranks do, called on a rollout rank.
    fn not_on_rollout_rank(&self, what: &str) -> Result<()> {
        if self.rolls_out() {
            return Err(Error::invalid(format!(
                "{what}: this is a rollout rank (rollout.async.roles); the trainer ranks evaluate, and \
                 each step's metrics carry the evaluations due (evaluation.every)"
            )));
        }
        Ok(())
    }

    /// The configuration of this step's update (the objective fitted to the run's response
    /// budget, logits divided by the sampling temperature as verl does, so that the ratio
    /// is on-policy; T <= 0 is greedy: none; the rollout correction resolved for rollouts
    /// sampled by a copy in another dtype or `lag` policy versions ago), its notes passed on.
    fn update_config(
        &mut self,
        plan: &StepPlan,
        lag: u64,
        warnings: &mut Vec<String>,
    ) -> Result<UpdateConfig> {
        let mut actor = self.cfg.actor.clone();
        actor.objective = plan.objective.clone();
        let (ucfg, notes) = UpdateConfig::build(
            actor,
            Some(plan.sampling.max_new_tokens),
            plan.sampling.temperature,
            self.policy.samples_from_copy() || lag > 0,
            mix(self.cfg.seed ^ 0x5eed, self.step),
            self.cfg.logging.token_grad_norms,
        )?;
        for note in notes {
            self.notes.once(note, warnings);
        }
        Ok(ucfg)
    }

    /// The rollout this step trains on and the policy version that sampled it: the one
    /// drawn ahead during the last step when it was drawn with this plan's sampling, else
    /// rolled out now under the current weights (version `self.step`).
    fn take_rollout(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&AtomicBool>,
        warnings: &mut Vec<String>,
    ) -> Result<(StepBatch, u64)> {
        let draws_ahead = self.draws_ahead();
        if let Some(roles) = self.roles.as_mut() {
            // A trainer rank: the groups the rollout ranks drew ahead under this plan, else
            // those they draw now.
            let held = roles.held.take();
            if held.as_ref().is_some_and(|h| !h.drawn_with(plan)) {
                self.notes.once(
                    "rollout.async: the step's sampling settings differ from those the rollout drawn \
                     ahead used; it was discarded and the step rolled out again under the current weights"
                        .into(),
                    warnings,
                );
            }
            let got = match held.and_then(|h| h.serving(plan)) {
                Some(r) => r,
                None => roles.receive()?.ok_or_else(|| {
                    Error::invalid("roles: the rollout ranks gave up the step's own rollout")
                })?,
            };
            // Having sent this step's groups, the rollout ranks draw the next step's.
            roles.ahead_pending = draws_ahead;
            self.prompts.restore_sampler(got.sampler_after)?;
            warnings.extend(got.warnings);
            return Ok((got.batch, got.version));
        }
        if let Some(a) = self.ahead.take() {
            if a.drawn_with(plan) {
                warnings.extend(a.warnings);
                return Ok((a.batch, a.version));
            }
            self.prompts.restore_sampler(a.sampler_before)?;
            self.notes.once(
                "rollout.async: the step's sampling settings differ from those the rollout drawn ahead \
                 used; it was discarded and the step rolled out again under the current weights"
                    .into(),
                warnings,
            );
        }
        let mut r = Roller {
            cfg: &self.cfg,
            prompts: &mut self.prompts,
            comm: &*self.comm,
            model: self.policy.sampling_model(),
            step: self.step,
            partial: self.partial.as_mut(),
        };
        Ok((r.gather(plan, progress, cancel, warnings)?, self.step))
    }

    /// Whether this step draws the next step's rollout beside its update.
    fn draws_ahead(&self) -> bool {
        self.cfg.rollout.asynchronous.enabled() && self.final_step.is_none_or(|f| self.step + 1 < f)
    }

    /// The update of this step on `seqs` under `ucfg`, then the rollout copy refreshed;
    /// under `rollout.async` with a next step to come, the next step's rollout runs beside
    /// it in a second thread, on a copy of the weights the update starts from, and is kept
    /// for that step (`Ahead`; given up, its prompts put back, when cancelled or failed).
    fn update_step(
        &mut self,
        plan: &StepPlan,
        seqs: &[Sequence],
        ucfg: &UpdateConfig,
        cancel: Option<&AtomicBool>,
        figures: Option<&mut AsyncFigures>,
        warnings: &mut Vec<String>,
    ) -> Result<update::UpdateOutcome> {
        let pad_id = self.prompts.tokenizer().pad_id();
        let lr = plan.lr * self.lr_scale;
        if self.roles.is_some() {
            // A trainer rank: the update, then the next step's groups, which the rollout
            // ranks drew beside it.
            let ahead = self.draws_ahead();
            let outcome = self.policy.update(&*self.comm, seqs, ucfg, lr, pad_id);
            if let Some(roles) = self.roles.as_mut().filter(|_| ahead) {
                let t = Instant::now();
                roles.hold(plan)?;
                if let Some(f) = figures {
                    f.wait_rollout_secs += t.elapsed().as_secs_f64();
                    f.ahead_rollout_secs = roles.held_rollout_secs();
                }
            }
            return outcome;
        }
        let Some(figures) = figures.filter(|_| self.draws_ahead()) else {
            return self.pools.train(|| self.policy.update(&*self.comm, seqs, ucfg, lr, pad_id));
        };
        // The copy the rollout thread samples: the weights this update starts from.
        let t = Instant::now();
        match &self.behind {
            Some(b) => b.refresh(self.policy.model())?,
            None => {
                let dtype = self.policy.sampling_model().dtype();
                self.behind = Some(RolloutCopy::new(self.policy.model(), dtype)?);
            }
        }
        figures.weight_copy_secs = t.elapsed().as_secs_f64();
        let sampler_before = self.prompts.sampler_state();
        let (version, next) = (self.step, self.step + 1);
        let (policy, pools, comm) = (&mut self.policy, &self.pools, &*self.comm);
        let mut roller = Roller {
            cfg: &self.cfg,
            prompts: &mut self.prompts,
            comm,
            model: self.behind.as_ref().map(|b| b.model()).ok_or_else(|| Error::invalid("no weight copy"))?,
            step: next,
            // Partial rollouts are refused under `rollout.async` (`RolloutConfig::validate`).
            partial: None,
        };
        let (outcome, update_took, (ahead, ahead_warnings, rollout_took)) = std::thread::scope(|s| {
            let rollout = s.spawn(|| {
                let t = Instant::now();
                let mut w = Vec::new();
                let r = pools.rollout(|| roller.gather(plan, None, cancel, &mut w));
                (r, w, t.elapsed())
            });
            let t = Instant::now();
            let outcome = pools.train(|| policy.update(comm, seqs, ucfg, lr, pad_id));
            let took = t.elapsed();
            let joined = rollout.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            (outcome, took, joined)
        });
        figures.overlap(update_took, rollout_took);
        match ahead {
            Ok(batch) => {
                self.ahead = Some(Ahead {
                    batch,
                    version,
                    sampling: plan.sampling.clone(),
                    dynamic_sampling: plan.objective.dynamic_sampling,
                    sampler_before,
                    warnings: ahead_warnings,
                })
            }
            Err(e) => {
                // Its prompts are drawn again by the step that needs them.
                self.prompts.restore_sampler(sampler_before)?;
                if !cancel.is_some_and(|c| c.load(Ordering::SeqCst)) {
                    warnings.push(format!(
                        "rollout.async: the rollout of step {next} drawn ahead failed ({e}); that step \
                         rolls out again when it runs"
                    ));
                }
            }
        }
        outcome
    }

    /// The batch metrics, computed once over everything sampled this step (also the groups
    /// dynamic sampling dropped before the update); returns the groups dropped over ranks.
    fn batch_figures(
        &self,
        all_seqs: &[Sequence],
        seqs: &[Sequence],
        objective: &ObjectiveConfig,
        groups_dropped: usize,
        um: &mut UpdateMetrics,
    ) -> Result<usize> {
        let scored_all = update::score(all_seqs, objective)?;
        let [n_all, n_seqs, dropped] =
            dist::sum_f64(&*self.comm, [all_seqs.len() as f64, seqs.len() as f64, groups_dropped as f64])?;
        update::batch_metrics(&*self.comm, all_seqs, &scored_all, um)?;
        um.dropped_seqs += (n_all - n_seqs) as usize;
        Ok(dropped as usize)
    }

    /// Evaluates on `data.test` (or `examples`) with the configured eval sampling.
    pub fn evaluate(&mut self, examples: Option<&[Example]>) -> Result<EvalReport> {
        self.not_on_rollout_rank("evaluate")?;
        let s = &self.cfg.evaluation.sampling;
        let report = self.evaluate_once(examples, (s.temperature, s.top_p), false)?;
        self.folder.note_eval(self.step, &report);
        self.last.eval = Some(report.clone());
        Ok(report)
    }

    /// Evaluates at `temperature` / `top_p` (the paper reports T 1.0 and T 0.7 / top-p
    /// 0.9). At the configured setting this is [`evaluate`](Self::evaluate); at another,
    /// the report goes to `eval-t<T>-p<top_p>.jsonl` (not to `eval.jsonl`, the curves,
    /// TensorBoard or the run's evaluation history).
    pub fn evaluate_at(
        &mut self,
        examples: Option<&[Example]>,
        temperature: f64,
        top_p: f64,
    ) -> Result<EvalReport> {
        self.not_on_rollout_rank("evaluate")?;
        if (temperature, top_p)
            == (self.cfg.evaluation.sampling.temperature, self.cfg.evaluation.sampling.top_p)
        {
            return self.evaluate(examples);
        }
        check_eval_sampling(temperature, top_p)?;
        self.evaluate_once(examples, (temperature, top_p), true)
    }

    /// Sets the sampling of the periodic evaluations (`evaluation.sampling.temperature`,
    /// `evaluation.sampling.top_p`) from the next one on.
    pub fn set_eval_sampling(&mut self, temperature: f64, top_p: f64) -> Result<()> {
        check_eval_sampling(temperature, top_p)?;
        (self.cfg.evaluation.sampling.temperature, self.cfg.evaluation.sampling.top_p) = (temperature, top_p);
        Ok(())
    }

    /// One evaluation at `setting` (temperature, top_p), written by rank 0 (`extra`: not
    /// the configured setting) and broadcast, so every rank's hooks see the same numbers.
    fn evaluate_once(
        &mut self,
        examples: Option<&[Example]>,
        setting: (f64, f64),
        extra: bool,
    ) -> Result<EvalReport> {
        let ex = match examples {
            Some(e) => e.to_vec(),
            None => self.prompts.test_examples(self.cfg.evaluation.limit)?,
        };
        let mut params = self.cfg.evaluation.sampling.clone();
        (params.temperature, params.top_p) = setting;
        params.seed = mix(self.cfg.seed ^ 0xe7a1, 0);
        let comm = self.comm.clone();
        let report = dist::on_root(&*comm, || {
            let gen = self.prompts.generator(self.policy.sampling_model());
            let report =
                eval::evaluate(&gen, &ex, &params, self.cfg.data.extract, &self.cfg.rollout.engine, &|_| {})?
                    .with_pass_k(&self.cfg.evaluation.pass_k)?;
            self.folder.log_eval(self.step, &report, setting, extra)?;
            Ok(report)
        })?;
        let report = if comm.size() > 1 { dist::broadcast_json(&*comm, 0, &report)? } else { report };
        report.ok_or_else(|| Error::invalid("evaluate: rank 0 sent no report"))
    }

    /// Writes a checkpoint of model, optimizer and trainer state; returns its folder.
    /// Under several ranks (whose states are identical) rank 0 alone writes, with
    /// its share of the last rollout as the sample rollouts.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        let path = self.run_dir().join("checkpoints").join(format!("step-{:06}", self.step));
        if self.rolls_out() {
            // The trainers write it (rank 0); a rollout rank holds nothing a checkpoint needs.
            return Ok(path);
        }
        let comm = self.comm.clone();
        // A sharded optimizer: every rank writes its file, rank 0 moves them into place.
        let staging = self.run_dir().join("checkpoints").join(format!(".optimizer-step-{:06}", self.step));
        self.policy.stage_optimizer(&*comm, &staging)?;
        dist::on_root(&*comm, || self.write_checkpoint(&staging))?;
        Ok(path)
    }

    fn write_checkpoint(&self, staging: &Path) -> Result<PathBuf> {
        let state = TrainerState {
            step: self.step,
            // A rollout drawn ahead is not saved: a resumed run draws its prompts again.
            sampler: self.ahead.as_ref().map_or_else(|| self.prompts.sampler_state(), |a| a.sampler_before),
            silenced_totals: self.spurious.totals(),
            silenced_contexts: self.spurious.all_contexts().clone(),
            lr_scale: self.lr_scale,
            rollbacks: self.rollbacks,
            partial: self.partial.as_ref().map(PartialSource::state),
        };
        let what = format!("checkpoint step-{:06}", self.step);
        let path = self.folder.checkpoint(&state, self.cfg.checkpoint.keep, |tmp| {
            self.policy.save(tmp, &self.cfg.model.path, staging)?;
            signal::reached("save", self.step);
            // Verified before it can become `latest`: a resume must find finite weights.
            check_folder_finite(tmp, &what)
        })?;
        if let Some(r) = &self.last.rollout {
            self.folder.save_rollouts(self.step, r)?;
        }
        self.plot()?;
        self.folder.write_silenced(&self.spurious)?;
        Ok(path)
    }

    /// Draws the run's curves into `curves.png` and `curves.svg` in the run folder, and,
    /// once an update recorded gradient norms (`token_grad_norms`), STAPO's token scatter
    /// into `spurious.png` and `spurious.svg`.
    ///
    /// The scatter accumulates over the updates of this process (a resumed run starts it
    /// afresh), because one step silences a handful of tokens at most: every positive-
    /// advantage token with p below the larger of the run's tau_p and the paper's 0.002
    /// (the S2T candidates and their neighbourhood, up to 20,000) and a uniform sample of
    /// 4,000 of the others, each coloured by its logit-gradient norm at the step it was
    /// trained on; the S2T region drawn is the latest step's (tau_p, mean tau_h of its
    /// mini-batches).
    pub fn plot(&self) -> Result<(PathBuf, PathBuf)> {
        self.folder.plot(&self.cfg.actor.preset, &self.spurious)
    }
}
