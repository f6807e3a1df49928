//! Command-line definitions (clap) and the code behind each subcommand.

pub mod bench;
pub mod bench_async;
pub mod bench_common;
pub mod bench_gemm;
pub mod bench_lengths;
pub mod bench_partial;
pub mod bench_rollout;
pub mod bench_shard;
pub mod data_args;
pub mod eval;
pub mod lora;
pub mod model;
pub mod parity;
pub mod repl;
pub mod run;
pub mod sampling_args;
pub mod update;
pub mod verify;

use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand};

/// RL fine-tuning of Qwen3 models with STAPO and the GRPO family, driven by Rhai scripts.
#[derive(Parser, Debug)]
#[command(name = "stapo", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Load model folders that hold tensors the model does not use, with a warning
    /// listing them (by default they are an error: the config does not match the weights).
    #[arg(long, global = true)]
    pub allow_unused: bool,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one or more Rhai experiment scripts (training runs), each into its own run folder.
    Run(run::RunArgs),
    /// Interactive Rhai shell with the stapo bindings.
    Repl(repl::ReplArgs),
    /// Write a randomly initialised model folder of any shape.
    Init(model::InitArgs),
    /// Sample a continuation of a prompt.
    Generate(model::GenerateArgs),
    /// Per-token log-probabilities and entropies of a text under a model.
    Score(model::ScoreArgs),
    /// Evaluate avg@n / pass@n over benchmark files.
    Eval(eval::EvalArgs),
    /// One offline RL update from saved rollouts.
    Update(update::UpdateArgs),
    /// Check answers against references with the math-equivalence checker.
    Verify(verify::VerifyArgs),
    /// Time model pieces (forward, generation, update, optimizer) for a given shape.
    Bench(bench::BenchArgs),
    /// Compare a small model on a device/dtype against the CPU in f32: log-probs, one update, sampling.
    Parity(parity::ParityArgs),
    /// Merge a LoRA adapter folder (peft's format) into its base: a full Hugging Face model.
    Merge(lora::MergeArgs),
}

/// Where and in which precision a model runs.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Compute device: `cpu`, or `cuda` / `cuda:N` (needs the `cuda` feature).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight dtype in memory: float32, bfloat16 or float16.
    #[arg(long, default_value = "float32")]
    pub dtype: String,
}

impl DeviceArgs {
    /// The candle device and dtype these flags name.
    pub fn resolve(&self) -> anyhow::Result<(Device, DType)> {
        let device = parse_device(&self.device)?;
        let dtype = stapo::model::parse_dtype(&self.dtype).context("--dtype")?;
        Ok((device, dtype))
    }
}

/// Parses `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(name: &str) -> anyhow::Result<Device> {
    stapo::model::parse_device(name).context("--device")
}

/// Prints the warnings the library queued (a model loaded with `--allow-unused`).
pub fn print_notes() {
    for n in stapo::guard::take_notes() {
        eprintln!("warning: {n}");
    }
}

/// A model folder argument with a readable error when it is missing.
pub fn model_dir(p: &PathBuf) -> anyhow::Result<&PathBuf> {
    // What a killed `update --out` / `init` left beside the folder is cleaned up first.
    for n in stapo::guard::folder::recover_folder_leftovers(p)? {
        eprintln!("note: {n}");
    }
    anyhow::ensure!(p.is_dir(), "--model {}: not a folder", p.display());
    Ok(p)
}

/// `--objective`'s one-line help: the preset names, from the one registry.
pub fn presets_short_help() -> String {
    format!("Objective preset: {}", stapo::algo::preset_names().join(", "))
}

/// `--objective`'s `--help` text: every preset with its summary.
pub fn presets_long_help() -> String {
    format!("Objective preset, one of:\n{}", stapo::algo::presets_help())
}

/// `--set`'s one-line help.
pub const SET_SHORT_HELP: &str =
    "Overrides PATH=VALUE, e.g. --set actor.objective.mask.tau_p=0.01 (--help lists the paths)";

