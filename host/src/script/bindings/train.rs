//! Bindings for training: the hook-driven loop `train(cfg, steps)`, a run
//! driven step by step from the REPL (`trainer(cfg)`), and a single update
//! of a model on a scored rollout.

use std::sync::{Arc, Mutex};

use rhai::{Array, Dynamic, Engine, Map, NativeCallContext};

use super::{lock, ModelHandle, RolloutHandle, RunHandle};
use crate::script::convert::{config_arg, from_json, get_num, get_str, to_dynamic, to_json, usize_arg};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;
use crate::script::train_loop;
use crate::train::{self, AdamW, RunConfig, Sequence, UpdateOptions};

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

/// `x` with `d` decimals, in scientific notation when 0 < |x| < 1e-3.
fn format_number(x: f64, d: usize) -> String {
    if x != 0.0 && x.abs() < 1e-3 {
        format!("{x:.d$e}")
    } else {
        format!("{x:.d$}")
    }
}

fn train_with(ctx: &NativeCallContext, h: &Arc<Host>, cfg: &Map, steps: Option<i64>) -> RhaiResult<Map> {
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

/// Draws the curves of several runs into one figure. The figure must go into
/// one of the runs' folders or their parent (scripts write files only where
/// runs live).
fn plot_runs(runs: &Array, out: &str) -> RhaiResult<Map> {
    let mut curves = Vec::new();
    let mut allowed = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let m = r
            .clone()
            .try_cast::<Map>()
            .ok_or_else(|| bad_arg("plot_runs", format!("runs[{i}]: expected a map #{{label, run_dir}}")))?;
        let dir = std::path::PathBuf::from(
            get_str(&m, "run_dir")?
                .ok_or_else(|| bad_arg("plot_runs", format!("runs[{i}]: missing run_dir")))?,
        );
        let label = get_str(&m, "label")?
            .unwrap_or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        curves.push(train::plot::RunCurves {
            label,
            metrics: dir.join("metrics.jsonl"),
            eval: Some(dir.join("eval.jsonl")),
        });
        allowed.push(dir.clone());
        if let Some(p) = dir.parent() {
            allowed.push(p.to_path_buf());
        }
    }
    let out = std::path::PathBuf::from(out);
    let parent = out.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    if !allowed.contains(&parent) {
        return Err(bad_arg(
            "plot_runs",
            format!("{}: the figure must go into a run folder or its parent", out.display()),
        ));
    }
    let panels = train::plot::standard_panels(&curves).map_err(host)?;
    let (png, svg) = train::plot::plot(&panels, &out).map_err(host)?;
    let mut res = Map::new();
    res.insert("png".into(), png.display().to_string().into());
    res.insert("svg".into(), svg.display().to_string().into());
    Ok(res)
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

/// A run folder's metrics.jsonl and eval.jsonl rows as maps.
fn read_run(dir: &str) -> RhaiResult<Map> {
    let dir = std::path::Path::new(dir);
    let read = |name: &str| -> RhaiResult<Array> {
        let p = dir.join(name);
        if !p.is_file() {
            return Ok(Array::new());
        }
        let rows: Vec<serde_json::Value> = crate::files::read_jsonl(&p).map_err(host)?;
        Ok(rows.iter().map(from_json).collect())
    };
    if !dir.join("metrics.jsonl").is_file() {
        return Err(bad_arg("read_run", format!("{}: no metrics.jsonl (not a run folder?)", dir.display())));
    }
    let mut m = Map::new();
    m.insert("metrics".into(), read("metrics.jsonl")?.into());
    m.insert("evals".into(), read("eval.jsonl")?.into());
    // Evaluations at other settings: eval-t<T>-p<top_p>.jsonl, keyed by `t<T>-p<top_p>`.
    let mut at = Map::new();
    for entry in std::fs::read_dir(dir).map_err(|e| host(format!("read_run: {}: {e}", dir.display())))? {
        let name = entry.map_err(|e| host(format!("read_run: {}: {e}", dir.display())))?.file_name();
        let name = name.to_string_lossy();
        if let Some(tag) = name.strip_prefix("eval-").and_then(|n| n.strip_suffix(".jsonl")) {
            at.insert(tag.into(), read(&name)?.into());
        }
    }
    m.insert("evals_at".into(), at.into());
    Ok(m)
}

/// Draws groups of seeds as mean ± spread bands (see `train::plot::seed_panels`). Like
/// [`plot_runs`], the figure goes into one of the runs' folders or their parent.
fn plot_seeds(groups: &Array, out: &str) -> RhaiResult<Map> {
    let mut gs = Vec::new();
    let mut allowed = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let m = g.clone().try_cast::<Map>().ok_or_else(|| {
            bad_arg("plot_seeds", format!("groups[{i}]: expected a map #{{label, run_dirs}}"))
        })?;
        let label = get_str(&m, "label")?.unwrap_or_else(|| format!("group {i}"));
        let dirs = m
            .get("run_dirs")
            .and_then(|d| d.clone().try_cast::<Array>())
            .ok_or_else(|| bad_arg("plot_seeds", format!("groups[{i}]: missing run_dirs (an array)")))?;
        let mut runs = Vec::new();
        for d in dirs {
            let dir = std::path::PathBuf::from(d.to_string());
            runs.push(train::plot::RunCurves {
                label: label.clone(),
                metrics: dir.join("metrics.jsonl"),
                eval: Some(dir.join("eval.jsonl")),
            });
            if let Some(p) = dir.parent() {
                allowed.push(p.to_path_buf());
            }
            allowed.push(dir);
        }
        gs.push(train::plot::SeedGroup { label, runs });
    }
    let out = std::path::PathBuf::from(out);
    let parent = out.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    if !allowed.contains(&parent) {
        return Err(bad_arg(
            "plot_seeds",
            format!("{}: the figure must go into a run folder or its parent", out.display()),
        ));
    }
    let panels = train::plot::seed_panels(&gs).map_err(host)?;
    let (png, svg) = train::plot::plot_bands(&panels, &out).map_err(host)?;
    let mut res = Map::new();
    res.insert("png".into(), png.display().to_string().into());
    res.insert("svg".into(), svg.display().to_string().into());
    Ok(res)
}

