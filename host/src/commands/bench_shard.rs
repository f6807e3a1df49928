//! `stapo bench shard`: the memory of sharded data-parallel training, measured.
//! Every rank (one process, or each rank under `mpirun -np N`) builds the same
//! random model of the given shape, takes its own `--batch` synthetic sequences
//! (so the global batch is N x batch) and runs full updates with the optimizer
//! of `--shard` (none, ZeRO-1, ZeRO-2); it reports the optimizer bytes the
//! optimizer itself counts, the peak RSS of the timed updates (after a warm-up,
//! as `bench train --table` does) and seconds per update. Rank 0 prints one row
//! per rank.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use stapo::dist;
use stapo::model::{Config, Qwen3};
use stapo::train::update::{self, Policy};
use stapo::train::{AdamW, AdamWConfig, Optimizer, ShardMode, ShardedAdamW, UpdateConfig};

use super::bench_common::{peak_rss, reset_peak_rss, synthetic_sequences, BenchArgs};

/// What one rank measured.
#[derive(Debug, Serialize, Deserialize)]
struct Row {
    rank: usize,
    optimizer_bytes: u64,
    peak_rss: u64,
    secs: f64,
}

pub fn run(m: &Qwen3, cfg: &Config, a: &BenchArgs, seq: usize) -> anyhow::Result<()> {
    let comm = dist::for_device(dist::world(), m.device())?;
    let mode = ShardMode::parse(&a.shard, "--shard")?;
    let adam = AdamWConfig { lr: 1e-7, ..AdamWConfig::default() };
    let mut opt: Box<dyn Optimizer> = match mode {
        ShardMode::None => Box::new(AdamW::new(m.trainable_params(), adam)?),
        _ => Box::new(ShardedAdamW::new(m.trainable_params(), adam, mode, comm.rank(), comm.size())?),
    };
    let resp = a.response.unwrap_or(seq / 2).clamp(1, seq.saturating_sub(1).max(1));
    // This rank's sequences; group ids ascend along the ranks, as the update needs.
    let mut seqs = synthetic_sequences(cfg, a.batch, seq, resp);
    for s in &mut seqs {
        s.group += comm.rank() * a.batch;
    }
    let ucfg = UpdateConfig::default();
    let once = |opt: &mut dyn Optimizer| -> anyhow::Result<u64> {
        let policy = Policy { model: m, opt, reference: None };
        Ok(update::update_on(&*comm, policy, &seqs, &ucfg, 1e-7, 0)?.metrics.optimizer_bytes)
    };
    for _ in 0..a.warmup {
        once(opt.as_mut())?;
    }
    reset_peak_rss();
    let start = Instant::now();
    let reps = a.reps.max(1);
    let mut bytes = 0;
    for _ in 0..reps {
        bytes = once(opt.as_mut())?;
    }
    let secs = start.elapsed().as_secs_f64() / reps as f64;
    let row = Row { rank: comm.rank(), optimizer_bytes: bytes, peak_rss: peak_rss().unwrap_or(0), secs };
    let rows: Vec<Row> = dist::all_gather_json(&*comm, &row)?;
    if comm.rank() == 0 {
        println!(
            "shard {} over {} rank(s) ({}), {} x {} tokens per rank, {} trainable parameters",
            mode.name(),
            comm.size(),
            comm.backend(),
            a.batch,
            seq,
            opt.trainable().iter().map(|v| v.elem_count()).sum::<usize>()
        );
        println!("{:>4} {:>16} {:>14} {:>10}", "rank", "optimizer MiB", "peak RSS MiB", "s/update");
        for r in &rows {
            println!(
                "{:>4} {:>16.1} {:>14.1} {:>10.2}",
                r.rank,
                r.optimizer_bytes as f64 / (1 << 20) as f64,
                r.peak_rss as f64 / (1 << 20) as f64,
                r.secs
            );
        }
    }
    Ok(())
}
