//! `stapo run`: run Rhai scripts (placeholder until the script engine lands).

use std::path::PathBuf;

use clap::Args;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Scripts to run, each into its own run folder.
    pub scripts: Vec<PathBuf>,
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    anyhow::bail!("run: the script engine is not wired yet ({} scripts given)", a.scripts.len())
}
