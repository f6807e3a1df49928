//! How an update runs: where the old log-probs come from ([`OldLogp`]), the run
//! configuration's `actor` section
//! ([`ActorConfig`]: objective, epochs, mini/micro batches, token budget, optimizer, rollout
//! correction, LoRA), which the update reads as it is, wrapped with what a single update
//! adds ([`UpdateConfig`]: seed, temperature), and the options of a lone update
//! ([`UpdateOptions`], the `update` binding and `stapo update`).

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::algo::ObjectiveConfig;
use crate::model::LoraConfig;
use crate::overlay;
use crate::train::optim::{AdamWConfig, LrSchedule, ShardMode};
use crate::{Error, Result};

/// Where the old-policy log-probs (the PPO ratio's denominator) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OldLogp {
    /// A no-grad forward of the policy before the update (verl's default).
    Recompute,
    /// The log-probs recorded while sampling.
    Rollout,
}

/// The actor: the policy's objective and how it is optimised (verl's `actor_rollout_ref.actor`).
/// The run configuration's `actor` section, and what every update reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    /// The objective preset `objective` started from (`algo::PRESETS`: grpo, dapo, gspo, sapo,
    /// entropy20, justrl, stapo, dapo_s2t, drgrpo); a map's `objective` is laid over it.
    pub preset: String,
    /// The loss, advantages and masks ([`ObjectiveConfig`]'s serde form).
    pub objective: ObjectiveConfig,
    /// PPO epochs over each batch.
    pub epochs: usize,
    /// Sequences per optimizer step (0 = the whole batch).
    pub mini_batch: usize,
    /// Sequences per forward/backward (0 = the mini-batch); gradients accumulate.
    pub micro_batch: usize,
    /// Tokens per forward/backward (0 = no budget; verl's `ppo_max_token_len_per_gpu` with
    /// `use_dynamic_bsz`): each mini-batch's sequences sorted by length and cut into
    /// micro-batches of at most this many tokens, prompt + response with padding counted
    /// (and at most `micro_batch` sequences when that is set), each padded to its own longest
    /// prompt and response. The loss normalisers stay the mini-batch's: the gradients are
    /// those of the padded path up to float summation order. With a token mask (S2T,
    /// 20-Entropy) the micro-batches' gradient forwards all run before the mask is decided
    /// over the mini-batch, while their kept activations stay under 4 GiB (else one no-grad
    /// pass over them decides it first).
    pub max_tokens_per_micro: usize,
    /// Old-policy log-probs.
    pub old_logp: OldLogp,
    /// Divide the logits by the sampling temperature in the update's forward passes (old
    /// log-probs and training), as verl does, so the ratio is on-policy at T != 1; the S2T
    /// rule's p and H then refer to the tempered policy.
    pub scale_logits_by_temperature: bool,
    /// AdamW and the learning-rate schedule (`lr` is the base rate; paper: 1e-6 constant after
    /// 10 warm-up steps, grad clip 1.0).
    pub optim: AdamWConfig,
    /// Optimizer state over the ranks of a data-parallel run: `none` (every rank holds all
    /// of it), `optimizer` (ZeRO-1: each rank holds the AdamW moments, and f32 master
    /// weights of a model in another dtype, of its range of the flattened parameters) or
    /// `gradients` (ZeRO-2: also the summed gradients of its range alone). The weights after
    /// each step are the same in every mode ([`crate::train::ShardedAdamW`],
    /// docs/distributed.md).
    pub shard: ShardMode,
    /// The correction of the mismatch between a rollout copy and the master weights (`mode`:
    /// auto | off | token_tis | seq_mis, `cap` 2, `seq_lower` 0.5, `seq_upper` 2; auto is
    /// token_tis when `rollout.dtype` differs from `model.dtype`, at temperature 1): see
    /// [`RolloutCorrection`].
    pub rollout_correction: RolloutCorrection,
    /// LoRA (`#{rank, alpha, targets, lr_scale}`): train adapters on a frozen base, at
    /// `lr * lr_scale`; checkpoints are peft adapter folders. `None`: full fine-tuning.
    pub lora: Option<LoraConfig>,
}

impl Default for ActorConfig {
    /// The `stapo` preset, one epoch, whole-batch steps, lr 1e-6 after 10 warm-up steps.
    fn default() -> Self {
        ActorConfig {
            preset: "stapo".into(),
            objective: ObjectiveConfig::preset("stapo").unwrap_or_default(),
            epochs: 1,
            mini_batch: 0,
            micro_batch: 0,
            max_tokens_per_micro: 0,
            old_logp: OldLogp::Recompute,
            scale_logits_by_temperature: true,
            optim: AdamWConfig {
                schedule: LrSchedule::Constant { warmup_steps: 10 },
                ..AdamWConfig::default()
            },
            shard: ShardMode::None,
            rollout_correction: RolloutCorrection::default(),
            lora: None,
        }
    }
}

