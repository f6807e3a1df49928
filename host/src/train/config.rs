//! The run's configuration: one nested, typed tree in the shape verl users know
//! (verl's `ppo_trainer.yaml` groups `actor_rollout_ref.{model,rollout,actor}`, `data` and
//! `trainer`): [`RunConfig`] with `model`, `data`, `rollout` (sampling and engine), `actor`
//! (objective, epochs, batches, token budget, optimizer, rollout correction, LoRA; defined
//! beside the update, which reads it as it is), `evaluation` (its own [`SamplingParams`];
//! not `eval`, a keyword Rhai reserves), `checkpoint` and `logging`.
//!
//! Every section is a serde struct with `deny_unknown_fields`, defaults and one
//! `validate()`. A script map, `--set a.b=c` and `run_config.json` all become this tree
//! through one converter, [`RunConfig::from_json`] (layers merged by [`crate::overlay`]);
//! errors name the dotted path, and a key of the old flat layout names its new place
//! ([`moved_to`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::data::{DatasetOptions, PromptTemplate};
use crate::model;
use crate::overlay;
use crate::reward::ExtractMode;
use crate::rollout::{EngineConfig, PartialConfig, SamplingParams};
use crate::train::update::{under, ActorConfig};
use crate::{Error, Result};

/// What errors of the tree name as their file.
const WHAT: &str = "run config";

/// Everything a run needs. Missing fields take their defaults (the STAPO paper's, scaled to a
/// CPU where noted); `run_config.json` in the run folder records the whole tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// The model folder and how its weights are held.
    pub model: ModelConfig,
    /// Training and held-out problems, their prompt format and answer extraction.
    pub data: DataConfig,
    /// How rollouts are sampled.
    pub rollout: RolloutConfig,
    /// The policy's objective and optimisation (what the update reads).
    pub actor: ActorConfig,
    /// Periodic held-out evaluation.
    pub evaluation: EvalConfig,
    /// Checkpoint cadence and retention.
    pub checkpoint: CheckpointConfig,
    /// Optional figures the run records.
    pub logging: LoggingConfig,
    /// Seeds every random choice of the run (data order, sampling, LoRA init, shuffles).
    pub seed: u64,
    /// The guards against lost work and divergence (`guard.max_nonfinite_steps`,
    /// `guard.on_divergence`, ...): see [`crate::guard`].
    pub guard: crate::guard::GuardConfig,
}

/// `model`: the model folder (HF layout with tokenizer.json) and its weights in memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model folder.
    pub path: PathBuf,
    /// Weights in memory: float32, bfloat16, float16.
    pub dtype: String,
    /// cpu, cuda, cuda:N (under several ranks a bare `cuda` is the rank's local GPU).
    pub device: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            path: PathBuf::from("models/tiny-qwen3"),
            dtype: "float32".into(),
            device: "cpu".into(),
        }
    }
}

impl ModelConfig {
    /// Checks the dtype name.
    pub fn validate(&self) -> Result<()> {
        model::parse_dtype(&self.dtype).map(|_| ()).map_err(|e| under("model", "dtype", e))
    }
}

/// `data`: the problems, their prompt format and the answer extraction of the reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Training problems: a JSONL or Parquet file, a folder of Hugging Face shards, or a `*`
    /// pattern (see `data::Dataset::load`).
    pub train: PathBuf,
    /// Held-out problems for periodic evaluation.
    pub test: Option<PathBuf>,
    /// Field names and bad-line policy of the data files.
    pub options: DatasetOptions,
    /// Prompt template (default `"model"`: what the model folder declares).
    pub template: PromptTemplate,
    /// Answer extraction of the reward.
    pub extract: ExtractMode,
    /// Prompts per step (verl `data.train_batch_size`; paper: 256).
    pub prompts_per_step: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train: PathBuf::from("data/arith/train.jsonl"),
            test: None,
            options: DatasetOptions::default(),
            template: PromptTemplate::Model,
            extract: ExtractMode::Strict,
            prompts_per_step: 16,
        }
    }
}

impl DataConfig {
    /// Checks that a step has prompts.
    pub fn validate(&self) -> Result<()> {
        if self.prompts_per_step == 0 {
            return Err(under("data", "prompts_per_step", Error::invalid("expected at least 1, found 0")));
        }
        Ok(())
    }
}

