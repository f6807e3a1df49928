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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::algo::{ObjectiveConfig, S2tThresholds, TauH};
use crate::data::{
    Dataset, DatasetOptions, EpochSampler, Example, Prompt, PromptTemplate, Prompter, SamplerState, Tokenizer,
};
use crate::dist::{self, Comm};
use crate::eval::{self, EvalReport};
use crate::model::{self, checkpoint, Qwen3};
use crate::reward::{self, ExtractMode};
use crate::rollout::{GenerateHooks, Generator, PromptInfo, RolloutBatch, Sample, SamplingParams};
use crate::train::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::train::plot::{self, RunCurves};
use crate::train::spurious::{token_context, SilencedContexts, SpuriousPoints};
use crate::train::update::{
    self, optimize_on, OldLogp, Policy, Sequence, UpdateConfig, UpdateMetrics, UpdateRecord,
};
use crate::util::{append_line, write_file_atomically};
use crate::{Error, Result};

/// Everything a run needs, as a script map or JSON gives it. Missing fields
/// take their defaults (the STAPO paper's, scaled to a CPU where noted).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Model folder (HF layout with tokenizer.json).
    pub model: PathBuf,
    /// Training problems: a JSONL or Parquet file, a folder of Hugging Face
    /// shards, or a `*` pattern (see `data::Dataset::load`).
    pub data: PathBuf,
    /// Held-out problems for periodic evaluation.
    pub test_data: Option<PathBuf>,
    /// Field names and bad-line policy of the data files.
    pub data_options: DatasetOptions,
    /// Objective preset (`algo::PRESETS`: grpo, dapo, gspo, sapo, entropy20, justrl, stapo, drgrpo).
    pub objective: String,
    /// `key = value` overrides of the preset (see `ObjectiveConfig::set`).
    pub set: BTreeMap<String, String>,
    /// Prompts per step (paper: 256).
    pub prompts_per_step: usize,
    /// Rollout sampling (paper: n 8, temperature 1.0, top-p 1.0).
    pub sampling: SamplingParams,
    /// Prompt template (default `"model"`: what the model folder declares).
    pub template: PromptTemplate,
    /// Answer extraction of the reward.
    pub extract: ExtractMode,
    /// Base learning rate (paper: 1e-6) and schedule.
    pub lr: f64,
    pub schedule: LrSchedule,
    pub adamw: AdamWConfig,
    /// PPO epochs, sequences per optimizer step (0 = all), per forward (0 = mini-batch).
    pub epochs: usize,
    pub mini_batch: usize,
    pub micro_batch: usize,
    pub old_logp: OldLogp,
    /// With dynamic sampling: at most this many prompt batches per step to fill
    /// `prompts_per_step` groups with mixed rewards (verl `max_num_gen_batches`; 0 = no
    /// limit); when hit, the step updates on fewer groups and warns.
    pub max_num_gen_batches: usize,
    /// Divide the logits by the sampling temperature in the update's forward passes (old
    /// log-probs and training), as verl does, so the ratio is on-policy at T != 1; the
    /// S2T rule's p and H then refer to the tempered policy.
    pub scale_logits_by_temperature: bool,
    /// Record every response token's logit-gradient norm and report the shares of silenced
    /// and top-0.01% tokens each step (STAPO's analysis; one extra softmax over the logits).
    pub token_grad_norms: bool,
    pub seed: u64,
    /// Evaluate on `test_data` every this many steps (0 = never).
    pub eval_every: usize,
    /// Samples per test problem and how many problems (None = all).
    pub eval_n: usize,
    pub eval_limit: Option<usize>,
    pub eval_temperature: f64,
    pub eval_top_p: f64,
    /// Also report unbiased pass@k for these k (each at most `eval_n`) in eval.jsonl.
    pub eval_pass_k: Vec<usize>,
    /// Checkpoint every this many steps (0 = only when asked).
    pub save_every: usize,
    /// Checkpoints kept (older ones are removed).
    pub keep_checkpoints: usize,
    /// Weights in memory: float32, bfloat16, float16; device: cpu, cuda, cuda:N.
    pub dtype: String,
    pub device: String,
    /// Sample rollouts (and evaluate) with a copy of the policy in this dtype
    /// (e.g. "bfloat16" on a GPU), refreshed from the master weights after every
    /// update ([`model::RolloutCopy`]); `None` (or `dtype` itself) samples from the
    /// master weights.
    pub rollout_dtype: Option<String>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::from("models/tiny-qwen3"),
            data: PathBuf::from("data/arith/train.jsonl"),
            test_data: None,
            data_options: DatasetOptions::default(),
            objective: "stapo".into(),
            set: BTreeMap::new(),
            prompts_per_step: 16,
            sampling: SamplingParams::default(),
            template: PromptTemplate::Model,
            extract: ExtractMode::Strict,
            lr: 1e-6,
            schedule: LrSchedule::Constant { warmup_steps: 10 },
            adamw: AdamWConfig::default(),
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            old_logp: OldLogp::Recompute,
            max_num_gen_batches: 10,
            scale_logits_by_temperature: true,
            token_grad_norms: true,
            seed: 0,
            eval_every: 0,
            eval_n: 8,
            eval_limit: None,
            eval_temperature: 1.0,
            eval_top_p: 1.0,
            eval_pass_k: Vec::new(),
            save_every: 0,
            keep_checkpoints: 2,
            dtype: "float32".into(),
            device: "cpu".into(),
            rollout_dtype: None,
        }
    }
}

