//! One-step-off asynchronous training (`rollout.async`): staleness 0 is the synchronous
//! run; under staleness 1 every response token's behaviour log-prob is what the policy
//! version that drew it gives (recomputed here with a copy of those weights), the update
//! corrects against those log-probs, no update trains on a rollout more than one version
//! old, and a run stopped with a rollout in flight resumes drawing the same prompts.

use candle_core::DType;
use stapo::model::RolloutCopy;
use stapo::reward::ExtractMode;
use stapo::train::update::RolloutCorrMode;
use stapo::train::{token_analysis, RolesConfig, RunConfig, Sequence, StepMetrics, Trainer};

use crate::common::{arith_fixture, tempdir, weight_bits};

fn config(dir: &std::path::Path, staleness: Option<u32>) -> RunConfig {
    let (model, train, _) = arith_fixture(dir);
    let mut rollout = serde_json::json!({"sampling": {"n": 4, "max_tokens": 12}});
    if let Some(s) = staleness {
        rollout["async"] = serde_json::json!({"staleness": s});
    }
    // DAPO's overlong shaping gives a random model's truncated responses non-zero
    // advantages, so every update moves the weights.
    RunConfig::from_json(&serde_json::json!({
        "model": {"path": model},
        "data": {"train": train, "prompts_per_step": 3, "extract": ExtractMode::Flexible},
        "rollout": rollout,
        "actor": {"preset": "dapo_s2t", "optim": {"lr": 1e-2},
                  "objective": {"mask": {"tau_p": 0.05}, "dynamic_sampling": false}},
        "checkpoint": {"save_every": 0},
        "evaluation": {"every": 0},
    }))
    .unwrap()
}

/// A deep copy of the trainer's weights as they are now.
fn snapshot(t: &Trainer) -> RolloutCopy {
    RolloutCopy::new(t.model(), DType::F32).unwrap()
}

fn metrics_without_timing(m: &StepMetrics) -> serde_json::Value {
    let mut v = serde_json::to_value(m).unwrap();
    for k in ["rollout_secs", "update_secs", "rollout_tokens_per_sec", "phase_secs", "async"] {
        v.as_object_mut().unwrap().remove(k);
    }
    v
}

fn prompt_ids(t: &Trainer) -> Vec<String> {
    t.last_rollout().unwrap().prompts.iter().map(|p| p.id.clone()).collect()
}

#[test]
fn staleness_0_is_the_synchronous_run_weight_for_weight() {
    let dir = tempdir();
    let (cfg, cfg0) = (config(dir.path(), None), config(dir.path(), Some(0)));
    assert_eq!(cfg, cfg0, "staleness 0 is the default");
    let mut a = Trainer::new(cfg, &dir.path().join("sync")).unwrap();
    let mut b = Trainer::new(cfg0, &dir.path().join("zero")).unwrap();
    for _ in 0..3 {
        let ma = a.step(&a.default_plan(), None, None).unwrap();
        let mb = b.step(&b.default_plan(), None, None).unwrap();
        assert_eq!(metrics_without_timing(&ma), metrics_without_timing(&mb));
        assert!(mb.asynchronous.is_none(), "a synchronous step reports no async figures");
    }
    assert_eq!(weight_bits(&a), weight_bits(&b));
    let line = std::fs::read_to_string(dir.path().join("zero/metrics.jsonl")).unwrap();
    assert!(!line.contains("\"async\""), "{line}");

    // Staleness 1's first step rolls out synchronously (nothing is ahead yet) and updates on
    // version 0 as the synchronous run does, while the next step's rollout runs beside it.
    let mut s = Trainer::new(config(dir.path(), None), &dir.path().join("sync-2")).unwrap();
    let mut o = Trainer::new(config(dir.path(), Some(1)), &dir.path().join("one")).unwrap();
    let ms = s.step(&s.default_plan(), None, None).unwrap();
    let mo = o.step(&o.default_plan(), None, None).unwrap();
    assert_eq!(metrics_without_timing(&ms), metrics_without_timing(&mo));
    assert_eq!(weight_bits(&s), weight_bits(&o));
    let f = mo.asynchronous.unwrap();
    assert_eq!((f.staleness_max, f.off_policy_token_share), (0, 0.0));
}