/// `rollout`: how responses are sampled (verl `actor_rollout_ref.rollout`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Sampling (paper: n 8, temperature 1.0, top-p 1.0).
    pub sampling: SamplingParams,
    /// Sample rollouts (and evaluate) with a copy of the policy in this dtype (e.g.
    /// "bfloat16" on a GPU), refreshed from the master weights after every update
    /// ([`model::RolloutCopy`]); `None` (or `model.dtype` itself) samples from the master
    /// weights.
    pub dtype: Option<String>,
    /// With dynamic sampling: at most this many prompt batches per step to fill
    /// `data.prompts_per_step` groups with mixed rewards (verl `max_num_gen_batches`; 0 = no
    /// limit); when hit, the step updates on fewer groups and warns.
    pub max_num_gen_batches: usize,
    /// The rollout engine (`#{kv_cache_gb, max_rows, block_size}`): the paged KV cache's
    /// budget in GB, sequences decoded at once and tokens per cache block.
    pub engine: EngineConfig,
    /// Partial rollouts (`#{enable, extra_prompts, max_staleness, on_stale}`): a step
    /// ends when `data.prompts_per_step` groups are whole, the unfinished responses
    /// continue in the next step under the updated weights ([`PartialConfig`]).
    pub partial: PartialConfig,
    /// One-step-off asynchronous training (`#{staleness, rollout_threads, train_threads}`):
    /// with `staleness: 1` the rollout of step k+1 runs while step k's update does.
    #[serde(rename = "async")]
    pub asynchronous: AsyncConfig,
}

/// `rollout.async`: one-step-off asynchronous training (verl's `one_step_off_policy`).
///
/// With `staleness: 1`, the rollout of step k+1 starts when the update of step k starts, in
/// a second thread of the process, sampling a copy of the weights update k starts from (the
/// weights update k-1 produced); step k+1 then trains on it, one policy version behind. The
/// default, `staleness: 0`, is the synchronous run: each step rolls out and then updates.
///
/// With `roles`, the ranks of an MPI job split into rollout ranks and trainer ranks
/// instead (slime's and AReaL's disaggregated placement): the rollout ranks generate
/// and score each step's groups and send them to the trainer ranks, which update
/// data-parallel among themselves and send the new weights back after each update.
/// Under `staleness: 1` the rollout ranks generate step k+1 under the weights of step k
/// while the trainers update step k; under `staleness: 0` they wait for the new weights.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AsyncConfig {
    /// Policy versions a rollout may lag behind the weights that train on it: 0 or 1.
    pub staleness: u32,
    /// Threads of the rollout thread's pool while it runs beside an update (0: the
    /// process's pool, shared with the update).
    pub rollout_threads: usize,
    /// Threads of the update's pool while a rollout runs beside it (0: the process's pool).
    pub train_threads: usize,
    /// Rollout and trainer roles over the ranks of the job (absent: every rank rolls
    /// out and trains, in one or two threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roles: Option<RolesConfig>,
}

/// `rollout.async.roles`: of the job's N ranks, the last `rollout_ranks` generate
/// (the step's prompts shared among them, each GRPO group whole on one rank) and the
/// first N - `rollout_ranks` train. Rank 0, the first trainer, writes the run folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolesConfig {
    /// Ranks that generate: 1 to N - 1.
    pub rollout_ranks: usize,
}

impl AsyncConfig {
    /// Whether rollouts run one step ahead of the updates.
    pub fn enabled(&self) -> bool {
        self.staleness > 0
    }

    fn validate(&self) -> Result<()> {
        if let Some(r) = &self.roles {
            let field = |f: &str, msg: String| Error::Config {
                file: "run config".into(),
                field: format!("rollout.async.{f}"),
                msg,
            };
            if r.rollout_ranks == 0 {
                return Err(field(
                    "roles.rollout_ranks",
                    "expected at least 1 rollout rank (remove `roles` to roll out on every rank)".into(),
                ));
            }
            for (f, n) in [("rollout_threads", self.rollout_threads), ("train_threads", self.train_threads)] {
                if n > 0 {
                    return Err(field(
                        f,
                        format!(
                            "{n} threads: this setting shares one process between the two roles; under                              `roles` each rank plays one role with all its threads (set it to 0)"
                        ),
                    ));
                }
            }
        }
        if self.staleness > 1 {
            return Err(under(
                "rollout.async",
                "staleness",
                Error::invalid(format!(
                    "expected 0 (synchronous) or 1 (one step off), found {}",
                    self.staleness
                )),
            ));
        }
        Ok(())
    }
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            sampling: SamplingParams::default(),
            dtype: None,
            max_num_gen_batches: 10,
            engine: EngineConfig::default(),
            partial: PartialConfig::default(),
            asynchronous: AsyncConfig::default(),
        }
    }
}

