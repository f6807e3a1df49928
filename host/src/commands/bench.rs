//! `stapo bench`: times the pieces of a training step and generation for a
//! model shape given on the command line, with achieved GFLOP/s and peak memory.

use std::time::Instant;

use anyhow::Context;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use stapo::model::{self, Config, Grad, Qwen3, TokenBatch};
use stapo::train::update::{Phase, PhaseTimes};
use stapo::train::{AdamW, AdamWConfig, UpdateConfig};

use super::bench_common::{
    cpu_seconds, forward_flops, peak_rss, report, reset_peak_rss, synthetic_sequences, time,
    update_forward_flops,
};
pub use super::bench_common::{BenchArgs, What};

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    model::fused::simd::check_env().map_err(anyhow::Error::msg)?;
    if a.what == What::Kernels {
        return bench_kernels(a.reps);
    }
    if a.what == What::Async {
        return super::bench_async::run(&a);
    }
    let (device, dtype) = a.device.resolve()?;
    let cfg = a.shape.config()?;
    let seq = *a.seqs.first().context("--seq: give at least one length")?;
    anyhow::ensure!(a.seqs.iter().all(|&s| s >= 2), "--seq: every length must be at least 2");
    println!(
        "shape: {:.1}M params, {} layers, hidden {}, heads {}/{}, head_dim {}, intermediate {}, vocab {}; batch {} x {}; {:?} on {:?}",
        cfg.num_params() as f64 / 1e6,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        a.batch,
        a.seqs.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","),
        dtype,
        device_name(&device)
    );
    if a.what == What::Optimizer {
        return bench_optimizer(cfg.num_params(), a.reps);
    }
    if a.what == What::Gemm {
        return super::bench_gemm::run(&cfg, &a, seq);
    }
    let recompute = a.recompute.as_deref().map(|r| model::Recompute::parse(r, "--recompute")).transpose()?;
    let mut options = model::ModelOptions::process_default();
    if let Some(k) = &a.kernels {
        options.kernels = model::Kernels::parse(k, "--kernels")?;
    }
    options.recompute = recompute.unwrap_or(options.recompute);
    options.set_process_default();
    println!("kernels: {}, recompute: {}", options.kernels.name(), options.recompute.name());
    if device.is_cpu() && matches!(a.what, What::Train | What::Generate | What::Rollout) {
        // Which SIMD path the CPU kernels run, and this CPU's measured peaks beside it.
        println!("{}", model::fused::simd::describe());
        println!("{}", model::fused::roofline::line(&model::fused::roofline::measure(200)));
    }
    if a.what == What::Train && (a.seqs.len() > 1 || a.table) && !a.table_row {
        return train_table(&a, &cfg, options);
    }
    let mut m = model::init(&cfg, 0, 0.02, dtype, &device)?;
    if let Some(lora) = a.lora.config()? {
        m.add_lora(&lora, 0)?;
        let n: usize = m.lora_params().iter().map(|(_, v)| v.elem_count()).sum();
        println!(
            "lora: rank {}, {} targets, {:.2}M adapter parameters (f32)",
            lora.rank,
            lora.targets.len(),
            n as f64 / 1e6
        );
    }
    if a.table_row {
        return table_row(&m, &cfg, &a, seq);
    }
    if a.what == What::Rollout && a.partial.is_some() {
        return super::bench_partial::run(&m, &a);
    }
    if a.what == What::Rollout {
        return super::bench_rollout::run(&m, &a);
    }
    if a.what == What::Shard {
        return super::bench_shard::run(&m, &cfg, &a, seq);
    }
    if let (What::Train, Some(lengths)) = (a.what, &a.lengths) {
        let plan = super::bench_lengths::Plan {
            lengths: super::bench_lengths::LogNormal::parse(lengths)?,
            batch: a.batch,
            prompt: a.prompt,
            micro_batch: a.micro_batch,
            budget: a.max_tokens_per_micro,
            reps: a.reps,
        };
        return super::bench_lengths::run(&m, &cfg, &plan);
    }
    let rows: Vec<Vec<u32>> = (0..a.batch)
        .map(|b| (0..seq).map(|t| ((b * 7919 + t * 104_729) % cfg.vocab_size) as u32).collect())
        .collect();
    let batch = TokenBatch::left_padded(&rows, 0, &device)?;
    if a.what == What::Matmul {
        return bench_matmul(&cfg, &a, seq, &device);
    }
    if matches!(a.what, What::Forward | What::All) {
        let secs = time(a.reps, || {
            let h = m.forward_hidden(&batch, Grad::Off)?;
            let logits = m.lm_head(&h, Grad::Off)?;
            logits.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
            Ok(())
        })?;
        report("forward (no grad)", secs, Some(forward_flops(&cfg, a.batch, seq)), a.batch * seq);
    }
    if matches!(a.what, What::Train | What::All) {
        bench_train(&m, &cfg, &a, seq)?;
    }
    if matches!(a.what, What::Generate | What::All) {
        bench_generate(&m, &a)?;
    }
    if let Some(p) = peak_rss() {
        println!("peak memory (RSS): {:.2} GB", p as f64 / 1e9);
    }
    Ok(())
}