impl ActorConfig {
    /// The serde form every user layer is laid over: the defaults, with the objective of
    /// the preset the user's `actor` layer names (`preset`, else the default's). The error
    /// names `actor.preset`.
    pub fn base_json(what: &str, user_actor: Option<&Value>) -> Result<Value> {
        let mut base = ActorConfig::default();
        if let Some(p) = user_actor.and_then(|a| a.get("preset")) {
            let name = p.as_str().ok_or_else(|| {
                overlay::config_error(what, "actor.preset", &format!("expected a preset name, found {p}"))
            })?;
            base.objective = ObjectiveConfig::preset(name)
                .map_err(|e| overlay::config_error(what, "actor.preset", &e.to_string()))?;
            base.preset = name.to_string();
        }
        serde_json::to_value(base).map_err(|e| overlay::config_error(what, "actor", &e.to_string()))
    }

    /// Checks every field (the error names the path under `actor.`).
    pub fn validate(&self) -> Result<()> {
        let under = |field: &str, e: Error| under("actor", field, e);
        self.objective.validate().map_err(|e| under("objective", e))?;
        self.optim.validate().map_err(|e| under("optim", e))?;
        self.optim.schedule.validate().map_err(|e| under("optim.schedule", e))?;
        self.rollout_correction.validate().map_err(|e| under("rollout_correction", e))?;
        if self.epochs == 0 {
            return Err(under("epochs", Error::invalid("expected at least 1, found 0")));
        }
        if let Some(l) = &self.lora {
            if l.rank == 0 {
                return Err(under("lora.rank", Error::invalid("expected at least 1, found 0")));
            }
        }
        Ok(())
    }
}

/// `e` as an error of the configuration path `section.field` (a sub-config's own field
/// name appended), in the run configuration.
pub fn under(section: &str, field: &str, e: Error) -> Error {
    let path =
        |f: &str| [section, field, f].iter().filter(|s| !s.is_empty()).copied().collect::<Vec<_>>().join(".");
    match e {
        Error::Config { field: f, msg, .. } => {
            // A sub-config names its field relative to itself (`lr`), or already with the
            // section (`rollout_correction.cap`): keep the longer path once.
            let tail = f.strip_prefix(&format!("{field}.")).unwrap_or(&f);
            Error::Config { file: "run config".into(), field: path(tail), msg }
        }
        other => Error::Config { file: "run config".into(), field: path(""), msg: other.to_string() },
    }
}

/// How one update runs: the actor's settings as they apply to this update (the objective
/// with the step's thresholds, fitted to the run; the rollout correction resolved), and
/// what one update adds to them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateConfig {
    /// The actor section, read as it is.
    pub actor: ActorConfig,
    /// Seeds the shuffle between epochs (sequences are shuffled exactly when there are
    /// several epochs).
    pub seed: u64,
    /// The logits are divided by this in every forward of the update (old log-probs and
    /// training), as verl does with the rollout temperature so that the ratio is
    /// on-policy at T != 1; p and H of the S2T rule are then the tempered policy's.
    pub temperature: f64,
    /// Record each response token's logit-gradient norm (first epoch) and the per-step
    /// shares of silenced and top-0.01% tokens; costs one softmax over the logits.
    pub token_grad_norms: bool,
}

impl Default for UpdateConfig {
    /// GRPO (the objective's default), one epoch, whole-batch steps, temperature 1.
    fn default() -> Self {
        UpdateConfig::for_objective(ObjectiveConfig::default())
    }
}

impl UpdateConfig {
    /// The default update under `objective`.
    pub fn for_objective(objective: ObjectiveConfig) -> Self {
        let actor = ActorConfig { preset: String::new(), objective, ..ActorConfig::default() };
        UpdateConfig { actor, seed: 0, temperature: 1.0, token_grad_norms: false }
    }

    /// The one builder of an update's configuration, for a run's step and a single
    /// update alike: `actor` (with the step's objective) fitted to the rollouts' response
    /// budget `max_tokens` ([`ObjectiveConfig::fit_to_run`]), the logits divided by the
    /// sampling temperature `sampled_at` when `actor.scale_logits_by_temperature` (verl;
    /// greedy, `sampled_at <= 0`, divides by 1), and the rollout correction resolved for
    /// rollouts drawn by other weights than the master's (`from_copy`: a copy in another
    /// dtype, or an older policy version under `rollout.async`). Returns the notes of
    /// the fit and of the resolution, for the user.
    pub fn build(
        mut actor: ActorConfig,
        max_tokens: Option<usize>,
        sampled_at: f64,
        from_copy: bool,
        seed: u64,
        token_grad_norms: bool,
    ) -> Result<(Self, Vec<String>)> {
        let mut notes = match max_tokens {
            Some(n) => actor.objective.fit_to_run(n),
            None => Vec::new(),
        };
        let temperature =
            if actor.scale_logits_by_temperature && sampled_at > 0.0 { sampled_at } else { 1.0 };
        let (rollout_correction, note) =
            actor.rollout_correction.resolve(from_copy, temperature, actor.old_logp)?;
        notes.extend(note);
        actor.rollout_correction = rollout_correction;
        Ok((UpdateConfig { actor, seed, temperature, token_grad_norms }, notes))
    }