#[test]
fn one_step_off_rollouts_carry_the_log_probs_of_the_weights_that_drew_them() {
    let dir = tempdir();
    let mut t = Trainer::new(config(dir.path(), Some(1)), &dir.path().join("run")).unwrap();
    t.set_final_step(4);
    let mut versions = vec![snapshot(&t)];
    for k in 0..4u64 {
        let m = t.step(&t.default_plan(), None, None).unwrap();
        versions.push(snapshot(&t));
        let f = m.asynchronous.clone().expect("async figures");
        // Step 0 samples version 0 itself; step k >= 1 trains (from version k) on the
        // rollout drawn beside update k-1, from version k-1.
        let want = k.saturating_sub(1);
        assert_eq!(t.last_rollout_version(), Some(want), "step {k}");
        let lag = k - want;
        assert_eq!(
            (f.staleness_max, f.staleness_mean, f.off_policy_token_share),
            (lag, lag as f64, lag as f64)
        );
        // A rollout runs beside every update but the last step's.
        assert_eq!(f.ahead_rollout_secs > 0.0, k < 3, "step {k}: {f:?}");
        let seqs: Vec<Sequence> =
            t.last_rollout().unwrap().samples.iter().map(|s| Sequence::from_sample(s, 0.0)).collect();
        let mean_gap = |v: &RolloutCopy| {
            let p = token_analysis(v.model(), &seqs, 0, 1.0, 4).unwrap();
            let (mut gap, mut k1, mut n) = (0f64, 0f64, 0usize);
            for (s, a) in seqs.iter().zip(&p) {
                for (&r, &p) in s.rollout_logprobs.as_ref().unwrap().iter().zip(&a.p) {
                    gap = gap.max((r as f64 - (p as f64).ln()).abs());
                    k1 += r as f64 - (p as f64).ln();
                    n += 1;
                }
            }
            (gap, k1 / n as f64)
        };
        // The behaviour log-probs are the drawing version's (the engine's kernels against
        // the training forward: equal to float rounding) ...
        let (drawn, _) = mean_gap(&versions[want as usize]);
        assert!(drawn < 2e-4, "step {k}: |rollout - version {want}| up to {drawn}");
        if lag == 0 {
            continue;
        }
        // ... not the version the update started from, which the correction measures them
        // against (token-TIS, switched on by the lag): its k1 is theirs.
        let (stale, k1) = mean_gap(&versions[k as usize]);
        assert!(stale > 100.0 * drawn.max(1e-6), "step {k}: the versions differ by {stale} only");
        let rc = m.update.rollout_corr.clone().expect("rollout correction metrics");
        assert_eq!(rc.mode, RolloutCorrMode::TokenTis);
        assert!((rc.kl as f64 - k1).abs() < 1e-3 * k1.abs().max(1e-2), "step {k}: kl {} vs {k1}", rc.kl);
    }
}

/// A run stopped (a signal cancels the rollout in flight) or crashed with a rollout drawn
/// ahead resumes from its checkpoint drawing that rollout's prompts again, under the
/// checkpoint's weights (one synchronous step), then goes on one step off.
#[test]
fn a_rollout_in_flight_is_given_up_and_drawn_again_on_resume() {
    let dir = tempdir();
    let cfg = config(dir.path(), Some(1));
    let mut a = Trainer::new(cfg.clone(), &dir.path().join("a")).unwrap();
    let mut want = Vec::new();
    for _ in 0..4 {
        a.step(&a.default_plan(), None, None).unwrap();
        want.push(prompt_ids(&a));
    }

    // Stopped during step 1: the flag cancels the rollout of step 2 drawn beside update 1;
    // the update finishes and the step completes, then the checkpoint is written.
    let b_dir = dir.path().join("b");
    let mut b = Trainer::new(cfg.clone(), &b_dir).unwrap();
    b.step(&b.default_plan(), None, None).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(true);
    let m = b.step(&b.default_plan(), None, Some(&stop)).unwrap();
    assert_eq!(m.step, 1);
    let weights = weight_bits(&b);
    b.save_on_exit().unwrap();
    drop(b);
    let mut b = Trainer::resume(&b_dir).unwrap();
    assert_eq!(b.step_count(), 2);
    assert_eq!(weight_bits(&b), weights);
    let m2 = b.step(&b.default_plan(), None, None).unwrap();
    assert_eq!(prompt_ids(&b), want[2], "the resumed step draws the prompts of the rollout given up");
    assert_eq!((b.last_rollout_version(), m2.asynchronous.unwrap().staleness_max), (Some(2), 0));
    b.step(&b.default_plan(), None, None).unwrap();
    assert_eq!(prompt_ids(&b), want[3]);
    assert_eq!(b.last_rollout_version(), Some(2), "one step off again");

    // Crashed after a checkpoint written while the rollout of the next step was held.
    let c_dir = dir.path().join("c");
    let mut c = Trainer::new(cfg, &c_dir).unwrap();
    c.step(&c.default_plan(), None, None).unwrap();
    c.checkpoint().unwrap();
    c.step(&c.default_plan(), None, None).unwrap();
    drop(c);
    let mut c = Trainer::resume(&c_dir).unwrap();
    assert_eq!(c.step_count(), 1);
    c.step(&c.default_plan(), None, None).unwrap();
    assert_eq!(prompt_ids(&c), want[1]);
    assert_eq!(c.last_rollout_version(), Some(1));
    let lines = std::fs::read_to_string(c_dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = lines
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1]);
}

