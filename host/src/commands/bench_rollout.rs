//! `stapo bench rollout --lengths lognormal:LO:HI`: one rollout of `--prompts` random
//! prompts x `--samples` responses whose lengths are forced (each response ends at a
//! length drawn from the log-normal, EOS ignored), with the static policy (the engine
//! the paged one replaced: whole chunks, every sequence's maximum length reserved, no
//! refill) against continuous batching over the paged cache, at the same cache memory,
//! interleaved in one process. Reports tokens/s, model calls, rows per call, the cache's
//! peak against the live tokens, and the responses that differ between the two (draws
//! flipped by batched rounding). `--kv-cache-dtype auto,bfloat16` and `--prefix-caching
//! off,on` run several paged engines side by side at the same budget; `--shared-prefix N`
//! puts the same N tokens before every prompt (a system prompt for prefix caching to find).
//! Each engine's decode steps are reported against their budget: kernel launches per
//! decoder layer and copies to the host per step (see `model::budget`), the bytes a step
//! must read, and on CUDA the share of the memory bandwidth (measured by a device copy)
//! that those bytes over the steps' time reach.

use std::sync::OnceLock;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use stapo::model::{PagedKvCache, Qwen3};
use stapo::rollout::{
    generate_stats, EngineConfig, EngineStats, GenerateOptions, KvCacheDtype, Sample, SamplingParams,
    SchedulePolicy,
};

use super::bench_common::{peak_rss, BenchArgs};
use super::bench_lengths::LogNormal;

/// The comparison's sizes, from the command line.
struct Plan {
    prompts: Vec<Vec<u32>>,
    params: SamplingParams,
    lengths: Vec<usize>,
    /// The budget in GB and the rows of each engine.
    budget_gb: f64,
    static_rows: usize,
    paged_rows: usize,
    /// The paged engines, each run in turn: a cache dtype (the static policy keeps the
    /// model's) and whether prefix caching is on.
    variants: Vec<Variant>,
}

/// One paged engine of the comparison.
#[derive(Debug, Clone, Copy)]
struct Variant {
    kv_cache_dtype: KvCacheDtype,
    prefix_caching: bool,
}

