//! The training loop scripts start with `train(cfg, steps)`: it lives in Rust
//! and calls the script's hooks, looked up by name in the *current*
//! [`HookSet`] at every step, so a hot reload changes behaviour at the next
//! step while the model, optimizer, data order and step counter stay put.
//!
//! Per step, each hook only if defined:
//!
//! 1. `sampling(step)` → map merged into the step's `SamplingParams`
//!    (`n`, `temperature`, `top_p`, `top_k`, `max_tokens`, ...);
//! 2. `thresholds(step, stats)` → the S2T thresholds in their one form
//!    ([`crate::algo::S2tThresholds`]: `#{tau_p, tau_h}` with `tau_h` a number or a
//!    quantile `#{q, over}`; what the map leaves out stays), plus `state`, a map of the
//!    hook's own; applied to the step's S2T mask (S2T objectives only: with another
//!    objective the hook is not called and a note says so once). Any other key is an
//!    error naming the nearest valid one. `stats` holds the previous step's metrics
//!    (`silenced_ratio`, `s2t_candidates`, `response_tokens`, `tau_h` applied, ...;
//!    absent at the first step), `run` (the run folder's name, e.g. a config's
//!    `name`), `thresholds` (those in force, in the same form), `tau_p` and `prev`, the
//!    map the hook returned last time (`state` included), so a hook can keep state
//!    across steps;
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
//! `--set key=value` pairs whose key is a path of the configuration tree
//! ([`RunConfig`]: `actor.optim.lr=1e-5`, `data.prompts_per_step=8`,
//! `rollout.sampling.n=4`, `actor.objective.mask.tau_p=0.01`, `seed=3`) are laid over
//! every config map; the others are only visible to the script as `ARGS.key`
//! ([`check_set_keys`] rejects a key that is neither, naming the nearest).
//!
//! A resumed run (`stapo run --resume DIR`) compares the config the script asks for with
//! the run's `run_config.json`: equal, it continues; different, it stops with the list of
//! fields that differ, unless `--apply-changes` says to continue under the new values
//! (the old file is kept as `run_config-step-NNNNNN.json` and `reloads.log` lists them).
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
    clean_f64, config_arg, from_json, get_num, num, sampling_from_map, to_dynamic, to_json,
};
use super::error::{bad_arg, host as host_err, into_error, RhaiResult};
use super::handles::{lock, RolloutHandle, RolloutState, RunHandle};
use super::hooks::{hook_type_error, HookSet, HookSpec, LR, ON_STEP, SAMPLING, SHOULD_STOP, THRESHOLDS};
use super::shared_state::{timestamp, Host};
use crate::algo::MaskConfig;
use crate::files::append_line;
use crate::overlay;
use crate::train::trainer::RunFolder;
use crate::train::{config::moved_to, ResumeOptions, RunConfig, StepMetrics, StepPlan, Trainer};
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

/// `RunConfig` from a script map, with `--set` overrides and smoke clamps: the one
/// conversion ([`RunConfig::from_json`]).
pub fn run_config(host: &Host, cfg: &Map) -> RhaiResult<RunConfig> {
    let mut m = cfg.clone();
    for k in HOST_KEYS {
        m.remove(k);
    }
    let mut v = to_json("config", &Dynamic::from_map(m))?;
    for (k, raw) in &host.opts.args {
        if is_config_key(k) {
            overlay::set_dotted(&mut v, k, overlay::parse_value(raw));
        }
    }
    let mut rc = RunConfig::from_json(&v).map_err(|e| config_arg("train config", e))?;
    if host.opts.smoke {
        smoke_clamp(&mut rc);
    }
    Ok(rc)
}

/// Whether a `--set` key is a path of the configuration tree: a dotted path below one of
/// its sections (`actor.optim.lr`), or a top-level leaf (`seed`). A bare section name
/// (`model`) is not: scripts read such keys as `ARGS.model`.
fn is_config_key(key: &str) -> bool {
    let Ok(Value::Object(tree)) = serde_json::to_value(RunConfig::default()) else { return false };
    let top = key.split('.').next().unwrap_or_default();
    match tree.get(top) {
        Some(v) => key.contains('.') || !v.is_object(),
        None => false,
    }
}

