//! Bindings for run folders and the session: read a run's logs, plot runs
//! and seed groups, format numbers, and what the session knows (`smoke()`,
//! `args()`, `run_dir()`).

use rhai::plugin::{export_module, exported_module};
use rhai::{Array, Engine, Map};

use crate::script::convert::{from_json, get_str};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::train;

/// `x` with `d` decimals, in scientific notation when 0 < |x| < 1e-3.
fn format_number(x: f64, d: usize) -> String {
    if x != 0.0 && x.abs() < 1e-3 {
        format!("{x:.d$e}")
    } else {
        format!("{x:.d$}")
    }
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
    // silenced_tokens.tsv: what the S2T mask silenced over the run, most frequent first.
    let tsv = dir.join("silenced_tokens.tsv");
    let silenced = if tsv.is_file() {
        let rows = train::spurious::read_silenced_tsv(&tsv).map_err(host)?;
        rows.iter()
            .map(|r| serde_json::to_value(r).map(|v| from_json(&v)))
            .collect::<Result<Array, _>>()
            .map_err(|e| host(e.to_string()))?
    } else {
        Array::new()
    };
    m.insert("silenced".into(), silenced.into());
    Ok(m)
}

/// The panels of `plot_seeds(groups, out, panels)`: each a map #{title, key, evals}.
fn panel_specs(panels: &Array) -> RhaiResult<Vec<train::plot::SeedPanelSpec>> {
    let mut specs = Vec::new();
    for (i, p) in panels.iter().enumerate() {
        let what = |msg: &str| bad_arg("plot_seeds", format!("panels[{i}]: {msg}"));
        let m = p.clone().try_cast::<Map>().ok_or_else(|| what("expected a map #{title, key, evals}"))?;
        if let Some(k) = m.keys().find(|k| !["title", "key", "evals"].contains(&k.as_str())) {
            return Err(what(&format!("unknown key `{k}`: expected title, key, evals")));
        }
        // `evals`: absent = metrics.jsonl, true = eval.jsonl, a string = eval-<string>.jsonl.
        let eval = match m.get("evals") {
            None => None,
            Some(v) if v.is_bool() => v.as_bool().ok().filter(|&b| b).map(|_| None),
            Some(v) if v.is_string() => Some(Some(v.to_string())),
            Some(v) => {
                return Err(what(&format!(
                    "evals: expected true or a setting's tag, found {}",
                    v.type_name()
                )))
            }
        };
        let key = match get_str(&m, "key")? {
            Some(k) => k,
            None if eval.is_some() => "overall.avg".to_string(),
            None => return Err(what("missing key (the metric, e.g. \"entropy_p99\")")),
        };
        let title = get_str(&m, "title")?.unwrap_or_else(|| key.clone());
        specs.push(train::plot::SeedPanelSpec {
            title,
            eval,
            key: key.split('.').map(str::to_string).collect(),
        });
    }
    Ok(specs)
}

/// Draws groups of seeds as mean ± spread bands (see `train::plot::seed_panels`; the given
/// `panels` instead, when some). Like [`plot_runs`], the figure goes into one of the runs'
/// folders or their parent.
fn plot_seeds(groups: &Array, out: &str, panels: Option<&Array>) -> RhaiResult<Map> {
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
    let panels = match panels {
        Some(p) => train::plot::seed_panels_with(&gs, &panel_specs(p)?),
        None => train::plot::seed_panels(&gs),
    }
    .map_err(host)?;
    let (png, svg) = train::plot::plot_bands(&panels, &out).map_err(host)?;
    let mut res = Map::new();
    res.insert("png".into(), png.display().to_string().into());
    res.insert("svg".into(), svg.display().to_string().into());
    Ok(res)
}

/// Registers the run-folder and session functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible run-folder and session functions.
#[export_module]
mod fns {
    use rhai::{Array, Dynamic, Map, NativeCallContext};

    use crate::script::bindings::host_of;
    use crate::script::convert::usize_arg;
    use crate::script::error::{host, RhaiResult};

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
    #[rhai_fn(volatile, return_raw)]
    pub fn plot_seeds(groups: Array, out: &str) -> RhaiResult<Map> {
        super::plot_seeds(&groups, out, None)
    }

    /// plot_seeds(groups, out, panels) -> map
    ///
    /// The same figure with the given panels: an array of #{title, key, evals}, where `key` is a
    /// metric of metrics.jsonl ("entropy_p99"; a dotted path reaches inside a value) and `evals`
    /// reads the evaluations instead: true for eval.jsonl, a setting's tag ("t0.7-p0.9") for
    /// eval-<tag>.jsonl; an eval panel's key defaults to "overall.avg".
    ///
    /// # Example
    ///
    /// ```rhai
    /// plot_seeds(groups, parent + "/entropy", [#{title: "entropy", key: "entropy"},
    ///     #{title: "avg@8 at T 0.7", evals: "t0.7-p0.9"}])
    /// ```
    #[rhai_fn(name = "plot_seeds", volatile, return_raw)]
    pub fn plot_seeds_with(groups: Array, out: &str, panels: Array) -> RhaiResult<Map> {
        super::plot_seeds(&groups, out, Some(&panels))
    }

    /// read_run(run_dir) -> map
    ///
    /// A run folder's logs as data: #{metrics: [one map per step, as metrics.jsonl], evals: [one
    /// map per evaluation, as eval.jsonl], evals_at: #{"t0.7-p0.9": [the evaluations at another
    /// setting, as eval-t0.7-p0.9.jsonl], ...}, silenced: [#{token, count, contexts}, as
    /// silenced_tokens.tsv, most frequent first; empty without it]}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let h = read_run(res.run_dir).metrics.map(|m| m.entropy);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn read_run(run_dir: &str) -> RhaiResult<Map> {
        super::read_run(run_dir)
    }

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
    #[rhai_fn(volatile, return_raw)]
    pub fn plot_runs(runs: Array, out: &str) -> RhaiResult<Map> {
        super::plot_runs(&runs, out)
    }

    /// format_number(x, digits) -> string
    ///
    /// `x` with `digits` decimals (at most 12), in scientific notation when 0 < |x| < 1e-3.
    ///
    /// # Example
    ///
    /// ```rhai
    /// format_number(0.0000021, 2)   // "2.10e-6"
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn format_number(x: f64, digits: i64) -> RhaiResult<String> {
        Ok(super::format_number(x, usize_arg("digits", digits)?.min(12)))
    }

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
    #[rhai_fn(volatile, return_raw)]
    pub fn smoke(ctx: NativeCallContext) -> RhaiResult<bool> {
        Ok(host_of(&ctx)?.opts.smoke)
    }

    /// args() -> map
    ///
    /// The `--set key=value` pairs (the constant ARGS), callable inside functions.
    ///
    /// # Example
    ///
    /// ```rhai
    /// fn lr(step) { args().lr ?? 1e-6 }
    /// ```
    #[rhai_fn(name = "args", volatile, return_raw)]
    pub fn set_args(ctx: NativeCallContext) -> RhaiResult<Map> {
        Ok(host_of(&ctx)?.args_map())
    }

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
    #[rhai_fn(volatile, return_raw)]
    pub fn run_dir(ctx: NativeCallContext) -> RhaiResult<Dynamic> {
        let d = host_of(&ctx)?.claimed_run_dir().map_err(host)?;
        Ok(d.map_or(Dynamic::UNIT, |d| Dynamic::from(d.display().to_string())))
    }
}