impl RolloutConfig {
    /// Checks the sampling (the vocabulary is checked when the model is loaded), the dtype,
    /// `async` and that it is not combined with `partial`.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate(usize::MAX).map_err(|e| under("rollout", "sampling", e))?;
        if let Some(d) = &self.dtype {
            model::parse_dtype(d).map_err(|e| under("rollout", "dtype", e))?;
        }
        self.asynchronous.validate()?;
        if self.asynchronous.enabled() && self.partial.enable {
            // Both carry rollouts across updates, each with its own staleness bookkeeping:
            // the rollout drawn ahead would continue groups the step before still holds.
            return Err(Error::Config {
                file: "run config".into(),
                field: "rollout.async.staleness".into(),
                msg: "one-step-off training (rollout.async.staleness 1) and partial rollouts \
                      (rollout.partial.enable) cannot be combined: turn one of them off"
                    .into(),
            });
        }
        if self.asynchronous.roles.is_some() && self.partial.enable {
            return Err(Error::Config {
                file: "run config".into(),
                field: "rollout.async.roles".into(),
                msg: "rollout and trainer roles (rollout.async.roles) and partial rollouts \
                      (rollout.partial.enable) cannot be combined: the groups in flight would live on \
                      the rollout ranks across updates; turn one of them off"
                    .into(),
            });
        }
        // Its errors already name `rollout.engine.<field>`.
        self.engine.validate()
    }
}

/// `evaluation`: the held-out evaluation every `every` steps, with its own sampling. Fields of
/// `evaluation.sampling` that neither the defaults (n 8, temperature 1.0, top-p 1.0) nor the user
/// set follow `rollout.sampling` (the response budget, top-k, stop strings).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluate on `data.test` every this many steps (0 = never).
    pub every: usize,
    /// How many test problems (None = all).
    pub limit: Option<usize>,
    /// Also report unbiased pass@k for these k (each at most `sampling.n`) in eval.jsonl.
    pub pass_k: Vec<usize>,
    /// The evaluation's sampling; `n` is the samples per problem (avg@n, pass@n).
    pub sampling: SamplingParams,
}

impl EvalConfig {
    /// Checks the sampling and that every pass@k is between 1 and `sampling.n`.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate(usize::MAX).map_err(|e| under("evaluation", "sampling", e))?;
        crate::eval::check_pass_k(&self.pass_k, self.sampling.n).map_err(|e| under("evaluation", "pass_k", e))
    }
}

/// `checkpoint`: when checkpoints are written and how many are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Checkpoint every this many steps (0 = only when asked, and at the end of `train`).
    pub save_every: usize,
    /// Checkpoints kept (older ones are removed).
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { save_every: 0, keep: 2 }
    }
}

impl CheckpointConfig {
    /// Checks that at least one checkpoint is kept.
    pub fn validate(&self) -> Result<()> {
        if self.keep == 0 {
            return Err(under("checkpoint", "keep", Error::invalid("expected at least 1, found 0")));
        }
        Ok(())
    }
}

/// `logging`: figures beyond the per-step metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// Record every response token's logit-gradient norm and report the shares of silenced
    /// and top-0.01% tokens each step (STAPO's analysis; one extra softmax over the logits).
    pub token_grad_norms: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig { token_grad_norms: true }
    }
}

impl LoggingConfig {
    /// Nothing to check: every value is valid.
    pub fn validate(&self) -> Result<()> {
        Ok(())
    }
}

