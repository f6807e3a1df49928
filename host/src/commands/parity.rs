//! `stapo parity`: the same small random model on the CPU in f32 (the
//! reference) and on `--device` (the target), compared on what a run depends
//! on. The target holds f32 master weights; with a half `--dtype` the sampling
//! model is a rollout copy of them in that dtype (`model::RolloutCopy`), as in
//! a run with `rollout_dtype` set:
//!
//! - per-token log-probs and entropies of a left-padded batch (sampling model);
//! - one full RL update of the f32 weights (`train::update`: old log-probs,
//!   loss, backward, AdamW), its loss and gradient norm, then the log-probs
//!   again (and those of the refreshed copy);
//! - the rollout sampler: the device-side draw of `rollout::device` against
//!   the host sampler on the same logits, same seeds.
//!
//! Prints one line per check with the largest difference and its tolerance,
//! and fails when any check is out of tolerance. On a GPU machine this is the
//! first half of `scripts/device_check.sh`; on the CPU, `--dtype bfloat16`
//! checks the rollout precision against f32.

use candle_core::{DType, Device};
use clap::Args;
use rand::rngs::StdRng;
use rand::SeedableRng;
use stapo::model::{self, Grad, PagedSeq, Qwen3, RolloutCopy, TokenBatch};
use stapo::rollout::device::{Blocked, StepLogits};
use stapo::rollout::{generate_stats, EngineConfig, GenerateOptions, Sample, Sampler, SamplingParams};
use stapo::train::{AdamW, AdamWConfig, Sequence, UpdateConfig, UpdateMetrics};

use super::bench_common::ShapeArgs;
use super::DeviceArgs;