/// The preemption path of `stapo run`: SIGTERM raised while the rollout of step 2 runs
/// beside update 1 gives that rollout up; update 1 finishes, step 1 is logged and
/// checkpoint step-000002 written; `--resume` runs step 2 synchronously on the same
/// prompts and step 3 one step off again. Steps 0 and 1 equal the uninterrupted run's.
#[test]
fn sigterm_with_a_rollout_in_flight_resumes_from_the_step_before_it() {
    let dir = tempdir();
    let (model, train, _) = arith_fixture(dir.path());
    let script = dir.path().join("run.rhai");
    std::fs::write(
        &script,
        format!(
            r#"train(#{{ model: #{{ path: "{}" }}, data: #{{ train: "{}", prompts_per_step: 2 }},
    actor: #{{ preset: "grpo", optim: #{{ lr: 1e-3 }} }},
    rollout: #{{ sampling: #{{ n: 3, max_tokens: 8 }}, "async": #{{ staleness: 1 }} }},
    checkpoint: #{{ save_every: 0 }} }}, 4);"#,
            model.display(),
            train.display()
        ),
    )
    .unwrap();
    let stapo = |args: &[&str], signal: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"));
        c.args(args).env_remove("STAPO_TEST_SIGNAL");
        if let Some(s) = signal {
            c.env("STAPO_TEST_SIGNAL", s);
        }
        let o = c.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.code(), text)
    };
    let rows = |run: &std::path::Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let script = script.to_str().unwrap();
    let reference = dir.path().join("reference");
    let (code, out) = stapo(&["run", "--quiet", "--out", reference.to_str().unwrap(), script], None);
    assert_eq!(code, Some(0), "{out}");
    let run = dir.path().join("stopped");
    let (code, out) =
        stapo(&["run", "--quiet", "--out", run.to_str().unwrap(), script], Some("TERM@rollout:2"));
    assert_eq!(code, Some(143), "{out}");
    assert!(out.contains("stopped by SIGTERM"), "{out}");
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-000002", "{out}");
    let (code, out) = stapo(&["run", "--quiet", "--resume", run.to_str().unwrap()], None);
    assert_eq!(code, Some(0), "{out}");
    let (want, got) = (rows(&reference), rows(&run));
    assert_eq!(got.iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2, 3]);
    for k in 0..2 {
        for key in ["loss", "reward_mean", "entropy", "grad_norm", "response_len_mean"] {
            assert!(want[k][key].is_number(), "step {k}: no {key}");
            assert_eq!(want[k][key], got[k][key], "step {k} {key}");
        }
    }
    let staleness = |r: &[serde_json::Value]| -> Vec<u64> {
        r.iter().map(|r| r["async"]["staleness_max"].as_u64().unwrap()).collect()
    };
    assert_eq!(staleness(&want), [0, 1, 1, 1]);
    assert_eq!(staleness(&got), [0, 1, 0, 1], "the resumed step draws its rollout itself");
}

#[test]
fn staleness_above_one_and_async_over_ranks_are_refused() {
    let dir = tempdir();
    let cfg = config(dir.path(), Some(1));
    let comms = stapo::dist::ThreadComm::group(2);
    let errors: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let (cfg, run) = (cfg.clone(), dir.path().join("ranks"));
                s.spawn(move || Trainer::new_on(std::sync::Arc::new(c), cfg, &run).err().unwrap().to_string())
            })
            .collect();
        runs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("rollout.async.staleness") && e.contains("2 ranks"), "{e}");
    }
    let mut v = serde_json::to_value(config(dir.path(), Some(1))).unwrap();
    v["rollout"]["async"]["staleness"] = 2.into();
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout.async.staleness") && e.contains("found 2"), "{e}");
    v["rollout"]["async"] = serde_json::json!({"stalenes": 1});
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("stalenes"), "{e}");
}

