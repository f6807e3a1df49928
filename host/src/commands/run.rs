//! `stapo run`: run Rhai experiment scripts, each into its own run folder,
//! then print a summary table. A failing script does not stop the others;
//! the exit status is non-zero if any failed.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::Args;
use stapo::script::{self, Console, Host, HostOptions, RunOutcome};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Scripts to run in turn, each into its own run folder (runs/<stem>-<YYYYmmdd-HHMMSS>/).
    pub scripts: Vec<PathBuf>,
    /// Watch each script and the files it imports; on a change, swap its hook functions at the
    /// next step (model, optimizer and step counter untouched). A broken edit keeps the old hooks.
    #[arg(long)]
    pub watch: bool,
    /// KEY=VALUE, repeatable: ARGS.KEY for the script, and a dotted path of the
    /// configuration tree (actor.optim.lr, rollout.sampling.n, ...) is laid over every
    /// train() config (--help lists the paths).
    #[arg(long = "set", value_name = "KEY=VALUE", long_help = super::run_set_long_help())]
    pub set: Vec<String>,
    /// The run folder (one script only).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in this folder from its latest checkpoint; the script is the given one,
    /// or the copy saved in the folder (script.rhai). The step counter continues. A config that
    /// differs from the run's run_config.json (another script, another --set) is an error
    /// listing the fields, unless --apply-changes. The folder of a script that trains named runs
    /// (`name` in its configs) resumes each of them that holds a run and starts the others.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With --resume: continue under the changed config (the old run_config.json is kept as
    /// run_config-step-NNNNNN.json; the changes are listed on stderr and in reloads.log).
    #[arg(long, requires = "resume")]
    pub apply_changes: bool,
    /// With --resume: a damaged line of the run's metrics.jsonl (a crash cut it, an editor
    /// broke it) cuts the file back to the last whole step before it, and says so; without
    /// it such a line is an error naming metrics.jsonl:LINE.
    #[arg(long, requires = "resume")]
    pub repair_metrics: bool,
    /// Smoke mode (also STAPO_SMOKE=1): scripts see SMOKE = true and every train() is clamped to
    /// 2 tiny steps.
    #[arg(long)]
    pub smoke: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Wall-clock limit of one hook call during train(), in seconds (0: none). A hook past it
    /// stops with an error naming it; after a hot reload the run goes back to the previous hooks.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub hook_timeout: f64,
    /// Wall-clock limit of each whole script, training included, in seconds (0: none, the default).
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    pub script_timeout: f64,
}

