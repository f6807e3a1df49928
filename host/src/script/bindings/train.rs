//! Bindings for training: the hook-driven loop `train(cfg, steps)`, a run
//! driven step by step from the REPL (`trainer(cfg)`), a single update of a
//! model on a scored rollout, and building `models/tiny-qwen3` by SFT
//! (`pretrain_tiny`).

use rhai::plugin::{export_module, exported_module};
use rhai::{Dynamic, Engine, Map, NativeCallContext};

use super::{lock, ModelHandle, RolloutHandle, RunHandle};
use crate::script::convert::{config_arg, from_json, get_num, options, to_dynamic, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;
use crate::script::train_loop;
use crate::train::{self, AdamW, Sequence, TinyConfig, UpdateOptions};

/// `update(model, rollout, opts)`: `opts` are [`UpdateOptions`] (`actor`, `seed`,
/// `temperature`, `max_tokens`; the same constructor as `stapo update`); the optimizer is
/// made on the first call from `actor.optim`.
fn update(m: &ModelHandle, r: &RolloutHandle, opts: &Map) -> RhaiResult<Map> {
    let user = to_json("update", &Dynamic::from_map(opts.clone()))?;
    let uo = UpdateOptions::from_json(&user).map_err(|e| config_arg("update", e))?;
    let (ucfg, notes) = uo.to_config().map_err(|e| bad_arg("update", e))?;
    let lr = uo.actor.optim.lr;
    let seqs: Vec<Sequence> = {
        let st = lock(&r.0, "rollout")?;
        let rewards = st.rewards().map_err(|e| bad_arg("update", e))?;
        st.batch.samples.iter().zip(rewards).map(|(s, r)| Sequence::from_sample(s, r)).collect()
    };
    let mut slot = lock(&m.0, "model")?;
    let slot = &mut *slot;
    if slot.opt.is_none() {
        slot.opt = Some(AdamW::new(slot.model.params(), uo.actor.optim.clone()).map_err(host)?);
    }
    let pad = slot.tokenizer.as_ref().map_or(0, |t| t.pad_id());
    let opt = slot.opt.as_mut().ok_or_else(|| host("no optimizer"))?;
    let mut um = train::update(&slot.model, opt, None, &seqs, &ucfg, lr, pad).map_err(host)?.metrics;
    let mut warnings = notes;
    warnings.append(&mut um.warnings);
    um.warnings = warnings;
    let mut out = to_dynamic(&um)?.cast::<Map>();
    out.insert("reward".into(), (um.reward_mean as f64).into());
    Ok(out)
}

fn train_with(
    ctx: &NativeCallContext,
    h: &std::sync::Arc<Host>,
    cfg: &Map,
    steps: Option<i64>,
) -> RhaiResult<Map> {
    let steps = match (steps, cfg.get("steps")) {
        (Some(s), _) => s,
        (None, Some(s)) => {
            s.as_int().map_err(|t| bad_arg("train", format!("cfg.steps: expected an integer, found {t}")))?
        }
        (None, None) => {
            return Err(bad_arg("train", "give the number of steps: train(cfg, steps) or cfg.steps"))
        }
    };
    train_loop::train(ctx.engine(), h, cfg, steps)
}

/// `run.evaluate([#{temperature, top_p}])`: the report with the setting it sampled at.
fn evaluate_run(r: &RunHandle, opts: &Map) -> RhaiResult<Dynamic> {
    if let Some(k) = opts.keys().find(|k| !["temperature", "top_p"].contains(&k.as_str())) {
        return Err(bad_arg("evaluate", format!("unknown key `{k}`: expected temperature, top_p")));
    }
    let mut run = lock(&r.0, "run")?;
    let cfg = run.config();
    let t = get_num(opts, "temperature")?.unwrap_or(cfg.evaluation.sampling.temperature);
    let p = get_num(opts, "top_p")?.unwrap_or(cfg.evaluation.sampling.top_p);
    let rep = run.evaluate_at(None, t, p).map_err(host)?;
    Ok(from_json(&serde_json::json!({"overall": rep.overall, "by_source": rep.by_source,
        "avg": rep.overall.avg, "pass": rep.overall.pass, "pass_at_k": rep.overall.pass_at_k,
        "temperature": t, "top_p": p})))
}

/// Builds the tiny model; smoke mode shrinks everything and writes under the run folder.
fn pretrain_tiny(h: &Host, cfg: &Map) -> RhaiResult<Dynamic> {
    let mut c: TinyConfig = options("pretrain_tiny", cfg)?;
    if h.opts.smoke {
        c.max_steps = c.max_steps.min(2);
        c.warmup_steps = c.warmup_steps.min(1);
        c.eval_every = c.eval_every.min(1);
        c.n_train = c.n_train.min(32);
        c.n_test = c.n_test.min(8);
        c.eval_problems = c.eval_problems.min(4);
        c.eval_samples = c.eval_samples.min(2);
        c.batch_size = c.batch_size.min(4);
        c.max_new_tokens = c.max_new_tokens.min(64);
        c.final_eval = false;
        // Never overwrite a real model folder from a smoke run.
        let base =
            h.claimed_run_dir().map_err(host)?.unwrap_or_else(|| std::env::temp_dir().join("stapo-smoke"));
        c.model_dir = base.join("tiny-model");
        c.data_dir = Some(base.join("tiny-data"));
    }
    let report = crate::train::pretrain_tiny(&c, &mut |line: &str| h.println(line)).map_err(host)?;
    to_dynamic(&report)
}

/// Registers the training functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible training functions.
#[export_module]
mod fns {
    use std::sync::Arc;

    use rhai::{Array, Dynamic, Map, NativeCallContext};

    use super::{lock, ModelHandle, RolloutHandle, RunHandle};
    use crate::script::bindings::{host_of, HeldRun};
    use crate::script::convert::{to_dynamic, usize_arg};
    use crate::script::error::{host, RhaiResult};
    use crate::script::train_loop;
    use crate::train::RunConfig;

    /// train(cfg, steps) -> map
    ///
    /// Runs the training loop for `steps` steps in total (a resumed run continues): each step calls
    /// the script's hooks if defined: sampling(step) -> map, thresholds(step, stats) -> #{tau_p,
    /// tau_h (a number or #{q, over}), state}, lr(step) -> number, then on_step(step, metrics) and
    /// should_stop(step, metrics) -> bool. cfg: the configuration tree (model, data, rollout, actor,
    /// evaluation, checkpoint, logging, seed; default_config() shows it) plus optional `name`
    /// (sub-folder), `steps` and `hook_timeout`. Returns #{run_dir, steps, final, checkpoint,
    /// seconds, stopped_early}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// train(r::stapo(#{model: "models/tiny-qwen3"}), 200);
    /// ```
    #[rhai_fn(name = "train", volatile, return_raw)]
    pub fn train_steps(ctx: NativeCallContext, cfg: Map, steps: i64) -> RhaiResult<Map> {
        super::train_with(&ctx, &host_of(&ctx)?, &cfg, Some(steps))
    }

    /// train(cfg) -> map
    ///
    /// Same, with the number of steps in `cfg.steps`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let res = train(#{model: #{path: "models/tiny-qwen3"}, data: #{train: "data/arith/train.jsonl"}, steps: 50});
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn train(ctx: NativeCallContext, cfg: Map) -> RhaiResult<Map> {
        super::train_with(&ctx, &host_of(&ctx)?, &cfg, None)
    }

    /// trainer(cfg) -> Run
    ///
    /// Starts a run (next run folder) to drive step by step: run.step(), run.rollout,
    /// run.evaluate(), run.checkpoint().
    ///
    /// # Example
    ///
    /// ```rhai
    /// let t = trainer(#{model: #{path: "models/tiny-qwen3"}, data: #{train: "data/arith/train.jsonl"}}); t.step();
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn trainer(ctx: NativeCallContext, cfg: Map) -> RhaiResult<RunHandle> {
        let host = host_of(&ctx)?;
        Ok(RunHandle(Arc::new(HeldRun::new(train_loop::make_trainer(&host, &cfg)?, &host))))
    }

    /// run.step() -> map
    ///
    /// One training step with the run's configuration; returns the metrics.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let m = t.step(); print(m.reward);
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn step(ctx: NativeCallContext, r: &mut RunHandle) -> RhaiResult<Map> {
        train_loop::step_once(&*host_of(&ctx)?, r, &Map::new())
    }

    /// run.step(plan) -> map
    ///
    /// One step with overrides: #{sampling: #{n, temperature, ...}, lr, thresholds: #{tau_p,
    /// tau_h}} (thresholds in the `thresholds` hook's form).
    ///
    /// # Example
    ///
    /// ```rhai
    /// t.step(#{thresholds: #{tau_p: 0.01}, sampling: #{temperature: 0.7}})
    /// ```
    #[rhai_fn(name = "step", pure, volatile, return_raw)]
    pub fn step_with(ctx: NativeCallContext, r: &mut RunHandle, plan: Map) -> RhaiResult<Map> {
        train_loop::step_once(&*host_of(&ctx)?, r, &plan)
    }

    /// run.rollout -> Rollout
    ///
    /// The last step's rollout, with advantages and the S2T mask of the run's objective (print it
    /// for the token table).
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t.rollout.table(0));
    /// ```
    #[rhai_fn(get = "rollout", pure, volatile, return_raw)]
    pub fn last_rollout(r: &mut RunHandle) -> RhaiResult<RolloutHandle> {
        train_loop::last_rollout(r)
    }

    /// run.steps -> int
    ///
    /// Steps completed.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t.steps);
    /// ```
    #[rhai_fn(get = "steps", pure, volatile, return_raw)]
    pub fn steps(r: &mut RunHandle) -> RhaiResult<i64> {
        Ok(lock(&r.0, "run")?.step_count() as i64)
    }

    /// run.run_dir -> string
    ///
    /// The run folder.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t.run_dir);
    /// ```
    #[rhai_fn(get = "run_dir", pure, volatile, return_raw)]
    pub fn run_dir(r: &mut RunHandle) -> RhaiResult<String> {
        Ok(lock(&r.0, "run")?.run_dir().display().to_string())
    }

    /// run.checkpoint() -> string
    ///
    /// Writes a checkpoint (model, optimizer, trainer state); returns its folder.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let dir = t.checkpoint();
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn checkpoint(r: &mut RunHandle) -> RhaiResult<String> {
        Ok(lock(&r.0, "run")?.checkpoint().map_err(host)?.display().to_string())
    }

    /// run.evaluate() -> map
    ///
    /// Evaluates on the run's test_data (avg@n, pass@n, pass@k for the config's eval_pass_k, by source).
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t.evaluate().avg);
    /// ```
    #[rhai_fn(name = "evaluate", pure, volatile, return_raw)]
    pub fn evaluate_run(r: &mut RunHandle) -> RhaiResult<Dynamic> {
        super::evaluate_run(r, &Map::new())
    }

    /// run.evaluate(#{temperature, top_p}) -> map
    ///
    /// Evaluates at another sampling setting (each key optional, default the run's
    /// eval_temperature / eval_top_p); a setting other than the run's is logged to
    /// `eval-t<T>-p<top_p>.jsonl` in the run folder, not to eval.jsonl.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t.evaluate(#{temperature: 0.7, top_p: 0.9}).avg);
    /// ```
    #[rhai_fn(name = "evaluate", pure, volatile, return_raw)]
    pub fn evaluate_run_at(r: &mut RunHandle, opts: Map) -> RhaiResult<Dynamic> {
        super::evaluate_run(r, &opts)
    }

    /// run.silenced(n) -> array
    ///
    /// The n most often silenced tokens of the run so far, as [token, count, contexts]: contexts
    /// holds up to three of its occurrences with a few tokens either side (`…12+7=1⟦9⟧\n\boxed…`).
    ///
    /// # Example
    ///
    /// ```rhai
    /// t.silenced(10)
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn silenced(r: &mut RunHandle, n: i64) -> RhaiResult<Array> {
        let run = lock(&r.0, "run")?;
        let row = |(t, c): (String, usize)| {
            let ctx: Array = run.silenced_contexts(&t).iter().map(|s| Dynamic::from(s.clone())).collect();
            Dynamic::from_array(vec![t.into(), (c as i64).into(), ctx.into()])
        };
        Ok(run.silenced_totals().into_iter().take(usize_arg("n", n)?).map(row).collect())
    }

    /// to_string(run) -> string
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(t);
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn run_to_string(r: &mut RunHandle) -> String {
        match r.0.lock() {
            Ok(t) => format!("Run({}, {} steps)", t.run_dir().display(), t.step_count()),
            Err(_) => "Run(<unusable>)".into(),
        }
    }

    /// update(model, rollout, opts) -> map
    ///
    /// One RL update of `model` on a scored rollout. opts: #{actor: the run configuration's actor
    /// section (preset (default stapo), objective overrides, optim: #{lr (1e-6), ...}, epochs
    /// (1; shuffled between epochs when > 1), mini_batch, micro_batch, max_tokens_per_micro,
    /// old_logp: "recompute"|"rollout", rollout_correction), seed, temperature (the rollout's;
    /// logits are divided by it), max_tokens (the rollout's budget: sizes the preset's overlong
    /// buffer and Dr.GRPO's normaliser)}; other keys are an error naming the nearest. The
    /// optimizer (from actor.optim on the first call) stays with the model; warnings (a skipped
    /// step) are in the result's `warnings`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// score(r); let m = update(model, r, #{actor: #{preset: "grpo", optim: #{lr: 1e-5}}});
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn update(m: ModelHandle, r: RolloutHandle, opts: Map) -> RhaiResult<Map> {
        super::update(&m, &r, &opts)
    }

    /// default_config() -> map
    ///
    /// The whole configuration tree with its defaults (model, data, rollout, actor, evaluation, checkpoint,
    /// logging, seed).
    ///
    /// # Example
    ///
    /// ```rhai
    /// default_config().rollout.sampling
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn default_config() -> RhaiResult<Dynamic> {
        to_dynamic(&RunConfig::default())
    }

    /// pretrain_tiny(cfg) -> map
    ///
    /// Builds a tiny model from scratch (task data, BPE tokenizer, SFT until the target accuracy);
    /// cfg keys as TinyConfig (model_dir, data_dir, n_train, max_steps, target_accuracy, ...).
    /// Returns the report.
    ///
    /// # Example
    ///
    /// ```rhai
    /// pretrain_tiny(#{model_dir: "models/tiny-qwen3", max_steps: 200})
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn pretrain_tiny(ctx: NativeCallContext, cfg: Map) -> RhaiResult<Dynamic> {
        super::pretrain_tiny(&*host_of(&ctx)?, &cfg)
    }
}
