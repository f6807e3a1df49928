//! Running one script file: compile (errors with file:line:col), install its
//! hooks, optionally watch it, evaluate it with `SMOKE`/`ARGS` in scope, and
//! report what its `train` calls did in plain Rust types (so the CLI needs
//! no Rhai).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rhai::Map;

use super::convert::num;
use super::error::{from_eval, from_parse};
use super::hooks::HookSet;
use super::shared_state::{Host, KeptRun};
use super::{build_engine, new_scope, resolver, watch};
use crate::{Error, Result};

/// What one `train` call of a script did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainSummary {
    /// The run folder.
    pub run_dir: String,
    /// Steps run.
    pub steps: u64,
    /// Mean reward of the last step.
    pub reward: Option<f64>,
    /// Held-out avg@n of the last evaluation.
    pub accuracy: Option<f64>,
    /// True when `should_stop` ended the run.
    pub stopped_early: bool,
    /// The checkpoint written at the end (empty when none was: no step completed).
    pub checkpoint: String,
    /// True when the `train` call ended with an error (a signal, a failed hook, ...).
    pub failed: bool,
}

/// What running a script did.
#[derive(Debug)]
pub struct RunOutcome {
    /// The script's path.
    pub script: PathBuf,
    /// `None` when the script ran to the end.
    pub error: Option<Error>,
    /// One summary per `train` call.
    pub trains: Vec<TrainSummary>,
    /// Wall-clock seconds of the run.
    pub seconds: f64,
    /// Runs the script held itself (`trainer(cfg)`), checkpointed as a signal or a time
    /// limit ended it.
    pub kept: Vec<KeptRun>,
}

impl RunOutcome {
    /// True when the script ran to the end.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

fn summary(m: &Map) -> TrainSummary {
    let fin = m.get("final").filter(|f| f.is_map()).map(|f| f.clone().cast::<Map>()).unwrap_or_default();
    TrainSummary {
        run_dir: m.get("run_dir").map(|d| d.to_string()).unwrap_or_default(),
        steps: m.get("steps").and_then(|s| s.as_int().ok()).unwrap_or(0).max(0) as u64,
        reward: fin.get("reward_mean").and_then(num),
        accuracy: fin.get("accuracy").and_then(num),
        stopped_early: m.get("stopped_early").and_then(|s| s.as_bool().ok()).unwrap_or(false),
        checkpoint: m.get("checkpoint").map(|c| c.to_string()).unwrap_or_default(),
        failed: m.get("failed").and_then(|s| s.as_bool().ok()).unwrap_or(false),
    }
}

/// Runs the script at `path` in the session `host` (whose options say smoke,
/// watch, resume, run folder). The script is recorded as the session's
/// script, so `train` copies it into its run folder and hot reload reads it.
pub fn run_file(host: &Arc<Host>, path: &Path) -> RunOutcome {
    let started = Instant::now();
    let error = run_inner(host, path).err();
    RunOutcome {
        script: path.to_path_buf(),
        error,
        trains: host.results().iter().map(summary).collect(),
        seconds: started.elapsed().as_secs_f64(),
        kept: host.kept_runs(),
    }
}

fn run_inner(host: &Arc<Host>, path: &Path) -> Result<()> {
    let label = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    host.set_script(Some(path.to_path_buf()));
    let engine = build_engine(host);
    let mut ast = engine.compile(&text).map_err(|e| from_parse(&label, e))?;
    ast.set_source(label.as_str());
    let hooks = HookSet::compile(&engine, &label, &text)?;
    for w in hooks.lint() {
        host.notice(&format!("warning: {w}"));
    }
    host.set_hooks(hooks);
    let _watcher = if host.opts.watch {
        let mut dirs: Vec<PathBuf> =
            vec![path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))];
        dirs.extend(host.opts.stdlib_dirs.iter().cloned());
        Some(watch::start(host.clone(), &dirs)?)
    } else {
        None
    };
    let mut scope = new_scope(host);
    let limit = host.opts.time_limits.script;
    if let Some(l) = limit {
        host.start_script_deadline(
            limit,
            format!("the script {label} ran past its time limit of {} s", l.as_secs_f64()),
        );
    }
    let r = engine.run_ast_with_scope(&mut scope, &ast).map_err(|e| from_eval(&label, e));
    host.start_script_deadline(None, String::new());
    r
}

/// The stdlib folders for a script (re-exported for the CLI); `env_dir` is
/// `$STAPO_STDLIB`, read by the caller.
pub fn stdlib_dirs(env_dir: Option<&Path>, script: Option<&Path>) -> Vec<PathBuf> {
    resolver::stdlib_dirs(env_dir, script)
}
