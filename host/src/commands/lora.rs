//! LoRA on the command line: the `--lora-*` flags of `stapo update` and `stapo bench`,
//! and `stapo merge` (a peft adapter folder + its base -> a full Hugging Face folder).

use std::path::PathBuf;

use anyhow::Context;
use candle_core::{DType, Device};
use clap::Args;

use stapo::model::{self, peft, LoraConfig, LoraTarget};

/// `--lora-rank` and its companions; without `--lora-rank` the whole model trains.
#[derive(Args, Debug, Clone, Default)]
pub struct LoraArgs {
    /// Train LoRA adapters of this rank on a frozen base (peft's `r`).
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// LoRA alpha: the adapter term is scaled by alpha / rank (default: the rank).
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// Adapted projections, comma-separated (default: all of q_proj,k_proj,v_proj,o_proj,
    /// gate_proj,up_proj,down_proj).
    #[arg(long, value_delimiter = ',', requires = "lora_rank")]
    pub lora_targets: Vec<String>,
    /// The adapters' learning rate is --lr times this (default 10, "LoRA Without Regret").
    #[arg(long, requires = "lora_rank")]
    pub lora_lr_scale: Option<f64>,
}

impl LoraArgs {
    /// The LoRA settings these flags name (`None` without `--lora-rank`).
    pub fn config(&self) -> anyhow::Result<Option<LoraConfig>> {
        let Some(rank) = self.lora_rank else { return Ok(None) };
        let mut c = LoraConfig::new(rank);
        c.alpha = self.lora_alpha;
        if let Some(s) = self.lora_lr_scale {
            c.lr_scale = s;
        }
        if !self.lora_targets.is_empty() {
            c.targets = self.lora_targets.iter().map(|t| parse_target(t)).collect::<anyhow::Result<_>>()?;
        }
        c.validate().context("--lora-*")?;
        Ok(Some(c))
    }
}

/// `q_proj` (or `self_attn.q_proj`) -> its target.
fn parse_target(name: &str) -> anyhow::Result<LoraTarget> {
    let last = name.trim().rsplit('.').next().unwrap_or_default();
    LoraTarget::ALL
        .into_iter()
        .find(|t| t.module().rsplit('.').next() == Some(last))
        .with_context(|| {
            format!("--lora-targets: {name:?} is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
        })
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// A peft adapter folder (adapter_model.safetensors + adapter_config.json), e.g. a
    /// LoRA run's checkpoint.
    pub adapter: PathBuf,
    /// The base model folder (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// Output folder: a full Hugging Face model (written atomically; a new or empty one
    /// unless --force, never the adapter or base folder).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out even if it already exists and holds files (it is replaced as a whole).
    #[arg(long)]
    pub force: bool,
    /// Weights on disk: float32, bfloat16 or float16 (default: the base's torch_dtype).
    #[arg(long)]
    pub dtype: Option<String>,
}

/// `stapo merge`: `W + scale B A` into every adapted projection, saved as a plain model
/// with the base's tokenizer files.
pub fn merge(a: MergeArgs) -> anyhow::Result<()> {
    let base = match &a.base {
        Some(b) => b.clone(),
        None => peft::read_config(&a.adapter)?.base_dir(&a.adapter)?,
    };
    stapo::guard::check_output_folder(&a.out, &[("adapter", &a.adapter), ("--base", &base)], a.force)?;
    let cfg = model::Config::from_file(&base.join("config.json"))?;
    let save = match &a.dtype {
        Some(d) => model::parse_dtype(d).context("--dtype")?,
        None => model::parse_dtype(&cfg.torch_dtype).unwrap_or(DType::F32),
    };
    // Merge in f32 whatever the file's dtype, then round once.
    let (mut m, lora) = peft::load_with_adapter(&a.adapter, Some(&base), DType::F32, &Device::Cpu)
        .with_context(|| format!("loading {} on {}", a.adapter.display(), base.display()))?;
    m.merge_lora()?;
    let tokenizer = if a.adapter.join("tokenizer.json").is_file() { &a.adapter } else { &base };
    model::save(&m, &a.out, save, Some(tokenizer))?;
    eprintln!(
        "merged rank-{} adapters ({} targets) of {} into {} ({})",
        lora.rank,
        lora.targets.len(),
        a.adapter.display(),
        a.out.display(),
        model::dtype_name(save)
    );
    Ok(())
}
