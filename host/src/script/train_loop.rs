//! The training loop scripts start with `train(cfg, steps)`: it lives in Rust
//! and calls the script's hooks, looked up by name in the *current*
//! [`HookSet`] at every step, so a hot reload changes behaviour at the next
//! step while the model, optimizer, data order and step counter stay put.
//!
//! Per step, each hook only if defined:
//!
//! 1. `sampling(step)` → map merged into the step's `SamplingParams`
//!    (`n`, `temperature`, `top_p`, `top_k`, `max_tokens`, ...);
//! 2. `thresholds(step, stats)` → `#{tau_p, tau_h}` or `#{tau_p, tau_h_quantile, tau_h_over}`,
//!    applied to the step's S2T mask (S2T objectives only: with another objective
//!    the hook is not called and a note says so once). `stats` holds the previous step's
//!    metrics (`silenced_ratio`, `s2t_candidates`, `response_tokens`, ...; absent at the
//!    first step), `run` (the run folder's name, e.g. a config's `name`), the
//!    thresholds in force (`tau_p`, `tau_h`/`tau_h_quantile`) and `prev`, the
//!    map the hook returned last time (extra keys included), so a hook can
//!    keep state across steps;
//! 3. `lr(step)` → the step's learning rate;
//! 4. the step itself (rollout, reward, update; metrics logged to `metrics.jsonl`);
//! 5. `on_step(step, metrics)` and `should_stop(step, metrics)` → bool.
//!
//! (The hooks' one table is [`super::hooks::HOOKS`].) Each hook call has a
//! wall-clock limit, 60 s unless `hook_timeout` (seconds, in the config map)
//! or `stapo run --hook-timeout` says otherwise. A hook past its limit is
//! treated as a broken edit: when a hot reload brought it in, the run goes
//! back to the hooks from before that reload, says so (stderr and
//! `reloads.log`) and calls the previous version; otherwise the run ends with
//! the error, which names the hook and its file:line, after a checkpoint.
//!
//! `steps` is the total: a resumed run continues from its checkpoint's step.
//! The run ends with a checkpoint (also when cancelled or a hook fails, so it
//! can be resumed), and `train` returns a summary map.
//!
//! `--set key=value` pairs are applied to the config map: a `RunConfig` field
//! (`lr=1e-5`, `prompts_per_step=8`, dotted for nested ones: `sampling.n=4`)
//! or an objective override key (`tau_p=0.01`, goes into `set`). Other keys
//! are only visible to the script as `ARGS.key`.
//!
//! In smoke mode every run is clamped to at most 2 steps of 2 prompts × 2
//! samples × 8 tokens (at most 2 generation batches per step), evaluation to 2
//! problems × 1 sample, no periodic saves.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rhai::{Dynamic, Engine, Map, Scope};
use serde_json::Value;

use super::convert::{
    clean_f64, from_json, get_num, get_str, num, parse_cli_value, sampling_from_map, sampling_json, to_json,
};
use super::error::{bad_arg, host as host_err, into_error, RhaiResult};
use super::handles::{lock, RolloutHandle, RolloutState, RunHandle};
use super::hooks::{hook_type_error, HookSet, HookSpec, LR, ON_STEP, SAMPLING, SHOULD_STOP, THRESHOLDS};
use super::host::{timestamp, Host};
use crate::algo::{is_set_key, MaskConfig, QuantileOver, TauH};
use crate::train::{RunConfig, StepMetrics, StepPlan, Trainer};
use crate::util::append_line;
use crate::{Error, Result};

/// Keys of a config map that belong to the host, not to `RunConfig`.
const HOST_KEYS: [&str; 3] = ["steps", "name", "hook_timeout"];