    /// Whether sequences are shuffled between epochs: exactly when there are several.
    pub fn shuffle(&self) -> bool {
        self.actor.epochs > 1
    }
}

/// The options of a single update as a user gives them (the `update` script binding's
/// map, `stapo update`'s flags): the `actor` section (preset, objective, optimizer, ...)
/// and what the rollouts were sampled with. Missing fields take their defaults; unknown
/// fields are an error naming them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpdateOptions {
    /// The actor, as in a run configuration (`actor.optim.lr` is the step's learning rate).
    pub actor: ActorConfig,
    /// Seeds the shuffle between epochs.
    pub seed: u64,
    /// The rollout's sampling temperature: the update divides the logits by it (verl).
    pub temperature: f64,
    /// The rollout's response budget (`max_tokens`): sizes DAPO's overlong buffer and
    /// Dr.GRPO's normaliser when the preset's are in force ([`ObjectiveConfig::fit_to_run`]).
    pub max_tokens: Option<usize>,
}

impl Default for UpdateOptions {
    fn default() -> Self {
        UpdateOptions { actor: ActorConfig::default(), seed: 0, temperature: 1.0, max_tokens: None }
    }
}

impl UpdateOptions {
    /// The options from a user's partial serde form (a script map, the CLI's flags): laid
    /// over the defaults with the objective of the preset `actor.preset` names, validated.
    pub fn from_json(user: &Value) -> Result<Self> {
        const WHAT: &str = "update options";
        let mut base = serde_json::to_value(UpdateOptions::default())
            .map_err(|e| overlay::config_error(WHAT, "", &e.to_string()))?;
        base["actor"] = ActorConfig::base_json(WHAT, user.get("actor"))?;
        let o: UpdateOptions = overlay::build(WHAT, &base, user)?;
        o.actor.validate()?;
        Ok(o)
    }

    /// The update configuration (the rollout correction resolved: `auto` is off here, which
    /// copy sampled the rollouts is not known). With `max_tokens`, also returns the notes of
    /// [`ObjectiveConfig::fit_to_run`].
    pub fn to_config(&self) -> Result<(UpdateConfig, Vec<String>)> {
        self.actor.objective.validate()?;
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::Config {
                file: "update options".into(),
                field: "temperature".into(),
                msg: format!("expected a number > 0, found {}", self.temperature),
            });
        }
        UpdateConfig::build(self.actor.clone(), self.max_tokens, self.temperature, false, self.seed, false)
    }
}

// The rollout correction's settings (what `rollout_corr.rs` computes with them).

/// verl keeps IS weights within `[exp(-20), exp(20)]`.
pub(super) const LOG_WEIGHT_CLAMP: f64 = 20.0;

/// Which correction the update applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutCorrMode {
    /// `token_tis` when rollouts sample from a copy in another dtype than the master
    /// weights (at temperature 1, old log-probs recomputed), else `off`.
    #[default]
    Auto,
    /// No correction: every token and sequence weighs 1.
    Off,
    /// Token-level truncated importance sampling: each token's loss weighted by `min(exp(old - rollout), cap)`.
    TokenTis,
    /// Sequence-level masked importance sampling: sequences whose weight falls outside `[seq_lower, seq_upper]` are rejected.
    SeqMis,
}

/// The rollout correction as a run or an update gives it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrection {
    /// Which correction applies (`auto` resolves per run).
    pub mode: RolloutCorrMode,
    /// token-TIS: the cap of the token weight (verl's `rollout_is_threshold`, 2); also the
    /// threshold of the `fraction_high` metric.
    pub cap: f32,
    /// seq-MIS: the bounds of the sequence weight outside which a sequence is rejected.
    pub seq_lower: f32,
    /// seq-MIS: the upper bound of the sequence weight.
    pub seq_upper: f32,
}

impl Default for RolloutCorrection {
    fn default() -> Self {
        RolloutCorrection { mode: RolloutCorrMode::Auto, cap: 2.0, seq_lower: 0.5, seq_upper: 2.0 }
    }
}