/// `--set`'s `--help` text: the paths of the update options (the actor section of a run's
/// configuration, docs/scripting.md), read from the options' default tree.
pub fn set_long_help() -> String {
    let tree = serde_json::to_value(stapo::train::UpdateOptions::default()).unwrap_or_default();
    format!(
        "Overrides PATH=VALUE (repeatable), dotted paths of the update options (VALUE is JSON when \
         it parses, else a string), e.g. --set actor.objective.mask.tau_p=0.01. A section with a \
         `kind` (actor.objective.loss, actor.objective.mask) takes that kind's fields; a new kind \
         takes its defaults. Paths:\n{}",
        indent(&stapo::overlay::paths_help(&stapo::overlay::leaves(&tree)))
    )
}

/// `stapo run --set`'s `--help` text: the paths of the run configuration, read from its
/// default tree.
pub fn run_set_long_help() -> String {
    format!(
        "KEY=VALUE, repeatable. Scripts see it as ARGS.KEY (int, float, bool or string). A KEY \
         that is a dotted path of the configuration tree (VALUE read as JSON when it parses) is \
         also laid over every train() config. Any other KEY must be one the script reads as \
         ARGS.KEY: an unknown one is an error naming the nearest. Paths:\n{}",
        indent(&stapo::overlay::paths_help(&stapo::train::RunConfig::leaves()))
    )
}

/// Each line of `text` indented by two spaces.
fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
}

/// The model options the environment names, the only place that reads
/// `STAPO_NO_FUSED` (`1`: composed candle ops instead of the fused CPU
/// kernels; unset, empty or `0`: fused) and `STAPO_RECOMPUTE` (`auto`, `on`,
/// `off`); `main` makes them the process default before any command runs.
pub fn model_options_from_env() -> anyhow::Result<stapo::model::ModelOptions> {
    model_options_from(|k| std::env::var(k).ok())
}

/// [`model_options_from_env`] over any lookup of variables (for tests).
pub fn model_options_from(
    var: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<stapo::model::ModelOptions> {
    use stapo::model::{Kernels, ModelOptions, Recompute};
    let kernels = match var("STAPO_NO_FUSED").as_deref() {
        None | Some("" | "0") => Kernels::Fused,
        Some("1") => Kernels::Composed,
        Some(v) => anyhow::bail!("STAPO_NO_FUSED: expected 1 (composed ops) or 0 (fused kernels), got {v:?}"),
    };
    let recompute = match var("STAPO_RECOMPUTE") {
        Some(s) => Recompute::parse(&s, "STAPO_RECOMPUTE")?,
        None => Recompute::default(),
    };
    Ok(ModelOptions { kernels, recompute })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stapo::model::{Kernels, ModelOptions, Recompute};

    fn from(vars: &[(&str, &str)]) -> anyhow::Result<ModelOptions> {
        model_options_from(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn model_options_come_from_the_two_variables() {
        assert_eq!(from(&[]).unwrap(), ModelOptions::default());
        let o = from(&[("STAPO_NO_FUSED", "1"), ("STAPO_RECOMPUTE", "off")]).unwrap();
        assert_eq!(o, ModelOptions { kernels: Kernels::Composed, recompute: Recompute::Off });
        assert_eq!(from(&[("STAPO_NO_FUSED", "0")]).unwrap().kernels, Kernels::Fused);
        let e = from(&[("STAPO_NO_FUSED", "yes")]).unwrap_err().to_string();
        assert!(e.contains("STAPO_NO_FUSED") && e.contains("\"yes\""), "{e}");
        let e = format!("{:#}", from(&[("STAPO_RECOMPUTE", "sometimes")]).unwrap_err());
        assert!(e.contains("STAPO_RECOMPUTE") && e.contains("\"sometimes\""), "{e}");
    }
}