/// The time limit of one hook call: `hook_timeout` (seconds; 0 = none) of the
/// config map, else the session's.
fn hook_timeout(host: &Host, cfg: &Map) -> RhaiResult<Option<Duration>> {
    match cfg.get("hook_timeout") {
        None => Ok(host.opts.time_limits.hook),
        Some(v) => {
            let s = num(v)
                .filter(|s| s.is_finite() && *s >= 0.0)
                .ok_or_else(|| bad_arg("train", format!("hook_timeout: expected seconds >= 0, found {v}")))?;
            Ok((s > 0.0).then(|| Duration::from_secs_f64(s)))
        }
    }
}

/// `RunConfig` from a script map, with `--set` overrides and smoke clamps.
pub fn run_config(host: &Host, cfg: &Map) -> RhaiResult<RunConfig> {
    let mut m = cfg.clone();
    for k in HOST_KEYS {
        m.remove(k);
    }
    let mut v = to_json("config", &Dynamic::from_map(m))?;
    if let Value::Object(o) = &mut v {
        if let Some(s) = o.remove("sampling") {
            o.insert("sampling".into(), sampling_json(s));
        }
        // Objective overrides are strings to `ObjectiveConfig::set`; scripts write numbers.
        if let Some(Value::Object(set)) = o.get_mut("set") {
            for val in set.values_mut() {
                if !val.is_string() {
                    *val = Value::String(val.to_string());
                }
            }
        }
    }
    apply_args(host, &mut v)?;
    // A value that does not convert is named by its key (`sampling.n`, `lr`).
    let mut rc: RunConfig = super::convert::overlay("train config", &RunConfig::default(), v)?;
    if host.opts.smoke {
        smoke_clamp(&mut rc);
    }
    Ok(rc)
}

/// Applies `--set` pairs that name config fields or objective overrides.
fn apply_args(host: &Host, v: &mut Value) -> RhaiResult<()> {
    let fields = serde_json::to_value(RunConfig::default()).map_err(host_err)?;
    let Value::Object(o) = v else { return Ok(()) };
    for (k, raw) in &host.opts.args {
        let val = to_json(k, &parse_cli_value(raw))?;
        let mut parts = k.split('.');
        let top = parts.next().unwrap_or_default();
        if fields.get(top).is_some() {
            let rest: Vec<&str> = parts.collect();
            let mut slot = o.entry(top.to_string()).or_insert(Value::Object(Default::default()));
            for p in rest {
                if !slot.is_object() {
                    *slot = Value::Object(Default::default());
                }
                let Value::Object(inner) = slot else { break };
                slot = inner.entry(p.to_string()).or_insert(Value::Null);
            }
            *slot = val;
            if top == "sampling" {
                if let Some(s) = o.remove("sampling") {
                    o.insert("sampling".into(), sampling_json(s));
                }
            }
        } else if is_set_key(k) {
            let set = o.entry("set").or_insert(Value::Object(Default::default()));
            if let Value::Object(s) = set {
                s.insert(k.clone(), Value::String(raw.clone()));
            }
        }
    }
    Ok(())
}

/// Smoke mode: tiny steps whatever the script asked for.
pub fn smoke_clamp(rc: &mut RunConfig) {
    rc.prompts_per_step = rc.prompts_per_step.clamp(1, 2);
    clamp_sampling(&mut rc.sampling);
    rc.eval_n = rc.eval_n.min(1);
    rc.eval_pass_k = smoke_pass_k(&rc.eval_pass_k, rc.eval_n);
    rc.eval_limit = Some(rc.eval_limit.unwrap_or(2).min(2));
    rc.save_every = 0;
    rc.epochs = rc.epochs.min(1);
    rc.max_num_gen_batches = rc.max_num_gen_batches.clamp(1, 2);
}

/// Smoke mode: the pass@k list clamped to the smoke run's samples per problem.
pub fn smoke_pass_k(ks: &[usize], n: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = ks.iter().map(|&k| k.min(n)).collect();
    ks.dedup();
    ks
}