/// One step off and partial rollouts both carry rollouts across updates: the configuration
/// refuses them together, naming both fields; each alone (or partial rollouts with
/// staleness 0) is accepted.
#[test]
fn one_step_off_with_partial_rollouts_is_refused() {
    let dir = tempdir();
    let mut v = serde_json::to_value(config(dir.path(), Some(1))).unwrap();
    v["rollout"]["partial"]["enable"] = true.into();
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout.async.staleness") && e.contains("rollout.partial.enable"), "{e}");
    v["rollout"]["async"]["staleness"] = 0.into();
    let cfg = RunConfig::from_json(&v).unwrap();
    assert!(cfg.rollout.partial.enable && !cfg.rollout.asynchronous.enabled());
    v["rollout"]["async"]["staleness"] = 1.into();
    v["rollout"]["partial"]["enable"] = false.into();
    assert!(RunConfig::from_json(&v).unwrap().rollout.asynchronous.enabled());
}

/// `rollout.async.roles` with `rollout_ranks` rollout ranks, over `ranks` ranks on threads:
/// `steps` steps; each rank's metrics, its weights and whether it rolled out.
fn role_run(
    cfg: &RunConfig,
    ranks: usize,
    rollout_ranks: usize,
    run: &std::path::Path,
    steps: u64,
) -> Vec<RankRun> {
    let mut cfg = cfg.clone();
    cfg.rollout.asynchronous.roles = Some(RolesConfig { rollout_ranks });
    on_thread_ranks(ranks, |c| {
        let mut t = Trainer::new_on(std::sync::Arc::new(c), cfg.clone(), run).unwrap();
        t.set_final_step(steps);
        let metrics = (0..steps).map(|_| t.step(&t.default_plan(), None, None).unwrap()).collect();
        RankRun { metrics, weights: weight_bits(&t), versions: t.last_rollout_version() }
    })
}

/// `f` on each rank of an in-process group of `ranks` ranks, one thread each; the
/// results in rank order.
fn on_thread_ranks<T: Send>(ranks: usize, f: impl Fn(stapo::dist::ThreadComm) -> T + Sync) -> Vec<T> {
    let comms = stapo::dist::ThreadComm::group(ranks);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

struct RankRun {
    metrics: Vec<StepMetrics>,
    weights: Vec<u32>,
    versions: Option<u64>,
}

/// The reference: one process under `rollout.async` with `staleness`, `steps` steps.
fn one_process(cfg: RunConfig, run: &std::path::Path, steps: u64) -> (Vec<StepMetrics>, Vec<u32>) {
    let mut t = Trainer::new(cfg, run).unwrap();
    t.set_final_step(steps);
    let m = (0..steps).map(|_| t.step(&t.default_plan(), None, None).unwrap()).collect();
    (m, weight_bits(&t))
}

/// One rollout rank and one trainer rank train what one process trains under
/// `rollout.async` with the same staleness, weight for weight: the same rollouts (drawn
/// under the same policy versions), the same updates. Both ranks report the trainer's
/// metrics, which equal the one process's (timings aside); the trainer alone writes the
/// run folder.
#[test]
fn one_rollout_rank_and_one_trainer_rank_train_as_one_process() {
    let dir = tempdir();
    for staleness in [0, 1] {
        let cfg = config(dir.path(), Some(staleness));
        let (want_m, want_w) = one_process(cfg.clone(), &dir.path().join(format!("one-{staleness}")), 3);
        let run = dir.path().join(format!("roles-{staleness}"));
        let ranks = role_run(&cfg, 2, 1, &run, 3);
        let (trainer, rollout) = (&ranks[0], &ranks[1]);
        assert_eq!(trainer.weights, want_w, "staleness {staleness}: the trainer's weights");
        assert_ne!(rollout.weights, want_w, "a rollout rank does not train its own master copy");
        for (k, ((a, b), c)) in want_m.iter().zip(&trainer.metrics).zip(&rollout.metrics).enumerate() {
            assert_eq!(
                metrics_without_timing(a),
                metrics_without_timing(b),
                "staleness {staleness} step {k}"
            );
            assert_eq!(
                b, c,
                "staleness {staleness} step {k}: the rollout rank reports the trainer's metrics"
            );
            let lag = if staleness == 1 && k > 0 { 1 } else { 0 };
            match (&a.asynchronous, &b.asynchronous) {
                (None, None) => assert_eq!(staleness, 0),
                (Some(x), Some(y)) => {
                    assert_eq!((x.staleness_max, y.staleness_max), (lag, lag), "step {k}");
                    assert_eq!(x.staleness_hist, y.staleness_hist, "step {k}");
                }
                _ => panic!("staleness {staleness} step {k}: async figures on one side only"),
            }
        }
        assert_eq!(trainer.versions, Some(if staleness == 1 { 1 } else { 2 }));
        let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 3, "one line per step, written by the trainer");
    }
}