impl RunConfig {
    /// The objective: preset plus overrides, validated.
    pub fn objective_config(&self) -> Result<ObjectiveConfig> {
        ObjectiveConfig::with_overrides(&self.objective, &self.set)
    }
}

/// What a step may change relative to the configuration (hooks decide it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepPlan {
    pub sampling: SamplingParams,
    pub lr: f64,
    pub objective: ObjectiveConfig,
}

/// Per-step metrics: the update's, plus rollout and timing figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    pub lr: f64,
    #[serde(flatten)]
    pub update: UpdateMetrics,
    /// Most frequently silenced tokens this step, as text.
    pub silenced_tokens_text: Vec<(String, usize)>,
    /// A few silenced tokens of this step in their response (`…12+7=1⟦9⟧\n\boxed…`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub silenced_examples: Vec<String>,
    pub rollout_secs: f64,
    pub update_secs: f64,
    pub rollout_tokens_per_sec: f64,
    /// Prompt batches generated this step (more than 1 when dynamic sampling refilled).
    #[serde(default)]
    pub gen_batches: usize,
    /// Groups dynamic sampling dropped before the update (all rewards equal).
    #[serde(default)]
    pub groups_dropped: usize,
    /// Held-out avg@n when this step evaluated.
    pub eval_avg: Option<f64>,
    pub eval_pass: Option<f64>,
}

/// Silenced-token contexts reported per step in the metrics.
const SILENCED_EXAMPLES: usize = 8;

/// Saved with each checkpoint: where the run stood.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    step: u64,
    sampler: SamplerState,
    silenced_totals: Vec<(String, usize)>,
    #[serde(default)]
    silenced_contexts: SilencedContexts,
}

/// A training run in progress.
pub struct Trainer {
    cfg: RunConfig,
    objective: ObjectiveConfig,
    model: Qwen3,
    /// The low-precision copy rollouts sample from (`rollout_dtype`).
    rollout_copy: Option<model::RolloutCopy>,
    reference: Option<Qwen3>,
    opt: AdamW,
    tokenizer: Tokenizer,
    /// `cfg.template` resolved against the model folder.
    prompter: Prompter,
    train: Dataset,
    test: Option<Dataset>,
    sampler: EpochSampler,
    step: u64,
    run_dir: PathBuf,
    silenced_totals: HashMap<String, usize>,
    /// Readable contexts of silenced tokens, by token string (bounded).
    silenced_contexts: SilencedContexts,
    /// Positive-advantage tokens of this process's updates for `spurious.png` (bounded).
    spurious: SpuriousPoints,
    last_rollout: Option<RolloutBatch>,
    /// What the last update used, one entry per sample of `last_rollout`.
    last_update: Option<UpdateRecord>,
    /// Warnings not yet reported (data lines skipped at load); the next step's metrics
    /// carry them, since the library prints nothing.
    pending_warnings: Vec<String>,
    /// Notes already reported once (settings that cannot take effect).
    warned: std::collections::HashSet<String>,
    last_eval: Option<EvalReport>,
    /// (step, avg@n, pass@n) of every held-out evaluation of this run.
    evals: Vec<(u64, f64, f64)>,
    dtype: DType,
    /// The ranks of a data-parallel run ([`dist::Local`] for one process).
    comm: Arc<dyn Comm>,
    /// `tb/`: every metrics and eval row again as TensorBoard scalars (rank 0 writes).
    tb: super::tensorboard::Board,
}

/// The device of this rank: under several ranks a bare `cuda` means the GPU
/// numbered by the rank's index on its host.
fn rank_device(name: &str, comm: &dyn Comm) -> Result<candle_core::Device> {
    if comm.size() > 1 && name.trim() == "cuda" {
        return model::parse_device(&format!("cuda:{}", dist::local_rank()));
    }
    model::parse_device(name)
}

impl Trainer {
    /// Starts a run writing into `run_dir` (created; must not hold a run yet), on the
    /// process's world ([`dist::world`]: one process, or every rank under `mpirun`).
    pub fn new(cfg: RunConfig, run_dir: &Path) -> Result<Self> {
        Self::new_on(dist::world(), cfg, run_dir)
    }

