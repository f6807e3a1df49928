//! Data-parallel runs. The invariant: with the same script, seed and global
//! batch, two ranks train the same model and report the same metrics as one
//! process (up to float summation order), for the STAPO, DAPO and GRPO presets;
//! a checkpoint written by two ranks resumes on one. Checked in-process (ranks
//! on threads, every build) and, with `--features mpi`, between real processes
//! started by `mpirun -np 2`. Also: the message a binary without MPI gives when
//! an MPI launcher starts it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use stapo::data::PromptTemplate;
use stapo::dist::Local;
use stapo::train::{LrSchedule, RunConfig, ShardMode, StepMetrics, Trainer};

use crate::common::{on_ranks, tempdir};

/// Weights may differ by float summation order only: gradients summed over two
/// ranks instead of one pass, normalisers and metrics reduced in f64.
const WEIGHT_TOL: f64 = 2e-5;
/// Metrics (means over a few hundred tokens) likewise.
const METRIC_TOL: f64 = 1e-4;

/// A small run of `preset` on the bundled tiny Qwen3 (about 43% right on
/// held-out arithmetic, so groups have mixed rewards) that exercises the global
/// normalisers: several mini-batches and micro-batches, S2T candidates (a high
/// tau_p, since this model is confident).
fn config(preset: &str) -> RunConfig {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    // Per preset: stapo with several mini- and micro-batches, dapo with two epochs
    // (mini-batches cut from the shuffled global order).
    let actor = match preset {
        "stapo" => {
            serde_json::json!({"objective": {"mask": {"tau_p": 0.95}}, "mini_batch": 8, "micro_batch": 3})
        }
        "dapo" => serde_json::json!({"epochs": 2, "mini_batch": 6}),
        _ => serde_json::json!({}),
    };
    let mut user = serde_json::json!({
        "model": {"path": root.join("models/tiny-qwen3")},
        // The tiny model's prompt format (models/tiny-qwen3/README.md).
        "data": {"train": root.join("data/arith/train.jsonl"), "test": root.join("data/arith/test.jsonl"),
                 "prompts_per_step": 4, "template": PromptTemplate::Raw { suffix: String::new() }},
        "rollout": {"sampling": {"n": 4, "max_tokens": 16}},
        "actor": {"preset": preset, "optim": {"lr": 2e-4, "schedule": LrSchedule::Constant { warmup_steps: 0 }}},
        "checkpoint": {"save_every": 2},
        "evaluation": {"every": 2, "sampling": {"n": 1}, "limit": 2},
        "seed": 11,
    });
    stapo::overlay::merge(&mut user["actor"], actor);
    RunConfig::from_json(&user).unwrap()
}

fn weights(t: &Trainer) -> Vec<f32> {
    t.model()
        .params()
        .iter()
        .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// `steps` steps on `ranks` in-process ranks (threads) writing into `dir`;
/// rank 0's metrics and every rank's final weights.
fn train_on(
    ranks: usize,
    cfg: &RunConfig,
    dir: &Path,
    steps: usize,
    resume: bool,
) -> (Vec<StepMetrics>, Vec<Vec<f32>>) {
    let out = on_ranks(ranks, cfg, dir, (steps, resume), weights);
    let metrics = out[0].0.clone();
    (metrics, out.into_iter().map(|o| o.1).collect())
}

fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max)
}

/// The metrics two runs must agree on, step by step.
const KEYS: [&str; 14] = [
    "loss",
    "reward_mean",
    "reward_std",
    "accuracy",
    "entropy",
    "grad_norm",
    "response_tokens",
    "kept_tokens",
    "silenced_tokens",
    "tau_h",
    "clip_frac_high",
    "approx_kl",
    "zero_var_group_frac",
    "dropped_seqs",
];