impl Plan {
    /// A variant's name where several run: what sets it apart.
    fn name(&self, v: Variant) -> String {
        let dtypes = self.variants.iter().any(|w| w.kv_cache_dtype != v.kv_cache_dtype);
        let caching = self.variants.iter().any(|w| w.prefix_caching != v.prefix_caching);
        let mut parts = Vec::new();
        if dtypes {
            parts.push(format!("cache {}", v.kv_cache_dtype.name()));
        }
        if caching {
            parts.push(format!("prefix caching {}", on_off(v.prefix_caching)));
        }
        parts.join(", ")
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// Runs the comparison; its last line is `rollout: R.RRx the static engine's tokens/s,
/// cache peak C.CC x live tokens`.
pub fn run(m: &Qwen3, a: &BenchArgs) -> anyhow::Result<()> {
    let plan = plan(m, a)?;
    if m.device().is_cuda() {
        let bw = copy_bandwidth(m.device())?;
        println!(
            "device memory bandwidth: {:.0} GB/s (a device-to-device copy of 1 GiB, read + write)",
            bw / 1e9
        );
        let _ = BANDWIDTH.set(bw);
    }
    println!(
        "rollout: {} prompts x {} of {} tokens{}, lengths {} (mean {:.0}), max {} new; cache {:.3} GB: static {} rows, paged {} rows{}",
        plan.prompts.len(),
        plan.params.n,
        a.shared_prefix + a.rollout_prompt,
        if a.shared_prefix > 0 { format!(" (the first {} shared)", a.shared_prefix) } else { String::new() },
        a.lengths.as_deref().unwrap_or(""),
        plan.lengths.iter().sum::<usize>() as f64 / plan.lengths.len().max(1) as f64,
        plan.params.max_new_tokens,
        plan.budget_gb,
        plan.static_rows,
        plan.paged_rows,
        match plan.variants.as_slice() {
            [_] => String::new(),
            v => format!(" (paged: {})", v.iter().map(|&v| plan.name(v)).collect::<Vec<_>>().join(", then ")),
        }
    );
    if !a.rows_sweep.is_empty() {
        return sweep(m, plan, a);
    }
    let kinds = plan.variants.len();
    let label = |v: Variant| match plan.name(v) {
        n if n.is_empty() => "paged  ".to_string(),
        n => format!("paged, {n}"),
    };
    if a.paged_only {
        let mut outs = Vec::new();
        for &v in &plan.variants {
            let (out, p) = once(m, &plan, SchedulePolicy::Continuous, v)?;
            report(&label(v), &p);
            outs.push((v, out, p));
        }
        print_rss();
        print_caching_diffs(&plan, &outs);
        for (v, _, p) in outs.iter().rev() {
            let head = match plan.name(*v) {
                n if n.is_empty() => "rollout (paged only)".to_string(),
                n => format!("rollout (paged only, {n})"),
            };
            println!(
                "{head}: {:.0} tok/s, cache peak {:.2} x live tokens",
                p.tokens_per_sec(),
                p.peak_cache_bytes() as f64 / (p.peak_live_tokens * p.bytes_per_token).max(1) as f64
            );
        }
        return Ok(());
    }
    let (mut stat, mut paged) = (Vec::new(), vec![Vec::new(); kinds]);
    let mut flips = vec![0; kinds];
    let mut last = Vec::new();
    for round in 0..a.rounds.max(1) {
        let (s_out, s) = once(
            m,
            &plan,
            SchedulePolicy::Static,
            Variant { kv_cache_dtype: KvCacheDtype::Auto, prefix_caching: false },
        )?;
        report(&format!("static  (round {round})"), &s);
        last.clear();
        for (i, &v) in plan.variants.iter().enumerate() {
            let (p_out, p) = once(m, &plan, SchedulePolicy::Continuous, v)?;
            report(&format!("{} (round {round})", label(v)), &p);
            flips[i] = s_out.iter().zip(&p_out).filter(|(x, y)| x.response_ids != y.response_ids).count();
            paged[i].push(p.clone());
            last.push((v, p_out, p));
        }
        stat.push(s);
    }
    let tps = |v: &[EngineStats]| {
        v.iter().map(|s| s.tokens).sum::<usize>() as f64 / v.iter().map(|s| s.secs).sum::<f64>().max(1e-9)
    };
    let peak_vs_live = |v: &[EngineStats]| {
        let last = v.last().cloned().unwrap_or_default();
        last.peak_cache_bytes() as f64 / ((last.peak_live_tokens * last.bytes_per_token) as f64).max(1.0)
    };
    print_rss();
    print_caching_diffs(&plan, &last);
    // The first paged engine's comparison last (the line scripts read); the others before it.
    for i in (0..kinds).rev() {
        let name = match plan.name(plan.variants[i]) {
            n if n.is_empty() => plan.variants[i].kv_cache_dtype.name().to_string(),
            n => n,
        };
        println!("responses that differ between the static engine and the paged one ({name}): {}", flips[i]);
        let head = if i == 0 { "rollout".to_string() } else { format!("rollout, paged {name}") };
        let vs_first = if i == 0 {
            String::new()
        } else {
            format!(" ({:.2}x the first paged engine's)", tps(&paged[i]) / tps(&paged[0]))
        };
        println!(
            "{head}: {:.2}x the static engine's tokens/s{vs_first}, cache peak {:.2} x live tokens",
            tps(&paged[i]) / tps(&stat),
            peak_vs_live(&paged[i])
        );
    }
    Ok(())
}

fn plan(m: &Qwen3, a: &BenchArgs) -> anyhow::Result<Plan> {
    let spec = a.lengths.as_deref().ok_or_else(|| {
        anyhow::anyhow!("bench rollout: give the response lengths, e.g. --lengths lognormal:100:4000")
    })?;
    let dist = LogNormal::parse(spec)?;
    let (np, n) = (a.prompts.max(1), a.samples.max(1));
    anyhow::ensure!(a.rollout_prompt >= 1, "--rollout-prompt: at least 1 token");
    let max_new = a.max_new.max(dist.hi);
    let vocab = m.config().vocab_size as u32;
    // The shared prefix draws from another sequence than the prompts' own tokens.
    let shared: Vec<u32> = (0..a.shared_prefix as u32).map(|t| (t * 7_753 + 3) % vocab).collect();
    let prompts: Vec<Vec<u32>> = (0..np as u32)
        .map(|p| {
            let own = (0..a.rollout_prompt as u32).map(|t| (p * 7919 + t * 104_729 + 1) % vocab);
            shared.iter().copied().chain(own).collect()
        })
        .collect();
    let prompt_len = a.shared_prefix + a.rollout_prompt;
    let params =
        SamplingParams { n, max_new_tokens: max_new, ignore_eos: true, seed: 1, ..Default::default() };
    // What one sequence at its maximum length takes: the static engine's reservation.
    // What one sequence at its maximum length takes, in whole blocks: the static
    // engine's reservation.
    let bs = EngineConfig::default().block_size;
    let per_seq = ((prompt_len + max_new - 1).div_ceil(bs) * bs) as f64
        * PagedKvCache::bytes_per_token(m.config(), m.dtype()) as f64;
    let budget_gb = a.kv_cache_gb.unwrap_or(a.max_rows as f64 * per_seq / 1e9);
    // The static engine's rows: whole groups of n that fit the budget at full length.
    let fit = (budget_gb * 1e9 / per_seq * (1.0 + 1e-9)).floor() as usize;
    anyhow::ensure!(
        fit >= n,
        "--kv-cache-gb {budget_gb}: holds {fit} full-length sequences, fewer than one group of {n}"
    );
    Ok(Plan {
        prompts,
        lengths: dist.sample(np * n, 7),
        params,
        budget_gb,
        static_rows: fit / n * n,
        paged_rows: a.paged_rows.unwrap_or_else(|| EngineConfig::default().rows(m)),
        variants: variants(a)?,
    })
}

/// Every `--kv-cache-dtype` with every `--prefix-caching`, in that order.
fn variants(a: &BenchArgs) -> anyhow::Result<Vec<Variant>> {
    let dtypes = a
        .kv_cache_dtype
        .split(',')
        .map(|d| KvCacheDtype::parse(d.trim(), "--kv-cache-dtype"))
        .collect::<Result<Vec<_>, _>>()?;
    let caching = a
        .prefix_caching
        .split(',')
        .map(|c| match c.trim() {
            "on" => Ok(true),
            "off" => Ok(false),
            other => {
                Err(anyhow::anyhow!("--prefix-caching: expected on, off or a list (off,on), got {other:?}"))
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(dtypes
        .iter()
        .flat_map(|&kv_cache_dtype| {
            caching.iter().map(move |&prefix_caching| Variant { kv_cache_dtype, prefix_caching })
        })
        .collect())
}

/// Where the last round ran a paged engine with prefix caching off and on (same cache
/// dtype): the hit rates, and the responses and log-probs that differ between them
/// (none where a cached block's keys and values equal recomputed ones bit for bit).
fn print_caching_diffs(plan: &Plan, runs: &[(Variant, Vec<Sample>, EngineStats)]) {
    for (v, _, s) in runs.iter().filter(|(v, _, _)| v.prefix_caching) {
        // The only variant has no name: no empty parentheses.
        let name = plan.name(*v);
        let of = if name.is_empty() { String::new() } else { format!(" ({name})") };
        println!(
            "prefix cache{of}: hit rate {:.1}% ({} of {} tokens looked up), {} prefill tokens, {} evictions",
            100.0 * s.prefix_cache_hit_rate(),
            s.prefix_cache_hit_tokens,
            s.prefix_cache_queried_tokens,
            s.prefill_tokens,
            s.prefix_cache_evictions
        );
    }
    for (off_v, off, off_s) in runs.iter().filter(|(v, _, _)| !v.prefix_caching) {
        let on = runs.iter().find(|(v, _, _)| v.prefix_caching && v.kv_cache_dtype == off_v.kv_cache_dtype);
        let Some((_, on, _)) = on else { continue };
        let differ = off.iter().zip(on).filter(|(x, y)| x.response_ids != y.response_ids).count();
        let lp = off
            .iter()
            .zip(on)
            .flat_map(|(x, y)| x.old_logprobs.iter().zip(&y.old_logprobs))
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!(
            "prefix caching off vs on (cache {}): {differ} of {} responses differ, largest log-prob difference {lp:e} ({} prefill tokens off)",
            off_v.kv_cache_dtype.name(),
            off.len(),
            off_s.prefill_tokens
        );
    }
}

/// The paged engine at each row cap of `--rows-sweep`, same budget, rounds
/// interleaved; prints each cap's tokens/s over all rounds.
fn sweep(m: &Qwen3, mut plan: Plan, a: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.rows_sweep.iter().all(|&r| r > 0), "--rows-sweep: row caps of at least 1");
    let mut runs: Vec<Vec<EngineStats>> = vec![Vec::new(); a.rows_sweep.len()];
    for round in 0..a.rounds.max(1) {
        for (i, &rows) in a.rows_sweep.iter().enumerate() {
            plan.paged_rows = rows;
            let (_, s) = once(m, &plan, SchedulePolicy::Continuous, plan.variants[0])?;
            report(&format!("paged {rows:>3} rows (round {round})"), &s);
            runs[i].push(s);
        }
    }
    for (rows, v) in a.rows_sweep.iter().zip(&runs) {
        let tokens: usize = v.iter().map(|s| s.tokens).sum();
        let secs: f64 = v.iter().map(|s| s.secs).sum();
        let calls: usize = v.iter().map(|s| s.model_calls).sum();
        let fed: usize = v.iter().map(|s| s.rows_fed).sum();
        println!(
            "rows sweep: max_rows {rows:>3}: {:.0} tok/s, {:.1} rows per call",
            tokens as f64 / secs.max(1e-9),
            fed as f64 / calls.max(1) as f64
        );
    }
    Ok(())
}

/// One rollout under `policy`.
fn once(
    m: &Qwen3,
    plan: &Plan,
    policy: SchedulePolicy,
    v: Variant,
) -> anyhow::Result<(Vec<Sample>, EngineStats)> {
    let rows = if policy == SchedulePolicy::Static { plan.static_rows } else { plan.paged_rows };
    let engine = EngineConfig {
        kv_cache_gb: Some(plan.budget_gb),
        max_rows: Some(rows),
        kv_cache_dtype: v.kv_cache_dtype,
        enable_prefix_caching: v.prefix_caching,
        ..EngineConfig::default()
    };
    let n = plan.params.n;
    let forced = |p: usize, s: usize| plan.lengths[p * n + s];
    let opts = GenerateOptions { engine, policy, lengths: Some(&forced), ..GenerateOptions::default() };
    Ok(generate_stats(m, &plan.prompts, &plan.params, 0, &|_| String::new(), &opts)?)
}

fn print_rss() {
    if let Some(p) = peak_rss() {
        println!("peak memory (RSS): {:.2} GB", p as f64 / 1e9);
    }
}

/// The device's memory bandwidth in bytes/s, where `run` measured it (CUDA).
static BANDWIDTH: OnceLock<f64> = OnceLock::new();

/// Bytes/s of a device-to-device copy of 1 GiB (each byte read once and written once),
/// the best of 5 after a warm-up.
fn copy_bandwidth(dev: &Device) -> anyhow::Result<f64> {
    let n = 1usize << 28; // f32 values
    let src = Tensor::zeros(n, DType::F32, dev)?;
    let mut best = f64::INFINITY;
    for i in 0..6 {
        dev.synchronize()?;
        let t0 = Instant::now();
        let dst = src.copy()?;
        dev.synchronize()?;
        if i > 0 {
            best = best.min(t0.elapsed().as_secs_f64());
        }
        drop(dst);
    }
    Ok(2.0 * (4 * n) as f64 / best)
}

fn report(name: &str, s: &EngineStats) {
    let live = s.peak_live_tokens * s.bytes_per_token;
    println!(
        "{name}: {:.0} tok/s ({} tokens in {:.1} s), {} model calls, {:.1} rows per call, cache peak {:.1} MB \
         (live tokens {:.1} MB, {:.2}x), {} preemptions, {} prefill tokens{}",
        s.tokens_per_sec(),
        s.tokens,
        s.secs,
        s.model_calls,
        s.mean_rows(),
        s.peak_cache_bytes() as f64 / 1e6,
        live as f64 / 1e6,
        s.peak_cache_bytes() as f64 / live.max(1) as f64,
        s.preemptions,
        s.prefill_tokens,
        if s.prefix_cache_queried_tokens > 0 {
            format!(", prefix cache hit rate {:.1}%", 100.0 * s.prefix_cache_hit_rate())
        } else {
            String::new()
        }
    );
    println!("  time: {}", s.phases.line());
    if s.decode_steps > 0 {
        let c = &s.decode_counts;
        let bound = match BANDWIDTH.get() {
            Some(&bw) => format!(", {:.1}% of the bandwidth bound", 100.0 * s.bandwidth_fraction(bw)),
            None => String::new(),
        };
        println!(
            "  decode ({}): {} steps, {:.1} launches per layer ({:.0} per step in the model call), {:.1} copies \
             to the host per step, {:.1} MB read per step at the least{bound}",
            s.decode_path,
            s.decode_steps,
            c.launches_per_layer(),
            c.launches as f64 / s.decode_steps as f64,
            s.host_copies_per_step(),
            s.bytes_per_decode_step() / 1e6,
        );
    }
}