fn clamp_sampling(s: &mut crate::rollout::SamplingParams) {
    s.n = s.n.clamp(1, 2);
    s.max_new_tokens = s.max_new_tokens.clamp(1, 8);
}

/// A step's metrics as a script map: the `StepMetrics` fields, plus `reward`
/// (= `reward_mean`) and the thresholds used.
pub fn metrics_map(m: &StepMetrics, plan: &StepPlan) -> RhaiResult<Map> {
    let v = serde_json::to_value(m).map_err(host_err)?;
    let mut map = from_json(&v).cast::<Map>();
    map.insert("reward".into(), (m.update.reward_mean as f64).into());
    // `tau_h` is already the entropy threshold applied; the configured one is `tau_h_abs`.
    insert_thresholds(&mut map, &plan.objective.mask, "tau_h_abs");
    Ok(map)
}

/// Inserts the S2T thresholds of `mask` (if it is S2T): `tau_p`, and `abs_key` or
/// `tau_h_quantile` with `tau_h_over` (`"response"` / `"candidates"`).
fn insert_thresholds(map: &mut Map, mask: &MaskConfig, abs_key: &str) {
    if let Some(t) = mask.s2t() {
        map.insert("tau_p".into(), clean_f64(t.tau_p).into());
        match t.tau_h {
            TauH::Abs(h) => {
                map.insert(abs_key.into(), clean_f64(h).into());
            }
            TauH::Quantile { q, over } => {
                map.insert("tau_h_quantile".into(), clean_f64(q).into());
                map.insert("tau_h_over".into(), over.name().into());
            }
        }
    }
}

/// `m.tau_h_over` (`"response"` / `"candidates"`), if present.
pub(crate) fn get_over(m: &Map) -> RhaiResult<Option<QuantileOver>> {
    get_str(m, "tau_h_over")?.map(|s| QuantileOver::parse(&s).map_err(host_err)).transpose()
}

/// Applies a `sampling` hook's map to the plan.
pub fn apply_sampling(plan: &mut StepPlan, m: &Map, smoke: bool) -> RhaiResult<()> {
    plan.sampling = sampling_from_map(&plan.sampling, m)?;
    if smoke {
        clamp_sampling(&mut plan.sampling);
    }
    Ok(())
}

/// Applies a `thresholds` map (`tau_p`, `tau_h` or `tau_h_quantile` / `tau_h_over`) to the plan's S2T
/// mask; what the map leaves out stays as configured. Thresholds apply to S2T only: for
/// an objective without the S2T mask this is an error (it never switches the mask on).
pub fn apply_thresholds(plan: &mut StepPlan, m: &Map) -> RhaiResult<()> {
    let cur = plan.objective.mask.s2t().ok_or_else(|| {
        bad_arg(
            "thresholds",
            format!(
                "the objective has no S2T mask (mask = {}); thresholds apply to S2T only \
                 (set mask = \"s2t\" or use the stapo preset)",
                mask_name(&plan.objective.mask)
            ),
        )
    })?;
    let t = cur
        .with(get_num(m, "tau_p")?, get_num(m, "tau_h")?, get_num(m, "tau_h_quantile")?, get_over(m)?)
        .map_err(host_err)?;
    plan.objective.mask = t.into();
    plan.objective.validate().map_err(host_err)
}

fn mask_name(m: &MaskConfig) -> &'static str {
    match m {
        MaskConfig::None => "none",
        MaskConfig::S2t { .. } => "s2t",
        MaskConfig::TopEntropy { .. } => "top_entropy",
    }
}

/// The `stats` argument of `thresholds(step, stats)`.
fn threshold_stats(last: &Map, plan: &StepPlan, prev: &Map, step: u64, run: &str) -> Map {
    let mut s = last.clone();
    s.insert("step".into(), (step as i64).into());
    s.insert("run".into(), run.into());
    insert_thresholds(&mut s, &plan.objective.mask, "tau_h");
    s.insert("prev".into(), Dynamic::from_map(prev.clone()));
    s
}

