//! `stapo repl`: the interactive shell. On a terminal it uses rustyline
//! (history in ~/.stapo_history, tab completion, Ctrl-C cancels a running
//! step); with piped input it reads lines from stdin and writes answers to
//! stdout, so it can be scripted.

use std::io::IsTerminal;

use clap::Args;
use stapo::repl;
use stapo::script::{self, HostOptions};

#[derive(Args, Debug)]
pub struct ReplArgs {
    /// Smoke mode: SMOKE = true and every train() / run.step() is tiny.
    #[arg(long)]
    pub smoke: bool,
    /// KEY=VALUE pairs visible as ARGS.KEY (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Where train() and trainer() write runs (default runs/repl-<time>/).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Wall-clock limit of one hook call during train(), in seconds (0: none).
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub hook_timeout: f64,
}

pub fn run(a: ReplArgs) -> anyhow::Result<()> {
    let mut args = std::collections::BTreeMap::new();
    for p in &a.set {
        let (k, v) = p.split_once('=').ok_or_else(|| anyhow::anyhow!("--set {p:?}: expected KEY=VALUE"))?;
        args.insert(k.trim().to_string(), v.trim().to_string());
    }
    let opts = HostOptions {
        smoke: a.smoke || std::env::var("STAPO_SMOKE").is_ok_and(|v| !v.is_empty() && v != "0"),
        args,
        run_dir: a.out,
        resume: false,
        apply_changes: false,
        repair_metrics: false,
        progress: std::io::stderr().is_terminal(),
        watch: false,
        stdlib_dirs: script::runner::stdlib_dirs(
            std::env::var_os("STAPO_STDLIB").map(std::path::PathBuf::from).as_deref(),
            None,
        ),
        time_limits: script::TimeLimits {
            hook: script::TimeLimits::seconds(a.hook_timeout)
                .map_err(|e| anyhow::anyhow!("--hook-timeout: {e}"))?,
            script: None,
        },
    };
    if std::io::stdin().is_terminal() {
        let cancel = stapo::guard::signal::install();
        repl::run_interactive(opts, cancel)?;
    } else {
        repl::run_repl(std::io::stdin().lock(), std::io::stdout().lock(), opts)?;
    }
    Ok(())
}