/// Checks every `--set` key before a script runs: a path of the configuration tree must
/// exist in it; any other key must be one the script reads (`ARGS.key` in `script`, the
/// script's text; a script that reads `ARGS` as a whole or calls `args()` accepts any).
/// An unknown key is an error naming the nearest valid one, or the new place of a key of
/// the old flat layout (`lr` → `actor.optim.lr`).
pub fn check_set_keys(args: &std::collections::BTreeMap<String, String>, script: &str) -> Result<()> {
    let read = args_read(script);
    for (k, raw) in args {
        if is_config_key(k) {
            let mut v = Value::Object(Default::default());
            overlay::set_dotted(&mut v, k, overlay::parse_value(raw));
            match RunConfig::from_json(&v) {
                Err(Error::Config { field, msg, .. }) if msg.starts_with("unknown") => {
                    return Err(Error::Config { file: "--set".into(), field, msg });
                }
                _ => continue,
            }
        }
        let reads_it = match &read {
            Some(keys) => keys.iter().any(|r| r == k),
            None => true,
        };
        if reads_it {
            continue;
        }
        let leaves = RunConfig::leaves();
        let section: Vec<&str> =
            leaves.iter().filter(|l| l.starts_with(&format!("{k}."))).map(String::as_str).collect();
        let msg = match moved_to(k) {
            Some(new) => format!("`{k}` moved to `{new}` (and the script reads no ARGS.{k})"),
            None if !section.is_empty() => format!(
                "`{k}` is a section of the config: set a path below it ({}; the script reads no ARGS.{k})",
                section.join(", ")
            ),
            None => {
                let known = read.clone().unwrap_or_default();
                match nearest_key(k, &known, &leaves) {
                    Some(n) => format!("unknown key `{k}`; did you mean `{n}`? (neither a config path nor an ARGS key the script reads)"),
                    None => format!("unknown key `{k}`: neither a config path (e.g. actor.optim.lr) nor an ARGS key the script reads ({})", known.join(", ")),
                }
            }
        };
        return Err(Error::Config { file: "--set".into(), field: k.clone(), msg });
    }
    Ok(())
}

/// The nearest valid `--set` key to `key`: an ARGS key the script reads, a config path, or
/// the path of the config leaf (or old flat key) whose name is nearest (`tau_pp` →
/// `actor.objective.mask.tau_p`).
fn nearest_key(key: &str, args: &[String], leaves: &[String]) -> Option<String> {
    let mut cands: Vec<(String, String)> = args.iter().map(|a| (a.clone(), a.clone())).collect();
    for l in leaves {
        cands.push((l.clone(), l.clone()));
        let last = l.rsplit('.').next().unwrap_or(l);
        cands.push((last.to_string(), l.clone()));
    }
    let near = overlay::nearest(key, cands.iter().map(|(c, _)| c.as_str()))?;
    let (_, path) = cands.iter().find(|(c, _)| c == near)?;
    Some(path.clone())
}

/// The `ARGS.key` names `script` reads, or `None` when it reads `ARGS` in a way that hides
/// the keys (`ARGS[..]`, `args()`, `ARGS` passed on).
fn args_read(script: &str) -> Option<Vec<String>> {
    let mut keys = Vec::new();
    let mut rest = script;
    while let Some(i) = rest.find("ARGS") {
        let after = &rest[i + 4..];
        let before_ok = rest[..i].chars().next_back().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        if before_ok {
            let key: String = after
                .strip_prefix('.')
                .map(|a| a.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect())
                .unwrap_or_default();
            if key.is_empty() {
                return None;
            }
            keys.push(key);
        }
        rest = after;
    }
    if script.contains("args()") {
        return None;
    }
    Some(keys)
}