/// Two rollout ranks (the step's prompts split between them, groups whole) and two
/// trainer ranks (each updating on its share, gradients summed over the two): the
/// weights are the one process's up to float summation order.
#[test]
fn two_rollout_ranks_and_two_trainer_ranks_train_as_one_process() {
    let dir = tempdir();
    let mut cfg = config(dir.path(), Some(1));
    cfg.data.prompts_per_step = 4;
    let (_, want) = one_process(cfg.clone(), &dir.path().join("one"), 3);
    let ranks = role_run(&cfg, 4, 2, &dir.path().join("roles"), 3);
    let f = |bits: &[u32]| bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<f32>>();
    let (want, got) = (f(&want), f(&ranks[0].weights));
    let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 2e-5, "weights differ by {worst}");
    assert_eq!(ranks[0].weights, ranks[1].weights, "the two trainers hold the same weights");
    assert_eq!(ranks[2].metrics, ranks[0].metrics);
    assert_eq!(ranks[3].metrics, ranks[0].metrics);
}

/// Bad role settings are refused naming the field: no rollout rank, as many rollout
/// ranks as ranks (or one process), with partial rollouts, with the threads of the
/// one-process form, with rollbacks, with fewer prompts than ranks of a role.
#[test]
fn bad_role_settings_name_the_field() {
    let dir = tempdir();
    let mut v = serde_json::to_value(config(dir.path(), Some(1))).unwrap();
    v["rollout"]["async"]["roles"] = serde_json::json!({"rollout_ranks": 0});
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout.async.roles.rollout_ranks") && e.contains("at least 1"), "{e}");
    v["rollout"]["async"]["roles"] = serde_json::json!({"rollout_rank": 1});
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout_rank"), "{e}");
    v["rollout"]["async"]["roles"] = serde_json::json!({"rollout_ranks": 1});
    v["rollout"]["partial"]["enable"] = true.into();
    v["rollout"]["async"]["staleness"] = 0.into();
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout.async.roles") && e.contains("rollout.partial.enable"), "{e}");
    v["rollout"]["partial"]["enable"] = false.into();
    v["rollout"]["async"]["rollout_threads"] = 2.into();
    let e = RunConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("rollout.async.rollout_threads"), "{e}");
    v["rollout"]["async"]["rollout_threads"] = 0.into();
    assert!(RunConfig::from_json(&v).unwrap().rollout.asynchronous.roles.is_some());

    // Checked against the job's ranks when the run starts, on every rank.
    let start = |cfg: &RunConfig, ranks: usize| -> Vec<String> {
        let comms = stapo::dist::ThreadComm::group(ranks);
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let (cfg, run) = (cfg.clone(), dir.path().join("refused"));
                    s.spawn(move || {
                        Trainer::new_on(std::sync::Arc::new(c), cfg, &run).err().unwrap().to_string()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let with_roles = |r: usize| {
        let mut c = config(dir.path(), Some(1));
        c.rollout.asynchronous.roles = Some(RolesConfig { rollout_ranks: r });
        c
    };
    for e in start(&with_roles(2), 2) {
        assert!(
            e.contains("rollout.async.roles.rollout_ranks") && e.contains("2 rollout rank(s) in a job of 2"),
            "{e}"
        );
    }
    let e = Trainer::new(with_roles(1), &dir.path().join("alone")).err().unwrap().to_string();
    assert!(e.contains("rollout.async.roles.rollout_ranks") && e.contains("at least 2 ranks"), "{e}");
    let mut few = with_roles(2);
    few.data.prompts_per_step = 1;
    for e in start(&few, 3) {
        assert!(e.contains("data.prompts_per_step") && e.contains("2 rollout rank(s)"), "{e}");
    }
    let mut rollback = with_roles(1);
    rollback.guard.on_divergence = stapo::guard::OnDivergence::Rollback;
    for e in start(&rollback, 2) {
        assert!(e.contains("guard.on_divergence"), "{e}");
    }
}

/// When a rank's preemption flag goes up at a step of [`split_run`].
#[derive(Clone, Copy, PartialEq, Debug)]
enum Flag {
    Down,
    /// Up as the step starts (after the ranks agreed to run it), and it stays up: a stop
    /// signal received during the step.
    Up,
    /// Up at the first token of the step's own rollout, and it stays up.
    InRollout,
    /// Up during this step only: its rollouts are cancelled, the run goes on (Ctrl-C in a
    /// session).
    Cancel,
}

/// How one rank's part of a [`split_run`] ended.
struct RankEnd {
    /// Steps completed.
    steps: u64,
    metrics: Vec<StepMetrics>,
    weights: Vec<u32>,
    /// The ranks agreed to stop before the next step (`stapo run` after a signal).
    stopped: bool,
    /// The step that failed and ended the run, if any.
    error: Option<String>,
    /// What `save_on_exit` returned after a stop or an error.
    checkpoint: Option<std::path::PathBuf>,
}

/// A run split into roles on threads (`ranks` ranks, the last `rollout_ranks` of them
/// rolling out; none: data-parallel ranks), in folder `run` (`resume`: continuing the run there from its latest
/// checkpoint), stepped towards `steps` steps as `stapo run` steps it: each rank has a
/// preemption flag of its own, as each process under `mpirun` does; the ranks agree
/// whether to stop before every step ([`Trainer::stop_requested`]); a stop or a failed
/// step ends the loop and `save_on_exit` leaves a checkpoint. `crash_at`: every rank
/// gives up before that step without saving anything (the job killed). `flag(rank,
/// step)` says when a rank's flag goes up.
fn split_run(
    cfg: &RunConfig,
    (ranks, rollout_ranks): (usize, usize),
    run: &std::path::Path,
    resume: bool,
    steps: u64,
    crash_at: Option<u64>,
    flag: &(dyn Fn(usize, u64) -> Flag + Sync),
) -> Vec<RankEnd> {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let mut cfg = cfg.clone();
    cfg.rollout.asynchronous.roles = (rollout_ranks > 0).then_some(RolesConfig { rollout_ranks });
    on_thread_ranks(ranks, |c| {
        let rank = stapo::dist::Comm::rank(&c);
        let c = std::sync::Arc::new(c);
        let mut t = if resume {
            Trainer::resume_on(c, run).unwrap()
        } else {
            Trainer::new_on(c, cfg.clone(), run).unwrap()
        };
        t.set_final_step(steps);
        let up = AtomicBool::new(false);
        let raise = |_: usize| up.store(true, SeqCst);
        let mut end = RankEnd {
            steps: 0,
            metrics: Vec::new(),
            weights: Vec::new(),
            stopped: false,
            error: None,
            checkpoint: None,
        };
        while t.step_count() < crash_at.unwrap_or(steps) {
            if t.stop_requested(&up).unwrap().is_some() {
                end.stopped = true;
                break;
            }
            let how = flag(rank, t.step_count());
            if matches!(how, Flag::Up | Flag::Cancel) {
                up.store(true, SeqCst);
            }
            let progress: Option<&dyn Fn(usize)> = (how == Flag::InRollout).then_some(&raise);
            match t.step(&t.default_plan(), progress, Some(&up)) {
                Ok(m) => end.metrics.push(m),
                Err(e) => {
                    end.error = Some(e.to_string());
                    break;
                }
            }
            if how == Flag::Cancel {
                up.store(false, SeqCst);
            }
        }
        end.steps = t.step_count();
        if crash_at.is_none() && (end.stopped || end.error.is_some()) {
            end.checkpoint = t.save_on_exit().unwrap();
        }
        end.weights = weight_bits(&t);
        end
    })
}

/// The run folder's metrics lines without the timings (and the async figures but their
/// staleness), one per step logged.
fn logged(run: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            let staleness = o.get("async").map(|a| a["staleness_max"].clone());
            for k in ["rollout_secs", "update_secs", "rollout_tokens_per_sec", "phase_secs", "async", "time"]
            {
                o.remove(k);
            }
            if let Some(s) = staleness {
                o.insert("staleness_max".into(), s);
            }
            v
        })
        .collect()
}

