//! `stapo bench train --lengths lognormal:LO:HI`: one RL update over responses of mixed
//! lengths (reasoning answers: most short, a few long), with micro-batches of a fixed
//! number of sequences padded to the mini-batch's longest (the padded path) against
//! micro-batches cut by a token budget (`max_tokens_per_micro`, verl's
//! `use_dynamic_bsz`): update time and the share of padding in the tokens each runs.

use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use stapo::model::{Config, Qwen3};
use stapo::train::update::micro_batch_shapes;
use stapo::train::{AdamW, AdamWConfig, Sequence, UpdateConfig};

use super::bench_common::{peak_rss, report};

/// Response lengths drawn from a log-normal whose 2.5% and 97.5% quantiles are `lo` and
/// `hi` (`mu = (ln lo + ln hi) / 2`, `sigma = (ln hi - ln lo) / 3.92`), clamped to
/// `[lo, hi]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormal {
    pub lo: usize,
    pub hi: usize,
}

impl LogNormal {
    /// Parses `lognormal:LO:HI`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let bad = || format!("--lengths: expected lognormal:LO:HI (e.g. lognormal:100:4000), found `{s}`");
        let rest = s.strip_prefix("lognormal:").with_context(bad)?;
        let (lo, hi) = rest.split_once(':').with_context(bad)?;
        let (lo, hi): (usize, usize) = (lo.parse().with_context(bad)?, hi.parse().with_context(bad)?);
        anyhow::ensure!(1 <= lo && lo < hi, "--lengths: expected 1 <= LO < HI, found {lo} and {hi}");
        Ok(LogNormal { lo, hi })
    }

    /// `n` lengths from the seeded generator.
    pub fn sample(&self, n: usize, seed: u64) -> Vec<usize> {
        let (l, h) = ((self.lo as f64).ln(), (self.hi as f64).ln());
        let (mu, sigma) = ((l + h) / 2.0, (h - l) / 3.92);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                // Box-Muller: one standard normal from two uniforms in (0, 1].
                let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                ((mu + sigma * z).exp().round() as usize).clamp(self.lo, self.hi)
            })
            .collect()
    }
}

/// What the comparison runs: `batch` responses of `lengths` after `prompt`-token prompts,
/// the padded path with `micro_batch` sequences per micro-batch, the budget path with
/// `budget` tokens.
pub struct Plan {
    pub lengths: LogNormal,
    pub batch: usize,
    pub prompt: usize,
    pub micro_batch: Option<usize>,
    pub budget: usize,
    pub reps: usize,
}

/// `batch` sequences with prompts of `prompt` tokens and responses of `lens` tokens, in
/// groups of 4 with mixed rewards.
fn sequences(cfg: &Config, prompt: usize, lens: &[usize]) -> Vec<Sequence> {
    let v = cfg.vocab_size;
    let tok = |b: usize, t: usize| ((b * 7919 + t * 104_729 + 1) % v) as u32;
    lens.iter()
        .enumerate()
        .map(|(b, &n)| Sequence {
            prompt_ids: (0..prompt).map(|t| tok(b / 4, t)).collect(),
            response_ids: (0..n).map(|t| tok(b, prompt + t)).collect(),
            rollout_logprobs: None,
            reward: (b % 2) as f32,
            group: b / 4,
            truncated: false,
        })
        .collect()
}

/// Rows, tokens run (padding counted) and the padding share of micro-batch `shapes`.
fn padding(shapes: &[(usize, usize)], real: usize) -> (usize, f64) {
    let run: usize = shapes.iter().map(|(b, l)| b * l).sum();
    (run, 1.0 - real as f64 / run.max(1) as f64)
}