    /// [`Trainer::new`] as one rank of `comm` (every rank calls it with the same
    /// arguments); rank 0 alone creates and writes the run folder.
    pub fn new_on(comm: Arc<dyn Comm>, cfg: RunConfig, run_dir: &Path) -> Result<Self> {
        eval::check_pass_k(&cfg.eval_pass_k, cfg.eval_n)
            .map_err(|e| Error::invalid(format!("eval_pass_k (eval_n = {}): {e}", cfg.eval_n)))?;
        dist::on_root(&*comm, || {
            if run_dir.join("run_config.json").exists() {
                return Err(Error::invalid(format!(
                    "{} already holds a run; resume it or pick another folder",
                    run_dir.display()
                )));
            }
            std::fs::create_dir_all(run_dir).map_err(|e| Error::io(run_dir, e))?;
            let text = serde_json::to_string_pretty(&cfg).map_err(|e| Error::invalid(e.to_string()))?;
            write_file_atomically(&run_dir.join("run_config.json"), text.as_bytes())
        })?;
        let device = rank_device(&cfg.device, &*comm)?;
        let dtype = model::parse_dtype(&cfg.dtype)?;
        let m = model::load(&cfg.model, dtype, &device)?;
        Self::assemble(comm, cfg, m, run_dir, None)
    }

    /// Continues the run in `run_dir` from its latest checkpoint, on the process's
    /// world. The checkpoint does not depend on the number of ranks that wrote it.
    pub fn resume(run_dir: &Path) -> Result<Self> {
        Self::resume_on(dist::world(), run_dir)
    }