/// Swaps the hooks if a reload was requested; logs the outcome.
pub fn maybe_reload(engine: &Engine, host: &Host, run_dir: Option<&Path>, step: u64) {
    if !host.take_reload_request() {
        return;
    }
    let Some(path) = host.script() else { return };
    let label = path.display().to_string();
    let log = |line: &str| log_reload(host, run_dir, line);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            return log(&format!("step {step}: reload of {label} failed ({e}); keeping the previous hooks"))
        }
    };
    match HookSet::compile(engine, &label, &text) {
        Ok(h) => {
            let same = h.text() == host.hooks().text();
            let warnings = h.lint();
            host.reload_hooks(h);
            if let Some(d) = run_dir {
                let _ = crate::util::write_file_atomically(
                    &d.join("reloads").join(format!("step-{step:06}.rhai")),
                    text.as_bytes(),
                );
            }
            let what = if same { "imports changed" } else { "script changed" };
            log(&format!(
                "step {step}: reloaded {label} ({what}); hooks now: {}",
                host.hooks().names().join(", ")
            ));
            for w in warnings {
                log(&format!("warning: {w}"));
            }
        }
        Err(e) => log(&format!("step {step}: reload of {label} failed, keeping the previous hooks: {e}")),
    }
}

/// A reload's outcome (or a hook's fallback) on stderr and in the run folder's `reloads.log`.
fn log_reload(host: &Host, run_dir: Option<&Path>, line: &str) {
    host.notice(line);
    if let Some(d) = run_dir {
        let _ = append_line(&d.join("reloads.log"), &format!("{} {line}", timestamp()));
    }
}

/// How the loop calls hooks: the engine, the session, the time limit of one
/// call, the run folder (for `reloads.log`) and the step (for messages).
struct HookCaller<'a> {
    engine: &'a Engine,
    host: &'a Host,
    limit: Option<Duration>,
    run_dir: &'a Path,
    step: u64,
}

impl HookCaller<'_> {
    /// Calls `hook` if the current hooks define it, under the time limit. A call past the
    /// limit, or one that raises an error, falls back to the hooks from before the last
    /// reload (logged with the error's file:line) and calls the hook there: a runtime error
    /// of a hot edit is a broken edit like a syntax error. With no reload to undo, the
    /// error ends the run.
    fn call(&self, hook: &HookSpec, args: Vec<Dynamic>) -> Result<Option<Dynamic>> {
        debug_assert_eq!(args.len(), hook.arity(), "{}", hook.signature());
        loop {
            let hooks = self.host.hooks();
            if !hooks.has_hook(hook) {
                return Ok(None);
            }
            let at = hooks.hook_pos(hook);
            let what = format!(
                "hook `{}` (defined at {at}) ran past its time limit of {}",
                hook.name,
                secs(self.limit)
            );
            let mut scope: Scope = super::new_scope(self.host);
            let guard = self.host.hook_deadline(self.limit, what);
            let r = hooks.call(self.engine, &mut scope, hook.name, args.clone());
            drop(guard);
            // Ctrl-C and the whole script's deadline end the run whatever the hooks.
            let stopping = self.host.cancelled() || self.host.deadline_passed().is_some();
            match r {
                Err(e) if !stopping && self.host.revert_hooks() => log_reload(
                    self.host,
                    Some(self.run_dir),
                    &format!(
                        "step {}: {e}; treated as a broken edit: keeping the previous hooks \
                         (from before the last reload): {}",
                        self.step,
                        self.host.hooks().names().join(", ")
                    ),
                ),
                r => return r.map(Some),
            }
        }
    }
}

/// `60 s` (or `no limit`).
fn secs(d: Option<Duration>) -> String {
    d.map_or("none".into(), |d| format!("{} s", d.as_secs_f64()))
}

