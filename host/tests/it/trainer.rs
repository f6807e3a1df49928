//! The training loop: a resumed run reproduces the uninterrupted one, and a
//! run folder holds what it promises.

use stapo::reward::ExtractMode;
use stapo::train::{RunConfig, Trainer};

use crate::common::{arith_fixture, max_abs_diff, tempdir, weight_bits};

fn config(model: std::path::PathBuf, train: std::path::PathBuf, test: std::path::PathBuf) -> RunConfig {
    // DAPO + S2T: its overlong shaping gives the truncated responses of a random model
    // non-zero advantages (stapo, the paper's JustRL recipe, has no length shaping).
    // Flexible extraction (last-number fallback) so a random model sometimes scores.
    RunConfig::from_json(&serde_json::json!({
        "model": {"path": model},
        "data": {"train": train, "test": test, "prompts_per_step": 3, "extract": ExtractMode::Flexible},
        "rollout": {"sampling": {"n": 4, "max_tokens": 12}},
        "actor": {"preset": "dapo_s2t", "optim": {"lr": 1e-2},
                  "objective": {"mask": {"tau_p": 0.05}, "dynamic_sampling": false}},
        "checkpoint": {"save_every": 2},
        "evaluation": {"every": 3, "sampling": {"n": 2}, "pass_k": [1, 2], "limit": 4},
    }))
    .unwrap()
}

#[test]
fn resume_equals_uninterrupted_run() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let cfg = config(model, train, test);

    let mut a = Trainer::new(cfg.clone(), &dir.path().join("run-a")).unwrap();
    let mut metrics_a = Vec::new();
    let mut nonzero_adv = 0;
    for _ in 0..3 {
        metrics_a.push(a.step(&a.default_plan(), None, None).unwrap());
        let rec = a.last_update().unwrap();
        nonzero_adv += rec.advantages.iter().filter(|x| **x != 0.0).count();
    }
    // The comparison below means something only if the policy gradient moved the
    // weights, not weight decay alone.
    assert!(nonzero_adv > 0, "every advantage was 0: {metrics_a:?}");

    let b_dir = dir.path().join("run-b");
    let mut b = Trainer::new(cfg, &b_dir).unwrap();
    for _ in 0..2 {
        b.step(&b.default_plan(), None, None).unwrap();
    }
    // One extra step after the checkpoint at step 2, then a "crash".
    b.step(&b.default_plan(), None, None).unwrap();
    drop(b);
    let mut b = Trainer::resume(&b_dir).unwrap();
    assert_eq!(b.step_count(), 2);
    let m = b.step(&b.default_plan(), None, None).unwrap();
    assert!(b.last_update().unwrap().advantages.iter().any(|x| *x != 0.0), "resumed step: all advantages 0");

    assert_eq!(weight_bits(&a), weight_bits(&b), "weights differ after resume");
    let (ma, mb) = (serde_json::to_value(&metrics_a[2]).unwrap(), serde_json::to_value(&m).unwrap());
    for key in ["loss", "reward_mean", "entropy", "kept_tokens", "silenced_tokens", "grad_norm", "eval_avg"] {
        assert_eq!(ma[key], mb[key], "metric {key}");
    }
    // metrics.jsonl holds each step once: the re-run step replaced the lost one.
    let lines = std::fs::read_to_string(b_dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = lines
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![0, 1, 2]);
    // TensorBoard: the first run's file and the resumed run's (whose step 2 replaced
    // the lost one there: train::tensorboard's tests).
    assert_eq!(std::fs::read_dir(b_dir.join("tb")).unwrap().count(), 2);
    // The run folder: config, checkpoint with optimizer and state, eval results.
    for f in [
        "run_config.json",
        "checkpoints/latest",
        "checkpoints/step-000002/model.safetensors",
        "checkpoints/step-000002/optimizer.safetensors",
        "checkpoints/step-000002/trainer_state.json",
        "checkpoints/step-000002/tokenizer.json",
        "eval.jsonl",
        "eval/step-000003.jsonl",
        "curves.png",
        "curves.svg",
        "rollouts/step-000002.jsonl",
        "silenced_tokens.tsv",
    ] {
        assert!(b_dir.join(f).exists(), "missing {f}");
    }
    // eval.jsonl reports pass@k for the configured k: pass@1 is avg@n, pass@n is pass.
    let evals = std::fs::read_to_string(b_dir.join("eval.jsonl")).unwrap();
    assert!(evals.lines().count() >= 2);
    for line in evals.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let o = &v["overall"];
        let k = |k: &str| o["pass_at_k"][k].as_f64().unwrap_or(f64::NAN);
        assert!((k("1") - o["avg"].as_f64().unwrap()).abs() < 1e-12, "{line}");
        assert!((k("2") - o["pass"].as_f64().unwrap()).abs() < 1e-12, "{line}");
        assert!(
            v["by_source"].as_object().unwrap().values().all(|s| s["pass_at_k"]["2"].is_number()),
            "{line}"
        );
    }
}