/// Times full updates on the padded path and the budget path, alternating, and prints
/// both with their micro-batch shapes, padding shares and the time ratio.
pub fn run(m: &Qwen3, cfg: &Config, plan: &Plan) -> anyhow::Result<()> {
    let lens = plan.lengths.sample(plan.batch, 0x1e57);
    let seqs = sequences(cfg, plan.prompt, &lens);
    let real: usize = lens.iter().map(|r| r + plan.prompt).sum();
    let longest = plan.prompt + lens.iter().max().copied().unwrap_or(1);
    // The padded path holds at most as many tokens per forward as the budget, unless told.
    let micro = plan.micro_batch.unwrap_or((plan.budget / longest).max(1));
    let pairs: Vec<(usize, usize)> = lens.iter().map(|&r| (plan.prompt, r)).collect();
    let padded_shapes = micro_batch_shapes(&pairs, micro, 0);
    let budget_shapes = micro_batch_shapes(&pairs, 0, plan.budget);
    println!(
        "lengths: {} responses from lognormal:{}:{} (mean {:.0}, max {}), prompts of {} tokens: {real} real tokens",
        lens.len(),
        plan.lengths.lo,
        plan.lengths.hi,
        lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64,
        lens.iter().max().copied().unwrap_or(0),
        plan.prompt
    );
    let (mut padded, mut budget) = (UpdateConfig::default(), UpdateConfig::default());
    padded.actor.micro_batch = micro;
    budget.actor.max_tokens_per_micro = plan.budget;
    let paths = [("padded", padded, &padded_shapes), ("budget", budget, &budget_shapes)];
    for (name, _, shapes) in &paths {
        let (run, share) = padding(shapes, real);
        let what = if *name == "padded" {
            format!("{micro} sequences per micro-batch")
        } else {
            format!("max_tokens_per_micro {}", plan.budget)
        };
        println!(
            "{name}: {what}: {} micro-batches, {run} tokens run, padding share {share:.3}",
            shapes.len()
        );
    }
    let mut opt = AdamW::new(m.params(), AdamWConfig { lr: 1e-7, ..AdamWConfig::default() })?;
    let mut secs = [0f64; 2];
    for rep in 0..plan.reps.max(1) {
        for (k, (name, ucfg, _)) in paths.iter().enumerate() {
            let s = Instant::now();
            stapo::train::update(m, &mut opt, None, &seqs, ucfg, 1e-7, 0)?;
            let d = s.elapsed().as_secs_f64();
            secs[k] += d;
            // As it goes: a long comparison cut short still reports what ran.
            println!("  rep {rep}: {name} update {d:.1} s");
        }
    }
    let r = plan.reps.max(1) as f64;
    for (k, (name, _, shapes)) in paths.iter().enumerate() {
        report(&format!("full update, {name}"), secs[k] / r, None, padding(shapes, real).0);
    }
    println!(
        "time ratio budget / padded: {:.3} (mean of {} each, alternating)",
        secs[1] / secs[0],
        plan.reps.max(1)
    );
    if let Some(p) = peak_rss() {
        println!("peak memory (RSS) over both: {:.2} GB", p as f64 / 1e9);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lognormal_lengths_parse_and_stay_in_bounds() {
        let d = LogNormal::parse("lognormal:100:4000").unwrap();
        assert_eq!(d, LogNormal { lo: 100, hi: 4000 });
        for bad in ["lognormal:100", "normal:1:2", "lognormal:5:5", "lognormal:0:9", "lognormal:a:9"] {
            assert!(LogNormal::parse(bad).is_err(), "{bad}");
        }
        let lens = d.sample(20_000, 1);
        assert!(lens.iter().all(|&l| (100..=4000).contains(&l)));
        // The median is exp(mu) = sqrt(100 · 4000) = 632.5; about 2.5% sit at each bound.
        let mut sorted = lens.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2] as f64;
        assert!((median / 632.5 - 1.0).abs() < 0.05, "median {median}");
        let at_hi = lens.iter().filter(|&&l| l == 4000).count() as f64 / lens.len() as f64;
        assert!((at_hi - 0.025).abs() < 0.006, "share at HI {at_hi}");
        assert_eq!(d.sample(8, 3), d.sample(8, 3));
    }

    #[test]
    fn padding_share_counts_padding_of_every_micro_batch() {
        // Two micro-batches 2 x 10 and 3 x 6: 38 tokens run for 30 real ones.
        let (run, share) = padding(&[(2, 10), (3, 6)], 30);
        assert_eq!(run, 38);
        assert!((share - 8.0 / 38.0).abs() < 1e-12);
    }
}