fn parse_set(pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|p| {
            let (k, v) =
                p.split_once('=').ok_or_else(|| anyhow::anyhow!("--set {p:?}: expected KEY=VALUE"))?;
            anyhow::ensure!(!k.trim().is_empty(), "--set {p:?}: empty key");
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let mut scripts = a.scripts.clone();
    if let Some(dir) = &a.resume {
        // A run, or the folder of a script's named runs (the script given again): a folder
        // the script claimed (`run_dir()`), or one that holds runs.
        let named_runs = !scripts.is_empty() && (stapo::guard::folder::is_run_folder(dir) || holds_runs(dir));
        anyhow::ensure!(
            dir.join("run_config.json").is_file() || named_runs,
            "--resume {}: not a run folder (no run_config.json){}",
            dir.display(),
            if stapo::guard::folder::is_run_folder(dir) {
                "; to resume the named runs of a script in it, give the script"
            } else {
                ""
            }
        );
        if scripts.is_empty() {
            scripts.push(dir.join("script.rhai"));
        }
        anyhow::ensure!(scripts.len() == 1, "--resume continues one run: give at most one script");
    }
    anyhow::ensure!(
        !scripts.is_empty(),
        "give one or more scripts to run (e.g. stapo run scripts/stapo_basic.rhai)"
    );
    anyhow::ensure!(a.out.is_none() || scripts.len() == 1, "--out names the run folder of a single script");
    let args = parse_set(&a.set)?;
    let smoke = a.smoke || std::env::var("STAPO_SMOKE").is_ok_and(|v| !v.is_empty() && v != "0");
    // Under mpirun every rank runs this; rank 0 names the run folder and alone
    // prints and writes (the trainer sees the same world).
    let world = stapo::dist::world();
    let root = world.rank() == 0;
    anyhow::ensure!(
        !(a.watch && world.size() > 1),
        "--watch with {} MPI ranks: each rank would reload at a different step; run without --watch",
        world.size()
    );
    let time_limits = script::TimeLimits {
        hook: script::TimeLimits::seconds(a.hook_timeout)
            .map_err(|e| anyhow::anyhow!("--hook-timeout: {e}"))?,
        script: script::TimeLimits::seconds(a.script_timeout)
            .map_err(|e| anyhow::anyhow!("--script-timeout: {e}"))?,
    };
    // Read once here and passed down, so the library never looks at the environment.
    let env_stdlib = std::env::var_os("STAPO_STDLIB").map(PathBuf::from);
    for path in &scripts {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        script::train_loop::check_set_keys(&args, &text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    let cancel = stapo::guard::signal::install_preemption();
    let mut outcomes = Vec::new();
    // The last script started and its run folder, for the message after a signal.
    let mut last_folder: Option<(PathBuf, PathBuf)> = None;
    for path in &scripts {
        let run_dir = a.resume.clone().or_else(|| a.out.clone()).or_else(|| {
            Some(script::shared_state::default_run_dir(Some(path), std::path::Path::new("runs")))
        });
        let run_dir = stapo::dist::broadcast_json(&*world, 0, &run_dir)?;
        last_folder = run_dir.clone().map(|d| (d, path.clone()));
        let opts = HostOptions {
            smoke,
            args: args.clone(),
            run_dir,
            resume: a.resume.is_some(),
            apply_changes: a.apply_changes,
            repair_metrics: a.repair_metrics,
            progress: root && !a.quiet && std::io::stderr().is_terminal(),
            watch: a.watch,
            stdlib_dirs: script::runner::stdlib_dirs(env_stdlib.as_deref(), Some(path)),
            time_limits,
        };
        stapo::guard::signal::clear();
        let console = if root { Console::Stdout } else { Console::Buffer(Default::default()) };
        let host = Host::with_cancel(opts, console, cancel);
        if root {
            eprintln!("== {}", path.display());
        }
        let out = script::run_file(&host, path);
        if let Some(e) = &out.error {
            eprintln!("error in {}: {e}", path.display());
        }
        outcomes.push(out);
        if stapo::guard::signal::received().is_some() {
            break; // the scripts after it do not start
        }
    }
    if root {
        print_summary(&outcomes);
    }
    if let Some(sig) = stapo::guard::signal::received() {
        if root {
            let folder = last_folder.as_ref().map(|(d, p)| (d.as_path(), p.as_path()));
            eprintln!("{}", stopped_by_signal(sig, outcomes.last(), folder, &set_flags(&a.set)));
        }
        stapo::dist::finalize();
        std::process::exit(128 + sig);
    }
    let failed = outcomes.iter().filter(|o| !o.ok()).count();
    anyhow::ensure!(failed == 0, "{failed} of {} scripts failed", outcomes.len());
    Ok(())
}

/// What a run stopped by signal `sig` left behind and how to continue it. `folder`: the
/// last script's run folder and the script, for a script that steps its runs itself
/// (`trainer(cfg)`): those runs were checkpointed as the script let go of them
/// (`RunOutcome::kept`), each at its last completed step, in named sub-folders.
/// `sets`: the command's `--set` values ([`set_flags`]), repeated after the command.
fn stopped_by_signal(
    sig: i32,
    last: Option<&RunOutcome>,
    folder: Option<(&Path, &Path)>,
    sets: &str,
) -> String {
    let name = stapo::guard::signal::name(sig);
    let Some(t) = last.and_then(|o| o.trains.last()) else {
        let kept = last.map(|o| o.kept.as_slice()).unwrap_or_default();
        let resumable = kept.iter().any(|k| matches!(k.checkpoint, Ok(Some(_))));
        if let Some((dir, script)) = folder.filter(|(d, _)| resumable || holds_named_checkpoints(d)) {
            let mut msg = format!("stopped by {name}:");
            for k in kept {
                let at = match &k.checkpoint {
                    Ok(Some(c)) => format!("checkpoint {c}"),
                    Ok(None) => "no step completed, so there is no checkpoint".to_string(),
                    Err(e) => format!("not saved ({e})"),
                };
                msg += &format!("\n  {} after step {}: {at}", k.run_dir.display(), k.steps);
            }
            if kept.is_empty() {
                msg += &format!(" the runs in {} keep their last checkpoints.", dir.display());
            }
            return format!(
                "{msg}\nContinue with: stapo run --resume {} {}{sets}",
                dir.display(),
                script.display()
            );
        }
        return format!("stopped by {name} before training started; nothing to resume");
    };
    let at = if t.checkpoint.is_empty() {
        "no step completed, so there is no checkpoint".to_string()
    } else {
        format!("checkpoint {}", t.checkpoint)
    };
    format!(
        "stopped by {name} after step {}: {at}. Continue with: stapo run --resume {}{sets}",
        t.steps, t.run_dir
    )
}

/// The `--set` values of this command, to repeat after a "Continue with" command (a
/// script reads them again when it resumes): ` --set k=v` each, in the order given.
fn set_flags(set: &[String]) -> String {
    set.iter().map(|kv| format!(" --set {kv}")).collect()
}

/// Whether a sub-folder of `dir` is a run (has its `run_config.json`).
fn holds_runs(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|es| es.flatten().any(|e| e.path().join("run_config.json").is_file()))
        .unwrap_or(false)
}

/// Whether a sub-folder of `dir` holds a run with a checkpoint.
fn holds_named_checkpoints(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|es| es.flatten().any(|e| e.path().join("checkpoints").join("latest").is_file()))
        .unwrap_or(false)
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.3}"))
}