#[derive(Args, Debug)]
pub struct ParityArgs {
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Sequences in the batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens of the longest sequence (the others are shorter, left-padded).
    #[arg(long, default_value_t = 96)]
    pub seq: usize,
    /// Largest allowed |log-prob| and |entropy| difference of the sampling
    /// model, in nats; default 2e-3 for float32, 0.15 for a bfloat16/float16
    /// rollout copy. The update is always compared in f32 (master weights).
    #[arg(long)]
    pub tol: Option<f64>,
    /// Learning rate of the compared update.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// Log-prob tolerance (nats) between two f32 models on different devices.
const F32_TOL: f64 = 2e-3;

/// One comparison and its verdict.
struct Check {
    failed: usize,
}

impl Check {
    fn line(&mut self, name: &str, found: f64, tol: f64, note: &str) {
        let ok = found.is_finite() && found <= tol;
        self.failed += usize::from(!ok);
        println!("  {name:<44} {found:>10.3e}  (tol {tol:.1e})  {}{note}", if ok { "ok" } else { "FAIL" });
    }
}

pub fn run(a: ParityArgs) -> anyhow::Result<()> {
    let (device, dtype) = a.device.resolve()?;
    let cfg = a.shape.config()?;
    anyhow::ensure!(a.batch >= 2 && a.seq >= 8, "--batch must be >= 2 and --seq >= 8");
    anyhow::ensure!(a.seq < cfg.vocab_size, "--seq must be below the vocabulary size");
    anyhow::ensure!(
        dtype != DType::F64,
        "--dtype: parity compares float32 masters with float32 or half copies"
    );
    let tol = a.tol.unwrap_or(if dtype == DType::F32 { F32_TOL } else { 0.15 });
    println!(
        "parity: {} {} against cpu float32; {:.1}M params ({} layers, hidden {}, vocab {}), batch {} x {}",
        a.device.device,
        model::dtype_name(dtype),
        cfg.num_params() as f64 / 1e6,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        a.batch,
        a.seq
    );
    // model::init draws on the host, so one seed gives the same weights everywhere.
    // The device model holds f32 master weights, as in a run; a half `--dtype`
    // is the rollout copy made from it (model::RolloutCopy), which samples.
    let reference = model::init(&cfg, 1, 0.05, DType::F32, &Device::Cpu)?;
    let master = model::init(&cfg, 1, 0.05, DType::F32, &device)?;
    let copy = (dtype != DType::F32).then(|| RolloutCopy::new(&master, dtype)).transpose()?;
    let rows = token_rows(&cfg, a.batch, a.seq);
    let mut check = Check { failed: 0 };
    let half = if copy.is_some() { format!(" ({} copy)", model::dtype_name(dtype)) } else { String::new() };

    // 1. Log-probs and entropies of every real next-token position.
    let (lp_ref, h_ref) = logprobs(&reference, &rows)?;
    let (lp_dev, h_dev) = logprobs(copy.as_ref().map_or(&master, |c| c.model()), &rows)?;
    check.line(&format!("log-probs{half}"), max_diff(&lp_ref, &lp_dev), tol, "");
    check.line(&format!("entropies{half}"), max_diff(&h_ref, &h_dev), tol, "");

    // 2. One RL update of the f32 weights on each, then the log-probs again.
    let seqs = sequences(&rows);
    let (m_ref, lp_ref2) = one_update(&reference, &seqs, &rows, a.lr)?;
    let (m_dev, lp_dev2) = one_update(&master, &seqs, &rows, a.lr)?;
    check.line(
        "update: |loss difference|",
        (m_ref.loss - m_dev.loss).abs() as f64,
        1e-4,
        &format!("  cpu {:.6} vs {:.6}", m_ref.loss, m_dev.loss),
    );
    check.line(
        "update: grad norm (relative)",
        ((m_ref.grad_norm - m_dev.grad_norm).abs() / m_ref.grad_norm.abs().max(1e-6)) as f64,
        1e-3,
        &format!("  cpu {:.6} vs {:.6}", m_ref.grad_norm, m_dev.grad_norm),
    );
    let moved = max_diff(&lp_ref, &lp_ref2);
    // Adam's first step moves every weight by about lr whatever the gradient's
    // size, so a weight whose gradient is ~0 may move the other way on the other
    // device: allowed for by 5% of how far the update moved the log-probs.
    check.line(
        "log-probs after the update",
        max_diff(&lp_ref2, &lp_dev2),
        F32_TOL + 0.05 * moved,
        &format!("  (the update moved them by up to {moved:.3e})"),
    );
    if let Some(c) = &copy {
        c.refresh(&master)?;
        let (lp_copy2, _) = logprobs(c.model(), &rows)?;
        check.line(
            &format!("log-probs after the update{half}"),
            max_diff(&lp_ref2, &lp_copy2),
            tol + 0.05 * moved,
            "  (refreshed from the f32 master)",
        );
    }
    let target = copy.as_ref().map_or(&master, |c| c.model());

    // 3. Sampling from the target's last-position logits: device-side blocks
    // against the host sampler on the same logits.
    let batch = TokenBatch::left_padded(&rows, 0, &device)?;
    let h = target.forward_hidden(&batch, Grad::Off)?;
    let last = h.narrow(1, a.seq - 1, 1)?.squeeze(1)?;
    let logits = target.lm_head(&last, Grad::Off)?;
    let host = match StepLogits::host(&logits)? {
        StepLogits::Host { data, .. } => data,
        _ => unreachable!("StepLogits::host copies to the host"),
    };
    let v = cfg.vocab_size;
    for (name, temperature) in [("sampling T=1.0", 1.0), ("sampling T=0.7", 0.7), ("sampling greedy", 0.0)] {
        let s = Sampler::new(&SamplingParams { temperature, ..SamplingParams::default() });
        let blocked = Blocked::new(&logits, &s)?;
        let (mut dev_rng, mut host_rng): (Vec<StdRng>, Vec<StdRng>) =
            (0..a.batch).map(|r| (StdRng::seed_from_u64(r as u64), StdRng::seed_from_u64(r as u64))).unzip();
        let (mut draws, mut mismatched, mut stat_diff) = (0usize, 0usize, 0f64);
        for _ in 0..32 {
            let got = blocked.draw(&s, dev_rng.iter_mut().enumerate().collect())?;
            for (r, g) in got.iter().enumerate() {
                let want = s.draw(&host[r * v..(r + 1) * v], &mut host_rng[r])?;
                draws += 1;
                if g.id != want.id {
                    mismatched += 1;
                    continue;
                }
                for (x, y) in
                    [(g.logprob, want.logprob), (g.logprob_raw, want.logprob_raw), (g.entropy, want.entropy)]
                {
                    stat_diff = stat_diff.max((x - y).abs() as f64);
                }
            }
        }
        // A draw may flip only when its uniform lands within float rounding of a
        // token boundary: allow 1% of draws.
        check.line(
            &format!("{name}: ids differing"),
            mismatched as f64 / draws as f64,
            0.01,
            &format!("  ({mismatched} of {draws})"),
        );
        check.line(&format!("{name}: stats of equal ids"), stat_diff, 1e-4, "");
    }
    // The step's own sampler (on CUDA the sampling kernel, filters included)
    // against the host sampler with the same generators.
    for (name, temperature, top_k, top_p, min_p) in [
        ("step sampler T=1.0", 1.0, None, 1.0, 0.0),
        ("step sampler T=0.7 top-k 50 top-p 0.9 min-p 0.05", 0.7, Some(50), 0.9, 0.05),
    ] {
        let s =
            Sampler::new(&SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() });
        let step = StepLogits::new(&logits, &s)?;
        let (mut dev_rng, mut host_rng): (Vec<StdRng>, Vec<StdRng>) =
            (0..a.batch).map(|r| (StdRng::seed_from_u64(r as u64), StdRng::seed_from_u64(r as u64))).unzip();
        let (mut draws, mut mismatched) = (0usize, 0usize);
        for _ in 0..32 {
            let got = step.draw(&s, dev_rng.iter_mut().enumerate().collect())?;
            for (r, g) in got.iter().enumerate() {
                let want = s.draw(&host[r * v..(r + 1) * v], &mut host_rng[r])?;
                draws += 1;
                mismatched += usize::from(g.id != want.id);
            }
        }
        check.line(
            &format!("{name}: ids differing"),
            mismatched as f64 / draws as f64,
            0.01,
            &format!("  ({mismatched} of {draws})"),
        );
    }

