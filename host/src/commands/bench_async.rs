//! `stapo bench async`: steps per hour of a training run, synchronous against one step
//! off (`rollout.async: #{ staleness: 1 }`), on the same cores, in one process. Each
//! round runs `--steps` steps of each mode from the same initial weights, in a fresh
//! run folder under the system's temporary directory (removed after); the figures
//! exclude loading the model and data. The last line reads
//! `async: R.RRx the synchronous steps/hour over S steps`.
//!
//! With `--rollout-ranks R`, under `mpirun -np N`: the same on N ranks, data-parallel
//! synchronous (every rank rolls out and trains) against R rollout ranks and N - R
//! trainer ranks (`rollout.async.roles`) at staleness 0 and at staleness 1; rank 0
//! prints, and the last line compares the role split at staleness 1 with the
//! synchronous data-parallel run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use stapo::train::{RunConfig, StepMetrics, Trainer};

use super::bench_common::{cpu_seconds, BenchArgs};

/// What one run of `steps` steps took.
struct Timed {
    secs: f64,
    cpu: Option<f64>,
    metrics: Vec<StepMetrics>,
}

pub fn run(a: &BenchArgs) -> anyhow::Result<()> {
    if a.rollout_ranks > 0 {
        return run_roles(a);
    }
    let steps = step_count(a);
    anyhow::ensure!(steps >= 2, "--steps: one step off needs at least 2 steps to overlap anything");
    println!(
        "async: {} steps of {} prompts x {} samples, at most {} new tokens; rollout threads {}, train threads {} \
         (0: shared pool of {}); {} round(s)",
        steps,
        a.prompts,
        a.samples,
        a.max_new,
        a.rollout_threads,
        a.train_threads,
        rayon::current_num_threads(),
        a.rounds.max(1)
    );
    let (mut sync_secs, mut async_secs) = (0.0, 0.0);
    for round in 0..a.rounds.max(1) {
        for staleness in [0, 1] {
            let t = run_one(a, staleness, round)?;
            let name = if staleness == 0 { "synchronous" } else { "one step off" };
            let per_hour = steps as f64 * 3600.0 / t.secs;
            let sum = |f: &dyn Fn(&StepMetrics) -> f64| t.metrics.iter().map(f).sum::<f64>();
            let mut line = format!(
                "round {round} {name:>12}: {:.2} s, {per_hour:.1} steps/hour; rollouts {:.2} s, updates {:.2} s",
                t.secs,
                sum(&|m| m.rollout_secs),
                sum(&|m| m.update_secs)
            );
            if let Some(cpu) = t.cpu {
                line += &format!("; cpu/wall {:.2}", cpu / t.secs);
            }
            if staleness == 1 {
                let f = |g: &dyn Fn(&stapo::train::AsyncFigures) -> f64| {
                    t.metrics.iter().filter_map(|m| m.asynchronous.as_ref()).map(g).sum::<f64>()
                };
                line += &format!(
                    "; waited for rollouts {:.2} s, rollout waited for weights {:.2} s, rollouts ahead {:.2} s",
                    f(&|x| x.wait_rollout_secs),
                    f(&|x| x.wait_weights_secs),
                    f(&|x| x.ahead_rollout_secs)
                );
                async_secs += t.secs;
            } else {
                sync_secs += t.secs;
            }
            println!("{line}");
        }
    }
    println!(
        "async: {:.2}x the synchronous steps/hour over {} steps",
        sync_secs / async_secs.max(1e-9),
        steps
    );
    Ok(())
}

/// `--steps`, 4 when not given.
fn step_count(a: &BenchArgs) -> u64 {
    a.steps.unwrap_or(4) as u64
}