fn latest_checkpoint(run: &std::path::Path) -> String {
    std::fs::read_to_string(run.join("checkpoints/latest")).unwrap().trim().to_string()
}

const STEPS: u64 = 4;

/// A reference run: trainer 0's end and its folder's metrics lines ([`logged`]).
type Reference = (RankEnd, Vec<serde_json::Value>);

/// The references of a split run of [`STEPS`] steps: uninterrupted, and (staleness 1)
/// with the rollout of step 2, drawn beside update 1, given up (cancelled on the last
/// rollout rank), so that step 2 rolls out under the weights of step 2 itself, as a run
/// resumed from checkpoint step-000002 does. Trainer 0's end and its folder's lines.
fn split_references(
    cfg: &RunConfig,
    shape: (usize, usize),
    dir: &std::path::Path,
) -> (RankEnd, Vec<serde_json::Value>, Option<Reference>) {
    let s = cfg.rollout.asynchronous.staleness;
    let tag = format!("{}x{}-s{s}", shape.0, shape.1);
    std::fs::create_dir_all(dir).unwrap();
    let run = dir.join(format!("uninterrupted-{tag}"));
    let mut u = split_run(cfg, shape, &run, false, STEPS, None, &|_, _| Flag::Down);
    let u = (u.swap_remove(0), logged(&run));
    assert_eq!(u.0.steps, STEPS);
    if s == 0 {
        return (u.0, u.1, None);
    }
    let run = dir.join(format!("given-up-{tag}"));
    let last = shape.0 - 1;
    let mut g = split_run(cfg, shape, &run, false, STEPS, None, &|rank, step| {
        if rank == last && step == 1 {
            Flag::Cancel
        } else {
            Flag::Down
        }
    });
    let g = (g.swap_remove(0), logged(&run));
    assert_eq!(g.0.steps, STEPS);
    let staleness: Vec<u64> = g.1.iter().map(|l| l["staleness_max"].as_u64().unwrap()).collect();
    assert_eq!(staleness, [0, 1, 0, 1], "step 2 rolls out itself, step 3 one step off again");
    assert_eq!(u.1[..2], g.1[..2], "the steps before the rollout given up");
    assert_ne!(u.0.weights, g.0.weights);
    (u.0, u.1, Some(g))
}

