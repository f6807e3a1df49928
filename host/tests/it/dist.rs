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
use stapo::train::{LrSchedule, RunConfig, StepMetrics, Trainer};

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
    println!("rank collectives ok");
    dist::finalize();
}

/// The same script under `stapo run` (one process) and `mpirun -np 2 stapo run`
/// (two MPI processes): for STAPO, DAPO and GRPO the two-rank checkpoints hold
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
for preset in ["stapo", "dapo", "grpo"] {{
    train(#{{
        name: preset, model: #{{ path: "{m}" }},
        data: #{{ train: "{d}", template: #{{ kind: "raw", suffix: "" }}, prompts_per_step: 4 }},
        rollout: #{{ sampling: #{{ n: 4, max_tokens: 16 }} }},
        actor: #{{
            preset: preset,
            objective: if preset == "stapo" {{ #{{ mask: #{{ tau_p: 0.95 }} }} }} else {{ #{{}} }},
            mini_batch: if preset == "stapo" {{ 8 }} else {{ 0 }}, micro_batch: if preset == "stapo" {{ 3 }} else {{ 0 }},
            optim: #{{ lr: 2e-4, schedule: #{{ kind: "constant", warmup_steps: 0 }} }},
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
    for preset in ["stapo", "dapo", "grpo"] {
        let ck = |d: &Path| {
            candle_core::safetensors::load(
                d.join(preset).join("checkpoints/step-000002/model.safetensors"),
                &Device::Cpu,
            )
            .unwrap()
        };
        let (a, b) = (ck(&one), ck(&two));
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
            std::fs::read_to_string(d.join(preset).join("metrics.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let (ma, mb) = (metrics(&one), metrics(&two));
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