/// A bf16 run trains in mixed precision: its checkpoint keeps the f32 master
/// weights in `optimizer.safetensors` beside the bf16 model files, and a run resumed
/// from it continues bit for bit as the uninterrupted run (the master weights come back
/// exactly; rounding them again would not give back what the bf16 files lost).
#[test]
fn a_bf16_run_resumes_exactly_from_its_master_weights() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model, train, test);
    cfg.model.dtype = "bfloat16".into();
    cfg.evaluation.every = 0;
    let mut a = Trainer::new(cfg.clone(), &dir.path().join("run-a")).unwrap();
    for _ in 0..3 {
        a.step(&a.default_plan(), None, None).unwrap();
    }
    let b_dir = dir.path().join("run-b");
    let mut b = Trainer::new(cfg, &b_dir).unwrap();
    for _ in 0..3 {
        b.step(&b.default_plan(), None, None).unwrap();
    }
    drop(b);
    let opt = b_dir.join("checkpoints/step-000002/optimizer.safetensors");
    let saved = candle_core::safetensors::load(&opt, &candle_core::Device::Cpu).unwrap();
    let masters: Vec<_> = saved.iter().filter(|(n, _)| n.ends_with(".master")).collect();
    assert!(!masters.is_empty(), "no master weights in {}", opt.display());
    assert!(masters.iter().all(|(_, t)| t.dtype() == candle_core::DType::F32));
    // The master weights hold what the bf16 model files cannot: a resume that started
    // them from the files would continue from other weights.
    let files = candle_core::safetensors::load(
        b_dir.join("checkpoints/step-000002/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let finer = masters.iter().any(|(n, m)| {
        let w = &files[n.trim_end_matches(".master")];
        let w = w.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        m.flatten_all().unwrap().to_vec1::<f32>().unwrap() != w
    });
    assert!(finer, "every master weight equals its bf16 rounding");
    let mut b = Trainer::resume(&b_dir).unwrap();
    assert_eq!(b.step_count(), 2);
    b.step(&b.default_plan(), None, None).unwrap();
    assert!(b.model().params().iter().all(|(_, v)| v.dtype() == candle_core::DType::BF16));
    assert_eq!(weight_bits(&a), weight_bits(&b), "bf16 weights differ after resume");
}

#[test]
fn a_new_run_refuses_an_existing_run_folder() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let cfg = config(model, train, test);
    let mut a = Trainer::new(cfg.clone(), &dir.path().join("run")).unwrap();
    // Before its first checkpoint the folder may be started again, but not while a run lives.
    let err = Trainer::new(cfg.clone(), &dir.path().join("run")).err().unwrap().to_string();
    assert!(err.contains("is in use"), "{err}");
    a.step(&a.default_plan(), None, None).unwrap();
    a.checkpoint().unwrap();
    let err = Trainer::new(cfg.clone(), &dir.path().join("run")).err().unwrap().to_string();
    assert!(err.contains("already holds a run"), "{err}");
    let mut bad = cfg;
    bad.evaluation.pass_k = vec![1, 4];
    let err = Trainer::new(bad, &dir.path().join("run-2")).err().unwrap().to_string();
    assert!(err.contains("evaluation.pass_k") && err.contains("k = 4"), "{err}");
}