fn expect_map(host: &Host, name: &str, v: Dynamic) -> Result<Map> {
    if v.is_map() {
        Ok(v.cast::<Map>())
    } else {
        Err(hook_type_error(&host.hooks(), name, "a map", &v))
    }
}

/// A failed run's error, with where its work is: the checkpoint written after the failure
/// (or why none could be), and how to resume it.
fn with_checkpoint(e: Error, ckpt: &Result<String>, run_dir: &Path) -> Error {
    let note = match ckpt {
        Ok(p) if !p.is_empty() => {
            format!(
                "; the run is checkpointed at {p} (stapo run --resume {} continues it)",
                run_dir.display()
            )
        }
        Ok(_) => format!("; no step completed, so no checkpoint (run folder {})", run_dir.display()),
        Err(c) => format!("; the checkpoint after the failure could not be written either: {c}"),
    };
    match e {
        Error::Script { pos, msg } => Error::Script { pos, msg: format!("{msg}{note}") },
        Error::Host { pos, msg } => Error::Host { pos, msg: format!("{msg}{note}") },
        other => Error::invalid(format!("{other}{note}")),
    }
}

fn to_rhai(e: Error) -> Box<rhai::EvalAltResult> {
    // A hook's error already carries its own position; keep it in the message.
    match e {
        Error::Script { pos, msg } | Error::Host { pos, msg } => host_err(format!("in hook at {pos}: {msg}")),
        other => host_err(other),
    }
}

/// Copies the running script into the run folder (`script.rhai`, or a
/// timestamped copy when resuming with a different text).
fn save_script(host: &Host, run_dir: &Path) {
    let Some(p) = host.script() else { return };
    let Ok(text) = std::fs::read_to_string(&p) else { return };
    let dst = run_dir.join("script.rhai");
    let dst = match std::fs::read_to_string(&dst) {
        Ok(old) if old == text => return,
        Ok(_) => run_dir.join(format!("script-{}.rhai", timestamp())),
        Err(_) => dst,
    };
    if let Err(e) = crate::util::write_file_atomically(&dst, text.as_bytes()) {
        host.notice(&format!("warning: cannot save the script into the run folder: {e}"));
    }
}

/// Builds a trainer for a config map in the next run folder (new or resumed).
pub fn make_trainer(host: &Host, cfg: &Map) -> RhaiResult<Trainer> {
    let name = cfg.get("name").filter(|n| n.is_string()).map(|n| n.to_string());
    let (dir, resume) = host.next_run_dir(name.as_deref());
    let t = if resume {
        Trainer::resume(&dir).map_err(host_err)?
    } else {
        Trainer::new(run_config(host, cfg)?, &dir).map_err(host_err)?
    };
    // Under several ranks, rank 0 alone writes into the run folder.
    if t.comm().rank() == 0 {
        save_script(host, &dir);
    }
    Ok(t)
}

fn progress_bar(host: &Host, total: u64, pos: u64) -> ProgressBar {
    let target = if host.opts.progress { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let pb = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:30.cyan/blue} step {pos}/{len}  {msg}  [{elapsed_precise} < {eta}]",
    ) {
        pb.set_style(style);
    }
    pb.set_position(pos);
    pb
}