/// `stapo bench kernels`: the CPU paths, the roofline peaks, the self-check
/// table ([`model::fused::selfcheck`]); an error when a row fails.
fn bench_kernels(reps: usize) -> anyhow::Result<()> {
    use model::fused::{roofline, selfcheck, simd};
    println!("{}", simd::describe());
    for n in &simd::selection().notes {
        println!("note: {n}");
    }
    for s in selfcheck::skipped() {
        println!("{s}");
    }
    println!("{}", roofline::line(&roofline::measure(200)));
    let rows = selfcheck::run(false, reps.clamp(1, 5));
    print!("{}", selfcheck::table(&rows));
    let failed = rows.iter().filter(|r| !r.pass()).count();
    anyhow::ensure!(failed == 0, "kernel self-check: {failed} of {} rows FAILED", rows.len());
    println!("kernel self-check: all {} rows passed", rows.len());
    Ok(())
}

/// Times the pieces of one update; see [`What::Train`].
fn bench_train(m: &Qwen3, cfg: &Config, a: &BenchArgs, seq: usize) -> anyhow::Result<()> {
    let device = m.device().clone();
    let resp = a.response.unwrap_or(seq / 2).clamp(1, seq.saturating_sub(1).max(1));
    let (b, p) = (a.batch, seq - resp);
    let seqs = synthetic_sequences(cfg, b, seq, resp);
    let rows: Vec<Vec<u32>> =
        seqs.iter().map(|s| [s.prompt_ids.clone(), s.response_ids.clone()].concat()).collect();
    let tokens = TokenBatch::left_padded(&rows, 0, &device)?;
    let targets = Tensor::from_vec(
        seqs.iter().flat_map(|s| s.response_ids.clone()).collect::<Vec<_>>(),
        (b, resp),
        &device,
    )?;
    let adv = Tensor::from_vec(
        (0..b).map(|i| if i % 2 == 0 { -1f32 } else { 1.0 }).collect::<Vec<_>>(),
        (b, 1),
        &device,
    )?;
    let fwd = update_forward_flops(cfg, b, seq, resp);
    let logp_of = |grad: Grad| -> anyhow::Result<(Tensor, Tensor)> {
        let h = m.forward_hidden_from(&tokens, p - 1, grad)?.narrow(1, 0, resp)?;
        let s = m.token_stats(&h, &targets, grad)?;
        Ok((s.logp, s.entropy))
    };
    let mut opt = AdamW::new(m.trainable_params(), AdamWConfig { lr: 1e-7, ..AdamWConfig::default() })?;
    let (mut t_old, mut t_fwd, mut t_bwd, mut t_opt) = (0f64, 0f64, 0f64, 0f64);
    let mut best = [f64::INFINITY; 5];
    let mut cpu = [0f64; 4];
    let cpu_now = || cpu_seconds().unwrap_or(0.0);
    let reps = a.reps.max(1);
    let cpu0 = cpu_seconds();
    for rep in 0..=reps {
        let c0 = cpu_now();
        let s = Instant::now();
        let (old, _) = logp_of(Grad::Off)?;
        old.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let d_old = s.elapsed().as_secs_f64();
        let c1 = cpu_now();
        let s = Instant::now();
        // Token-mean policy gradient over the response: -sum(adv * logp) / tokens.
        let (logp, _) = logp_of(Grad::Track)?;
        let loss = (logp.to_dtype(DType::F32)?.broadcast_mul(&adv)?.sum_all()? * (-1.0 / (b * resp) as f64))?;
        loss.to_scalar::<f32>()?;
        let d_fwd = s.elapsed().as_secs_f64();
        let c2 = cpu_now();
        let s = Instant::now();
        let grads = loss.backward()?;
        let d_bwd = s.elapsed().as_secs_f64();
        let c3 = cpu_now();
        let s = Instant::now();
        opt.step(&grads, 1e-7)?;
        let d_opt = s.elapsed().as_secs_f64();
        drop(grads);
        let c4 = cpu_now();
        if rep > 0 {
            for (acc, d) in cpu.iter_mut().zip([c1 - c0, c2 - c1, c3 - c2, c4 - c3]) {
                *acc += d;
            }
            t_old += d_old;
            t_fwd += d_fwd;
            t_bwd += d_bwd;
            t_opt += d_opt;
            for (b, d) in best.iter_mut().zip([d_old, d_fwd, d_bwd, d_opt, d_old + d_fwd + d_bwd + d_opt]) {
                *b = b.min(d);
            }
        }
    }
    let r = reps as f64;
    let n = b * seq;
    println!(
        "update pieces: {b} x {} tokens ({p} prompt + {resp} response), mean of {reps} after a warm-up",
        seq
    );
    report("old-policy forward (no grad)", t_old / r, Some(fwd), n);
    report("forward + loss", t_fwd / r, Some(fwd), n);
    report("backward", t_bwd / r, Some(2.0 * fwd), n);
    report("optimizer (AdamW)", t_opt / r, None, n);
    report("sum of pieces", (t_old + t_fwd + t_bwd + t_opt) / r, Some(4.0 * fwd), n);
    println!(
        "best of {reps} (ms): old-policy {:.0}, forward {:.0}, backward {:.0}, optimizer {:.0}, sum {:.0}",
        best[0] * 1e3,
        best[1] * 1e3,
        best[2] * 1e3,
        best[3] * 1e3,
        best[4] * 1e3
    );
    println!(
        "process cpu s/rep: old-policy {:.2}, forward {:.2}, backward {:.2}, optimizer {:.2}",
        cpu[0] / r,
        cpu[1] / r,
        cpu[2] / r,
        cpu[3] / r
    );
    let cpu1 = cpu_seconds();

    // The real thing: one `train::update` (recomputed old log-probs, one mini-batch).
    let ucfg = UpdateConfig::default();
    let mut best_update = f64::INFINITY;
    let (mut total_wall, mut total_cpu) = (0f64, 0f64);
    let mut calls = 0;
    let secs = time(a.reps, || {
        // The warm-up update runs first, unrecorded; every timed one records its phases.
        if calls == 1 {
            PhaseTimes::start();
        }
        calls += 1;
        let (c, s) = (cpu_now(), Instant::now());
        stapo::train::update(m, &mut opt, None, &seqs, &ucfg, 1e-7, 0)?;
        let d = s.elapsed().as_secs_f64();
        if PhaseTimes::recording() {
            total_wall += d;
            total_cpu += cpu_now() - c;
        }
        best_update = best_update.min(d);
        Ok(())
    })?;
    let phases = PhaseTimes::stop();
    // One epoch over one mini-batch takes the old log-probs from the forward
    // with the graph: the old-policy forward runs only when the phases say so.
    let old = if phases.get(Phase::OldPolicy).wall > 0.0 { fwd } else { 0.0 };
    report("full update step", secs, Some(3.0 * fwd + old), n);
    report("full update step (best)", best_update, Some(3.0 * fwd + old), n);
    let flops = [old, fwd - head_flops(cfg, b, resp), head_flops(cfg, b, resp), 2.0 * fwd, 0.0];
    print!("{}", phase_table(&phases, (total_wall, total_cpu), reps, &flops));
    if let (Some(c0), Some(c1), Some(c2)) = (cpu0, cpu1, cpu_seconds()) {
        println!(
            "cpu time: pieces {:.2} s/rep, update {:.2} s/rep ({} threads available)",
            (c1 - c0) / (r + 1.0),
            (c2 - c1) / (r + 1.0),
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
    }
    Ok(())
}

/// The forward flops of the head over `resp` positions of `b` rows.
fn head_flops(cfg: &Config, b: usize, resp: usize) -> f64 {
    2.0 * (b * resp) as f64 * cfg.hidden_size as f64 * cfg.vocab_size as f64
}

/// The phases of the timed updates as a table, per update: wall seconds,
/// share of the update, CPU seconds and CPU over wall (how many cores the
/// phase kept busy), GFLOP/s where `flops` (per update, by phase) says; the
/// host work between the phases is the update's time less theirs.
fn phase_table(t: &PhaseTimes, (wall, cpu): (f64, f64), reps: usize, flops: &[f64; 5]) -> String {
    use std::fmt::Write;
    let r = reps.max(1) as f64;
    let mut out = format!(
        "update phases, per update (mean of {reps}):\n{:<40} {:>9} {:>7} {:>9} {:>8} {:>9}\n",
        "phase", "wall ms", "share", "cpu ms", "cpu/wall", "GFLOP/s"
    );
    let mut row = |name: &str, w: f64, c: f64, f: f64| {
        let gf = if f > 0.0 && w > 0.0 { format!("{:.1}", f / w / 1e9) } else { "-".into() };
        let ratio = if w > 0.0 { format!("{:.2}", c / w) } else { "-".into() };
        let share = if wall > 0.0 { 100.0 * w * r / wall } else { 0.0 };
        let _ =
            writeln!(out, "{name:<40} {:>9.1} {:>6.1}% {:>9.1} {ratio:>8} {gf:>9}", w * 1e3, share, c * 1e3);
    };
    for (p, f) in Phase::ALL.iter().zip(flops) {
        let pt = t.get(*p);
        row(p.name(), pt.wall / r, pt.cpu / r, *f);
    }
    row("host work between the phases", (wall - t.wall()).max(0.0) / r, (cpu - t.cpu()).max(0.0) / r, 0.0);
    row("whole update", wall / r, cpu / r, flops.iter().sum());
    out
}

/// One full `train::update` (AdamW, one mini-batch) per length of `--seq`,
/// each length in a fresh process (this program with `--table-row`): time,
/// tokens/s, peak RSS, and the growth of the peak per extra token from the
/// previous length.
fn train_table(a: &BenchArgs, cfg: &Config, options: model::ModelOptions) -> anyhow::Result<()> {
    println!(
        "full update step (AdamW, one mini-batch), batch {}, response {} per sequence, {} kernels, \
         recompute {}, mean of {} after {} warm-up; each length in a fresh process",
        a.batch,
        a.response.map_or("seq/2".to_string(), |r| r.to_string()),
        options.kernels.name(),
        options.recompute.name(),
        a.reps.max(1),
        a.warmup
    );
    println!(
        "{:>7} {:>8} {:>10} {:>9} {:>9} {:>10}",
        "seq", "tokens", "time (s)", "tok/s", "peak GB", "MB/token"
    );
    let exe = std::env::current_exe().context("bench: cannot find this program to rerun it")?;
    let mut prev: Option<(usize, u64)> = None;
    for &seq in &a.seqs {
        let out = std::process::Command::new(&exe)
            .args(row_args(std::env::args().skip(1), seq))
            .output()
            .with_context(|| format!("bench: running {}", exe.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let row = stdout.lines().find_map(|l| l.strip_prefix("table-row "));
        let (tokens, secs, peak) = match (out.status.success(), row) {
            (true, Some(row)) => parse_row(row).with_context(|| format!("bench: bad row {row:?}"))?,
            _ => anyhow::bail!(
                "bench: the run for --seq {seq} failed ({}):\n{}{}",
                out.status,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        let growth = match prev {
            Some((t, p)) if tokens > t => {
                format!("{:>10.3}", (peak as f64 - p as f64) / 1e6 / (tokens - t) as f64)
            }
            _ => format!("{:>10}", "-"),
        };
        println!(
            "{seq:>7} {tokens:>8} {secs:>10.2} {:>9.0} {:>9.2} {growth}",
            tokens as f64 / secs,
            peak as f64 / 1e9
        );
        // The numerator of MFU (layers' recomputation not counted): a script divides it by
        // the device's peak.
        let flops = model::budget::update_flops_per_token(cfg, seq);
        println!(
            "  model FLOPs at seq {seq}: {flops:.4e} per token, {:.2} TFLOP/s",
            flops * tokens as f64 / secs / 1e12
        );
        prev = Some((tokens, peak));
    }
    Ok(())
}

/// The arguments of this run with `--seq` replaced by one length and
/// `--table-row` added.
fn row_args(mut args: impl Iterator<Item = String>, seq: usize) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(x) = args.next() {
        if x == "--seq" {
            args.next();
        } else if !x.starts_with("--seq=") {
            out.push(x);
        }
    }
    out.extend(["--seq".to_string(), seq.to_string(), "--table-row".to_string()]);
    out
}

/// `tokens seconds peak-bytes` from a `--table-row` line.
fn parse_row(row: &str) -> anyhow::Result<(usize, f64, u64)> {
    let f: Vec<&str> = row.split_whitespace().collect();
    anyhow::ensure!(f.len() == 3, "expected 3 fields");
    Ok((f[0].parse()?, f[1].parse()?, f[2].parse()?))
}

/// One length of [`train_table`]: `warmup` then `reps` full updates from a
/// fresh optimizer, the latter timed, printed as `table-row <tokens> <seconds per update> <peak RSS bytes>`.
fn table_row(m: &Qwen3, cfg: &Config, a: &BenchArgs, seq: usize) -> anyhow::Result<()> {
    let mut opt = AdamW::new(m.trainable_params(), AdamWConfig { lr: 1e-7, ..AdamWConfig::default() })?;
    let ucfg = UpdateConfig::default();
    let reps = a.reps.max(1);
    let resp = a.response.unwrap_or(seq / 2).clamp(1, seq - 1);
    let seqs = synthetic_sequences(cfg, a.batch, seq, resp);
    for _ in 0..a.warmup {
        stapo::train::update(m, &mut opt, None, &seqs, &ucfg, 1e-7, 0)?;
    }
    reset_peak_rss();
    let start = Instant::now();
    for _ in 0..reps {
        stapo::train::update(m, &mut opt, None, &seqs, &ucfg, 1e-7, 0)?;
    }
    let secs = start.elapsed().as_secs_f64() / reps as f64;
    println!("table-row {} {secs} {}", a.batch * seq, peak_rss().unwrap_or(0));
    Ok(())
}

/// Times `a @ b` for the shapes of the step, with `b` contiguous or a transposed view.
fn bench_matmul(cfg: &Config, a: &BenchArgs, seq: usize, device: &Device) -> anyhow::Result<()> {
    let n = a.batch * seq;
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let r = |s: &[usize]| Tensor::randn(0f32, 1.0, s, device);
    for (name, m, k, nn) in [
        ("x @ W^T  gate/up", n, h, i),
        ("dy @ W   (dx of down)", n, h, i),
        ("x^T @ dy (dW of gate)", h, n, i),
        ("lm head", n, h, cfg.vocab_size),
    ] {
        let x = r(&[m, k])?;
        let w = r(&[nn, k])?;
        let wt = w.t()?.contiguous()?;
        let xt = r(&[k, m])?;
        let flops = 2.0 * (m * k * nn) as f64;
        let t1 = time(a.reps, || {
            let _ = x.matmul(&w.t()?)?;
            Ok(())
        })?;
        let t2 = time(a.reps, || {
            let _ = x.matmul(&wt)?;
            Ok(())
        })?;
        let t3 = time(a.reps, || {
            let _ = xt.t()?.matmul(&wt)?;
            Ok(())
        })?;
        report(&format!("{name} {m}x{k}x{nn} rhs^T view"), t1, Some(flops), n);
        report(&format!("{name} rhs contiguous"), t2, Some(flops), n);
        report(&format!("{name} lhs^T view"), t3, Some(flops), n);
    }
    // Elementwise: what each node of candle's backward costs (zeros_like + add).
    for len in [n * h, n * i] {
        let (x, y) = (r(&[len])?, r(&[len])?);
        let t1 = time(a.reps, || {
            let _ = (&x + &y)?;
            Ok(())
        })?;
        let t2 = time(a.reps, || {
            let _ = (x.zeros_like()? + &y)?;
            Ok(())
        })?;
        println!("add of {len} f32: {:.2} ms; zeros_like + add {:.2} ms", t1 * 1e3, t2 * 1e3);
    }
    // Weight gradient dW = dy^T x (out x in), with dy^T as a view or copied first.
    let (dy, x) = (r(&[n, i])?, r(&[n, h])?);
    let flops = 2.0 * (n * h * i) as f64;
    let t1 = time(a.reps, || {
        let _ = dy.t()?.matmul(&x)?;
        Ok(())
    })?;
    let t2 = time(a.reps, || {
        let _ = dy.t()?.contiguous()?.matmul(&x)?;
        Ok(())
    })?;
    let t3 = time(a.reps, || {
        let _ = x.t()?.matmul(&dy)?.t()?.contiguous()?;
        Ok(())
    })?;
    report(&format!("dW {i}x{n}x{h}: dy^T view @ x"), t1, Some(flops), n);
    report("dW: copy dy^T then @ x", t2, Some(flops), n);
    report("dW: (x^T @ dy)^T", t3, Some(flops), n);
    let (nkv, g, d, l) =
        (cfg.num_key_value_heads, cfg.num_attention_heads / cfg.num_key_value_heads, cfg.head_dim, seq);
    let q = r(&[a.batch, nkv, g * l, d])?;
    let k = r(&[a.batch, nkv, l, d])?;
    let flops = 2.0 * (a.batch * nkv * g * l * l * d) as f64;
    let t = time(a.reps, || {
        let _ = q.matmul(&k.t()?)?;
        Ok(())
    })?;
    report("attn scores q @ k^T (batched)", t, Some(flops), n);
    Ok(())
}

/// Times batched generation; see [`What::Generate`].
fn bench_generate(m: &Qwen3, a: &BenchArgs) -> anyhow::Result<()> {
    if m.has_lora() {
        // The unmerged adapter path against the merged copy the trainer samples from.
        let merged = model::RolloutCopy::new(m, m.dtype())?;
        let unmerged = generate_tps(m, a)?;
        let merged_tps = generate_tps(merged.model(), a)?;
        println!(
            "generate with LoRA: unmerged {unmerged:.0} tok/s, merged {merged_tps:.0} tok/s (merged/unmerged time {:.2})",
            unmerged / merged_tps
        );
    }
    stapo::rollout::bench_generate(m, a.batch, a.prompt, a.new_tokens)?; // warm-up
    let mut best = 0f64;
    let mut sum = 0f64;
    for _ in 0..a.reps.max(1) {
        let tps = stapo::rollout::bench_generate(m, a.batch, a.prompt, a.new_tokens)?;
        best = best.max(tps);
        sum += tps;
    }
    println!(
        "generate (batch {}, prompt {}, {} new tokens): {:.0} tok/s mean, {:.0} best of {}",
        a.batch,
        a.prompt,
        a.new_tokens,
        sum / a.reps.max(1) as f64,
        best,
        a.reps.max(1)
    );
    // Long answers: one run each; the KV cache holds 2 x layers x kv_heads x
    // head_dim values per token and sequence.
    let c = m.config();
    let per_token =
        2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * m.activation_dtype().size_in_bytes();
    for &n in &a.long {
        reset_peak_rss();
        let tps = stapo::rollout::bench_generate(m, a.batch, a.prompt, n)?;
        println!(
            "generate long (batch {}, prompt {}, {n} new tokens): {tps:.0} tok/s, KV cache {:.1} MB, peak {:.2} GB",
            a.batch,
            a.prompt,
            (a.batch * (a.prompt + n) * per_token) as f64 / 1e6,
            peak_rss().unwrap_or(0) as f64 / 1e9
        );
    }
    Ok(())
}

/// Mean generation tokens/s of `m` over `reps` runs after a warm-up.
fn generate_tps(m: &Qwen3, a: &BenchArgs) -> anyhow::Result<f64> {
    stapo::rollout::bench_generate(m, a.batch, a.prompt, a.new_tokens)?;
    let mut sum = 0f64;
    for _ in 0..a.reps.max(1) {
        sum += stapo::rollout::bench_generate(m, a.batch, a.prompt, a.new_tokens)?;
    }
    Ok(sum / a.reps.max(1) as f64)
}

fn device_name(d: &Device) -> &'static str {
    if d.is_cuda() {
        "cuda"
    } else {
        "cpu"
    }
}

// ---------------------------------------------------------------------------
// The optimizer
// ---------------------------------------------------------------------------

/// `stapo bench optimizer`: seconds per AdamW step over `n_params` f32 parameters,
/// the fused in-place optimizer against `candle_nn::AdamW`.
fn bench_optimizer(n_params: usize, reps: usize) -> anyhow::Result<()> {
    use candle_nn::Optimizer;
    let ours = bench_adamw(n_params, reps)?;
    println!("stapo AdamW (fused):  {n_params} params, {ours:.4} s/step over {reps} steps");
    let (params, grads) = bench_problem(n_params)?;
    let vars = params.into_iter().map(|(_, v)| v).collect();
    let mut opt = candle_nn::AdamW::new(vars, candle_nn::ParamsAdamW { lr: 1e-4, ..Default::default() })?;
    opt.step(&grads)?;
    let start = Instant::now();
    for _ in 0..reps {
        opt.step(&grads)?;
    }
    let theirs = start.elapsed().as_secs_f64() / reps as f64;
    println!(
        "candle_nn AdamW:      {n_params} params, {theirs:.4} s/step over {reps} steps ({:.1}x)",
        theirs / ours
    );
    Ok(())
}

/// Times `AdamW::step` over `n_params` f32 parameters on the CPU (split into
/// tensors of at most 4 Mi elements, like a transformer's matrices, with random
/// weights and gradients, clipping on) and returns the mean seconds per step over
/// `steps` steps, after one untimed warm-up step (which pays the first-touch page
/// faults of the zero-initialised moments). Needs about 16 bytes per parameter.
fn bench_adamw(n_params: usize, steps: usize) -> anyhow::Result<f64> {
    if n_params == 0 || steps == 0 {
        anyhow::bail!("bench optimizer: the parameter count and --reps must be positive");
    }
    let (params, grads) = bench_problem(n_params)?;
    let mut opt = AdamW::new(params, AdamWConfig { lr: 1e-4, ..AdamWConfig::default() })?;
    opt.step(&grads, 1e-4)?;
    let start = std::time::Instant::now();
    for _ in 0..steps {
        opt.step(&grads, 1e-4)?;
    }
    Ok(start.elapsed().as_secs_f64() / steps as f64)
}

/// Random parameters (uniform in [-1, 1]) and gradients (in [-1e-3, 1e-3]).
fn bench_problem(n_params: usize) -> anyhow::Result<(Vec<(String, Var)>, GradStore)> {
    const MAX_TENSOR: usize = 1 << 22;
    let dev = candle_core::Device::Cpu;
    let mut params = Vec::new();
    let mut grads = GradStore::default();
    let mut left = n_params;
    while left > 0 {
        let n = left.min(MAX_TENSOR);
        let var = Var::rand_f64(-1.0, 1.0, n, DType::F32, &dev)?;
        grads.insert(var.as_tensor(), Tensor::rand(-1e-3f32, 1e-3, n, &dev)?);
        params.push((format!("bench.{}.weight", params.len()), var));
        left -= n;
    }
    Ok((params, grads))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_row_reruns_the_same_command_with_one_length() {
        let args = ["bench", "train", "--seq", "1024,2048", "--layers", "2", "--seq=7"].map(String::from);
        let want = ["bench", "train", "--layers", "2", "--seq", "2048", "--table-row"];
        assert_eq!(row_args(args.into_iter(), 2048), want);
        assert_eq!(parse_row("4096 1.5 123456").unwrap(), (4096, 1.5, 123456));
        assert!(parse_row("4096 1.5").is_err());
    }
}
