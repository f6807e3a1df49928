//! `stapo init`, `stapo generate` and `stapo score`.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use clap::Args;
use stapo::data::{Prompt, PromptTemplate, Tokenizer};
use stapo::model::{self, Config, Grad, TokenBatch};
use stapo::rollout::{GenerateOptions, Generator, SamplingParams};

use super::{model_dir, DeviceArgs};

#[derive(Args, Debug)]
pub struct InitArgs {
    /// A Hugging Face config.json giving the shape.
    #[arg(long)]
    pub config: PathBuf,
    /// tokenizer.json to copy into the folder (tokenizer_config.json next to it is copied too).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output model folder (a new or empty one unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out even if it already exists and holds files (it is replaced as a whole).
    #[arg(long)]
    pub force: bool,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Standard deviation of the normal init (HF's initializer_range).
    #[arg(long, default_value_t = 0.02)]
    pub init_std: f64,
}

pub fn init(a: InitArgs) -> anyhow::Result<()> {
    stapo::guard::check_output_folder(&a.out, &[], a.force)?;
    let cfg = Config::from_file(&a.config)?;
    let save_dtype = model::parse_dtype(&cfg.torch_dtype)?;
    let m = model::init(&cfg, a.seed, a.init_std, DType::F32, &Device::Cpu)?;
    let tok_dir = match &a.tokenizer {
        Some(t) => {
            anyhow::ensure!(t.is_file(), "--tokenizer {}: no such file", t.display());
            Some(t.parent().map(PathBuf::from).unwrap_or_default())
        }
        None => None,
    };
    model::save(&m, &a.out, save_dtype, tok_dir.as_deref())?;
    if let (Some(t), Some(name)) = (&a.tokenizer, a.tokenizer.as_ref().and_then(|t| t.file_name())) {
        if name != "tokenizer.json" {
            std::fs::copy(t, a.out.join("tokenizer.json"))
                .with_context(|| format!("copying {}", t.display()))?;
        }
    }
    println!(
        "wrote {} ({:.2}M parameters, {} layers, hidden {}, vocab {}, {})",
        a.out.display(),
        cfg.num_params() as f64 / 1e6,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.torch_dtype
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model folder (config.json, model.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value = "model", value_parser = parse_template,
          help = TEMPLATE_SHORT_HELP, long_help = stapo::data::templates_help())]
    pub template: PromptTemplate,
    /// Same as `--template chat`.
    #[arg(long, conflicts_with = "template")]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Temperature and filters.
    #[command(flatten)]
    pub sampling: super::sampling_args::SamplingArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let dir = model_dir(&a.model)?;
    let (device, dtype) = a.device.resolve()?;
    let m = model::load(dir, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    super::print_notes();
    let tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;
    let template = if a.chat { PromptTemplate::chat(false) } else { a.template.clone() };
    let gen = Generator::new(&m, &tok, &template)?;
    if let Some(note) = gen.note() {
        eprintln!("{note}");
    }
    let prompts = [Prompt::Text(a.prompt.clone())];
    let (ids, texts) = gen.encode(&prompts)?;
    anyhow::ensure!(ids.iter().all(|p| !p.is_empty()), "the prompt encodes to no tokens");
    // Plain-text prompts are echoed before the continuation; chat markup is not.
    let echo = match gen.prompter().template() {
        PromptTemplate::Chat { .. } => "",
        _ => texts[0].as_str(),
    };
    let params = a.sampling.apply(SamplingParams {
        n: a.n,
        max_new_tokens: a.max_tokens,
        seed: a.seed,
        ..SamplingParams::default()
    });
    let start = std::time::Instant::now();
    let samples = gen.generate(&prompts, &params, &GenerateOptions::default())?.samples;
    let secs = start.elapsed().as_secs_f64();
    let n_tokens: usize = samples.iter().map(|s| s.response_ids.len()).sum();
    for s in &samples {
        if samples.len() > 1 {
            println!("--- sample {} ({:?}, {} tokens)", s.sample_index, s.finish, s.response_ids.len());
        }
        println!("{echo}{}", s.text);
    }
    eprintln!("{n_tokens} tokens in {secs:.2} s ({:.0} tokens/s)", n_tokens as f64 / secs.max(1e-9));
    Ok(())
}

/// `--template`'s one-line help (`--help` lists the names from `stapo::data::TEMPLATES`).
pub const TEMPLATE_SHORT_HELP: &str = "Prompt template: a name (--help lists them) or a JSON map";

/// `--template` values: a name or a JSON map.
pub fn parse_template(s: &str) -> Result<PromptTemplate, String> {
    PromptTemplate::parse_arg(s).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct ScoreArgs {
    /// Model folder.
    #[arg(long)]
    pub model: PathBuf,
    /// Text to score (tokenized with the folder's tokenizer.json).
    #[arg(long, conflicts_with = "ids", required_unless_present = "ids")]
    pub text: Option<String>,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// One JSON object per token instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// One scored position: the token there, its log-probability given the prefix
/// and the entropy of the distribution that predicted it (none for the first).
#[derive(serde::Serialize)]
struct Scored {
    pos: usize,
    id: u32,
    token: String,
    logprob: Option<f32>,
    entropy: Option<f32>,
}

pub fn score(a: ScoreArgs) -> anyhow::Result<()> {
    let dir = model_dir(&a.model)?;
    let (device, dtype) = a.device.resolve()?;
    let m = model::load(dir, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    super::print_notes();
    let tok_path = dir.join("tokenizer.json");
    let tok = if tok_path.is_file() { Some(Tokenizer::from_file(&tok_path)?) } else { None };
    let ids = match (&a.ids, &a.text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let tok = tok.as_ref().with_context(|| format!("--text needs {}", tok_path.display()))?;
            tok.encode(text, false)?
        }
        (None, None) => anyhow::bail!("give --text or --ids"),
    };
    anyhow::ensure!(!ids.is_empty(), "nothing to score: no tokens");
    let vocab = m.config().vocab_size as u32;
    if let Some(bad) = ids.iter().find(|&&i| i >= vocab) {
        anyhow::bail!("token id {bad} is outside the vocabulary (size {vocab})");
    }
    let batch = TokenBatch::left_padded(std::slice::from_ref(&ids), 0, &device)?;
    let hidden = m.forward_hidden(&batch, Grad::Off)?.squeeze(0)?;
    let n = ids.len();
    let (logp, entropy) = if n > 1 {
        let targets = Tensor::new(&ids[1..], &device)?;
        // Through the head in tiles: no (T, V) logits (model::head).
        let s = m.token_stats(&hidden.narrow(0, 0, n - 1)?, &targets, Grad::Off)?;
        (s.logp.to_dtype(DType::F32)?.to_vec1::<f32>()?, s.entropy.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    } else {
        (vec![], vec![])
    };
    // Finite weights can still overflow (a model trained into huge activations): a score
    // is never printed as NaN with success.
    if let Some(p) = logp.iter().zip(&entropy).position(|(l, h)| !l.is_finite() || !h.is_finite()) {
        anyhow::bail!(
            "scoring {} gave a non-finite value at position {} (logprob {}, entropy {}): the model's \
             activations overflow",
            dir.display(),
            p + 1,
            logp[p],
            entropy[p]
        );
    }
    let rows: Vec<Scored> = ids
        .iter()
        .enumerate()
        .map(|(pos, &id)| Scored {
            pos,
            id,
            token: tok.as_ref().map(|t| t.token_str(id)).unwrap_or_default(),
            logprob: pos.checked_sub(1).map(|p| logp[p]),
            entropy: pos.checked_sub(1).map(|p| entropy[p]),
        })
        .collect();
    if a.json {
        for r in &rows {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!("{:>5}  {:>7}  {:<20}  {:>10}  {:>8}", "pos", "id", "token", "logprob", "entropy");
        for r in &rows {
            let f = |x: Option<f32>| x.map_or("-".to_string(), |v| format!("{v:.4}"));
            println!(
                "{:>5}  {:>7}  {:<20}  {:>10}  {:>8}",
                r.pos,
                r.id,
                format!("{:?}", r.token),
                f(r.logprob),
                f(r.entropy)
            );
        }
        let total: f32 = logp.iter().sum();
        println!(
            "total logprob {total:.4} over {} predicted tokens (perplexity {:.3})",
            logp.len(),
            (-total / logp.len().max(1) as f32).exp()
        );
    }
    Ok(())
}
