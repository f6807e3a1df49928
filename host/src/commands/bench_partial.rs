//! `stapo bench rollout --lengths lognormal:LO:HI --steps S --partial off,on`: the
//! rollouts of S consecutive training steps of `--prompts` groups of `--samples`
//! responses whose lengths are forced (each response ends at a length drawn from the
//! log-normal, EOS ignored), synchronous (`off`: each step samples its own prompts and
//! waits for its longest response) against partial rollouts (`on`: `--prompts` +
//! `--extra-prompts` groups in flight, a step ends when `--prompts` of them are whole,
//! the unfinished responses continue in the next step: with `--partial-kv recompute`
//! (the default, as `rollout.partial.kv`) after being prefilled again, as they are under
//! new weights in training; with `--partial-kv keep` over the keys and values kept in
//! the pool), in one process, interleaved over `--rounds`, same engine settings. Prompt
//! `i` and its lengths are the same in both modes. Reports tokens/s over the S steps
//! (every token sampled, the unfinished ones' included), rows per decode call over the
//! steps and in each step's last 10% of decode calls, the tokens recomputed and kept.
//! Its last line reads `partial: R.RRx the synchronous tokens/s over S steps, rows per
//! call A.A vs B.B` (A partial, B synchronous, in the steps' last 10% of decode calls).

use stapo::model::Qwen3;
use stapo::rollout::stats::rows_per_call;
use stapo::rollout::{
    generate_partial, generate_stats, row_seed, EngineConfig, EngineStats, GenerateOptions, PartialKv,
    PartialRollout, SamplingParams,
};

use super::bench_common::{BenchArgs, PartialKvArg};
use super::bench_lengths::LogNormal;

/// One mode's steps, summed.
#[derive(Debug, Default)]
struct Totals {
    tokens: usize,
    secs: f64,
    decode_rows: Vec<u32>,
    /// Each step's rows per decode call over its last 10% of decode calls.
    tail: Vec<f64>,
    recomputed: usize,
    kept: usize,
    carried_at_end: usize,
}

impl Totals {
    fn add(&mut self, s: &EngineStats) {
        self.tokens += s.tokens;
        self.secs += s.secs;
        self.decode_rows.extend_from_slice(&s.decode_rows);
        if !s.decode_rows.is_empty() {
            self.tail.push(s.decode_rows_tail(0.1));
        }
    }

    fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.secs.max(1e-9)
    }

    fn tail_rows(&self) -> f64 {
        self.tail.iter().sum::<f64>() / self.tail.len().max(1) as f64
    }
}

/// What every run shares: the prompts and lengths by global prompt index, the sampling
/// and the engine.
struct Setup {
    prompt_len: usize,
    vocab: u32,
    lengths: Vec<usize>,
    params: SamplingParams,
    engine: EngineConfig,
    per_step: usize,
    extra: usize,
    steps: usize,
    kv: PartialKv,
}

impl Setup {
    /// Prompt `i` (the same in both modes).
    fn prompt(&self, i: usize) -> Vec<u32> {
        (0..self.prompt_len as u32).map(|t| (i as u32 * 7919 + t * 104_729 + 1) % self.vocab).collect()
    }

    /// The forced length of response `s` of prompt `p`.
    fn length(&self, p: usize, s: usize) -> usize {
        self.lengths[(p * self.params.n + s) % self.lengths.len()]
    }
}

