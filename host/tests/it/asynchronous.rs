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
    let comms = stapo::dist::ThreadComm::group(ranks);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let mut t = Trainer::new_on(std::sync::Arc::new(c), cfg, run).unwrap();
                    t.set_final_step(steps);
                    let metrics =
                        (0..steps).map(|_| t.step(&t.default_plan(), None, None).unwrap()).collect();
                    RankRun { metrics, weights: weight_bits(&t), versions: t.last_rollout_version() }
                })
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