#[test]
fn dynamic_sampling_refills_or_warns_at_the_limit() {
    // A random model almost never answers right: no group has mixed rewards, so dynamic
    // sampling keeps generating until max_num_gen_batches and says so.
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model, train, test);
    cfg.actor.preset = "dapo".into();
    cfg.actor.objective = stapo::algo::ObjectiveConfig::preset("dapo").unwrap();
    cfg.data.extract = ExtractMode::Strict;
    cfg.evaluation.every = 0;
    cfg.checkpoint.save_every = 0;
    cfg.rollout.max_num_gen_batches = 3;
    let mut t = Trainer::new(cfg, &dir.path().join("run")).unwrap();
    let m = t.step(&t.default_plan(), None, None).unwrap();
    assert_eq!(m.gen_batches, 3, "{m:?}");
    assert_eq!(m.groups_dropped, 9);
    assert!(m.update.warnings.iter().any(|w| w.contains("max_num_gen_batches")), "{:?}", m.update.warnings);
    // The overlong buffer followed the run's max_tokens (12): a truncated response is cut
    // at L_max and gets the full penalty -1 on top of its reward.
    let rec = t.last_update().unwrap();
    let batch = t.last_rollout().unwrap();
    for (s, r) in batch.samples.iter().zip(&rec.rewards) {
        if s.truncated {
            assert_eq!(*r, s.reward.unwrap() - 1.0);
        }
    }
    assert!(batch.samples.iter().any(|s| s.truncated));
}

#[test]
fn rollout_dtype_samples_from_a_copy_that_follows_the_master() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model, train, test);
    cfg.evaluation.every = 0;
    cfg.checkpoint.save_every = 0;
    cfg.rollout.dtype = Some("bfloat16".into());
    let mut t = Trainer::new(cfg.clone(), &dir.path().join("run")).unwrap();
    assert_eq!(t.model().dtype(), candle_core::DType::F32);
    assert_eq!(t.sampling_model().dtype(), candle_core::DType::BF16);
    let before = weight_bits(&t);
    t.step(&t.default_plan(), None, None).unwrap();
    assert_ne!(weight_bits(&t), before, "the update moved the master weights");
    // After the update the copy holds the new master weights, rounded to bf16.
    for ((name, m), (_, c)) in t.model().params().iter().zip(t.sampling_model().params().iter()) {
        let want = m.as_tensor().to_dtype(candle_core::DType::BF16).unwrap();
        let d = max_abs_diff(&want, c.as_tensor());
        assert_eq!(d, 0.0, "{name}: the rollout copy lags the master");
    }
    // A bad name is an error naming the field.
    let mut bad = cfg;
    bad.rollout.dtype = Some("float8".into());
    let err = Trainer::new(bad, &dir.path().join("run-2")).err().unwrap().to_string();
    assert!(err.contains("rollout.dtype"), "{err}");
}

/// Rollouts sampled from a bf16 copy on the CPU: their log-probs are the copy's, not the
/// f32 master's; the update measures the mismatch against its recomputed f32 old log-probs
/// (the k1 KL is the hand-computed mean of rollout - master over the response tokens) and,
/// the copy's dtype differing, applies token-TIS by default. An explicit mode at T != 1 is
/// an error naming why; auto there is off, with a note.
#[test]
fn bf16_rollout_copy_log_probs_and_their_mismatch() {
    use stapo::train::update::{RolloutCorrMode, RolloutCorrection};
    use stapo::train::{token_analysis, Sequence};
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model, train, test);
    cfg.evaluation.every = 0;
    cfg.checkpoint.save_every = 0;
    cfg.rollout.dtype = Some("bfloat16".into());
    // The same policy, never updated: the master and the copy that sampled the step's rollouts.
    let t0 = Trainer::new(cfg.clone(), &dir.path().join("run-0")).unwrap();
    let mut t = Trainer::new(cfg.clone(), &dir.path().join("run")).unwrap();
    let m = t.step(&t.default_plan(), None, None).unwrap();
    let seqs: Vec<Sequence> =
        t.last_rollout().unwrap().samples.iter().map(|s| Sequence::from_sample(s, 0.0)).collect();
    let on_copy = token_analysis(t0.sampling_model(), &seqs, 0, 1.0, 4).unwrap();
    let on_master = token_analysis(t0.model(), &seqs, 0, 1.0, 4).unwrap();
    let (mut to_copy, mut to_master, mut k1, mut n) = (0f64, 0f64, 0f64, 0usize);
    for ((s, c), mm) in seqs.iter().zip(&on_copy).zip(&on_master) {
        for ((&r, pc), pm) in s.rollout_logprobs.as_ref().unwrap().iter().zip(&c.p).zip(&mm.p) {
            to_copy += (r as f64 - (*pc as f64).ln()).abs();
            to_master += (r as f64 - (*pm as f64).ln()).abs();
            k1 += r as f64 - (*pm as f64).ln();
            n += 1;
        }
    }
    let (to_copy, to_master, k1) = (to_copy / n as f64, to_master / n as f64, k1 / n as f64);
    // With f32 activations (AVX2, portable) the copy's forward gives its decoding's values
    // up to f32 rounding. The bf16 dot-product paths (AMX, AVX-512 BF16) round the
    // activations of this forward's products to bf16, which decoding (f32 activations,
    // few rows) does not: the copy's forward then differs from the rollout by as much as
    // that rounding (0.6x the distance to the master, measured on AMX), still less than
    // the master does.
    let bound = if stapo::model::fused::simd::cpu_path().bf16_dot() { 0.8 } else { 0.5 };
    assert!(
        to_copy < bound * to_master,
        "rollout log-probs: |r - copy| {to_copy} vs |r - master| {to_master}"
    );
    let rc = m.update.rollout_corr.clone().expect("rollout_corr metrics");
    assert_eq!(rc.mode, RolloutCorrMode::TokenTis);
    assert!(rc.log_ratio_abs_max > 0.0 && rc.log_ratio_abs_mean > 0.0, "{rc:?}");
    assert!((rc.kl as f64 - k1).abs() < 1e-4 * k1.abs().max(1e-2), "kl {} vs {k1}", rc.kl);
    assert!((rc.log_ratio_abs_mean as f64 - to_master).abs() < 1e-4 * to_master.max(1e-2), "{rc:?}");

    // At T = 0.7 the sampled log-probs (T = 1) are not the tempered policy's.
    let mut plan = t.default_plan();
    plan.sampling.temperature = 0.7;
    let m = t.step(&plan, None, None).unwrap();
    assert!(m.update.rollout_corr.is_none());
    assert!(
        m.update.warnings.iter().any(|w| w.contains("rollout correction off")),
        "{:?}",
        m.update.warnings
    );
    let tis = RolloutCorrection { mode: RolloutCorrMode::TokenTis, ..RolloutCorrection::default() };
    let mut tis_cfg = cfg;
    tis_cfg.actor.rollout_correction = tis;
    let mut t = Trainer::new(tis_cfg, &dir.path().join("run-2")).unwrap();
    let err = t.step(&plan, None, None).err().unwrap().to_string();
    assert!(err.contains("rollout_correction.mode") && err.contains("temperature"), "{err}");
}