fn assert_metrics_close(a: &[StepMetrics], b: &[StepMetrics], what: &str) {
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (serde_json::to_value(x).unwrap(), serde_json::to_value(y).unwrap());
        for k in KEYS {
            match (x[k].as_f64(), y[k].as_f64()) {
                (Some(p), Some(q)) => {
                    assert!(
                        (p - q).abs() <= METRIC_TOL * (1.0 + p.abs()),
                        "{what} step {step} {k}: {p} vs {q}"
                    )
                }
                _ => assert_eq!(x[k], y[k], "{what} step {step} {k}"),
            }
        }
        assert_eq!(x["eval_avg"], y["eval_avg"], "{what} step {step} eval_avg");
        assert_eq!(x["silenced_token_ids"], y["silenced_token_ids"], "{what} step {step} silenced ids");
    }
}

/// Two ranks on threads = one process, for STAPO, DAPO and GRPO, after 3 steps;
/// rank 0 alone wrote the run folder, and its checkpoint resumes on one rank.
#[test]
fn two_ranks_train_as_one() {
    let dir = tempdir();
    for preset in ["stapo", "dapo", "grpo"] {
        let cfg = config(preset);
        let one = dir.path().join(format!("{preset}-1"));
        let two = dir.path().join(format!("{preset}-2"));
        let (m1, w1) = train_on(1, &cfg, &one, 3, false);
        let (m2, w2) = train_on(2, &cfg, &two, 3, false);
        // Every rank applied the same summed gradients.
        assert_eq!(w2[0], w2[1], "{preset}: ranks diverged");
        let d = max_diff(&w1[0], &w2[0]);
        assert!(d <= WEIGHT_TOL, "{preset}: weights differ by {d}");
        // The runs learned something (else equality would be vacuous).
        let start =
            Trainer::new_on(Arc::new(Local), cfg.clone(), &dir.path().join(format!("{preset}-0"))).unwrap();
        let moved = max_diff(&weights(&start), &w1[0]);
        eprintln!("{preset}: weights moved by {moved:.3e}, one vs two ranks differ by {d:.3e}");
        assert!(moved > 1e-4, "{preset}: no learning ({moved})");
        assert_metrics_close(&m1, &m2, preset);
        assert!(m1.iter().any(|m| m.update.kept_tokens > 0), "{preset}: nothing reached the loss");
        if preset == "stapo" {
            assert!(m1.iter().any(|m| m.update.tau_h.is_some()), "stapo: no S2T candidates");
        }
        // One metrics line per step, written once.
        let lines = std::fs::read_to_string(two.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 3, "{preset}");
        // So are the TensorBoard scalars: one event file, from rank 0.
        assert_eq!(std::fs::read_dir(two.join("tb")).unwrap().count(), 1, "{preset}");
        assert!(two.join("checkpoints/step-000002/model.safetensors").is_file());

        // The two-rank checkpoint (step 2) resumes on one rank: step 3 as before.
        let (m3, w3) = train_on(1, &cfg, &two, 1, true);
        let d = max_diff(&w1[0], &w3[0]);
        assert!(d <= WEIGHT_TOL, "{preset}: resumed on one rank, weights differ by {d}");
        assert_metrics_close(&m1[2..], &m3, &format!("{preset} resumed"));
    }
}

/// A binary built without MPI, started as one of several MPI ranks, stops and
/// says how to build one with MPI (instead of training N independent copies).
#[cfg(not(feature = "mpi"))]
#[test]
fn launcher_without_mpi_says_how_to_get_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["run", "no-such-script.rhai"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .expect("start stapo");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without MPI"), "{err}");
    assert!(err.contains("--features mpi"), "{err}");
    // One rank is fine: nothing to split.
    let out = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["verify", "--gold", "2", "--pred", "2"])
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .output()
        .expect("start stapo");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `mpirun -np <n> <program> <args>`, with what Open MPI needs in a container
/// (running as root, more ranks than cores).
#[cfg(feature = "mpi")]
pub fn mpirun(n: usize, program: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    let open_mpi = Command::new("mpirun")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("Open MPI"))
        .unwrap_or(false);
    if open_mpi {
        c.args(["--oversubscribe", "--bind-to", "none"]);
        c.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    c.args(["-np", &n.to_string()]).arg(program).args(args);
    c
}