pub(super) fn register(engine: &mut Engine, host_: &Arc<Host>) {
    func! { engine, "plot_seeds", r#"
        /// plot_seeds(groups, out) -> map
        ///
        /// One figure (PNG and SVG) of held-out avg@n, entropy, reward, silenced ratio and the
        /// gradient-norm shares of silenced and top-0.01% tokens against step, one band per group of
        /// runs that differ only in their seed: the mean as a line, min..max over the runs shaded.
        /// groups: array of #{label, run_dirs: [..]}; out: the figure's path without extension, inside
        /// a run folder or its parent. Returns #{png, svg}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// plot_seeds([#{label: "grpo", run_dirs: [a.run_dir, b.run_dir]}], parent + "/stress")
        /// ```
    "#,
        |groups: Array, out: &str| plot_seeds(&groups, out)
    }
    func! { engine, "read_run", r#"
        /// read_run(run_dir) -> map
        ///
        /// A run folder's logs as data: #{metrics: [one map per step, as metrics.jsonl], evals: [one
        /// map per evaluation, as eval.jsonl], evals_at: #{"t0.7-p0.9": [the evaluations at another
        /// setting, as eval-t0.7-p0.9.jsonl], ...}}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let h = read_run(res.run_dir).metrics.map(|m| m.entropy);
        /// ```
    "#,
        |dir: &str| read_run(dir)
    }
    func! { engine, "plot_runs", r#"
        /// plot_runs(runs, out) -> map
        ///
        /// One figure (PNG and SVG) of reward, entropy, held-out accuracy, silenced ratio and response
        /// length against step, one line per run. runs: array of #{label, run_dir} (e.g. train()
        /// results); out: the figure's path without extension, inside a run folder or its parent.
        /// Returns #{png, svg}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// plot_runs([#{label: "stapo", run_dir: res.run_dir}], res.run_dir + "/curves")
        /// ```
    "#,
        |runs: Array, out: &str| plot_runs(&runs, out)
    }
    let h = host_.clone();
    func! { engine, "train", r#"
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
    "#,
        move |ctx: NativeCallContext, cfg: Map, steps: i64| train_with(&ctx, &h, &cfg, Some(steps))
    }
    let h = host_.clone();
    func! { engine, "train", r#"
        /// train(cfg) -> map
        ///
        /// Same, with the number of steps in `cfg.steps`.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let res = train(#{model: #{path: "models/tiny-qwen3"}, data: #{train: "data/arith/train.jsonl"}, steps: 50});
        /// ```
    "#,
        move |ctx: NativeCallContext, cfg: Map| train_with(&ctx, &h, &cfg, None)
    }
    let h = host_.clone();
    func! { engine, "trainer", r#"
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
    "#,
        move |cfg: Map| -> RhaiResult<RunHandle> {
            Ok(RunHandle(Arc::new(Mutex::new(train_loop::make_trainer(&h, &cfg)?))))
        }
    }
    let h = host_.clone();
    func! { engine, "step", r#"
        /// run.step() -> map
        ///
        /// One training step with the run's configuration; returns the metrics.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let m = t.step(); print(m.reward);
        /// ```
    "#,
        move |r: &mut RunHandle| train_loop::step_once(&h, r, &Map::new())
    }
    let h = host_.clone();
    func! { engine, "step", r#"
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
    "#,
        move |r: &mut RunHandle, plan: Map| train_loop::step_once(&h, r, &plan)
    }
    getter! { engine, "rollout", r#"
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
    "#,
        |r: &mut RunHandle| train_loop::last_rollout(r)
    }
    getter! { engine, "steps", r#"
        /// run.steps -> int
        ///
        /// Steps completed.
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(t.steps);
        /// ```
    "#,
        |r: &mut RunHandle| -> RhaiResult<i64> { Ok(lock(&r.0, "run")?.step_count() as i64) }
    }
    getter! { engine, "run_dir", r#"
        /// run.run_dir -> string
        ///
        /// The run folder.
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(t.run_dir);
        /// ```
    "#,
        |r: &mut RunHandle| -> RhaiResult<String> { Ok(lock(&r.0, "run")?.run_dir().display().to_string()) }
    }
    func! { engine, "checkpoint", r#"
        /// run.checkpoint() -> string
        ///
        /// Writes a checkpoint (model, optimizer, trainer state); returns its folder.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let dir = t.checkpoint();
        /// ```
    "#,
        |r: &mut RunHandle| -> RhaiResult<String> {
            Ok(lock(&r.0, "run")?.checkpoint().map_err(host)?.display().to_string())
        }
    }
    func! { engine, "evaluate", r#"
        /// run.evaluate() -> map
        ///
        /// Evaluates on the run's test_data (avg@n, pass@n, pass@k for the config's eval_pass_k, by source).
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(t.evaluate().avg);
        /// ```
    "#,
        |r: &mut RunHandle| -> RhaiResult<Dynamic> { evaluate_run(r, &Map::new()) }
    }
    func! { engine, "evaluate", r#"
        /// run.evaluate(#{temperature, top_p}) -> map
        ///
        /// Evaluates at another sampling setting (each key optional, default the run's
        /// eval_temperature / eval_top_p); a setting other than the run's is logged to
        /// eval-t<T>-p<top_p>.jsonl in the run folder, not to eval.jsonl.
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(t.evaluate(#{temperature: 0.7, top_p: 0.9}).avg);
        /// ```
    "#,
        |r: &mut RunHandle, opts: Map| -> RhaiResult<Dynamic> { evaluate_run(r, &opts) }
    }
    func! { engine, "silenced", r#"
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
    "#,
        |r: &mut RunHandle, n: i64| -> RhaiResult<Array> {
            let run = lock(&r.0, "run")?;
            Ok(run
                .silenced_totals()
                .into_iter()
                .take(usize_arg("n", n)?)
                .map(|(t, c)| {
                    let ctx: Array = run.silenced_contexts(&t).iter().map(|s| Dynamic::from(s.clone())).collect();
                    Dynamic::from_array(vec![t.into(), (c as i64).into(), ctx.into()])
                })
                .collect())
        }
    }
    func! { engine, "to_string", r#"
        /// to_string(run) -> string
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(t);
        /// ```
    "#,
        |r: &mut RunHandle| match r.0.lock() {
            Ok(t) => format!("Run({}, {} steps)", t.run_dir().display(), t.step_count()),
            Err(_) => "Run(<unusable>)".into(),
        }
    }
    func! { engine, "update", r#"
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
    "#,
        |m: ModelHandle, r: RolloutHandle, opts: Map| update(&m, &r, &opts)
    }
    func! { engine, "default_config", r#"
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
    "#,
        || to_dynamic(&RunConfig::default())
    }
    func! { engine, "format_number", r#"
        /// format_number(x, digits) -> string
        ///
        /// `x` with `digits` decimals (at most 12), in scientific notation when 0 < |x| < 1e-3.
        ///
        /// # Example
        ///
        /// ```rhai
        /// format_number(0.0000021, 2)   // "2.10e-6"
        /// ```
    "#,
        |x: f64, digits: i64| -> RhaiResult<String> {
            Ok(format_number(x, usize_arg("digits", digits)?.min(12)))
        }
    }
    let h = host_.clone();
    func! { engine, "smoke", r#"
        /// smoke() -> bool
        ///
        /// True in smoke mode (`--smoke`, STAPO_SMOKE=1); the same as the constant SMOKE, but callable
        /// inside functions.
        ///
        /// # Example
        ///
        /// ```rhai
        /// fn sampling(step) { #{ n: if smoke() { 2 } else { 8 } } }
        /// ```
    "#,
        move || h.opts.smoke
    }
    let h = host_.clone();
    func! { engine, "args", r#"
        /// args() -> map
        ///
        /// The `--set key=value` pairs (the constant ARGS), callable inside functions.
        ///
        /// # Example
        ///
        /// ```rhai
        /// fn lr(step) { args().lr ?? 1e-6 }
        /// ```
    "#,
        move || h.args_map()
    }
    let h = host_.clone();
    func! { engine, "run_dir", r#"
        /// run_dir() -> string or ()
        ///
        /// The session's run folder, when known (created with the run marker when new: files a script
        /// writes there are the run's, and a non-empty folder that is not a stapo run is refused).
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(run_dir());
        /// ```
    "#,
        move || -> RhaiResult<Dynamic> {
            let d = h.claimed_run_dir().map_err(host)?;
            Ok(d.map_or(Dynamic::UNIT, |d| Dynamic::from(d.display().to_string())))
        }
    }
}