/// The stress test's pairing: an S2T mask that silences nothing (tau_h = -1, below every
/// entropy) trains exactly as no mask, weight for weight, while its candidate and low-p
/// statistics are reported; so paired arms stay identical until the first silencing.
#[test]
fn an_s2t_mask_that_silences_nothing_trains_as_no_mask() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut base = config(model, train, test);
    (base.evaluation.every, base.checkpoint.save_every, base.actor.mini_batch) = (0, 0, 4);
    let preset = |name: &str, over: serde_json::Value| {
        stapo::algo::ObjectiveConfig::preset(name).unwrap().overlay("test", &over).unwrap()
    };
    base.actor.objective = preset("dapo", serde_json::json!({"dynamic_sampling": false}));
    let mut observer = base.clone();
    observer.actor.objective = preset(
        "dapo_s2t",
        serde_json::json!({"dynamic_sampling": false, "mask": {"tau_p": 0.05, "tau_h": -1.0}}),
    );
    let mut a = Trainer::new(base, &dir.path().join("plain")).unwrap();
    let mut b = Trainer::new(observer, &dir.path().join("observer")).unwrap();
    let (mut candidates, mut moved) = (0, 0);
    for _ in 0..2 {
        let ma = a.step(&a.default_plan(), None, None).unwrap();
        let mb = b.step(&b.default_plan(), None, None).unwrap();
        for key in ["loss", "entropy", "entropy_p99", "grad_norm", "kept_tokens", "optimizer_steps"] {
            let (x, y) = (serde_json::to_value(&ma).unwrap(), serde_json::to_value(&mb).unwrap());
            assert_eq!(x[key], y[key], "metric {key}");
        }
        assert!(
            ma.update.optimizer_steps >= 3,
            "several mini-batches per rollout: {}",
            ma.update.optimizer_steps
        );
        assert_eq!((mb.update.silenced_tokens, ma.update.candidate_grad_share), (0, None));
        assert!(mb.update.candidate_grad_share.is_some());
        candidates += mb.update.s2t_candidates;
        moved += a.last_update().unwrap().advantages.iter().filter(|x| **x != 0.0).count();
    }
    assert!(candidates > 0 && moved > 0, "candidates {candidates}, non-zero advantages {moved}");
    assert_eq!(weight_bits(&a), weight_bits(&b), "weights differ");
}