    // 4. The rollout engine (paged cache, continuous batching) end to end on the
    // target: against the CPU reference in f32, and against itself with a pool so
    // small that sequences are preempted and recomputed.
    engine_checks(&mut check, &reference, target, &rows, dtype, tol)?;
    paged_attention_check(&mut check, target, dtype)?;

    if check.failed > 0 {
        anyhow::bail!("parity: {} check(s) out of tolerance", check.failed);
    }
    println!("parity: all checks passed");
    Ok(())
}

/// Responses of the paged engine on `reference` (CPU, f32) and `target`, same seeds:
/// in f32 the two must sample the same tokens (a near-tie may flip: up to 1 response in
/// 8 may diverge) with old log-probs within `tol` on the common prefix; the target must
/// give the same responses (up to near-tie flips: 1 in 8 in f32, half in bf16, whose
/// rounding moves logits by ~1e-2) with a pool small enough to force preemption
/// (recompute) as with a large one, and the same old log-probs on common prefixes.
fn engine_checks(
    check: &mut Check,
    reference: &Qwen3,
    target: &Qwen3,
    rows: &[Vec<u32>],
    dtype: DType,
    tol: f64,
) -> anyhow::Result<()> {
    let prompts: Vec<Vec<u32>> = rows.iter().take(4).map(|r| r[..r.len().min(24)].to_vec()).collect();
    let params =
        SamplingParams { n: 4, max_new_tokens: 48, ignore_eos: true, seed: 7, ..SamplingParams::default() };
    let run = |m: &Qwen3, engine: EngineConfig| {
        let opts = GenerateOptions { engine, ..GenerateOptions::default() };
        generate_stats(m, &prompts, &params, 0, &|_| String::new(), &opts)
    };
    let roomy = EngineConfig { max_rows: Some(16), ..EngineConfig::default() };
    let (got, stats) = run(target, roomy)?;
    // Room for about 3 full sequences at a time, with 16 rows wanted: preemption.
    let per_seq = (24 + 48) * model::PagedKvCache::bytes_per_token(target.config(), target.dtype());
    let tight = EngineConfig { kv_cache_gb: Some(3.0 * per_seq as f64 / 1e9), ..roomy };
    let (again, tight_stats) = run(target, tight)?;
    let (diverged, lp) = compare_samples(&got, &again);
    // A recomputed sequence is prefilled in one chunk where it was decoded token by
    // token: the same math in another order, so a near-tie may flip (often in bf16).
    check.line(
        "engine: responses differing after preemption",
        diverged as f64 / got.len() as f64,
        if dtype == DType::F32 { 0.125 } else { 0.5 },
        &format!(
            "  ({diverged} of {}; {} preemptions, {} rows per call vs {:.1})",
            got.len(),
            tight_stats.preemptions,
            format_args!("{:.1}", tight_stats.mean_rows()),
            stats.mean_rows()
        ),
    );
    check.line("engine: old log-probs of equal prefixes (preempted)", lp, tol, "");
    if tight_stats.preemptions == 0 {
        check.line("engine: the tight pool preempted", 1.0, 0.0, "  (no preemption happened)");
    }
    if dtype == DType::F32 {
        let (want, _) = run(reference, roomy)?;
        let (diverged, lp) = compare_samples(&want, &got);
        check.line(
            "engine: responses differing from cpu",
            diverged as f64 / want.len() as f64,
            0.125,
            &format!("  ({diverged} of {})", want.len()),
        );
        check.line("engine: old log-probs of equal prefixes", lp, tol, "");
    }
    Ok(())
}