    /// [`Trainer::resume`] as one rank of `comm`.
    pub fn resume_on(comm: Arc<dyn Comm>, run_dir: &Path) -> Result<Self> {
        let cfg_path = run_dir.join("run_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let cfg: RunConfig = serde_json::from_str(&text).map_err(|e| Error::Parse {
            path: cfg_path.clone(),
            line: e.line(),
            msg: e.to_string(),
        })?;
        let latest = run_dir.join("checkpoints/latest");
        let name = std::fs::read_to_string(&latest).map_err(|e| Error::io(&latest, e))?;
        let ckpt = run_dir.join("checkpoints").join(name.trim());
        let device = rank_device(&cfg.device, &*comm)?;
        let dtype = model::parse_dtype(&cfg.dtype)?;
        let m = model::load(&ckpt, dtype, &device)?;
        let state_path = ckpt.join("trainer_state.json");
        let state_text = std::fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
        let state: TrainerState = serde_json::from_str(&state_text).map_err(|e| Error::Parse {
            path: state_path.clone(),
            line: e.line(),
            msg: e.to_string(),
        })?;
        let mut t = Self::assemble(comm.clone(), cfg, m, run_dir, Some(&state))?;
        let opt_path = ckpt.join("optimizer.safetensors");
        let tensors = candle_core::safetensors::load(&opt_path, &device).map_err(|e| Error::Config {
            file: opt_path.display().to_string(),
            field: "<safetensors>".into(),
            msg: format!("unreadable optimizer state: {e}"),
        })?;
        t.opt.load_state(&tensors, state.step, &opt_path.display().to_string())?;
        // Metrics logged after the checkpoint belong to steps that will run again.
        let metrics = run_dir.join("metrics.jsonl");
        let root = comm.rank() == 0;
        if let (true, Ok(text)) = (root, std::fs::read_to_string(&metrics)) {
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s < state.step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            write_file_atomically(&metrics, kept.as_bytes())?;
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
        let objective = cfg.objective_config()?;
        if cfg.prompts_per_step < comm.size() {
            return Err(Error::Config {
                file: "run config".into(),
                field: "prompts_per_step".into(),
                msg: format!(
                    "{} prompts per step cannot be shared by {} ranks (each needs at least one)",
                    cfg.prompts_per_step,
                    comm.size()
                ),
            });
        }
        // NCCL for gradients when the model is on a GPU (collective: every rank is here).
        let comm = dist::for_device(comm, m.device())?;
        let tok_path = cfg.model.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)?;
        let prompter = tokenizer.prompter(&cfg.template)?;
        let (train, mut warnings) = Dataset::load(&cfg.data, &cfg.data_options)?;
        // Reported with the first step's warnings (library code prints nothing).
        warnings.extend(prompter.note().map(str::to_string));
        let test = match &cfg.test_data {
            Some(p) => Some(Dataset::load(p, &cfg.data_options)?.0),
            None => None,
        };
        let sampler = match state {
            Some(s) => EpochSampler::restore(s.sampler, train.len())?,
            None => EpochSampler::new(train.len(), cfg.seed)?,
        };
        let reference = match &objective.kl {
            Some(kl) if kl.beta != 0.0 => Some(model::load(&cfg.model, m.dtype(), m.device())?),
            _ => None,
        };
        let opt = AdamW::new(m.params(), cfg.adamw.clone())?;
        let rollout_copy = rollout_copy(&cfg, &m)?;
        Ok(Self {
            rollout_copy,
            dtype: m.dtype(),
            objective,
            reference,
            opt,
            tokenizer,
            prompter,
            train,
            test,
            sampler,
            step: state.map_or(0, |s| s.step),
            run_dir: run_dir.to_path_buf(),
            silenced_totals: state.map(|s| s.silenced_totals.iter().cloned().collect()).unwrap_or_default(),
            silenced_contexts: state.map(|s| s.silenced_contexts.clone()).unwrap_or_default(),
            spurious: SpuriousPoints::default(),
            last_rollout: None,
            last_update: None,
            pending_warnings: warnings,
            warned: Default::default(),
            last_eval: None,
            // A new run has no evaluations yet. (Reading eval.jsonl here for a new run raced
            // with rank 0's step-0 evaluation in a data-parallel run: a rank that saw rank 0's
            // line skipped the evaluation and its collectives.)
            evals: state.map(|s| read_evals(&run_dir.join("eval.jsonl"), s.step)).unwrap_or_default(),
            tb: super::tensorboard::Board::new(run_dir),
            model: m,
            cfg,
            comm,
        })
    }

    /// The ranks this run trains on.
    pub fn comm(&self) -> &Arc<dyn Comm> {
        &self.comm
    }

    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }
    /// The weights rollouts and evaluation sample from: the `rollout_dtype` copy
    /// when there is one, else the master weights.
    pub fn sampling_model(&self) -> &Qwen3 {
        self.rollout_copy.as_ref().map_or(&self.model, |c| c.model())
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// Steps completed.
    pub fn step_count(&self) -> u64 {
        self.step
    }
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }
    pub fn last_rollout(&self) -> Option<&RolloutBatch> {
        self.last_rollout.as_ref()
    }
    /// What the last update used (advantages, kept and silenced tokens, thresholds),
    /// one entry per sample of [`Trainer::last_rollout`].
    pub fn last_update(&self) -> Option<&UpdateRecord> {
        self.last_update.as_ref()
    }
    /// (step, avg@n, pass@n) of every held-out evaluation so far.
    pub fn eval_history(&self) -> &[(u64, f64, f64)] {
        &self.evals
    }
    pub fn last_eval(&self) -> Option<&EvalReport> {
        self.last_eval.as_ref()
    }
    /// Silenced tokens over the whole run, most frequent first.
    pub fn silenced_totals(&self) -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = self.silenced_totals.iter().map(|(k, c)| (k.clone(), *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    /// Up to three readable contexts (`…left⟦token⟧right…`) of a silenced token string.
    pub fn silenced_contexts(&self, token: &str) -> &[String] {
        self.silenced_contexts.get(token)
    }

    /// The token points `spurious.png` draws (see [`Trainer::plot`]).
    pub fn spurious_points(&self) -> &SpuriousPoints {
        &self.spurious
    }

    /// The configuration's plan for the next step (schedules applied).
    pub fn default_plan(&self) -> StepPlan {
        StepPlan {
            sampling: self.cfg.sampling.clone(),
            lr: self.cfg.schedule.lr_at(self.cfg.lr, self.step),
            objective: self.objective.clone(),
        }
    }

    /// Sets the S2T thresholds of the objective used by later default plans; an error when
    /// the objective has no S2T mask (thresholds never switch it on).
    pub fn set_thresholds(&mut self, tau_p: f32, tau_h: TauH) -> Result<()> {
        if self.objective.mask.s2t().is_none() {
            return Err(Error::invalid(format!(
                "set_thresholds: the objective `{}` has no S2T mask; thresholds apply to S2T only",
                self.cfg.objective
            )));
        }
        let t = S2tThresholds { tau_p, tau_h };
        t.validate()?;
        self.objective.mask = t.into();
        Ok(())
    }

    /// One RL step under `plan`. `progress` receives rollout tokens so far.
    pub fn step(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<StepMetrics> {
        let step = self.step;
        // Like verl's val_before_train: the curve of held-out accuracy starts at step 0.
        if step == 0 && self.cfg.eval_every > 0 && self.test.is_some() && self.evals.is_empty() {
            self.evaluate(None)?;
        }
        let mut warnings = std::mem::take(&mut self.pending_warnings);
        let batch = self.gather(plan, progress, cancel, &mut warnings)?;
        let Gathered { examples, texts: prompt_texts, samples } = batch.kept;
        let seqs: Vec<Sequence> =
            samples.iter().map(|s| Sequence::from_sample(s, s.reward.unwrap_or(0.0))).collect();

        let t1 = Instant::now();
        let (outcome, objective) = self.train_on(plan, &seqs, &mut warnings)?;
        let mut um = outcome.metrics;
        let groups_dropped =
            self.batch_figures(&batch.all_seqs, &seqs, &objective, batch.groups_dropped, &mut um)?;
        warnings.append(&mut um.warnings);
        um.warnings = warnings;
        let ents = samples.iter().flat_map(|s| s.entropies.iter());
        let [n_tokens, ent_sum, ent_count] = dist::sum_f64(
            &*self.comm,
            [batch.local_tokens as f64, ents.clone().map(|&h| h as f64).sum::<f64>(), ents.count() as f64],
        )?;
        if um.response_tokens == 0 {
            // Nothing reached the update (e.g. dynamic sampling dropped every
            // group): report the policy's entropy from the rollout instead.
            um.entropy = (ent_sum / ent_count.max(1.0)) as f32;
        }
        let update_secs = t1.elapsed().as_secs_f64();
        let (silenced_tokens_text, silenced_examples) = self.log_silenced(&um, &samples, &outcome.record);
        let prompts_info = examples
            .iter()
            .zip(&prompt_texts)
            .map(|(e, t)| PromptInfo { id: e.id.clone(), text: t.clone(), answer: Some(e.answer.clone()) })
            .collect();
        self.last_rollout = Some(RolloutBatch::new(samples, prompts_info));
        self.last_update = Some(outcome.record);
        self.step += 1;

        let mut m = StepMetrics {
            step,
            lr: plan.lr,
            update: um,
            silenced_tokens_text,
            silenced_examples,
            rollout_secs: batch.rollout_secs,
            update_secs,
            rollout_tokens_per_sec: n_tokens / batch.rollout_secs.max(1e-9),
            gen_batches: batch.gen_batches,
            groups_dropped,
            eval_avg: None,
            eval_pass: None,
        };
        if self.cfg.eval_every > 0
            && self.step.is_multiple_of(self.cfg.eval_every as u64)
            && self.test.is_some()
        {
            let r = self.evaluate(None)?;
            m.eval_avg = Some(r.overall.avg);
            m.eval_pass = Some(r.overall.pass);
        }
        let line = serde_json::to_string(&m).map_err(|e| Error::invalid(e.to_string()))?;
        dist::on_root(&*self.comm, || {
            append_line(&self.run_dir.join("metrics.jsonl"), &line)?;
            self.tb.metrics(&m)
        })?;
        if self.cfg.save_every > 0 && self.step.is_multiple_of(self.cfg.save_every as u64) {
            self.checkpoint()?;
        }
        Ok(m)
    }

    /// The step's rollouts, scored. With dynamic sampling, keeps generating batches of
    /// prompts until `prompts_per_step` groups have mixed rewards (verl `filter_groups`), at
    /// most `max_num_gen_batches` batches (0 = no limit).
    fn gather(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
        warnings: &mut Vec<String>,
    ) -> Result<StepBatch> {
        let target = self.cfg.prompts_per_step;
        let dynamic = plan.objective.dynamic_sampling;
        let mut b = StepBatch::default();
        // Mixed groups held over all ranks.
        let mut held = 0usize;
        let mut last_round;
        loop {
            let t0 = Instant::now();
            let round = self.roll_out(plan, b.gen_batches as u64, progress, cancel)?;
            b.rollout_secs += t0.elapsed().as_secs_f64();
            b.local_tokens += round.samples.iter().map(|s| s.response_ids.len()).sum::<usize>();
            let offset = b.all_seqs.len();
            b.all_seqs.extend(round.samples.iter().map(|s| {
                let mut q = Sequence::from_sample(s, s.reward.unwrap_or(0.0));
                q.group += offset; // unique across batches, for the batch metrics
                q
            }));
            b.gen_batches += 1;
            if !dynamic {
                b.kept = round;
                return Ok(b);
            }
            let (dropped, now) = b.kept.add_mixed(&*self.comm, &round, target, held)?;
            b.groups_dropped += dropped;
            held = now;
            last_round = round;
            if held >= target {
                break;
            }
            if self.cfg.max_num_gen_batches > 0 && b.gen_batches >= self.cfg.max_num_gen_batches {
                warnings.push(format!(
                    "dynamic sampling: {held} of {target} groups with mixed rewards after {} \
                     generation batches (max_num_gen_batches); updating on fewer",
                    b.gen_batches
                ));
                break;
            }
        }
        if held == 0 {
            // No group had mixed rewards: the update drops them all and reports it.
            b.kept = last_round;
        }
        Ok(b)
    }

    /// The update of this step on `seqs` (the objective fitted to the run's response budget,
    /// logits divided by the sampling temperature as verl does, so that the ratio is
    /// on-policy; T <= 0 is greedy: none), then the rollout copy refreshed.
    fn train_on(
        &mut self,
        plan: &StepPlan,
        seqs: &[Sequence],
        warnings: &mut Vec<String>,
    ) -> Result<(update::UpdateOutcome, ObjectiveConfig)> {
        let mut objective = plan.objective.clone();
        for note in objective.fit_to_run(plan.sampling.max_new_tokens) {
            if self.warned.insert(note.clone()) {
                warnings.push(note);
            }
        }
        let t = plan.sampling.temperature;
        let temperature = if self.cfg.scale_logits_by_temperature && t > 0.0 { t } else { 1.0 };
        let ucfg = UpdateConfig::new(
            objective.clone(),
            self.cfg.epochs,
            self.cfg.mini_batch,
            self.cfg.micro_batch,
            self.cfg.old_logp,
            mix(self.cfg.seed ^ 0x5eed, self.step),
        )
        .with_temperature(temperature);
        let ucfg = UpdateConfig { token_grad_norms: self.cfg.token_grad_norms, ..ucfg };
        let policy = Policy { model: &self.model, opt: &mut self.opt, reference: self.reference.as_ref() };
        let outcome = optimize_on(&*self.comm, policy, seqs, &ucfg, plan.lr, self.tokenizer.pad_id())?;
        if let Some(copy) = &self.rollout_copy {
            copy.refresh(&self.model)?;
        }
        Ok((outcome, objective))
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

    /// Adds this step's silenced tokens to the run's spurious-token log (totals, contexts,
    /// the scatter's points); returns them as text and a few in their context.
    fn log_silenced(
        &mut self,
        um: &UpdateMetrics,
        samples: &[Sample],
        record: &UpdateRecord,
    ) -> (Vec<(String, usize)>, Vec<String>) {
        let text: Vec<(String, usize)> =
            um.silenced_token_ids.iter().map(|&(id, c)| (self.tokenizer.token_str(id), c)).collect();
        for (t, c) in &text {
            *self.silenced_totals.entry(t.clone()).or_default() += c;
        }
        // Contexts of the silenced tokens (the record is indexed like `samples`).
        let mut examples = Vec::new();
        for (s, sil) in samples.iter().zip(&record.silenced) {
            for (j, _) in sil.iter().enumerate().filter(|(_, &x)| x) {
                let ctx = token_context(&self.tokenizer, &s.response_ids, j);
                if examples.len() < SILENCED_EXAMPLES {
                    examples.push(ctx.clone());
                }
                self.silenced_contexts.add(&self.tokenizer.token_str(s.response_ids[j]), ctx);
            }
        }
        self.spurious.add(record);
        (text, examples)
    }

    /// Generation batch `round` of this step: the next `prompts_per_step` prompts, rolled
    /// out under `plan` and scored. Batch 0 is seeded as a step without refills always was.
    fn roll_out(
        &mut self,
        plan: &StepPlan,
        round: u64,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Gathered> {
        // The global batch is the same on every rank; each samples its contiguous
        // share of the prompts (so a GRPO group stays on one rank), with each
        // response's seed from its global prompt index.
        let idx = self.sampler.next_batch(self.cfg.prompts_per_step)?;
        let share = dist::shard(idx.len(), self.comm.rank(), self.comm.size());
        let examples: Vec<Example> = self.train.select(&idx[share.clone()])?.into_iter().cloned().collect();
        let prompts: Vec<Prompt> = examples.iter().map(|e| e.prompt()).collect();
        let mut sampling = plan.sampling.clone();
        let seed = mix(self.cfg.seed, self.step);
        sampling.seed = if round == 0 { seed } else { mix(seed, round) };
        let hooks =
            GenerateHooks { progress, cancel, first_prompt_index: share.start, ..GenerateHooks::default() };
        let gen = Generator::with_prompter(self.sampling_model(), &self.tokenizer, self.prompter.clone());
        let generated = gen.generate(&prompts, &sampling, &hooks)?;
        let (mut samples, texts) = (generated.samples, generated.prompt_texts);
        for s in &mut samples {
            let v = reward::verify(&examples[s.prompt_index].answer, &s.text, self.cfg.extract);
            s.reward = Some(if v.correct { 1.0 } else { 0.0 });
            // Group ids are global prompt indices (the update orders ranks' groups by them).
            s.group += share.start;
        }
        Ok(Gathered { examples, texts, samples })
    }

    /// Evaluates on `test_data` (or `examples`) with the configured eval sampling.
    pub fn evaluate(&mut self, examples: Option<&[Example]>) -> Result<EvalReport> {
        let owned: Vec<Example>;
        let ex: &[Example] = match (examples, &self.test) {
            (Some(e), _) => e,
            (None, Some(t)) => {
                let n = self.cfg.eval_limit.unwrap_or(t.len()).min(t.len());
                owned = t.examples()[..n].to_vec();
                &owned
            }
            (None, None) => return Err(Error::invalid("evaluate: the run has no test_data")),
        };
        let mut params = self.cfg.sampling.clone();
        params.n = self.cfg.eval_n;
        params.temperature = self.cfg.eval_temperature;
        params.top_p = self.cfg.eval_top_p;
        params.seed = mix(self.cfg.seed ^ 0xe7a1, 0);
        // Rank 0 evaluates and writes; the others receive its report, so that
        // every rank's hooks see the same numbers.
        let comm = self.comm.clone();
        let report = dist::on_root(&*comm, || {
            let gen = Generator::with_prompter(self.sampling_model(), &self.tokenizer, self.prompter.clone());
            let report = eval::evaluate(&gen, ex, &params, self.cfg.extract, 64, &|_| {})?
                .with_pass_k(&self.cfg.eval_pass_k)?;
            let dir = self.run_dir.join("eval");
            eval::write_samples(&dir.join(format!("step-{:06}.jsonl", self.step)), &report.samples)?;
            let summary = serde_json::json!({"step": self.step, "overall": report.overall, "by_source": report.by_source});
            append_line(&self.run_dir.join("eval.jsonl"), &summary.to_string())?;
            Ok(report)
        })?;
        dist::on_root(&*comm, || report.as_ref().map_or(Ok(()), |r| self.tb.eval(self.step, r)))?;
        let report = if comm.size() > 1 { dist::broadcast_json(&*comm, 0, &report)? } else { report };
        let report = report.ok_or_else(|| Error::invalid("evaluate: rank 0 sent no report"))?;
        self.evals.push((self.step, report.overall.avg, report.overall.pass));
        self.last_eval = Some(report.clone());
        Ok(report)
    }

    /// Writes a checkpoint of model, optimizer and trainer state; returns its folder.
    /// Under several ranks (whose states are identical) rank 0 alone writes, with
    /// its share of the last rollout as the sample rollouts.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        let path = self.run_dir.join("checkpoints").join(format!("step-{:06}", self.step));
        let comm = self.comm.clone();
        dist::on_root(&*comm, || self.write_checkpoint())?;
        Ok(path)
    }

    fn write_checkpoint(&self) -> Result<PathBuf> {
        let dir = self.run_dir.join("checkpoints");
        let name = format!("step-{:06}", self.step);
        let path = dir.join(&name);
        let save_dtype = model::parse_dtype(&self.model.config().torch_dtype).unwrap_or(DType::F32);
        let state = TrainerState {
            step: self.step,
            sampler: self.sampler.state(),
            silenced_totals: self.silenced_totals(),
            silenced_contexts: self.silenced_contexts.clone(),
        };
        checkpoint::write_atomically(&path, |tmp| {
            checkpoint::write_model_files(
                &self.model,
                tmp,
                save_dtype.max_precision(self.dtype),
                Some(&self.cfg.model),
            )?;
            let opt: HashMap<String, candle_core::Tensor> = self.opt.state_tensors()?.into_iter().collect();
            candle_core::safetensors::save(&opt, tmp.join("optimizer.safetensors"))?;
            let text = serde_json::to_string_pretty(&state).map_err(|e| Error::invalid(e.to_string()))?;
            std::fs::write(tmp.join("trainer_state.json"), text)
                .map_err(|e| Error::io(tmp.join("trainer_state.json"), e))
        })?;
        write_file_atomically(&dir.join("latest"), name.as_bytes())?;
        // Keep the newest `keep_checkpoints` folders.
        let mut all: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| Error::io(&dir, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
            .collect();
        all.sort();
        let keep = self.cfg.keep_checkpoints.max(1);
        if all.len() > keep {
            for old in &all[..all.len() - keep] {
                let _ = std::fs::remove_dir_all(old);
            }
        }
        if let Some(r) = &self.last_rollout {
            let dir = self.run_dir.join("rollouts");
            std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            r.save_jsonl(&self.run_dir.join("rollouts").join(format!("step-{:06}.jsonl", self.step)))?;
        }
        self.plot()?;
        write_file_atomically(
            &self.run_dir.join("silenced_tokens.tsv"),
            self.silenced_totals()
                .iter()
                .map(|(t, c)| format!("{t:?}\t{c}\t{}\n", self.silenced_contexts(t).join("  |  ")))
                .collect::<String>()
                .as_bytes(),
        )?;
        Ok(path)
    }
}

impl Trainer {
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
        if !self.spurious.is_empty() {
            let title = format!(
                "{}: tokens of positive-advantage responses of {} update{}",
                self.cfg.objective,
                self.spurious.steps,
                if self.spurious.steps == 1 { "" } else { "s" }
            );
            plot::spurious(
                &self.spurious.points(),
                self.spurious.region,
                &title,
                &self.run_dir.join("spurious"),
            )?;
        }
        let runs = [RunCurves {
            label: self.cfg.objective.clone(),
            metrics: self.run_dir.join("metrics.jsonl"),
            eval: Some(self.run_dir.join("eval.jsonl")),
        }];
        if !runs[0].metrics.is_file() {
            return Err(Error::invalid(format!("{}: no metrics yet", runs[0].metrics.display())));
        }
        plot::plot(&plot::standard_panels(&runs)?, &self.run_dir.join("curves"))
    }
}

/// What [`Trainer::gather`] collected: the samples the update trains on, everything
/// sampled (for the batch metrics) and the rollout figures.
#[derive(Debug, Default)]
struct StepBatch {
    kept: Gathered,
    all_seqs: Vec<Sequence>,
    rollout_secs: f64,
    local_tokens: usize,
    gen_batches: usize,
    groups_dropped: usize,
}

/// The prompts and scored samples of a step, gathered over one or more generation
/// batches; sample `prompt_index` and `group` index `examples`.
#[derive(Debug, Default)]
struct Gathered {
    examples: Vec<Example>,
    texts: Vec<String>,
    samples: Vec<Sample>,
}

impl Gathered {
    /// Appends the groups of `round` whose rewards are mixed (DAPO dynamic sampling;
    /// a single-sample group is all-equal), renumbered, until `target` groups are held
    /// over all ranks of `comm` (`held` before this round; the groups of a round are
    /// numbered rank by rank, as one process would meet them). Returns how many
    /// all-equal groups this rank dropped and the groups now held over all ranks.
    fn add_mixed(
        &mut self,
        comm: &dyn Comm,
        round: &Gathered,
        target: usize,
        held: usize,
    ) -> Result<(usize, usize)> {
        let mut dropped = 0;
        let mut mixed = Vec::new();
        for (p, (ex, text)) in round.examples.iter().zip(&round.texts).enumerate() {
            let members: Vec<&Sample> = round.samples.iter().filter(|s| s.prompt_index == p).collect();
            if !members.windows(2).any(|w| w[0].reward != w[1].reward) {
                dropped += 1;
                continue;
            }
            mixed.push((ex, text, members));
        }
        let (first, total) = dist::offset_and_total(comm, mixed.len())?;
        for (j, (ex, text, members)) in mixed.into_iter().enumerate() {
            if held + first + j >= target {
                break;
            }
            let new = self.examples.len();
            for s in members {
                let mut s = s.clone();
                s.prompt_index = new;
                // The group's global index (its position over all ranks' kept groups).
                s.group = held + first + j;
                self.samples.push(s);
            }
            self.examples.push(ex.clone());
            self.texts.push(text.clone());
        }
        Ok((dropped, (held + total).min(target)))
    }
}

/// Keeps full precision when the weights in memory are wider than on disk.
trait MaxPrecision {
    fn max_precision(self, other: DType) -> DType;
}

impl MaxPrecision for DType {
    fn max_precision(self, other: DType) -> DType {
        if self.size_in_bytes() >= other.size_in_bytes() {
            self
        } else {
            other
        }
    }
}

/// The low-precision copy rollouts sample from, when `rollout_dtype` names a dtype other
/// than the master weights'.
fn rollout_copy(cfg: &RunConfig, m: &Qwen3) -> Result<Option<model::RolloutCopy>> {
    let Some(name) = &cfg.rollout_dtype else { return Ok(None) };
    let dt = model::parse_dtype(name).map_err(|e| Error::Config {
        file: "run config".into(),
        field: "rollout_dtype".into(),
        msg: e.to_string(),
    })?;
    (dt != m.dtype()).then(|| model::RolloutCopy::new(m, dt)).transpose()
}

/// The per-step seed: output `step` of the SplitMix64 stream seeded with `seed`.
fn mix(seed: u64, step: u64) -> u64 {
    crate::util::splitmix64(seed.wrapping_add(step.wrapping_mul(crate::util::SPLITMIX64_GAMMA)))
}

/// Evaluations recorded in `eval.jsonl` before `before_step` (a resumed run
/// re-runs later steps).
fn read_evals(path: &Path, before_step: u64) -> Vec<(u64, f64, f64)> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            Some((v["step"].as_u64()?, v["overall"]["avg"].as_f64()?, v["overall"]["pass"].as_f64()?))
        })
        .filter(|e| e.0 <= before_step)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::Finish;

    fn round(rewards: &[&[f32]]) -> Gathered {
        let mut g = Gathered::default();
        for (p, rs) in rewards.iter().enumerate() {
            g.examples.push(Example {
                id: format!("q{p}"),
                problem: String::new(),
                answer: String::new(),
                source: String::new(),
                messages: None,
            });
            g.texts.push(format!("prompt {p}"));
            for (i, &r) in rs.iter().enumerate() {
                g.samples.push(Sample {
                    group: p,
                    prompt_index: p,
                    sample_index: i,
                    prompt_ids: vec![1],
                    response_ids: vec![2, p as u32],
                    logprobs: vec![0.; 2],
                    old_logprobs: vec![0.; 2],
                    entropies: vec![0.; 2],
                    text: String::new(),
                    finish: Finish::Eos,
                    truncated: false,
                    reward: Some(r),
                });
            }
        }
        g
    }

    #[test]
    fn dynamic_sampling_refills_to_the_target() {
        // Target 3 groups. Batch 1: q0 mixed, q1 all wrong, q2 mixed → 2 kept, 1 dropped.
        // Batch 2: q0 all right, q1 mixed, q2 mixed → q1 fills the third place; q2 is surplus.
        let mut kept = Gathered::default();
        let local = crate::dist::Local;
        assert_eq!(kept.add_mixed(&local, &round(&[&[1., 0.], &[0., 0.], &[0., 1.]]), 3, 0).unwrap(), (1, 2));
        assert_eq!(kept.examples.len(), 2);
        assert_eq!(kept.add_mixed(&local, &round(&[&[1., 1.], &[1., 0.], &[0., 1.]]), 3, 2).unwrap(), (1, 3));
        let ids: Vec<&str> = kept.examples.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["q0", "q2", "q1"]);
        assert_eq!(kept.texts, ["prompt 0", "prompt 2", "prompt 1"]);
        // Renumbered: group and prompt index follow the kept order; the samples are the
        // originals (their response's second token is the original prompt index).
        let seen: Vec<(usize, usize, u32)> =
            kept.samples.iter().map(|s| (s.group, s.prompt_index, s.response_ids[1])).collect();
        assert_eq!(seen, [(0, 0, 0), (0, 0, 0), (1, 1, 2), (1, 1, 2), (2, 2, 1), (2, 2, 1)]);
        // A single sample per prompt is never mixed.
        assert_eq!(Gathered::default().add_mixed(&local, &round(&[&[1.], &[0.]]), 3, 0).unwrap(), (2, 0));
    }
}
