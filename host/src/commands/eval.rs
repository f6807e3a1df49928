//! `stapo eval`: avg@n and pass@k (k = n, or the `--pass-k` list) of a model
//! over benchmark files, as a table.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use stapo::data::{Dataset, Example, PromptTemplate, Tokenizer};
use stapo::eval;
use stapo::model;
use stapo::reward::ExtractMode;
use stapo::rollout::{EngineConfig, Generator, KvCacheDtype, SamplingParams};

use super::{model_dir, DeviceArgs};

#[derive(Args, Debug)]
#[command(
    mut_arg("temperature", |a| a.default_value("0.7")),
    mut_arg("top_p", |a| a.default_value("0.9"))
)]
pub struct EvalArgs {
    /// Model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// One or more datasets: JSONL or Parquet files, folders of Hugging Face shards, `*` patterns
    /// (e.g. data/benchmarks/aime24.jsonl ...).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    #[command(flatten)]
    pub data_args: super::data_args::DataArgs,
    /// Samples per problem (avg@n, pass@n).
    #[arg(long, default_value_t = 4)]
    pub n: usize,
    /// Report unbiased pass@k for these k (each at most n), e.g. `--pass-k 1,4,16`; default: n.
    #[arg(long = "pass-k", value_delimiter = ',')]
    pub pass_k: Vec<usize>,
    /// Temperature and filters (default T 0.7, top-p 0.9: the paper's evaluation setting).
    #[command(flatten)]
    pub sampling: super::sampling_args::SamplingArgs,
    /// Response budget in tokens. Default: 1024, clamped (with a note) to what fits the
    /// model's max_position_embeddings after the longest prompt of each file; a value given
    /// here is used as given.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Only the first N problems of each file.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long, default_value = "model", value_parser = super::model::parse_template,
          help = super::model::TEMPLATE_SHORT_HELP, long_help = stapo::data::templates_help())]
    pub template: PromptTemplate,
    /// Answer extraction: strict (last \boxed{}), flexible, or answer_line (DAPO-Math's last "Answer:" line).
    #[arg(long, default_value = "strict")]
    pub mode: ExtractMode,
    /// The rollout engine's KV cache budget in GB (default: a quarter of the available memory
    /// on the CPU; see `rollout.engine.kv_cache_gb`).
    #[arg(long)]
    pub kv_cache_gb: Option<f64>,
    /// Sequences decoded at once (default: the device's, see `rollout.engine.max_rows`).
    #[arg(long)]
    pub max_rows: Option<usize>,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// The KV cache's element type: auto (the model's) or bfloat16 (see
    /// `rollout.engine.kv_cache_dtype`).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write every graded sample (JSONL); default: eval-samples.jsonl.
    #[arg(long, default_value = "eval-samples.jsonl")]
    pub out: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    let dir = model_dir(&a.model)?;
    let (device, dtype) = a.device.resolve()?;
    let m = model::load(dir, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    super::print_notes();
    let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let gen = Generator::new(&m, &tok, &a.template)?;
    if let Some(note) = gen.note() {
        eprintln!("{note}");
    }
    let ks = pass_k_list(&a.pass_k, a.n)?;
    let params = a.sampling.apply(SamplingParams {
        n: a.n,
        max_new_tokens: a.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        seed: a.seed,
        ..SamplingParams::default()
    });
    let engine = EngineConfig {
        kv_cache_gb: a.kv_cache_gb,
        max_rows: a.max_rows,
        block_size: a.block_size,
        kv_cache_dtype: KvCacheDtype::parse(&a.kv_cache_dtype, "--kv-cache-dtype")?,
        ..EngineConfig::default()
    };
    engine.validate()?;
    let mut rows = Vec::new();
    let mut all_samples = Vec::new();
    for path in &a.data {
        let (ds, warnings) = Dataset::load(path, &a.data_args.options())?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        let n = a.limit.unwrap_or(ds.len()).min(ds.len());
        let examples = &ds.examples()[..n];
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let mut params = params.clone();
        if a.max_tokens.is_none() {
            params.max_new_tokens = default_max_tokens(&gen, examples, path)?;
        }
        // Responses end in any order, so the bar counts tokens, up to every response's maximum.
        let bar = ProgressBar::new((n * a.n * params.max_new_tokens) as u64);
        let problems = n;
        bar.set_style(
            ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos} tokens (at most {len})  {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{name} ({problems} problems)"));
        let report = eval::evaluate(&gen, examples, &params, a.mode, &engine, &|tokens| {
            bar.set_position(tokens as u64)
        })?
        .with_pass_k(&ks)?;
        bar.finish_and_clear();
        rows.push((name, report.overall.clone()));
        all_samples.extend(report.samples);
    }
    eval::write_samples(&a.out, &all_samples)?;
    print!("{}", table(&rows, a.n, &ks));
    eprintln!("samples written to {}", a.out.display());
    Ok(())
}

/// `--max-tokens` when not given.
const DEFAULT_MAX_TOKENS: usize = 1024;

/// The default response budget for `examples` of `path`: [`DEFAULT_MAX_TOKENS`], or less
/// (with a note) when the model's positions leave less after the longest prompt.
fn default_max_tokens(
    gen: &Generator,
    examples: &[Example],
    path: &std::path::Path,
) -> anyhow::Result<usize> {
    let positions = gen.model().config().max_position_embeddings;
    let prompts: Vec<_> = examples.iter().map(|e| e.prompt()).collect();
    let (ids, _) = gen.encode(&prompts)?;
    let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
    let fits = positions.saturating_sub(longest);
    anyhow::ensure!(
        fits > 0,
        "{}: a prompt of {longest} tokens leaves no room in the model's {positions} positions",
        path.display()
    );
    if fits < DEFAULT_MAX_TOKENS {
        eprintln!(
            "note: --max-tokens is {fits} for {}: the default {DEFAULT_MAX_TOKENS} does not fit the model's \
             {positions} positions after its longest prompt ({longest} tokens)",
            path.display()
        );
    }
    Ok(fits.min(DEFAULT_MAX_TOKENS))
}

/// The k to report: `--pass-k` sorted and deduplicated, or n alone; each in 1..=n.
fn pass_k_list(asked: &[usize], n: usize) -> anyhow::Result<Vec<usize>> {
    let mut ks = if asked.is_empty() { vec![n] } else { asked.to_vec() };
    ks.sort_unstable();
    ks.dedup();
    eval::check_pass_k(&ks, n).context("--pass-k")?;
    Ok(ks)
}

/// The results table: one row per benchmark (and their average when there are
/// several), columns avg@n, pass@k for each k, mean length.
fn table(rows: &[(String, eval::Scores)], n: usize, ks: &[usize]) -> String {
    use std::fmt::Write;
    let mut out = format!("{:<16} {:>8} {:>10}", "benchmark", "problems", format!("avg@{n}"));
    for k in ks {
        let _ = write!(out, " {:>10}", format!("pass@{k}"));
    }
    out.push_str(&format!(" {:>9}\n", "mean len"));
    let pass = |s: &eval::Scores, k: usize| s.pass_at_k.get(&k).copied().unwrap_or(f64::NAN);
    for (name, s) in rows {
        let _ = write!(out, "{:<16} {:>8} {:>9.1}%", name, s.problems, 100.0 * s.avg);
        for &k in ks {
            let _ = write!(out, " {:>9.1}%", 100.0 * pass(s, k));
        }
        let _ = writeln!(out, " {:>9.1}", s.mean_len);
    }
    if rows.len() > 1 {
        let mean =
            |f: &dyn Fn(&eval::Scores) -> f64| rows.iter().map(|r| f(&r.1)).sum::<f64>() / rows.len() as f64;
        let _ = write!(out, "{:<16} {:>8} {:>9.1}%", "average", "", 100.0 * mean(&|s| s.avg));
        for &k in ks {
            let _ = write!(out, " {:>9.1}%", 100.0 * mean(&|s| pass(s, k)));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_k_list_defaults_to_n_and_checks_range() {
        assert_eq!(pass_k_list(&[], 32).ok(), Some(vec![32]));
        assert_eq!(pass_k_list(&[16, 1, 4, 4], 32).ok(), Some(vec![1, 4, 16]));
        let err = pass_k_list(&[1, 64], 32).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains("--pass-k") && err.contains("k = 64"), "{err}");
        assert!(pass_k_list(&[0], 4).is_err());
    }

    #[test]
    fn table_has_a_column_per_k_and_an_average_row() {
        let s = |avg: f64, p1: f64, p4: f64| eval::Scores {
            problems: 2,
            samples_per_problem: 4,
            avg,
            pass: p4,
            mean_len: 10.0,
            pass_at_k: [(1, p1), (4, p4)].into_iter().collect(),
        };
        let rows = vec![("aime24".to_string(), s(0.25, 0.25, 0.5)), ("amc23".to_string(), s(0.5, 0.5, 1.0))];
        let t = table(&rows, 4, &[1, 4]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].contains("avg@4") && lines[0].contains("pass@1") && lines[0].contains("pass@4"));
        assert!(lines[1].starts_with("aime24") && lines[1].contains("25.0%") && lines[1].contains("50.0%"));
        assert!(lines[3].starts_with("average") && lines[3].contains("37.5%") && lines[3].contains("75.0%"));
    }
}