/// The paged attention the target runs by default (the CUDA kernel on a GPU, the
/// fused kernel on the CPU in f32) against the composed gathers, on one cache and
/// the same calls: a prefill of two sequences, then a decode token for each with a
/// third sequence that shares the first one's full first block and prefills 7
/// tokens after it. The largest logit difference relative to the largest logit:
/// within 1e-5 in f32, 5e-2 in a half dtype (the composed ops round
/// scores and probabilities to it, the kernels sum in f32).
fn paged_attention_check(check: &mut Check, m: &Qwen3, dtype: DType) -> anyhow::Result<()> {
    let vocab = m.config().vocab_size as u32;
    let toks =
        |seed: u32, n: u32| (0..n).map(|i| (seed * 7919 + i * 104_729 + 3) % vocab).collect::<Vec<u32>>();
    let seq = |blocks: &[u32], len, new| PagedSeq { blocks: blocks.to_vec(), len, new };
    let calls = [
        ([toks(1, 20), toks(2, 5)].concat(), vec![seq(&[3, 1], 20, 20), seq(&[0], 5, 5)]),
        (
            [toks(4, 1), toks(5, 1), toks(3, 7)].concat(),
            vec![seq(&[3, 1], 21, 1), seq(&[0], 6, 1), seq(&[3, 2], 23, 7)],
        ),
    ];
    // Each path on its own cache (the composed ops may keep it in another dtype).
    let logits = |k: model::Kernels| -> anyhow::Result<Vec<Vec<f32>>> {
        k.scope(|| {
            let cache = model::PagedKvCache::new(m, 8, 16)?;
            // The kernels' run over the fused projections, as rollouts take them.
            let fused = match k {
                model::Kernels::Fused => Some(model::DecodeWeights::new(m)?),
                model::Kernels::Composed => None,
            };
            let mut out = Vec::new();
            for (tokens, seqs) in &calls {
                let l = model::decode_paged(m, fused.as_ref(), tokens, seqs, &cache)?;
                out.push(l.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            Ok(out)
        })
    };
    let (composed, kernel) = (logits(model::Kernels::Composed)?, logits(model::Kernels::Fused)?);
    let mut worst = 0f64;
    for (c, k) in composed.iter().zip(&kernel) {
        let scale = c.iter().fold(0f64, |s, &v| s.max(v.abs() as f64)).max(1e-6);
        worst = worst.max(max_diff(c, k) / scale);
    }
    let tol = if dtype == DType::F32 { 1e-5 } else { 5e-2 };
    check.line("paged attention: kernel vs composed (rel.)", worst, tol, "");
    Ok(())
}

/// Responses of `b` whose tokens differ from `a`'s (same order), and the largest
/// old-log-prob difference over the tokens before each first difference.
fn compare_samples(a: &[Sample], b: &[Sample]) -> (usize, f64) {
    let (mut diverged, mut lp) = (0, 0f64);
    for (x, y) in a.iter().zip(b) {
        let same = x.response_ids.iter().zip(&y.response_ids).take_while(|(i, j)| i == j).count();
        diverged += usize::from(same < x.response_ids.len().max(y.response_ids.len()));
        for (p, q) in x.old_logprobs[..same].iter().zip(&y.old_logprobs[..same]) {
            lp = lp.max((p - q).abs() as f64);
        }
    }
    (diverged + a.len().abs_diff(b.len()), lp)
}

/// `batch` token rows of decreasing length (the longest `seq`), deterministic.
fn token_rows(cfg: &model::Config, batch: usize, seq: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            let len = seq - (b * seq / (2 * batch));
            (0..len).map(|t| ((b * 7919 + t * 104_729 + 1) % cfg.vocab_size) as u32).collect()
        })
        .collect()
}

