//! `stapo update`: one offline RL update from saved rollouts.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::DType;
use clap::Args;

use stapo::dist;
use stapo::model;
use stapo::rollout::RolloutBatch;
use stapo::train::config::moved_to;
use stapo::train::update::{self, Policy};
use stapo::train::{AdamW, AdamWConfig, Optimizer, Sequence, ShardMode, ShardedAdamW, UpdateOptions};

use super::{model_dir, DeviceArgs};

#[derive(Args, Debug)]
pub struct UpdateArgs {
    /// Model folder to update.
    #[arg(long)]
    pub model: PathBuf,
    /// Rollouts JSONL (as written by a run or the REPL), with rewards.
    #[arg(long)]
    pub rollouts: PathBuf,
    #[arg(long, default_value = "stapo", help = super::presets_short_help(), long_help = super::presets_long_help())]
    pub objective: String,
    #[arg(long = "set", value_name = "KEY=VALUE", help = super::SET_SHORT_HELP, long_help = super::set_long_help())]
    pub set: Vec<String>,
    #[arg(long, default_value_t = 1e-6)]
    pub lr: f64,
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Sequences per optimizer step (0 = all).
    #[arg(long, default_value_t = 0)]
    pub minibatch: usize,
    /// Sequences per forward/backward (0 = the mini-batch).
    #[arg(long, default_value_t = 0)]
    pub microbatch: usize,
    /// Optimizer state over MPI ranks (`mpirun -np N stapo update ...`, each rank updating
    /// its share of the rollouts' groups): none, optimizer (ZeRO-1: AdamW moments split
    /// over the ranks) or gradients (ZeRO-2: also the summed gradients).
    #[arg(long, default_value = "none")]
    pub shard: String,
    /// Tokens per forward/backward, prompt + response with padding counted (0 = no budget):
    /// sequences sorted by length and cut by this budget (verl's ppo_max_token_len_per_gpu).
    #[arg(long, default_value_t = 0)]
    pub max_tokens_per_micro: usize,
    /// The rollouts' sampling temperature: the update divides the logits by it (as verl
    /// does, so the ratio is on-policy); 1 for untempered sampling.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// The rollouts' response budget: sizes the preset's overlong buffer (DAPO, STAPO) and
    /// Dr.GRPO's normaliser to it. Without it they keep the preset's values (a warning says
    /// when the overlong penalty can never fire).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Rollout correction against the rollouts' recorded log-probs: off, token_tis (each
    /// token's policy loss times min(exp(old - rollout), 2)) or seq_mis (sequences whose
    /// weight lies outside [0.5, 2] rejected); its metrics are reported in every mode.
    #[arg(long, default_value = "off", value_parser = ["off", "token_tis", "seq_mis"])]
    pub rollout_correction: String,
    /// Take old log-probs from the rollouts instead of recomputing them.
    #[arg(long)]
    pub rollout_logprobs: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Activation checkpointing: auto (from 2048 tokens per forward), on or off
    /// (default: $STAPO_RECOMPUTE, else auto; read once by the CLI).
    #[arg(long)]
    pub recompute: Option<String>,
    /// Output model folder (written atomically; a new or empty one unless --force, never
    /// --model itself); metrics go to <out>/update_metrics.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out even if it already exists and holds files (it is replaced as a whole).
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub lora: super::lora::LoraArgs,
}

