//! `stapo eval`: avg@n and pass@n of a model over benchmark files, as a table.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use stapo::data::{Dataset, DatasetOptions, PromptTemplate, Tokenizer};
use stapo::eval;
use stapo::model;
use stapo::reward::ExtractMode;
use stapo::rollout::SamplingParams;

use super::{model_dir, DeviceArgs};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// One or more JSONL files (e.g. data/benchmarks/aime24.jsonl ...).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Samples per problem (avg@n, pass@n).
    #[arg(long, default_value_t = 4)]
    pub n: usize,
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f64,
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f64,
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Only the first N problems of each file.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Prompt template: raw (problem + boxed suffix), bare (problem only, as models/tiny-qwen3 expects), chat (Qwen3 chat, thinking off) or chat-think.
    #[arg(long, default_value = "raw")]
    pub template: String,
    /// Answer extraction: strict or flexible.
    #[arg(long, default_value = "strict")]
    pub mode: ExtractMode,
    /// Prompts decoded together.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write every graded sample (JSONL); default: eval-samples.jsonl.
    #[arg(long, default_value = "eval-samples.jsonl")]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn template(name: &str) -> anyhow::Result<PromptTemplate> {
    PromptTemplate::from_name(name)?
        .ok_or_else(|| anyhow::anyhow!("--template: expected raw, bare, chat or chat-think"))
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let dir = model_dir(&a.model)?;
    let (device, dtype) = a.device.resolve()?;
    let m = model::load(dir, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let tpl = template(&a.template)?;
    let params = SamplingParams {
        n: a.n,
        temperature: a.temperature,
        top_p: a.top_p,
        max_new_tokens: a.max_tokens,
        stop_token_ids: tok.eos_ids().to_vec(),
        seed: a.seed,
        ..SamplingParams::default()
    };
    let mut rows = Vec::new();
    let mut all_samples = Vec::new();
    for path in &a.data {
        let (ds, warnings) = Dataset::load(path, &DatasetOptions::default())?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        let n = a.limit.unwrap_or(ds.len()).min(ds.len());
        let examples = &ds.examples()[..n];
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let bar = ProgressBar::new(n as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>14} [{bar:30}] {pos}/{len} problems  {elapsed} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_prefix(name.clone());
        let report = eval::evaluate(&m, &tok, examples, &tpl, &params, a.mode, a.batch, &|done| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        rows.push((name, report.overall.clone()));
        all_samples.extend(report.samples);
    }
    eval::write_samples(&a.out, &all_samples)?;
    println!(
        "{:<16} {:>8} {:>10} {:>10} {:>9}",
        "benchmark",
        "problems",
        format!("avg@{}", a.n),
        format!("pass@{}", a.n),
        "mean len"
    );
    for (name, s) in &rows {
        println!(
            "{:<16} {:>8} {:>9.1}% {:>9.1}% {:>9.1}",
            name,
            s.problems,
            100.0 * s.avg,
            100.0 * s.pass,
            s.mean_len
        );
    }
    if rows.len() > 1 {
        let k = rows.len() as f64;
        let avg = rows.iter().map(|r| r.1.avg).sum::<f64>() / k;
        let pass = rows.iter().map(|r| r.1.pass).sum::<f64>() / k;
        println!("{:<16} {:>8} {:>9.1}% {:>9.1}%", "average", "", 100.0 * avg, 100.0 * pass);
    }
    eprintln!("samples written to {}", a.out.display());
    Ok(())
}
