//! Builds `models/tiny-qwen3` and `data/arith` from scratch (see
//! `stapo::train::sft::tiny`). Run from the repository root:
//!
//! ```text
//! cargo run --release --example pretrain_tiny                 # the committed model
//! cargo run --release --example pretrain_tiny -- --config my.json --out /tmp/m --data /tmp/d
//! ```
//!
//! `--config` reads a JSON `TinyConfig` (missing fields take the defaults);
//! `--out`, `--data`, `--max-steps`, `--target`, `--max-seconds`,
//! `--stop-at-step`, `--init-from`, `--sft-seed`, `--warmup`, `--eval-every` override it;
//! `--no-data` skips writing the data files, `--no-final-eval` the test-set measurement.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use stapo::train::sft::{pretrain_tiny, TinyConfig};

fn main() -> Result<()> {
    let mut cfg = TinyConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--config" => {
                let path = value()?;
                let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
                cfg = serde_json::from_str(&text).with_context(|| format!("{path}: not a TinyConfig"))?;
            }
            "--out" => cfg.model_dir = PathBuf::from(value()?),
            "--data" => cfg.data_dir = Some(PathBuf::from(value()?)),
            "--no-data" => cfg.data_dir = None,
            "--max-steps" => cfg.max_steps = value()?.parse().context("--max-steps: expected an integer")?,
            "--target" => cfg.target_accuracy = value()?.parse().context("--target: expected a number")?,
            "--max-seconds" => {
                cfg.max_seconds = value()?.parse().context("--max-seconds: expected a number")?
            }
            "--no-final-eval" => cfg.final_eval = false,
            "--stop-at-step" => {
                cfg.stop_at_step = value()?.parse().context("--stop-at-step: expected an integer")?
            }
            "--init-from" => cfg.init_from = Some(PathBuf::from(value()?)),
            "--sft-seed" => cfg.sft_seed = value()?.parse().context("--sft-seed: expected an integer")?,
            "--warmup" => cfg.warmup_steps = value()?.parse().context("--warmup: expected an integer")?,
            "--eval-every" => {
                cfg.eval_every = value()?.parse().context("--eval-every: expected an integer")?
            }
            other => {
                bail!("unknown flag {other:?} (see the header of host/examples/pretrain_tiny.rs)")
            }
        }
    }
    eprintln!("{}", serde_json::to_string(&cfg)?);
    let report = pretrain_tiny(&cfg, &mut |line| eprintln!("{line}"))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