/// Next-token log-probs and entropies at every real position of `rows`, flat, as f32.
fn logprobs(m: &Qwen3, rows: &[Vec<u32>]) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let batch = TokenBatch::left_padded(rows, 0, m.device())?;
    let (b, l) = batch.dims();
    let h = m.forward_hidden(&batch, Grad::Off)?.narrow(1, 0, l - 1)?;
    let logits = m.lm_head(&h, Grad::Off)?;
    let targets = batch.ids.narrow(1, 1, l - 1)?;
    let (lp, ent) = model::logprob_entropy(&logits, &targets)?;
    let lp = lp.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let ent = ent.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (mut out_lp, mut out_h) = (Vec::new(), Vec::new());
    for r in 0..b {
        // Position j predicts token j + 1; keep those whose input token is real.
        for j in 0..l - 1 {
            if batch.mask[r][j] == 1 {
                out_lp.push(lp[r][j]);
                out_h.push(ent[r][j]);
            }
        }
    }
    Ok((out_lp, out_h))
}

/// The rows as RL sequences: the first quarter of each is the prompt, groups
/// of two with one rewarded response each (so advantages are +-1).
fn sequences(rows: &[Vec<u32>]) -> Vec<Sequence> {
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            let p = (r.len() / 4).max(1);
            Sequence {
                prompt_ids: r[..p].to_vec(),
                response_ids: r[p..].to_vec(),
                rollout_logprobs: None,
                reward: (i % 2) as f32,
                group: i / 2,
                truncated: false,
            }
        })
        .collect()
}

/// One `train::update` of `m` (default objective, one mini-batch), then the
/// log-probs of `rows` under the updated weights.
fn one_update(
    m: &Qwen3,
    seqs: &[Sequence],
    rows: &[Vec<u32>],
    lr: f64,
) -> anyhow::Result<(UpdateMetrics, Vec<f32>)> {
    let mut opt = AdamW::new(m.params(), AdamWConfig { lr, ..AdamWConfig::default() })?;
    let metrics = stapo::train::update(m, &mut opt, None, seqs, &UpdateConfig::default(), lr, 0)?.metrics;
    anyhow::ensure!(metrics.optimizer_steps == 1, "parity: the update took no optimizer step");
    Ok((metrics, logprobs(m, rows)?.0))
}

fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max)
}