/// The one process under `rollout.async` with the rollout of step 2 given up as in
/// [`split_references`]: its weights after [`STEPS`] steps.
fn one_process_given_up(cfg: RunConfig, run: &std::path::Path) -> Vec<u32> {
    let mut t = Trainer::new(cfg, run).unwrap();
    t.set_final_step(STEPS);
    for k in 0..STEPS {
        let cancel = std::sync::atomic::AtomicBool::new(k == 1);
        t.step(&t.default_plan(), None, Some(&cancel)).unwrap();
    }
    weight_bits(&t)
}

/// A split run saves checkpoint step-000002 (`checkpoint.save_every`), logs step 2 and is
/// killed; resumed from the checkpoint as a split run, it ends with the weights and the
/// metrics lines of the uninterrupted split run, bit for bit: at staleness 0 the
/// uninterrupted run itself; at staleness 1 the uninterrupted run in which the rollout of
/// step 2 drawn ahead was given up, since a checkpoint never holds a rollout drawn ahead
/// (the resumed step 2 draws the same prompts again under the checkpoint's weights), which
/// is also what one process under `rollout.async` trains. One rollout rank and one trainer
/// rank, and two of each.
#[test]
fn a_split_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one() {
    let dir = tempdir();
    for (shape, staleness) in [((2, 1), 0), ((2, 1), 1), ((4, 2), 1)] {
        let mut cfg = config(dir.path(), Some(staleness));
        cfg.checkpoint.save_every = 2;
        if shape.0 == 4 {
            cfg.data.prompts_per_step = 4;
        }
        let case = format!("{} ranks, {} rolling out, staleness {staleness}", shape.0, shape.1);
        let (u, u_lines, given_up) = split_references(&cfg, shape, dir.path());
        let run = dir.path().join(format!("resumed-{}x{}-s{staleness}", shape.0, shape.1));
        let killed = split_run(&cfg, shape, &run, false, STEPS, Some(3), &|_, _| Flag::Down);
        assert!(killed.iter().all(|r| r.steps == 3), "{case}");
        assert_eq!(latest_checkpoint(&run), "step-000002", "{case}");
        assert_eq!(logged(&run).len(), 3, "{case}: step 2 logged after the checkpoint");
        let resumed = split_run(&cfg, shape, &run, true, STEPS, None, &|_, _| Flag::Down);
        for (rank, r) in resumed.iter().enumerate() {
            assert_eq!((r.steps, r.metrics.len()), (STEPS, 2), "{case}: rank {rank} ran steps 2 and 3");
            if rank >= shape.0 - shape.1 {
                assert_eq!(r.metrics, resumed[0].metrics, "{case}: rollout rank {rank} reports trainer 0's");
            }
        }
        let (want, want_lines) = match &given_up {
            None => (&u, &u_lines),
            Some((g, g_lines)) => (g, g_lines),
        };
        assert_eq!(resumed[0].weights, want.weights, "{case}: the trainer's weights");
        if shape.0 == 4 {
            assert_eq!(resumed[1].weights, want.weights, "{case}: the second trainer's weights");
        }
        assert_eq!(&logged(&run), want_lines, "{case}: metrics.jsonl");
        for (k, (a, b)) in want.metrics[2..].iter().zip(&resumed[0].metrics).enumerate() {
            assert_eq!(metrics_without_timing(a), metrics_without_timing(b), "{case}: step {}", k + 2);
        }
        if shape == (2, 1) && staleness == 1 {
            let one = one_process_given_up(
                config_with_save(dir.path(), staleness),
                &dir.path().join("one-given-up"),
            );
            assert_eq!(resumed[0].weights, one, "{case}: the one process giving up the same rollout");
        }
    }
}

