//! `stapo repl`: the interactive shell (placeholder until the script engine lands).

use clap::Args;

#[derive(Args, Debug)]
pub struct ReplArgs {}

pub fn run(_a: ReplArgs) -> anyhow::Result<()> {
    anyhow::bail!("repl: the script engine is not wired yet")
}