/// Smoke mode: tiny steps whatever the script asked for.
pub fn smoke_clamp(rc: &mut RunConfig) {
    rc.data.prompts_per_step = rc.data.prompts_per_step.clamp(1, 2);
    clamp_sampling(&mut rc.rollout.sampling);
    rc.evaluation.sampling.n = rc.evaluation.sampling.n.min(1);
    rc.evaluation.sampling.max_new_tokens =
        rc.evaluation.sampling.max_new_tokens.min(rc.rollout.sampling.max_new_tokens);
    rc.evaluation.pass_k = smoke_pass_k(&rc.evaluation.pass_k, rc.evaluation.sampling.n);
    rc.evaluation.limit = Some(rc.evaluation.limit.unwrap_or(2).min(2));
    rc.checkpoint.save_every = 0;
    rc.actor.epochs = rc.actor.epochs.min(1);
    rc.rollout.max_num_gen_batches = rc.rollout.max_num_gen_batches.clamp(1, 2);
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

/// A step's metrics as a script map: the `StepMetrics` fields (`tau_h` is the entropy
/// threshold applied, a number), plus `reward` (= `reward_mean`) and, under an S2T mask,
/// the thresholds in force in their one form (`thresholds: #{tau_p, tau_h}`) and `tau_p`.
pub fn metrics_map(m: &StepMetrics, plan: &StepPlan) -> RhaiResult<Map> {
    let v = serde_json::to_value(m).map_err(host_err)?;
    let mut map = from_json(&v).cast::<Map>();
    map.insert("reward".into(), (m.update.reward_mean as f64).into());
    insert_thresholds(&mut map, &plan.objective.mask)?;
    Ok(map)
}

/// Inserts the S2T thresholds of `mask` (if it is S2T): `thresholds` in their serde form
/// and `tau_p`.
fn insert_thresholds(map: &mut Map, mask: &MaskConfig) -> RhaiResult<()> {
    if let Some(t) = mask.s2t() {
        map.insert("tau_p".into(), clean_f64(t.tau_p).into());
        map.insert("thresholds".into(), to_dynamic(&t)?);
    }
    Ok(())
}

/// Applies a `sampling` hook's map to the plan.
pub fn apply_sampling(plan: &mut StepPlan, m: &Map, smoke: bool) -> RhaiResult<()> {
    plan.sampling = sampling_from_map(&plan.sampling, m)?;
    if smoke {
        clamp_sampling(&mut plan.sampling);
    }
    Ok(())
}

/// Applies a `thresholds` map (the serde form of [`crate::algo::S2tThresholds`], plus the
/// hook's own `state`) to the plan's S2T mask; what the map leaves out stays as configured,
/// an unknown key is an error naming the nearest. Thresholds apply to S2T only: for an
/// objective without the S2T mask this is an error (it never switches the mask on).
pub fn apply_thresholds(plan: &mut StepPlan, m: &Map) -> RhaiResult<()> {
    let cur = plan.objective.mask.s2t().ok_or_else(|| {
        bad_arg(
            "thresholds",
            format!(
                "the objective has no S2T mask (mask = {}); thresholds apply to S2T only \
                 (set actor.objective.mask.kind = \"s2t\" or use the stapo preset)",
                plan.objective.mask.name()
            ),
        )
    })?;
    let mut m = m.clone();
    m.remove("state");
    let over = to_json("thresholds", &Dynamic::from_map(m))?;
    let t = cur.overlay("thresholds", &over).map_err(|e| match e {
        Error::Config { field, msg, .. } if msg.starts_with("unknown") => {
            bad_arg("thresholds", format!("`{field}`: {msg}; a hook keeps values of its own under `state`"))
        }
        e => config_arg("thresholds", e),
    })?;
    plan.objective.mask = t.into();
    plan.objective.validate().map_err(host_err)
}

/// The `stats` argument of `thresholds(step, stats)`.
fn threshold_stats(last: &Map, plan: &StepPlan, prev: &Map, step: u64, run: &str) -> Map {
    let mut s = last.clone();
    s.insert("step".into(), (step as i64).into());
    s.insert("run".into(), run.into());
    // The configured thresholds; a hook map that cannot convert keeps the previous ones.
    let _ = insert_thresholds(&mut s, &plan.objective.mask);
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
                let _ = crate::files::write_file_atomically(
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
        Ok(_) => format!(
            "; no step completed, so no checkpoint: start it again into the same folder, or \
             stapo run --resume {} (from step 0)",
            run_dir.display()
        ),
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
    if let Err(e) = crate::files::write_file_atomically(&dst, text.as_bytes()) {
        host.notice(&format!("warning: cannot save the script into the run folder: {e}"));
    }
}

/// Builds a trainer for a config map in the next run folder (new or resumed).
pub fn make_trainer(host: &Host, cfg: &Map) -> RhaiResult<Trainer> {
    let name = cfg.get("name").filter(|n| n.is_string()).map(|n| n.to_string());
    let (dir, resume) = host.next_run_dir(name.as_deref());
    make_trainer_in(host, cfg, &dir, resume)
}

/// [`make_trainer`] in folder `dir`, resuming the run there when `resume`.
fn make_trainer_in(host: &Host, cfg: &Map, dir: &Path, resume: bool) -> RhaiResult<Trainer> {
    let dir = dir.to_path_buf();
    let wanted = run_config(host, cfg)?;
    let t = if resume {
        resume_trainer(host, &dir, wanted)?
    } else {
        Trainer::new(wanted, &dir).map_err(host_err)?
    };
    // Under several ranks, rank 0 alone writes into the run folder.
    if t.comm().rank() == 0 {
        save_script(host, &dir);
    }
    Ok(t)
}

/// Resumes the run in `dir`: under its saved configuration when `wanted` (the script's,
/// with `--set`) equals it; under `wanted` when they differ and `--apply-changes` says so
/// (the fields listed on stderr and in `reloads.log`); else an error listing the fields.
fn resume_trainer(host: &Host, dir: &Path, wanted: RunConfig) -> RhaiResult<Trainer> {
    let saved = RunFolder::read_config(dir).map_err(host_err)?;
    let diffs = saved.differences(&wanted);
    if diffs.is_empty() {
        let opts = ResumeOptions { changed: None, repair_metrics: host.opts.repair_metrics };
        return Trainer::resume_with(crate::dist::world(), dir, opts).map_err(host_err);
    }
    let list: Vec<String> = diffs.iter().map(|(p, a, b)| format!("{p} ({a} -> {b})")).collect();
    let list = list.join(", ");
    if !host.opts.apply_changes {
        return Err(bad_arg(
            "train",
            format!(
                "resume of {}: the config differs from its run_config.json in {} field(s): {list}. \
                 Run again with --apply-changes to continue under the new values (the old file \
                 is kept as run_config-step-NNNNNN.json), or without the changes",
                dir.display(),
                diffs.len()
            ),
        ));
    }
    log_reload(host, Some(dir), &format!("resume: applying {} changed field(s): {list}", diffs.len()));
    let opts = ResumeOptions { changed: Some(wanted), repair_metrics: host.opts.repair_metrics };
    Trainer::resume_with(crate::dist::world(), dir, opts).map_err(host_err)
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
    let name = cfg.get("name").filter(|n| n.is_string()).map(|n| n.to_string());
    let (dir, resume) = host.next_run_dir(name.as_deref());
    let mut trainer = match make_trainer_in(host, cfg, &dir, resume) {
        Ok(t) => t,
        Err(e) => {
            // The batch summary still names the run's folder.
            host.push_result(failed_summary(&dir, 0, "", started));
            return Err(e);
        }
    };
    let run_dir = trainer.run_dir().to_path_buf();
    let pb = progress_bar(host, steps, trainer.step_count());
    host.set_progress(Some(pb.clone()));
    let limit = hook_timeout(host, cfg)?;
    let result = run_steps(engine, host, &mut trainer, steps, &pb, limit);
    pb.finish_and_clear();
    host.set_progress(None);
    // Checkpoint whatever happened, so the run can be resumed (a checkpoint of this very
    // step, written by `save_every` just before a signal, is not written twice; a diverged
    // step is never saved).
    let ckpt = trainer.save_on_exit().map(|p| p.map(|p| p.display().to_string()).unwrap_or_default());
    let (last, stopped_early) = match result {
        Ok(r) => r,
        Err(e) => {
            let at = ckpt.as_deref().unwrap_or_default();
            host.push_result(failed_summary(&run_dir, trainer.step_count(), at, started));
            return Err(to_rhai(with_checkpoint(e, &ckpt, &run_dir)));
        }
    };
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

/// The summary of a `train` call that failed after `steps` steps, checkpointed at `ckpt`
/// (empty: no checkpoint).
fn failed_summary(run_dir: &Path, steps: u64, ckpt: &str, started: Instant) -> Map {
    let mut summary = Map::new();
    summary.insert("run_dir".into(), run_dir.display().to_string().into());
    summary.insert("steps".into(), (steps as i64).into());
    summary.insert("failed".into(), true.into());
    summary.insert("checkpoint".into(), ckpt.into());
    summary.insert("seconds".into(), started.elapsed().as_secs_f64().into());
    summary
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
    trainer.set_final_step(steps);
    while trainer.step_count() < steps {
        // Agreed by every rank of the job: all stop between the same two steps.
        if trainer.stop_requested(cancel)?.is_some() {
            return Err(Error::invalid(format!(
                "training stopped by {} after step {}",
                crate::guard::signal::cause(),
                trainer.step_count()
            )));
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
                    plan.objective.mask.name()
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
/// (`#{sampling: #{..}, lr, thresholds: #{tau_p, tau_h}}`), no hooks.
pub fn step_once(host: &Host, run: &RunHandle, over: &Map) -> RhaiResult<Map> {
    const KEYS: [&str; 3] = ["sampling", "lr", "thresholds"];
    if let Some(k) = over.keys().find(|k| !KEYS.contains(&k.as_str())) {
        let near = overlay::nearest(k, KEYS).map_or(String::new(), |n| format!("; did you mean `{n}`?"));
        return Err(bad_arg("step", format!("unknown key `{k}`{near} (valid: {})", KEYS.join(", "))));
    }
    let mut t = lock(&run.0, "run")?;
    let mut plan = t.default_plan();
    if host.opts.smoke {
        clamp_sampling(&mut plan.sampling);
    }
    for (key, apply) in [("sampling", apply_sampling_map as MapApply), ("thresholds", apply_thresholds_map)] {
        if let Some(s) = over.get(key) {
            if !s.is_map() {
                return Err(bad_arg("step", format!("`{key}` must be a map")));
            }
            apply(&mut plan, &s.clone().cast::<Map>(), host.opts.smoke)?;
        }
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

/// How `step_once` applies one of its maps.
type MapApply = fn(&mut StepPlan, &Map, bool) -> RhaiResult<()>;

fn apply_sampling_map(plan: &mut StepPlan, m: &Map, smoke: bool) -> RhaiResult<()> {
    apply_sampling(plan, m, smoke)
}

fn apply_thresholds_map(plan: &mut StepPlan, m: &Map, _smoke: bool) -> RhaiResult<()> {
    apply_thresholds(plan, m)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn check(pairs: &[(&str, &str)], script: &str) -> std::result::Result<(), String> {
        let args: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        check_set_keys(&args, script).map_err(|e| e.to_string())
    }

    #[test]
    fn set_keys_are_config_paths_or_args_the_script_reads() {
        let script = "let steps = ARGS.steps ?? 2; let m = ARGS.model ?? (); train(#{}, steps);";
        assert!(check(&[("actor.optim.lr", "1e-4"), ("steps", "3"), ("seed", "1")], script).is_ok());
        assert!(check(&[("model", "/m"), ("rollout.sampling.n", "4")], script).is_ok());
        let e = check(&[("lrr", "1e-3")], script).unwrap_err();
        assert!(e.contains("`lrr`") && e.contains("unknown key"), "{e}");
        let e = check(&[("stepz", "3")], script).unwrap_err();
        assert!(e.contains("did you mean `steps`?"), "{e}");
        let e = check(&[("lr", "1e-3")], script).unwrap_err();
        assert!(e.contains("`lr` moved to `actor.optim.lr`"), "{e}");
        let e = check(&[("tau_pp", "0.5")], script).unwrap_err();
        assert!(e.contains("`tau_pp`") && e.contains("did you mean"), "{e}");
        let e = check(&[("actor.optim.lrr", "1")], script).unwrap_err();
        assert!(e.contains("actor.optim.lrr") && e.contains("did you mean `lr`?"), "{e}");
        let e = check(&[("data", "x.jsonl")], script).unwrap_err();
        assert!(e.contains("section") && e.contains("data.train"), "{e}");
        // A script that reads ARGS as a whole accepts any key.
        assert!(check(&[("anything", "1")], "let a = args(); print(a);").is_ok());
        assert!(check(&[("anything", "1")], "let k = \"x\"; print(ARGS[k]);").is_ok());
    }

    #[test]
    fn args_read_finds_the_keys() {
        assert_eq!(args_read("ARGS.a + MY_ARGS.b + ARGS.c_d").unwrap(), ["a", "c_d"]);
        assert!(args_read("f(ARGS)").is_none());
    }
}