/// `evaluate_at` another sampling setting writes its own file (with the setting) and
/// leaves eval.jsonl, whose lines now record theirs, and the evaluation history alone.
#[test]
fn evaluations_at_another_setting_are_logged_apart() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model, train, test);
    (cfg.evaluation.every, cfg.checkpoint.save_every) = (1, 0);
    let run = dir.path().join("run");
    let mut t = Trainer::new(cfg, &run).unwrap();
    t.step(&t.default_plan(), None, None).unwrap();
    let low = t.evaluate_at(None, 0.7, 0.9).unwrap();
    assert_eq!(t.eval_history().len(), 2, "steps 0 and 1 at the configured setting only");
    let lines = |f: &str| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(run.join(f)).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let main = lines("eval.jsonl");
    assert_eq!(main.len(), 2);
    assert!(main.iter().all(|v| v["temperature"] == 1.0 && v["top_p"] == 1.0), "{main:?}");
    let extra = lines("eval-t0.7-p0.9.jsonl");
    assert_eq!(extra.len(), 1);
    assert_eq!((extra[0]["step"].as_u64(), extra[0]["temperature"].as_f64()), (Some(1), Some(0.7)));
    assert_eq!(extra[0]["top_p"], 0.9);
    assert_eq!(extra[0]["overall"]["avg"].as_f64(), Some(low.overall.avg));
    assert!(run.join("eval/step-000001-t0.7-p0.9.jsonl").is_file());
    // The configured setting is evaluate() itself; a bad setting names its field.
    t.evaluate_at(None, 1.0, 1.0).unwrap();
    assert_eq!(t.eval_history().len(), 3);
    let err = t.evaluate_at(None, 0.7, 1.5).unwrap_err().to_string();
    assert!(err.contains("top_p") && err.contains("1.5"), "{err}");
    t.set_eval_sampling(0.7, 0.9).unwrap();
    t.evaluate(None).unwrap();
    assert_eq!(lines("eval.jsonl").last().unwrap()["temperature"], 0.7);
}

/// Evaluation samples on the run's rollout engine (`rollout.engine`), not on defaults:
/// a KV cache budget that holds the training rollouts' sequences (prompt + 12 tokens) but
/// not the evaluation's (prompt + 90) makes `evaluate` fail with the budget it was given,
/// and a budget that holds them gives the same report as the default engine (each
/// response's draws do not depend on the schedule).
#[test]
fn evaluation_runs_on_the_runs_engine_settings() {
    let dir = tempdir();
    let (model, train, test) = arith_fixture(dir.path());
    let mut cfg = config(model.clone(), train, test);
    cfg.evaluation.every = 0;
    cfg.evaluation.sampling.max_new_tokens = 90;
    let mcfg = stapo::model::Config::from_file(&model.join("config.json")).unwrap();
    let per_token = stapo::model::PagedKvCache::bytes_per_token(&mcfg, candle_core::DType::F32) as f64;
    let mut t = Trainer::new(cfg.clone(), &dir.path().join("run-default")).unwrap();
    let want = t.evaluate(None).unwrap();

    let mut small = cfg.clone();
    // 80 tokens of cache (5 blocks of 16): a rollout sequence fits, an evaluation one does not.
    small.rollout.engine.kv_cache_gb = Some(80.0 * per_token / 1e9);
    let mut t = Trainer::new(small, &dir.path().join("run-small")).unwrap();
    t.step(&t.default_plan(), None, None).unwrap();
    let err = t.evaluate(None).unwrap_err().to_string();
    assert!(err.contains("rollout.engine.kv_cache_gb = ") && err.contains("holds 5"), "{err}");

    let mut rows = cfg;
    rows.rollout.engine = stapo::rollout::EngineConfig {
        kv_cache_gb: Some(2000.0 * per_token / 1e9),
        max_rows: Some(3),
        block_size: 8,
        ..Default::default()
    };
    let mut t = Trainer::new(rows, &dir.path().join("run-rows")).unwrap();
    let got = t.evaluate(None).unwrap();
    let ids = |r: &stapo::eval::EvalReport| {
        r.samples.iter().map(|s| (s.id.clone(), s.sample_index, s.response.clone())).collect::<Vec<_>>()
    };
    assert_eq!(ids(&got), ids(&want));
    assert_eq!(got.overall.avg, want.overall.avg);
}