/// Runs the comparison.
pub fn run(m: &Qwen3, a: &BenchArgs) -> anyhow::Result<()> {
    let spec = a.lengths.as_deref().ok_or_else(|| {
        anyhow::anyhow!(
            "bench rollout --partial: give the response lengths, e.g. --lengths lognormal:50:2000"
        )
    })?;
    let dist = LogNormal::parse(spec)?;
    let modes = modes(a.partial.as_deref().unwrap_or("off,on"))?;
    let steps = a.steps.unwrap_or(1);
    anyhow::ensure!(steps >= 1, "--steps: at least 1");
    anyhow::ensure!(a.rollout_prompt >= 1, "--rollout-prompt: at least 1 token");
    let (per_step, n) = (a.prompts.max(1), a.samples.max(1));
    let extra = a.extra_prompts.unwrap_or(per_step);
    let kv = match a.partial_kv {
        PartialKvArg::Recompute => PartialKv::Recompute,
        PartialKvArg::Keep => PartialKv::Keep,
    };
    let max_new = a.max_new.max(dist.hi);
    let prompts_needed = (steps + 1) * per_step + extra;
    let setup = Setup {
        prompt_len: a.rollout_prompt,
        vocab: m.config().vocab_size as u32,
        lengths: dist.sample(prompts_needed * n, 7),
        params: SamplingParams {
            n,
            max_new_tokens: max_new,
            ignore_eos: true,
            seed: 1,
            ..Default::default()
        },
        engine: EngineConfig {
            kv_cache_gb: a.kv_cache_gb,
            max_rows: a.paged_rows,
            ..EngineConfig::default()
        },
        per_step,
        extra,
        steps,
        kv,
    };
    println!(
        "partial rollouts: {} steps of {per_step} prompts x {n} of {} tokens, lengths {spec}, max {max_new} new; \
         partial keeps {} groups in flight, their KV cache {}; {} rows, cache {}",
        steps,
        a.rollout_prompt,
        per_step + extra,
        match kv {
            PartialKv::Recompute => "recomputed after each step",
            PartialKv::Keep => "kept across steps",
        },
        setup.engine.rows(m),
        a.kv_cache_gb.map_or("the engine's default".to_string(), |g| format!("{g} GB")),
    );
    let mut totals: Vec<Totals> = modes.iter().map(|_| Totals::default()).collect();
    for round in 0..a.rounds.max(1) {
        for (&on, t) in modes.iter().zip(&mut totals) {
            let r = if on { partial_steps(m, &setup)? } else { synchronous_steps(m, &setup)? };
            println!(
                "{} (round {round}): {:.0} tok/s ({} tokens in {:.1} s), {:.1} rows per decode call, {:.1} in the \
                 steps' last 10%{}",
                name(on),
                r.tokens_per_sec(),
                r.tokens,
                r.secs,
                rows_per_call(&r.decode_rows),
                r.tail_rows(),
                if on {
                    format!(
                        ", {} tokens recomputed, {} kept, {} responses in flight at the end",
                        r.recomputed, r.kept, r.carried_at_end
                    )
                } else {
                    String::new()
                }
            );
            t.tokens += r.tokens;
            t.secs += r.secs;
            t.decode_rows.extend(r.decode_rows);
            t.tail.extend(r.tail);
            t.recomputed += r.recomputed;
        }
    }
    for (&on, t) in modes.iter().zip(&totals) {
        println!(
            "{}: {:.0} tok/s over {} steps x {} rounds, {:.1} rows per decode call, {:.1} in the steps' last 10%",
            name(on),
            t.tokens_per_sec(),
            steps,
            a.rounds.max(1),
            rows_per_call(&t.decode_rows),
            t.tail_rows()
        );
    }
    let (sync, part) = (modes.iter().position(|&o| !o), modes.iter().position(|&o| o));
    if let (Some(s), Some(p)) = (sync, part) {
        let (s, p) = (&totals[s], &totals[p]);
        println!(
            "partial: {:.2}x the synchronous tokens/s over {} steps, rows per call {:.1} vs {:.1}",
            p.tokens_per_sec() / s.tokens_per_sec().max(1e-9),
            steps,
            p.tail_rows(),
            s.tail_rows()
        );
    }
    Ok(())
}

fn name(on: bool) -> &'static str {
    if on {
        "partial    "
    } else {
        "synchronous"
    }
}

/// `off`, `on` or a list of them.
fn modes(s: &str) -> anyhow::Result<Vec<bool>> {
    s.split(',')
        .map(|m| match m.trim() {
            "on" => Ok(true),
            "off" => Ok(false),
            other => Err(anyhow::anyhow!("--partial: expected on, off or a list (off,on), got {other:?}")),
        })
        .collect()
}

/// `steps` synchronous steps: step k samples prompts `k * per_step ..` and waits for all.
fn synchronous_steps(m: &Qwen3, u: &Setup) -> anyhow::Result<Totals> {
    let mut t = Totals::default();
    let forced = |p: usize, s: usize| u.length(p, s);
    for k in 0..u.steps {
        let first = k * u.per_step;
        let prompts: Vec<Vec<u32>> = (first..first + u.per_step).map(|i| u.prompt(i)).collect();
        let opts = GenerateOptions {
            engine: u.engine,
            first_prompt_index: first,
            lengths: Some(&forced),
            ..GenerateOptions::default()
        };
        let (_, s) = generate_stats(m, &prompts, &u.params, 0, &|_| String::new(), &opts)?;
        t.add(&s);
    }
    Ok(t)
}

/// `steps` partial steps: `per_step + extra` groups in flight (prompts admitted in
/// order), each step ending when `per_step` are whole.
fn partial_steps(m: &Qwen3, u: &Setup) -> anyhow::Result<Totals> {
    let mut t = Totals::default();
    let forced = |p: usize, s: usize| u.length(p, s);
    let mut partial = PartialRollout::default();
    partial.set_kv(u.kv);
    let mut next = 0usize;
    for k in 0..u.steps {
        while partial.in_flight() < u.per_step + u.extra {
            let seeds: Vec<u64> = (0..u.params.n).map(|s| row_seed(u.params.seed, next, s)).collect();
            partial.admit(next as u64, next, u.prompt(next), &seeds);
            next += 1;
        }
        let opts = GenerateOptions { engine: u.engine, lengths: Some(&forced), ..GenerateOptions::default() };
        let step =
            generate_partial(m, &mut partial, &u.params, 0, &|_| String::new(), &opts, k as u64, u.per_step)?;
        anyhow::ensure!(
            step.groups.len() == u.per_step,
            "a partial step returned {} groups",
            step.groups.len()
        );
        t.add(&step.stats);
        t.recomputed += step.figures.recomputed_tokens;
        t.kept += step.figures.kept_tokens;
    }
    t.carried_at_end = partial.unfinished();
    Ok(t)
}