/// script, status, steps, final reward/accuracy, wall time, run folder.
fn print_summary(outcomes: &[RunOutcome]) {
    let w = outcomes.iter().map(|o| o.script.display().to_string().chars().count()).max().unwrap_or(6).max(6);
    println!(
        "\n{:<w$} {:<7} {:>6} {:>8} {:>8} {:>9}  run folder",
        "script", "status", "steps", "reward", "acc", "time"
    );
    for o in outcomes {
        let name = o.script.display().to_string();
        let status = match stapo::guard::signal::received() {
            Some(_) if !o.ok() => "STOPPED",
            _ if o.ok() => "ok",
            _ => "FAILED",
        };
        let last = o.trains.last();
        println!(
            "{:<w$} {:<7} {:>6} {:>8} {:>8} {:>8.1}s  {}",
            name,
            status,
            o.trains.iter().map(|t| t.steps).sum::<u64>(),
            fmt_opt(last.and_then(|t| t.reward)),
            fmt_opt(last.and_then(|t| t.accuracy)),
            o.seconds,
            if o.trains.is_empty() {
                "-".to_string()
            } else {
                o.trains.iter().map(|t| t.run_dir.clone()).collect::<Vec<_>>().join(", ")
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script that stepped named runs itself leaves no train() outcome: the message
    /// points at its folder and script once a named run has a checkpoint, and says there is
    /// nothing to resume before that.
    #[test]
    fn a_signal_names_the_folder_of_named_runs_to_resume() {
        let dir = tempfile::tempdir().unwrap();
        let script = Path::new("scripts/long_stress.rhai");
        let folder = Some((dir.path(), script));
        let msg = stopped_by_signal(15, None, folder, "");
        assert!(msg.contains("nothing to resume"), "{msg}");
        std::fs::create_dir_all(dir.path().join("stapo-s0/checkpoints")).unwrap();
        std::fs::write(dir.path().join("stapo-s0/checkpoints/latest"), "step-000010").unwrap();
        let msg = stopped_by_signal(15, None, folder, " --set seeds=1");
        let want =
            format!("stapo run --resume {} scripts/long_stress.rhai --set seeds=1", dir.path().display());
        assert!(msg.contains("stopped by SIGTERM") && msg.contains(&want), "{msg}");
        let sets = ["seed0=1".to_string(), "methods=justrl,stapo".to_string()];
        assert_eq!(set_flags(&sets), " --set seed0=1 --set methods=justrl,stapo");
        assert_eq!(set_flags(&[]), "");
    }
}