/// Starts this test binary under `mpirun -np 2`, running only
/// [`mpi_rank_collectives`] in each rank.
#[cfg(feature = "mpi")]
#[test]
fn mpi_collectives_over_two_ranks() {
    let exe = std::env::current_exe().expect("test binary");
    let out = mpirun(
        2,
        &exe,
        &["--exact", "dist::mpi_rank_collectives", "--ignored", "--test-threads=1", "--nocapture"],
    )
    .output()
    .expect("start mpirun (install openmpi-bin)");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun failed\nstdout:\n{so}\nstderr:\n{se}");
    // Both ranks ran the test (not filtered away).
    assert_eq!(so.matches("rank collectives ok").count(), 2, "stdout:\n{so}\nstderr:\n{se}");
}

/// One rank of [`mpi_collectives_over_two_ranks`]: every collective of the MPI
/// communicator against values computed by hand.
#[cfg(feature = "mpi")]
#[test]
#[ignore = "runs inside mpirun, started by mpi_collectives_over_two_ranks"]
fn mpi_rank_collectives() {
    use candle_core::{Device, Tensor};
    use stapo::dist;

    assert!(dist::launched_size().is_some(), "run by mpi_collectives_over_two_ranks under mpirun");
    let c = dist::init().expect("MPI init");
    assert_eq!(c.backend(), "mpi");
    assert_eq!(c.size(), 2);
    let r = c.rank();

    let mut s = [r as f64 + 0.5, 1.0];
    c.all_reduce_f64(&mut s).unwrap();
    assert_eq!(s, [2.0, 2.0]);
    let mut f = vec![r as f32; 3];
    c.all_reduce_f32(&mut f).unwrap();
    assert_eq!(f, vec![1.0; 3]);
    // Rank 0 gives one value, rank 1 three.
    let g = c.all_gather_f32(&vec![10.0 + r as f32; 1 + 2 * r]).unwrap();
    assert_eq!(g, vec![10.0, 11.0, 11.0, 11.0]);
    let b = c.all_gather_bytes(if r == 0 { b"zero" } else { b"" }).unwrap();
    assert_eq!(b, vec![b"zero".to_vec(), Vec::new()]);
    let mut msg = if r == 1 { b"rank one decides".to_vec() } else { Vec::new() };
    c.broadcast_bytes(1, &mut msg).unwrap();
    assert_eq!(msg, b"rank one decides".to_vec());
    let v: Vec<u64> = dist::broadcast_json(&*c, 0, &vec![r as u64 + 7]).unwrap();
    assert_eq!(v, vec![7]);
    c.barrier().unwrap();

    // Bucketed tensors: two buckets of a 4-element cap.
    let mut ts = vec![
        Tensor::new(&[[r as f32, 1.0], [2.0, 3.0]], &Device::Cpu).unwrap(),
        Tensor::new(&[r as f32 * 2.0; 3], &Device::Cpu).unwrap(),
    ];
    c.all_reduce_tensors(&mut ts, 4).unwrap();
    assert_eq!(ts[0].to_vec2::<f32>().unwrap(), vec![vec![1.0, 2.0], vec![4.0, 6.0]]);
    assert_eq!(ts[1].to_vec1::<f32>().unwrap(), vec![2.0; 3]);

    // Reduce-scatter and all-gather of blocks (the sharded optimizer's), f32 and bf16,
    // on slices and on tensors: rank r gives [r, 1, 10r, 2]; the sums are [1, 2, 10, 4].
    let r32 = r as f32;
    let buf = [r32, 1.0, 10.0 * r32, 2.0];
    let want = [vec![1.0, 2.0], vec![10.0, 4.0]][r].clone();
    assert_eq!(c.reduce_scatter_f32(&buf).unwrap(), want);
    let b16: Vec<half::bf16> = buf.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let got: Vec<f32> = c.reduce_scatter_bf16(&b16).unwrap().iter().map(|x| x.to_f32()).collect();
    assert_eq!(got, want);
    let g16: Vec<f32> =
        c.all_gather_bf16(&[half::bf16::from_f32(r32 + 0.5)]).unwrap().iter().map(|x| x.to_f32()).collect();
    assert_eq!(g16, vec![0.5, 1.5]);
    let t = Tensor::new(&buf, &Device::Cpu).unwrap();
    assert_eq!(c.reduce_scatter_tensor(&t).unwrap().to_vec1::<f32>().unwrap(), want);
    let g = c.all_gather_tensor(&Tensor::new(&[r32; 2], &Device::Cpu).unwrap()).unwrap();
    assert_eq!(g.to_vec1::<f32>().unwrap(), vec![0.0, 0.0, 1.0, 1.0]);
    println!("rank collectives ok");
    dist::finalize();
}