fn field_err(field: &str, msg: String) -> Error {
    Error::Config { file: "run config".into(), field: format!("rollout_correction.{field}"), msg }
}

impl RolloutCorrection {
    /// Checks the numbers: `cap >= 1`, `0 < seq_lower <= 1 <= seq_upper`, all finite.
    pub fn validate(&self) -> Result<()> {
        if !(self.cap.is_finite() && self.cap >= 1.0) {
            return Err(field_err("cap", format!("expected a number >= 1, found {}", self.cap)));
        }
        if !(self.seq_lower.is_finite() && self.seq_lower > 0.0 && self.seq_lower <= 1.0) {
            return Err(field_err(
                "seq_lower",
                format!("expected a number in (0, 1], found {}", self.seq_lower),
            ));
        }
        if !(self.seq_upper.is_finite() && self.seq_upper >= 1.0) {
            return Err(field_err("seq_upper", format!("expected a number >= 1, found {}", self.seq_upper)));
        }
        Ok(())
    }

    /// The correction in force for an update whose rollouts sampled from a copy in another
    /// dtype (`copy_differs`), with the logits divided by `temperature` and old log-probs
    /// from `old_logp`: `auto` becomes `token_tis` or `off`. An explicit mode where the
    /// rollout's log-probs cannot be compared with the old ones is an error naming why;
    /// the second value is a note when `auto` turned it off although the copy differs.
    pub fn resolve(
        &self,
        copy_differs: bool,
        temperature: f64,
        old_logp: OldLogp,
    ) -> Result<(RolloutCorrection, Option<String>)> {
        self.validate()?;
        let blocker = if temperature != 1.0 {
            Some(format!(
                "the rollout's log-probs are recorded at temperature 1 while the update divides the \
                 logits by {temperature}: at T != 1 the sampled log-probs are not the policy's"
            ))
        } else if old_logp == OldLogp::Rollout {
            Some("old_logp = rollout: the ratio's denominator already is the rollout's log-probs".to_string())
        } else {
            None
        };
        let mode = match (self.mode, &blocker) {
            (RolloutCorrMode::Auto, Some(why)) => {
                let note = copy_differs.then(|| format!("rollout correction off: {why}"));
                return Ok((RolloutCorrection { mode: RolloutCorrMode::Off, ..*self }, note));
            }
            (RolloutCorrMode::Auto, None) if copy_differs => RolloutCorrMode::TokenTis,
            (RolloutCorrMode::Auto, None) => RolloutCorrMode::Off,
            (RolloutCorrMode::Off, _) => RolloutCorrMode::Off,
            (m, Some(why)) => {
                return Err(field_err(
                    "mode",
                    format!("{} cannot be applied: {why}; use off or auto", m.name()),
                ))
            }
            (m, None) => m,
        };
        Ok((RolloutCorrection { mode, ..*self }, None))
    }

    /// Whether a correction is applied (`auto` unresolved counts as off).
    pub fn active(&self) -> bool {
        matches!(self.mode, RolloutCorrMode::TokenTis | RolloutCorrMode::SeqMis)
    }

    /// seq-MIS: whether a sequence with these old and rollout log-probs stays in the loss.
    pub fn keeps_sequence(&self, old: &[f32], rollout: &[f32]) -> bool {
        let rho = seq_log_weight(old, rollout).exp();
        rho >= self.seq_lower as f64 && rho <= self.seq_upper as f64
    }

    /// The constant per-token weight of the policy loss for `(B, T)` log-ratios
    /// `d = old - rollout` (0 outside the response), or `None` without correction.
    pub fn weights(&self, d: &Tensor) -> Result<Option<Tensor>> {
        let c = LOG_WEIGHT_CLAMP as f32;
        Ok(match self.mode {
            RolloutCorrMode::TokenTis => Some(d.clamp(-c, c)?.exp()?.minimum(self.cap)?),
            RolloutCorrMode::SeqMis => {
                let s = d.sum_keepdim(1)?.clamp(-c, c)?.exp()?;
                Some(s.broadcast_as(d.shape())?.contiguous()?)
            }
            RolloutCorrMode::Auto | RolloutCorrMode::Off => None,
        })
    }
}

impl RolloutCorrMode {
    pub(super) fn name(&self) -> &'static str {
        match self {
            RolloutCorrMode::Auto => "auto",
            RolloutCorrMode::Off => "off",
            RolloutCorrMode::TokenTis => "token_tis",
            RolloutCorrMode::SeqMis => "seq_mis",
        }
    }
}

/// `sum_t (old - rollout)`, clamped to ±20 (the log of the sequence weight).
fn seq_log_weight(old: &[f32], rollout: &[f32]) -> f64 {
    let s: f64 = old.iter().zip(rollout).map(|(&o, &r)| o as f64 - r as f64).sum();
    s.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
}