impl RunConfig {
    /// The tree from a user's partial serde form (a script map as JSON, with `--set`
    /// pairs laid on it, or a `run_config.json`): laid over the defaults, with the
    /// objective of the preset `actor.preset` names and `evaluation.sampling` following
    /// `rollout.sampling`, then validated. Errors name the dotted path; a key of the old
    /// flat layout names its new place.
    pub fn from_json(user: &Value) -> Result<Self> {
        check_moved(user)?;
        let mut base = serde_json::to_value(RunConfig::default()).map_err(|e| overlay_err("", e))?;
        base["actor"] = ActorConfig::base_json(WHAT, user.get("actor"))?;
        base["evaluation"]["sampling"] = eval_sampling_base(&base, user)?;
        let cfg: RunConfig = overlay::build(WHAT, &base, user)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Every leaf path of the default tree (`actor.optim.lr`): what `--set` and a
    /// script's config map may name, for help texts and suggestions.
    pub fn leaves() -> Vec<String> {
        serde_json::to_value(RunConfig::default()).map(|v| overlay::leaves(&v)).unwrap_or_default()
    }

    /// Checks every section; the error names the dotted path.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.data.validate()?;
        self.rollout.validate()?;
        self.actor.validate()?;
        self.evaluation.validate()?;
        self.checkpoint.validate()?;
        self.guard.validate()?;
        self.logging.validate()
    }

    /// The leaves where `other` differs from this tree: (dotted path, this value, other's).
    pub fn differences(&self, other: &RunConfig) -> Vec<(String, Value, Value)> {
        match (serde_json::to_value(self), serde_json::to_value(other)) {
            (Ok(a), Ok(b)) => overlay::diff(&a, &b),
            _ => Vec::new(),
        }
    }
}

fn overlay_err(path: &str, e: serde_json::Error) -> Error {
    overlay::config_error(WHAT, path, &e.to_string())
}

/// The base of `evaluation.sampling`: `rollout.sampling` as the user sets it, with the
/// evaluation's own defaults for `n`, `temperature` and `top_p`.
fn eval_sampling_base(base: &Value, user: &Value) -> Result<Value> {
    let mut s = base["rollout"]["sampling"].clone();
    if let Some(u) = overlay::get_dotted(user, "rollout.sampling") {
        overlay::merge(&mut s, u.clone());
    }
    let own =
        serde_json::to_value(EvalConfig::default().sampling).map_err(|e| overlay_err("evaluation", e))?;
    for k in ["n", "temperature", "top_p"] {
        s[k] = own[k].clone();
    }
    Ok(s)
}

/// Where each key of the old flat layout went (a config map's top level, `--set KEY`, and
/// the objective's old `set` keys).
const MOVED: &[(&str, &str)] = &[
    ("test_data", "data.test"),
    ("data_options", "data.options"),
    ("objective", "actor.preset"),
    ("set", "actor.objective (e.g. `tau_p` is actor.objective.mask.tau_p)"),
    ("prompts_per_step", "data.prompts_per_step"),
    ("sampling", "rollout.sampling"),
    ("template", "data.template"),
    ("extract", "data.extract"),
    ("lr", "actor.optim.lr"),
    ("schedule", "actor.optim.schedule"),
    ("adamw", "actor.optim"),
    ("epochs", "actor.epochs"),
    ("mini_batch", "actor.mini_batch"),
    ("micro_batch", "actor.micro_batch"),
    ("max_tokens_per_micro", "actor.max_tokens_per_micro"),
    ("old_logp", "actor.old_logp"),
    ("max_num_gen_batches", "rollout.max_num_gen_batches"),
    ("scale_logits_by_temperature", "actor.scale_logits_by_temperature"),
    ("token_grad_norms", "logging.token_grad_norms"),
    ("eval_every", "evaluation.every"),
    ("eval_n", "evaluation.sampling.n"),
    ("eval_limit", "evaluation.limit"),
    ("eval_temperature", "evaluation.sampling.temperature"),
    ("eval_top_p", "evaluation.sampling.top_p"),
    ("eval_pass_k", "evaluation.pass_k"),
    ("save_every", "checkpoint.save_every"),
    ("keep_checkpoints", "checkpoint.keep"),
    ("dtype", "model.dtype"),
    ("device", "model.device"),
    ("rollout_dtype", "rollout.dtype"),
    ("rollout_engine", "rollout.engine"),
    ("rollout_correction", "actor.rollout_correction"),
    ("lora", "actor.lora"),
    ("shard", "actor.shard"),
    ("kind", "actor.objective.loss.kind"),
    ("eps", "actor.objective.loss.eps_low and actor.objective.loss.eps_high"),
    ("eps_low", "actor.objective.loss.eps_low"),
    ("eps_high", "actor.objective.loss.eps_high"),
    ("dual_clip", "actor.objective.loss.dual_clip"),
    ("sapo_tau_pos", "actor.objective.loss.tau_pos"),
    ("sapo_tau_neg", "actor.objective.loss.tau_neg"),
    ("kl", "actor.objective.kl (kl.kind, kl.beta)"),
    ("kl_beta", "actor.objective.kl.beta"),
    ("entropy_coef", "actor.objective.entropy_coef"),
    ("agg", "actor.objective.agg"),
    ("norm_len", "actor.objective.norm_len"),
    ("adv", "actor.objective.adv"),
    ("std", "actor.objective.std"),
    ("mask", "actor.objective.mask.kind"),
    ("tau_p", "actor.objective.mask.tau_p"),
    ("tau_h", "actor.objective.mask.tau_h"),
    ("tau_h_quantile", "actor.objective.mask.tau_h.q"),
    ("tau_h_over", "actor.objective.mask.tau_h.over"),
    ("rho", "actor.objective.mask.rho"),
    ("dynamic_sampling", "actor.objective.dynamic_sampling"),
    ("overlong", "actor.objective.overlong"),
    ("overlong_max_len", "actor.objective.overlong.max_len"),
    ("overlong_cache_len", "actor.objective.overlong.cache_len"),
    ("overlong_factor", "actor.objective.overlong.factor"),
    ("reward_scale", "actor.objective.reward_scale"),
];