/// The same script under `stapo run` (one process) and `mpirun -np 2 stapo run`
/// (two MPI processes): for STAPO, DAPO, GRPO and GRPO with ZeRO-2 (`shard:
/// "gradients"`, against the unsharded one-process GRPO) the two-rank checkpoints hold
/// the same weights, and metrics.jsonl the same losses and rewards.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_two_ranks_train_as_one() {
    use candle_core::{DType, Device};

    let dir = tempdir();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = dir.path().join("dp.rhai");
    let s = |p: &str| root.join(p).display().to_string().replace('\\', "/");
    std::fs::write(
        &script,
        format!(
            r#"
for run in ["stapo", "dapo", "grpo", "grpo-zero2"] {{
    let preset = if run == "grpo-zero2" {{ "grpo" }} else {{ run }};
    train(#{{
        name: run, model: #{{ path: "{m}" }},
        data: #{{ train: "{d}", template: #{{ kind: "raw", suffix: "" }}, prompts_per_step: 4 }},
        rollout: #{{ sampling: #{{ n: 4, max_tokens: 16 }} }},
        actor: #{{
            preset: preset,
            objective: if preset == "stapo" {{ #{{ mask: #{{ tau_p: 0.95 }} }} }} else {{ #{{}} }},
            mini_batch: if preset == "stapo" {{ 8 }} else {{ 0 }}, micro_batch: if preset == "stapo" {{ 3 }} else {{ 0 }},
            optim: #{{ lr: 2e-4, schedule: #{{ kind: "constant", warmup_steps: 0 }} }},
            shard: if run == "grpo-zero2" {{ "gradients" }} else {{ "none" }},
        }},
        seed: 11, checkpoint: #{{ save_every: 2 }},
    }}, 2);
}}
"#,
            m = s("models/tiny-qwen3"),
            d = s("data/arith/train.jsonl")
        ),
    )
    .unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_stapo"));
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let out = Command::new(&exe)
        .args(["run", "--quiet", "--out"])
        .arg(&one)
        .arg(&script)
        .env("CANDLE_NUM_THREADS", "1")
        .output()
        .expect("stapo");
    assert!(out.status.success(), "one rank: {}", String::from_utf8_lossy(&out.stderr));
    let two_s = two.display().to_string();
    let script_s = script.display().to_string();
    let out = mpirun(2, &exe, &["run", "--quiet", "--out", &two_s, &script_s]).output().expect("mpirun");
    assert!(
        out.status.success(),
        "two ranks: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The two ZeRO-2 ranks wrote one optimizer file each and the index.
    let z2 = two.join("grpo-zero2/checkpoints/step-000002");
    assert!(z2.join("optimizer.index.json").is_file());
    assert!(z2.join("optimizer-00001-of-00002.safetensors").is_file());
    // (run of two ranks, run of one rank it must equal): ZeRO-2 against the unsharded GRPO.
    for (preset, single) in [("stapo", "stapo"), ("dapo", "dapo"), ("grpo", "grpo"), ("grpo-zero2", "grpo")] {
        let ck = |d: &Path, run: &str| {
            candle_core::safetensors::load(
                d.join(run).join("checkpoints/step-000002/model.safetensors"),
                &Device::Cpu,
            )
            .unwrap()
        };
        let (a, b) = (ck(&one, single), ck(&two, preset));
        assert_eq!(a.len(), b.len());
        let mut worst = 0f64;
        for (name, t) in &a {
            let u = &b[name];
            let x = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let y = u.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            worst = worst.max(max_diff(&x, &y));
        }
        assert!(worst <= WEIGHT_TOL, "{preset}: mpirun weights differ by {worst}");
        let metrics = |d: &Path| -> Vec<serde_json::Value> {
            std::fs::read_to_string(d.join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (ma, mb) = (metrics(&one.join(single)), metrics(&two.join(preset)));
        assert_eq!(ma.len(), 2, "{preset}: rank 0 alone writes one line per step");
        assert_eq!(mb.len(), 2, "{preset}: rank 0 alone writes one line per step");
        for (x, y) in ma.iter().zip(&mb) {
            for k in ["loss", "reward_mean", "kept_tokens", "response_tokens", "grad_norm", "entropy"] {
                let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
                assert!((p - q).abs() <= METRIC_TOL * (1.0 + p.abs()), "{preset} {k}: {p} vs {q}");
            }
        }
    }
}

/// `rollout.async.roles` between real processes: `mpirun -np 2 stapo run` with one
/// rollout rank and one trainer rank trains, for staleness 0 and 1, the weights `stapo
/// run` trains in one process under `rollout.async` with the same staleness; rank 0
/// (the trainer) writes the run folder with one metrics line per step. A split run that
/// SIGTERM stops, on the rollout rank alone, stops on both ranks and resumes to the same
/// weights.
#[cfg(feature = "mpi")]
#[test]
fn mpirun_rollout_and_trainer_ranks_train_as_one_process() {
    use candle_core::Device;

    let dir = tempdir();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let s = |p: &str| root.join(p).display().to_string().replace('\\', "/");
    let script = |stalenesses: &str, roles: &str| {
        format!(
            r#"
for staleness in {stalenesses} {{
    train(#{{
        name: `s${{staleness}}`, model: #{{ path: "{m}" }},
        data: #{{ train: "{d}", template: #{{ kind: "raw", suffix: "" }}, prompts_per_step: 3 }},
        rollout: #{{ sampling: #{{ n: 4, max_tokens: 12 }}, "async": #{{ staleness: staleness{roles} }} }},
        actor: #{{ preset: "dapo_s2t", optim: #{{ lr: 1e-2 }},
                   objective: #{{ mask: #{{ tau_p: 0.05 }}, dynamic_sampling: false }} }},
        seed: 5, checkpoint: #{{ save_every: 3 }},
    }}, 3);
}}
"#,
            m = s("models/tiny-qwen3"),
            d = s("data/arith/train.jsonl")
        )
    };
    let (one_rhai, two_rhai) = (dir.path().join("one.rhai"), dir.path().join("two.rhai"));
    std::fs::write(&one_rhai, script("[0, 1]", "")).unwrap();
    std::fs::write(&two_rhai, script("[0, 1]", ", roles: #{ rollout_ranks: 1 }")).unwrap();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_stapo"));
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    // One thread per process on both sides: the same kernels, the same sums.
    let threads = [("CANDLE_NUM_THREADS", "1"), ("RAYON_NUM_THREADS", "1")];
    let out = Command::new(&exe)
        .args(["run", "--quiet", "--out"])
        .arg(&one)
        .arg(&one_rhai)
        .envs(threads)
        .output()
        .expect("stapo");
    assert!(out.status.success(), "one process: {}", String::from_utf8_lossy(&out.stderr));
    let (two_s, two_rhai_s) = (two.display().to_string(), two_rhai.display().to_string());
    let out = mpirun(2, &exe, &["run", "--quiet", "--out", &two_s, &two_rhai_s])
        .envs(threads)
        .output()
        .expect("mpirun");
    assert!(
        out.status.success(),
        "rollout and trainer ranks: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Stopped by SIGTERM, which reaches the rollout rank alone, at its rollout of step 1
    // (staleness 0): both ranks stop after step 0, rank 0 writes checkpoint step-000001
    // and reports the signal the rollout rank received, both exit with 143; resumed as a
    // split run, the run ends with the weights of the run never stopped.
    let stop_rhai = dir.path().join("stop.rhai");
    // Unnamed: the run folder is the one `--out` gives.
    let unnamed = script("[0]", ", roles: #{ rollout_ranks: 1 }").replace("name: `s${staleness}`, ", "");
    std::fs::write(&stop_rhai, unnamed).unwrap();
    let stopped = dir.path().join("stopped");
    let (stopped_s, stop_rhai_s) = (stopped.display().to_string(), stop_rhai.display().to_string());
    let text = |o: &std::process::Output| {
        format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    let out = mpirun(2, &exe, &["run", "--quiet", "--out", &stopped_s, &stop_rhai_s])
        .envs(threads)
        .env("STAPO_TEST_SIGNAL", "TERM@rollout:1")
        .output()
        .expect("mpirun");
    assert_eq!(out.status.code(), Some(143), "stopped: {}", text(&out));
    assert!(text(&out).contains("stopped by SIGTERM"), "{}", text(&out));
    let latest = std::fs::read_to_string(stopped.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-000001", "{}", text(&out));
    let out = mpirun(2, &exe, &["run", "--quiet", "--resume", &stopped_s, &stop_rhai_s])
        .envs(threads)
        .env_remove("STAPO_TEST_SIGNAL")
        .output()
        .expect("mpirun");
    assert!(out.status.success(), "resumed: {}", text(&out));
    for (run, split) in [("s0", two.join("s0")), ("s1", two.join("s1")), ("s0", stopped.clone())] {
        let ck = |d: &Path| {
            candle_core::safetensors::load(d.join("checkpoints/step-000003/model.safetensors"), &Device::Cpu)
                .unwrap()
        };
        let (a, b) = (ck(&one.join(run)), ck(&split));
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            let f = |t: &candle_core::Tensor| {
                t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            let (x, y) = (f(t), f(&b[name]));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&x), bits(&y), "{run}: {name} differs");
        }
        let lines = std::fs::read_to_string(split.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 3, "{run}: rank 0 writes one line per step");
    }
}

/// Every rank's trainable weights: the adapters with LoRA, else all weights.
fn trainable(t: &Trainer) -> Vec<f32> {
    let ps = if t.model().has_lora() { t.model().lora_params() } else { t.model().params() };
    ps.iter().flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

/// `config(preset)` with the optimizer sharded as `mode`; `lora` puts adapters on it.
fn sharded_config(preset: &str, mode: ShardMode, lora: bool) -> RunConfig {
    let mut cfg = config(preset);
    cfg.actor.shard = mode;
    if lora {
        cfg.actor.lora =
            Some(stapo::model::LoraConfig { alpha: Some(8.0), ..stapo::model::LoraConfig::new(4) });
    }
    cfg
}

/// ZeRO-1 and ZeRO-2 on two ranks (threads) train the weights of one unsharded
/// process, for STAPO, GRPO and a LoRA run, after 3 steps; each rank holds half
/// the optimizer state, and the checkpoint is one optimizer file per rank and an index.
#[test]
fn sharded_ranks_train_as_one() {
    let dir = tempdir();
    for (name, preset, mode, lora) in [
        ("stapo-zero2", "stapo", ShardMode::Gradients, false),
        ("grpo-zero1", "grpo", ShardMode::Optimizer, false),
        ("lora-zero2", "grpo", ShardMode::Gradients, true),
    ] {
        let plain = sharded_config(preset, ShardMode::None, lora);
        let cfg = sharded_config(preset, mode, lora);
        let one = on_ranks(1, &plain, &dir.path().join(format!("{name}-1")), (3, false), trainable);
        let two_dir = dir.path().join(format!("{name}-2"));
        let two = on_ranks(2, &cfg, &two_dir, (3, false), trainable);
        assert_eq!(two[0].1, two[1].1, "{name}: ranks diverged");
        let d = max_diff(&one[0].1, &two[0].1);
        let start =
            Trainer::new_on(Arc::new(Local), plain.clone(), &dir.path().join(format!("{name}-0"))).unwrap();
        let moved = max_diff(&trainable(&start), &one[0].1);
        eprintln!("{name}: weights moved by {moved:.3e}, unsharded vs two sharded ranks differ by {d:.3e}");
        assert!(d <= WEIGHT_TOL, "{name}: weights differ by {d}");
        assert!(moved > 1e-4, "{name}: no learning ({moved})");
        assert_metrics_close(&one[0].0, &two[0].0, name);
        // The moments (8 bytes per trainable parameter) are split in two.
        let (b1, b2) = (one[0].0[2].update.optimizer_bytes, two[0].0[2].update.optimizer_bytes);
        assert_eq!(b1, 8 * one[0].1.len() as u64, "{name}");
        assert!(b2 * 2 >= b1 && b2 * 2 <= b1 + 16, "{name}: {b2} bytes per rank of {b1}");
        let ck = two_dir.join("checkpoints/step-000002");
        assert!(ck.join("optimizer.index.json").is_file(), "{name}");
        for r in 0..2 {
            assert!(ck.join(format!("optimizer-{r:05}-of-00002.safetensors")).is_file(), "{name}");
        }
        assert!(!ck.join("optimizer.safetensors").exists(), "{name}");
        let staging = std::fs::read_dir(two_dir.join("checkpoints")).unwrap().flatten();
        assert!(staging.into_iter().all(|e| !e.file_name().to_string_lossy().starts_with('.')), "{name}");
    }
}

/// Sharded checkpoints resume exactly on the same number of ranks and re-shard to
/// another: 2 -> 2 gives the uninterrupted run's third step bit for bit; 2 -> 1 and
/// 1 -> 2 give it within the data-parallel tolerance (summation order).
#[test]
fn sharded_checkpoints_resume_on_other_world_sizes() {
    let dir = tempdir();
    let cfg = sharded_config("grpo", ShardMode::Gradients, false);
    let (two, one) = (dir.path().join("two"), dir.path().join("one"));
    let w2 = on_ranks(2, &cfg, &two, (3, false), trainable);
    let w1 = on_ranks(1, &cfg, &one, (3, false), trainable);
    let again = on_ranks(2, &cfg, &two, (1, true), trainable);
    assert_eq!(again[0].1, w2[0].1, "2 -> 2 is exact");
    assert_metrics_close(&w2[0].0[2..], &again[0].0, "2 -> 2");
    let down = on_ranks(1, &cfg, &two, (1, true), trainable);
    let d = max_diff(&down[0].1, &w2[0].1);
    assert!(d <= WEIGHT_TOL, "2 -> 1: weights differ by {d}");
    assert_metrics_close(&w2[0].0[2..], &down[0].0, "2 -> 1");
    let up = on_ranks(2, &cfg, &one, (1, true), trainable);
    assert_eq!(up[0].1, up[1].1, "1 -> 2: ranks diverged");
    let d = max_diff(&up[0].1, &w1[0].1);
    assert!(d <= WEIGHT_TOL, "1 -> 2: weights differ by {d}");
    assert_metrics_close(&w1[0].0[2..], &up[0].0, "1 -> 2");
    // And into the unsharded optimizer: the run may drop `shard` when it resumes.
    let mut plain = cfg.clone();
    plain.actor.shard = ShardMode::None;
    std::fs::write(one.join("run_config.json"), serde_json::to_string(&plain).unwrap()).unwrap();
    let unsharded = on_ranks(1, &plain, &one, (1, true), trainable);
    let d = max_diff(&unsharded[0].1, &w1[0].1);
    assert!(d <= WEIGHT_TOL, "sharded -> unsharded: weights differ by {d}");
}