/// `--rollout-ranks`: data-parallel synchronous against the role split at staleness 0
/// and 1, on the job's ranks.
fn run_roles(a: &BenchArgs) -> anyhow::Result<()> {
    let world = stapo::dist::world();
    let (n, r) = (world.size(), a.rollout_ranks);
    anyhow::ensure!(
        r < n,
        "--rollout-ranks {r}: start the benchmark under mpirun with more ranks (mpirun -np {} stapo bench \
         async --rollout-ranks {r})",
        r + 1
    );
    let steps = step_count(a);
    anyhow::ensure!(steps >= 2, "--steps: one step off needs at least 2 steps to overlap anything");
    let say = |line: String| {
        if world.rank() == 0 {
            println!("{line}");
        }
    };
    say(format!(
        "async roles: {n} ranks ({r} rollout, {} trainer); {steps} steps of {} prompts x {} samples, at most {} \
         new tokens; {} round(s)",
        n - r,
        a.prompts,
        a.samples,
        a.max_new,
        a.rounds.max(1)
    ));
    let modes = [
        ("data-parallel synchronous", None, 0),
        ("roles, staleness 0", Some(r), 0),
        ("roles, one step off", Some(r), 1),
    ];
    let mut secs = [0.0f64; 3];
    for round in 0..a.rounds.max(1) {
        for (i, (name, roles, staleness)) in modes.iter().enumerate() {
            let t = run_on(a, *staleness, *roles, round)?;
            // Every rank's clock: the slowest rank's time is the run's.
            let took = stapo::dist::max_f64(&*world, t.secs)?;
            secs[i] += took;
            say(format!(
                "round {round} {name:>26}: {took:.2} s, {:.1} steps/hour",
                steps as f64 * 3600.0 / took
            ));
        }
    }
    say(format!(
        "async roles: staleness 0 {:.2}x, one step off {:.2}x the synchronous data-parallel steps/hour over {steps} \
         steps",
        secs[0] / secs[1].max(1e-9),
        secs[0] / secs[2].max(1e-9)
    ));
    Ok(())
}

/// `--steps` steps of a fresh run at `staleness`.
fn run_one(a: &BenchArgs, staleness: u32, round: usize) -> anyhow::Result<Timed> {
    run_on(a, staleness, None, round)
}

/// `--steps` steps of a fresh run at `staleness` on the process's world, with
/// `rollout_ranks` rollout ranks when given.
fn run_on(
    a: &BenchArgs,
    staleness: u32,
    rollout_ranks: Option<usize>,
    round: usize,
) -> anyhow::Result<Timed> {
    let mut asynchronous = serde_json::json!({"staleness": staleness});
    match rollout_ranks {
        Some(r) => asynchronous["roles"] = serde_json::json!({"rollout_ranks": r}),
        None => {
            asynchronous["rollout_threads"] = a.rollout_threads.into();
            asynchronous["train_threads"] = a.train_threads.into();
        }
    }
    let cfg = RunConfig::from_json(&serde_json::json!({
        "data": {"prompts_per_step": a.prompts},
        "rollout": {"sampling": {"n": a.samples, "max_tokens": a.max_new}, "async": asynchronous},
        "actor": {"optim": {"lr": 2e-4}},
        "checkpoint": {"save_every": 0},
        "evaluation": {"every": 0},
    }))?;
    // One folder for every rank of the job: rank 0's process id names it.
    let world = stapo::dist::world();
    let id: u32 = stapo::dist::broadcast_json(&*world, 0, &std::process::id())?;
    let dir: PathBuf = std::env::temp_dir()
        .join(format!("stapo-bench-async-{id}-{round}-{staleness}-{}", rollout_ranks.unwrap_or(0)));
    let mut t = Trainer::new(cfg, &dir).with_context(|| {
        "bench async: run from the repository root (it trains models/tiny-qwen3 on data/arith)"
    })?;
    let steps = step_count(a);
    t.set_final_step(steps);
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let mut metrics = Vec::new();
    for _ in 0..steps {
        metrics.push(t.step(&t.default_plan(), None, None)?);
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    drop(t);
    world.barrier()?;
    if world.rank() == 0 {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    Ok(Timed { secs, cpu, metrics })
}