/// `train(cfg, steps)`: the loop described in the module docs.
pub fn train(engine: &Engine, host: &Arc<Host>, cfg: &Map, steps: i64) -> RhaiResult<Map> {
    let steps = u64::try_from(steps)
        .map_err(|_| bad_arg("train", format!("steps: expected a non-negative integer, found {steps}")))?;
    let steps = if host.opts.smoke { steps.min(2) } else { steps };
    let started = Instant::now();
    let mut trainer = make_trainer(host, cfg)?;
    let run_dir = trainer.run_dir().to_path_buf();
    let pb = progress_bar(host, steps, trainer.step_count());
    host.set_progress(Some(pb.clone()));
    let limit = hook_timeout(host, cfg)?;
    let result = run_steps(engine, host, &mut trainer, steps, &pb, limit);
    pb.finish_and_clear();
    host.set_progress(None);
    // Checkpoint whatever happened, so the run can be resumed.
    let ckpt = if trainer.step_count() > 0 {
        trainer.checkpoint().map(|p| p.display().to_string())
    } else {
        Ok(String::new())
    };
    let (last, stopped_early) = result.map_err(|e| to_rhai(with_checkpoint(e, &ckpt, &run_dir)))?;
    let ckpt = ckpt.map_err(host_err)?;
    let mut summary = Map::new();
    summary.insert("run_dir".into(), run_dir.display().to_string().into());
    summary.insert("steps".into(), (trainer.step_count() as i64).into());
    summary.insert("stopped_early".into(), stopped_early.into());
    summary.insert("checkpoint".into(), ckpt.into());
    summary.insert("seconds".into(), started.elapsed().as_secs_f64().into());
    summary.insert("final".into(), Dynamic::from_map(last));
    let evals: rhai::Array = trainer
        .eval_history()
        .iter()
        .map(|&(step, avg, pass)| {
            let mut e = Map::new();
            e.insert("step".into(), (step as i64).into());
            e.insert("avg".into(), avg.into());
            e.insert("pass".into(), pass.into());
            Dynamic::from_map(e)
        })
        .collect();
    summary.insert("evals".into(), evals.into());
    host.push_result(summary.clone());
    Ok(summary)
}

/// The step loop; returns the last metrics and whether `should_stop` ended it.
fn run_steps(
    engine: &Engine,
    host: &Arc<Host>,
    trainer: &mut Trainer,
    steps: u64,
    pb: &ProgressBar,
    limit: Option<Duration>,
) -> Result<(Map, bool)> {
    let mut last = Map::new();
    let mut prev_thresholds = Map::new();
    let mut told_no_s2t = false;
    let run_name =
        trainer.run_dir().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let cancel = host.cancel_flag();
    while trainer.step_count() < steps {
        if host.cancelled() {
            return Err(Error::invalid("training cancelled (Ctrl-C); a checkpoint was written"));
        }
        let step = trainer.step_count();
        maybe_reload(engine, host, Some(trainer.run_dir()), step);
        let run_dir = trainer.run_dir().to_path_buf();
        let hooks = HookCaller { engine, host, limit, run_dir: &run_dir, step };
        let mut plan = trainer.default_plan();
        if host.opts.smoke {
            clamp_sampling(&mut plan.sampling);
        }
        let s = Dynamic::from(step as i64);
        if let Some(v) = hooks.call(&SAMPLING, vec![s.clone()])? {
            let m = expect_map(host, SAMPLING.name, v)?;
            apply_sampling(&mut plan, &m, host.opts.smoke).map_err(into_error)?;
        }
        let has_thresholds = host.hooks().has_hook(&THRESHOLDS);
        if has_thresholds && plan.objective.mask.s2t().is_none() {
            // A thresholds hook only affects S2T: a logged no-op for other objectives (it
            // must never turn GRPO or 20-Entropy into STAPO).
            if !told_no_s2t {
                host.notice(&format!(
                    "note: the thresholds hook is ignored: the objective has no S2T mask (mask = {})",
                    mask_name(&plan.objective.mask)
                ));
                told_no_s2t = true;
            }
        } else if let Some(v) = hooks.call(
            &THRESHOLDS,
            vec![
                s.clone(),
                Dynamic::from_map(threshold_stats(&last, &plan, &prev_thresholds, step, &run_name)),
            ],
        )? {
            let m = expect_map(host, THRESHOLDS.name, v)?;
            apply_thresholds(&mut plan, &m).map_err(into_error)?;
            prev_thresholds = m;
        }
        if let Some(v) = hooks.call(&LR, vec![s.clone()])? {
            plan.lr = num(&v).ok_or_else(|| hook_type_error(&host.hooks(), LR.name, "a number", &v))?;
        }
        let tokens = Mutex::new(0usize);
        let progress = |n: usize| {
            if let Ok(mut t) = tokens.lock() {
                *t = n;
            }
            pb.tick();
        };
        let metrics = trainer.step(&plan, Some(&progress), Some(cancel))?;
        for w in &metrics.update.warnings {
            host.notice(&format!("warning: step {step}: {w}"));
        }
        last = metrics_map(&metrics, &plan).map_err(into_error)?;
        pb.set_position(trainer.step_count());
        pb.set_message(format!(
            "reward {:.3}  acc {:.3}  H {:.3}  silenced {}",
            metrics.update.reward_mean,
            metrics.update.accuracy,
            metrics.update.entropy,
            metrics.update.silenced_tokens
        ));
        let m = Dynamic::from_map(last.clone());
        hooks.call(&ON_STEP, vec![s.clone(), m.clone()])?;
        if let Some(v) = hooks.call(&SHOULD_STOP, vec![s, m])? {
            let stop =
                v.as_bool().map_err(|_| hook_type_error(&host.hooks(), SHOULD_STOP.name, "a bool", &v))?;
            if stop {
                return Ok((last, true));
            }
        }
    }
    Ok((last, false))
}