/// The new place of a key of the old flat layout (`lr` → `actor.optim.lr`), if it is one.
pub fn moved_to(key: &str) -> Option<&'static str> {
    MOVED.iter().find(|(old, _)| *old == key).map(|(_, new)| *new)
}

/// An error for the first top-level key of `user` that belongs to the old flat layout
/// (also `model: "DIR"` and `data: "FILE"`, which are sections now).
fn check_moved(user: &Value) -> Result<()> {
    let Some(o) = user.as_object() else {
        return Err(overlay::config_error(WHAT, "", &format!("expected a map, found {user}")));
    };
    for (k, v) in o {
        if let Some(new) = moved_to(k) {
            return Err(overlay::config_error(WHAT, k, &format!("`{k}` moved to `{new}`")));
        }
        let section = match k.as_str() {
            "model" if !v.is_object() => "model.path",
            "data" if !v.is_object() => "data.train",
            _ => continue,
        };
        return Err(overlay::config_error(
            WHAT,
            k,
            &format!("`{k}` is a section now: the path goes to `{section}` (found {v})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{MaskConfig, ObjectiveConfig, PolicyLoss};
    use serde_json::json;

    fn err(user: Value) -> String {
        RunConfig::from_json(&user).unwrap_err().to_string()
    }

    #[test]
    fn defaults_round_trip_through_the_converter() {
        let d = RunConfig::default();
        assert_eq!(RunConfig::from_json(&json!({})).unwrap(), d);
        let back = RunConfig::from_json(&serde_json::to_value(&d).unwrap()).unwrap();
        assert_eq!(back, d);
        assert_eq!(d.actor.objective, ObjectiveConfig::preset("stapo").unwrap());
        d.validate().unwrap();
    }

    #[test]
    fn a_map_lays_over_the_preset_and_eval_follows_the_rollout() {
        let c = RunConfig::from_json(&json!({
            "model": {"path": "m"},
            "actor": {"preset": "grpo", "objective": {"loss": {"eps_high": 0.28}}, "optim": {"lr": 2e-5}},
            "rollout": {"sampling": {"n": 4, "max_tokens": 64, "top_k": 5}},
            "evaluation": {"every": 5, "sampling": {"n": 2}},
        }))
        .unwrap();
        assert_eq!(c.model.path, PathBuf::from("m"));
        let grpo = ObjectiveConfig::preset("grpo").unwrap();
        assert_eq!(c.actor.objective.mask, grpo.mask);
        assert_eq!(c.actor.objective.loss, PolicyLoss::Ppo { eps_low: 0.2, eps_high: 0.28, dual_clip: None });
        assert_eq!((c.actor.optim.lr, c.actor.preset.as_str()), (2e-5, "grpo"));
        // The warm-up of the default schedule stays.
        assert_eq!(c.actor.optim.schedule, crate::train::LrSchedule::Constant { warmup_steps: 10 });
        // evaluation.sampling: its own n (2, given) and temperature/top-p (defaults), the rollout's
        // budget and top-k.
        let e = &c.evaluation.sampling;
        assert_eq!((e.n, e.temperature, e.top_p, e.max_new_tokens, e.top_k), (2, 1.0, 1.0, 64, Some(5)));
        assert_eq!(c.rollout.sampling.n, 4);
        // The S2T mask from a preset without one.
        let c = RunConfig::from_json(
            &json!({"actor": {"preset": "grpo", "objective": {"mask": {"kind": "s2t"}}}}),
        );
        assert_eq!(c.unwrap().actor.objective.mask, MaskConfig::S2T_DEFAULT);
    }

    #[test]
    fn errors_name_the_path_the_nearest_key_and_moved_keys() {
        let e = err(json!({"actor": {"optim": {"lrr": 1e-3}}}));
        assert!(e.contains("`actor.optim.lrr`") && e.contains("did you mean `lr`?"), "{e}");
        let e = err(json!({"actor": {"objective": {"mask": {"tau_P": 0.5}}}}));
        assert!(e.contains("`actor.objective.mask.tau_P`") && e.contains("did you mean `tau_p`?"), "{e}");
        let e = err(json!({"actor": {"optim": {"lr": "fast"}}}));
        assert!(e.contains("`actor.optim.lr`") && e.contains("fast"), "{e}");
        let e = err(json!({"rollout": {"sampling": {"n": -2}}}));
        assert!(e.contains("`rollout.sampling.n`") && e.contains("-2"), "{e}");
        let e = err(json!({"rollout": {"sampling": {"n": 0}}}));
        assert!(e.contains("`rollout.sampling.n`"), "{e}");
        let e = err(json!({"rollout": {"sampling": {"min_p": 1.5}}}));
        assert!(e.contains("`rollout.sampling.min_p`") && e.contains("1.5"), "{e}");
        let e = err(json!({"evaluation": {"sampling": {"min_p": -1}}}));
        assert!(e.contains("`evaluation.sampling.min_p`"), "{e}");
        let e = err(json!({"lr": 1e-3}));
        assert!(e.contains("`lr` moved to `actor.optim.lr`"), "{e}");
        let e = err(json!({"tau_p": 0.01}));
        assert!(e.contains("actor.objective.mask.tau_p"), "{e}");
        let e = err(json!({"model": "models/tiny-qwen3"}));
        assert!(e.contains("model.path"), "{e}");
        let e = err(json!({"actor": {"preset": "ppo2"}}));
        assert!(e.contains("actor.preset") && e.contains("grpo"), "{e}");
        let e = err(json!({"evaluation": {"pass_k": [1, 16]}}));
        assert!(e.contains("evaluation.pass_k") && e.contains("16"), "{e}");
        let e = err(json!({"actor": {"optim": {"beta1": 1.5}}}));
        assert!(e.contains("actor.optim.beta1"), "{e}");
        let e = err(json!({"actor": {"rollout_correction": {"cap": 0.5}}}));
        assert!(e.contains("actor.rollout_correction.cap"), "{e}");
        let e = err(json!({"actor": {"objective": {"loss": {"eps_low": 1.5}}}}));
        assert!(e.contains("actor.objective.loss.eps_low"), "{e}");
        let e = err(json!({"model": {"dtype": "float8"}}));
        assert!(e.contains("model.dtype"), "{e}");
    }

    #[test]
    fn differences_list_the_changed_leaves() {
        let a = RunConfig::default();
        let b = RunConfig::from_json(&json!({"actor": {"optim": {"lr": 0.5}}, "seed": 3})).unwrap();
        let d = a.differences(&b);
        let paths: Vec<&str> = d.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(paths, ["actor.optim.lr", "seed"]);
        assert_eq!((d[0].1.clone(), d[0].2.clone()), (json!(1e-6), json!(0.5)));
        assert!(a.differences(&a.clone()).is_empty());
    }
}