/// Every token id of the rollouts indexes the model's embedding (a rollout file of another
/// model would otherwise fail deep in a tensor op).
fn check_token_ids(batch: &RolloutBatch, vocab: usize, file: &std::path::Path) -> anyhow::Result<()> {
    for (i, s) in batch.samples.iter().enumerate() {
        for (what, ids) in [("prompt_ids", &s.prompt_ids), ("response_ids", &s.response_ids)] {
            if let Some((j, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                anyhow::bail!(
                    "{}: sample {i}: `{what}`[{j}] is token {t}, outside the model's vocabulary \
                     (vocab_size {vocab}): the rollouts come from another model or tokenizer",
                    file.display()
                );
            }
        }
    }
    Ok(())
}

pub fn run(a: UpdateArgs) -> anyhow::Result<()> {
    let dir = model_dir(&a.model)?;
    stapo::guard::check_output_folder(&a.out, &[("--model", dir)], a.force)?;
    let (device, dtype) = a.device.resolve()?;
    let mut m = model::load(dir, dtype, &device).with_context(|| format!("loading {}", dir.display()))?;
    super::print_notes();
    let lora = match (a.lora.config()?, m.lora_config().cloned()) {
        (Some(c), _) => {
            // Fresh adapters (replacing any the folder carried).
            m.add_lora(&c, a.seed)?;
            Some(c)
        }
        (None, loaded) => loaded, // an adapter folder keeps training its adapters
    };
    if let Some(r) = &a.recompute {
        m.set_recompute(model::Recompute::parse(r, "--recompute")?);
    }
    let opts = options(&a)?;
    let (cfg, notes) = opts.to_config()?;
    for n in &notes {
        eprintln!("warning: {n}");
    }
    let batch = RolloutBatch::load_jsonl(&a.rollouts)?;
    anyhow::ensure!(!batch.samples.is_empty(), "{}: no samples", a.rollouts.display());
    check_token_ids(&batch, m.config().vocab_size, &a.rollouts)?;
    let seqs: Vec<Sequence> = batch
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let reward =
                s.reward.with_context(|| format!("{}: sample {i} has no reward", a.rollouts.display()))?;
            Ok(Sequence::from_sample(s, reward))
        })
        .collect::<anyhow::Result<_>>()?;
    let pad_id = m.config().eos_token_id.unwrap_or(0);
    // With LoRA the optimizer holds the adapters alone, at lr x lr_scale.
    let base_lr = opts.actor.optim.lr;
    let lr = lora.as_ref().map_or(base_lr, |l| base_lr * l.lr_scale);
    let comm = dist::for_device(dist::world(), m.device())?;
    let adam = AdamWConfig { lr, ..opts.actor.optim.clone() };
    let mut opt: Box<dyn Optimizer> = match opts.actor.shard {
        ShardMode::None => Box::new(AdamW::new(m.trainable_params(), adam)?),
        mode => Box::new(ShardedAdamW::new(m.trainable_params(), adam, mode, comm.rank(), comm.size())?),
    };
    let mine = rank_share(seqs, comm.rank(), comm.size());
    let policy = Policy { model: &m, opt: opt.as_mut(), reference: None };
    let metrics = update::update_on(&*comm, policy, &mine, &cfg, lr, pad_id)?.metrics;
    if comm.rank() != 0 {
        // Every rank holds the same weights; rank 0 writes them.
        return Ok(());
    }
    for w in &metrics.warnings {
        eprintln!("warning: {w}");
    }
    let save_dtype = model::parse_dtype(&m.config().torch_dtype).unwrap_or(DType::F32);
    model::checkpoint::write_atomically(&a.out, |tmp| {
        match &lora {
            // A peft adapter folder on the same base.
            Some(l) => {
                let base = match model::peft::is_adapter_dir(dir) {
                    true => model::peft::read_config(dir)?.base_dir(dir)?,
                    false => dir.clone(),
                };
                let name = model::peft::base_name(&base);
                model::peft::write_adapter_files(&m, l, tmp, &name, Some(dir))?
            }
            None => model::checkpoint::write_model_files(&m, tmp, save_dtype, Some(dir))?,
        }
        stapo::guard::check_folder_finite(tmp, &format!("--out {}", a.out.display()))?;
        let text = serde_json::to_string_pretty(&serde_json::json!({"config": cfg, "metrics": metrics}))
            .map_err(|e| stapo::Error::invalid(e.to_string()))?;
        std::fs::write(tmp.join("update_metrics.json"), text)
            .map_err(|e| stapo::Error::io(tmp.join("update_metrics.json"), e))
    })?;
    println!("{}", serde_json::to_string_pretty(&metrics)?);
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// The update options of the flags, with the `--set PATH=VALUE` pairs laid on top (paths of
/// [`UpdateOptions`]: `actor.objective.mask.tau_p`, `actor.optim.weight_decay`, `seed`, ...).
fn options(a: &UpdateArgs) -> anyhow::Result<UpdateOptions> {
    let old_logp = if a.rollout_logprobs { "rollout" } else { "recompute" };
    let mut user = serde_json::json!({
        "actor": {
            "preset": a.objective,
            "optim": {"lr": a.lr},
            "epochs": a.epochs,
            "mini_batch": a.minibatch,
            "micro_batch": a.microbatch,
            "max_tokens_per_micro": a.max_tokens_per_micro,
            "old_logp": old_logp,
            "rollout_correction": {"mode": a.rollout_correction},
            "shard": ShardMode::parse(&a.shard, "--shard")?.name(),
        },
        "seed": a.seed,
        "temperature": a.temperature,
        "max_tokens": a.max_tokens,
    });
    let mut seen = std::collections::BTreeSet::new();
    for kv in &a.set {
        let (k, v) =
            kv.split_once('=').with_context(|| format!("--set: expected PATH=VALUE, found `{kv}`"))?;
        let k = k.trim();
        anyhow::ensure!(seen.insert(k.to_string()), "--set: `{k}` given twice");
        if let (false, Some(new)) = (k.contains('.'), moved_to(k)) {
            anyhow::bail!("--set {k}: `{k}` moved to `{new}`");
        }
        stapo::overlay::set_dotted(&mut user, k, stapo::overlay::parse_value(v));
    }
    Ok(UpdateOptions::from_json(&user)?)
}

/// This rank's contiguous share of the groups of `seqs` (whole groups, in the order of
/// their ids, as the data-parallel update wants them); everything with one rank.
fn rank_share(mut seqs: Vec<Sequence>, rank: usize, size: usize) -> Vec<Sequence> {
    if size == 1 {
        return seqs;
    }
    seqs.sort_by_key(|s| s.group);
    let mut groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
    groups.dedup();
    let share = dist::shard(groups.len(), rank, size);
    let keep = &groups[share];
    seqs.retain(|s| keep.binary_search(&s.group).is_ok());
    seqs
}