/// `run.step(plan)` for the REPL: one step with optional overrides
/// (`#{sampling: #{..}, lr, tau_p, tau_h, tau_h_quantile, tau_h_over}`), no hooks.
pub fn step_once(host: &Host, run: &RunHandle, over: &Map) -> RhaiResult<Map> {
    let mut t = lock(&run.0, "run")?;
    let mut plan = t.default_plan();
    if host.opts.smoke {
        clamp_sampling(&mut plan.sampling);
    }
    if let Some(s) = over.get("sampling") {
        if !s.is_map() {
            return Err(bad_arg("step", "`sampling` must be a map"));
        }
        apply_sampling(&mut plan, &s.clone().cast::<Map>(), host.opts.smoke)?;
    }
    if ["tau_p", "tau_h", "tau_h_quantile", "tau_h_over"].iter().any(|k| over.contains_key(*k)) {
        apply_thresholds(&mut plan, over)?;
    }
    if let Some(lr) = get_num(over, "lr")? {
        plan.lr = lr;
    }
    let m = t.step(&plan, None, Some(host.cancel_flag())).map_err(host_err)?;
    for w in &m.update.warnings {
        host.notice(&format!("warning: {w}"));
    }
    metrics_map(&m, &plan)
}

/// The last rollout of a run as a [`RolloutHandle`], with the advantages and the
/// S2T-silenced tokens the update actually used (its [`crate::train::UpdateRecord`]),
/// so the token table cannot disagree with the update.
pub fn last_rollout(run: &RunHandle) -> RhaiResult<RolloutHandle> {
    let t = lock(&run.0, "run")?;
    let batch = t.last_rollout().cloned().ok_or_else(|| host_err("the run has not taken a step yet"))?;
    let (advantages, silenced, region, points) = match t.last_update() {
        Some(rec) if rec.advantages.len() == batch.samples.len() => {
            let s2t = rec.silenced.iter().any(|v| !v.is_empty());
            let (pts, region) = crate::train::spurious::record_points(rec);
            let has_norms = rec.grad_norm.iter().any(|g| !g.is_empty());
            (
                Some(rec.advantages.clone()),
                s2t.then(|| rec.silenced.clone()),
                region,
                has_norms.then_some(pts),
            )
        }
        _ => (None, None, None, None),
    };
    let st =
        RolloutState { batch, tokenizer: Some(t.tokenizer().clone()), advantages, silenced, region, points };
    Ok(RolloutHandle(Arc::new(Mutex::new(st))))
}