fn config_with_save(dir: &std::path::Path, staleness: u32) -> RunConfig {
    let mut cfg = config(dir, Some(staleness));
    cfg.checkpoint.save_every = 2;
    cfg
}

/// A stop (the preemption flag that SIGTERM, SIGINT and SIGUSR1 set) in a split run: each
/// rank has its own flag, as each process under `mpirun` does, and it may go up on one
/// rank only. Every rank stops at the same step boundary (none left waiting in a receive
/// or a collective), rank 0 writes the checkpoint, and the split run resumed from it ends
/// with the weights and the metrics lines of the uninterrupted one (at staleness 1, of the
/// uninterrupted one with the rollout drawn ahead given up, as in one process: a
/// checkpoint never holds a rollout drawn ahead).
#[test]
fn a_stop_halts_every_rank_of_a_split_run_at_one_step_and_resumes_as_uninterrupted() {
    let dir = tempdir();
    type Shape = (usize, usize);
    const SPLIT: Shape = (2, 1);
    const DATA_PARALLEL: Shape = (2, 0);
    // (ranks, staleness, the rank whose flag goes up, at which step and how, the
    // checkpoint left)
    let cases: [(Shape, u32, usize, u64, Flag, u64); 5] = [
        // The rollout of step 2 is cancelled on the rollout rank: step 2 fails on every
        // rank, steps 0-1 are kept.
        (SPLIT, 0, 1, 2, Flag::InRollout, 2),
        // Raised on the trainer rank only while it trains step 1: the rollout rank learns
        // it between steps 1 and 2.
        (SPLIT, 0, 0, 1, Flag::Up, 2),
        // The rollout of step 2, drawn beside update 1, is cancelled: update 1 finishes,
        // step 1 completes, every rank stops before step 2.
        (SPLIT, 1, 1, 1, Flag::Up, 2),
        // Raised on the trainer rank only during step 1: the rollout of step 2 is drawn
        // whole and held, never saved; step 2 draws it again after the resume.
        (SPLIT, 1, 0, 1, Flag::Up, 2),
        // Two data-parallel ranks: the rollout of step 2 cancelled on rank 1 alone fails
        // step 2 on both.
        (DATA_PARALLEL, 0, 1, 2, Flag::InRollout, 2),
    ];
    let mut references = std::collections::HashMap::new();
    for (k, (shape, staleness, who, at, how, left)) in cases.into_iter().enumerate() {
        let cfg = config(dir.path(), Some(staleness));
        let (u, u_lines, given_up) = references
            .entry((shape, staleness))
            .or_insert_with(|| split_references(&cfg, shape, &dir.path().join("references")));
        let case = format!("{shape:?} staleness {staleness}: rank {who}'s flag {how:?} at step {at}");
        let run = dir.path().join(format!("stopped-{k}"));
        let ends = split_run(&cfg, shape, &run, false, STEPS, None, &|rank, step| {
            if rank == who && step == at {
                how
            } else {
                Flag::Down
            }
        });
        for (rank, e) in ends.iter().enumerate() {
            assert_eq!(e.steps, left, "{case}: rank {rank} stopped after {} steps", e.steps);
            assert_eq!(e.stopped, how != Flag::InRollout, "{case}: rank {rank} ({:?})", e.error);
            if how == Flag::InRollout {
                let err = e.error.as_deref().unwrap_or_default();
                assert!(err.contains("cancelled"), "{case}: rank {rank}: {err}");
            } else {
                assert!(e.error.is_none(), "{case}: rank {rank}: {:?}", e.error);
            }
            let want = run.join("checkpoints").join(format!("step-{left:06}"));
            assert_eq!(e.checkpoint.as_deref(), Some(want.as_path()), "{case}: rank {rank}");
        }
        assert_eq!(latest_checkpoint(&run), format!("step-{left:06}"), "{case}");
        assert_eq!(logged(&run).len() as u64, left, "{case}");
        let resumed = split_run(&cfg, shape, &run, true, STEPS, None, &|_, _| Flag::Down);
        assert!(resumed.iter().all(|r| r.steps == STEPS && !r.stopped && r.error.is_none()), "{case}");
        let (want, want_lines) = match given_up {
            Some((g, g_lines)) if staleness == 1 => (&*g, &*g_lines),
            _ => (&*u, &*u_lines),
        };
        assert_eq!(resumed[0].weights, want.weights, "{case}: the trainer's weights");
        assert_eq!(&logged(&run), want_lines, "{case}: metrics.jsonl");
    }
}
