//! The update step on a real (tiny) model: gradient accumulation equals the full
//! batch, S2T silences tokens and renormalises, non-finite losses change nothing.

use candle_core::{DType, Tensor};
use stapo::algo::ObjectiveConfig;
use stapo::train::{self, AdamW, AdamWConfig, OldLogp, Sequence, UpdateConfig};

use crate::common::tiny_model;

fn seqs() -> Vec<Sequence> {
    // 3 groups of 4 responses of varied lengths; rewards mixed so advantages are non-zero.
    let mut out = Vec::new();
    for g in 0..3u32 {
        for i in 0..4u32 {
            let prompt: Vec<u32> = (0..3 + g).map(|t| (t * 13 + g * 7 + 2) % 97).collect();
            let response: Vec<u32> = (0..4 + i + g).map(|t| (t * 29 + i * 5 + g + 3) % 97).collect();
            out.push(Sequence {
                prompt_ids: prompt,
                response_ids: response,
                rollout_logprobs: None,
                reward: ((i + g) % 2) as f32,
                group: g as usize,
                truncated: i == 3,
            });
        }
    }
    out
}

/// An AdamW whose first step is a smooth function of the gradient
/// (eps >> |g| makes `lr * g / (|g| + eps)` close to linear).
fn linearish_opt(m: &stapo::model::Qwen3) -> AdamW {
    let cfg = AdamWConfig { lr: 1.0, eps: 1e3, weight_decay: 0.0, max_grad_norm: None, ..Default::default() };
    AdamW::new(m.params(), cfg).unwrap()
}

fn flat_params(m: &stapo::model::Qwen3) -> Vec<f32> {
    m.params()
        .iter()
        .flat_map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

fn run(preset: &str, micro: usize, tau_p: Option<f32>) -> (Vec<f32>, Vec<f32>, train::UpdateMetrics) {
    run_with(preset, tau_p, 1e3, |c| c.actor.micro_batch = micro)
}

/// The objective `preset` (no dynamic sampling; S2T's `tau_p` when given) in an update
/// configured by `f`, on `seqs()` from the same random model; each optimizer step moves
/// the weights by about `lr / 1e3` times the gradient ([`linearish_opt`]).
fn run_with(
    preset: &str,
    tau_p: Option<f32>,
    lr: f64,
    f: impl Fn(&mut UpdateConfig),
) -> (Vec<f32>, Vec<f32>, train::UpdateMetrics) {
    let m = tiny_model(true, DType::F32, 31);
    let before = flat_params(&m);
    let mut opt = linearish_opt(&m);
    let mut cfg = UpdateConfig::for_objective(objective(preset, tau_p));
    f(&mut cfg);
    let metrics = train::update(&m, &mut opt, None, &seqs(), &cfg, lr, 0).unwrap().metrics;
    (before, flat_params(&m), metrics)
}

fn objective(preset: &str, tau_p: Option<f32>) -> ObjectiveConfig {
    let mut objective = ObjectiveConfig::preset(preset).unwrap();
    if let Some(tp) = tau_p {
        objective = objective.overlay("test", &serde_json::json!({"mask": {"tau_p": tp}})).unwrap();
    }
    objective.dynamic_sampling = false;
    objective
}

/// Every preset, with S2T's tau_p raised where S2T would silence nothing on this model.
fn all_presets() -> Vec<(&'static str, Option<f32>)> {
    stapo::algo::PRESETS
        .iter()
        .map(|p| {
            let s2t =
                matches!(ObjectiveConfig::preset(p.name).unwrap().mask, stapo::algo::MaskConfig::S2t(_));
            (p.name, s2t.then_some(0.03))
        })
        .collect()
}

/// Weights, losses and gradient norms of two updates agree up to float summation order
/// (and the update moved the weights): weights within `2e-6` of the largest move per
/// optimizer step (each step's gradient is taken at the weights the earlier steps left,
/// so rounding differences compound).
fn assert_same_update(
    what: &str,
    before: &[f32],
    a: (&[f32], &train::UpdateMetrics),
    b: (&[f32], &train::UpdateMetrics),
) {
    let (mut max_delta, mut max_diff) = (0f32, 0f32);
    for ((x0, x), y) in before.iter().zip(a.0).zip(b.0) {
        max_delta = max_delta.max((x - x0).abs());
        max_diff = max_diff.max((x - y).abs());
    }
    assert!(max_delta > 1e-4, "{what}: the update did not move the weights ({max_delta})");
    let tol = 2e-6 * a.1.optimizer_steps.max(1) as f32 * max_delta.max(1.0);
    assert!(max_diff <= tol, "{what}: weights differ by {max_diff} (moved {max_delta})");
    let (ma, mb) = (a.1, b.1);
    assert!(
        (ma.loss - mb.loss).abs() <= 1e-5 * ma.loss.abs().max(1.0),
        "{what}: loss {} vs {}",
        ma.loss,
        mb.loss
    );
    assert!(
        (ma.grad_norm - mb.grad_norm).abs() <= 1e-5 * ma.grad_norm.max(1.0),
        "{what}: grad norm {} vs {}",
        ma.grad_norm,
        mb.grad_norm
    );
    assert!(ma.grad_norm > 0.0, "{what}: zero gradient");
    assert_eq!(
        (ma.kept_tokens, ma.silenced_tokens, ma.optimizer_steps),
        (mb.kept_tokens, mb.silenced_tokens, mb.optimizer_steps),
        "{what}"
    );
    assert!((ma.entropy - mb.entropy).abs() < 1e-5, "{what}: entropy {} vs {}", ma.entropy, mb.entropy);
    // Per S2T mini-batch: tokens, candidates and silenced over the whole mini-batch, whatever
    // the cut into micro-batches or ranks.
    assert_eq!(ma.s2t_by_mini_batch, mb.s2t_by_mini_batch, "{what}");
    assert_eq!(ma.s2t_by_mini_batch.len(), ma.s2t_mini_batches, "{what}");
    let tokens: usize = ma.s2t_by_mini_batch.iter().map(|m| m.tokens).sum();
    assert!(ma.s2t_mini_batches == 0 || tokens > 0, "{what}: {:?}", ma.s2t_by_mini_batch);
}

/// Token-budget micro-batches (sorted by length, each padded to its own longest) give the
/// padded path's update for every objective: one mini-batch with one epoch (old log-probs
/// from the training forward), and two mini-batches over two shuffled epochs (old
/// log-probs from a no-grad pass cut by the same budget; smaller steps there, so that the
/// later steps see a policy whose entropies are not saturated into ties, which
/// 20-Entropy's top-k would break by row order). The budget of 24 tokens cuts the 12
/// sequences (8 to 17 tokens) into micro-batches of one and two.
#[test]
fn token_budget_micro_batches_equal_the_padded_path() {
    for (preset, tau_p) in all_presets() {
        for (mini_batch, epochs, lr) in [(0, 1, 1e3), (6, 2, 10.0)] {
            let shape = |c: &mut UpdateConfig| {
                c.actor.mini_batch = mini_batch;
                c.actor.epochs = epochs;
            };
            let (before, padded, m_padded) = run_with(preset, tau_p, lr, |c| {
                shape(c);
                c.actor.micro_batch = 5;
            });
            let (_, budget, m_budget) = run_with(preset, tau_p, lr, |c| {
                shape(c);
                c.actor.max_tokens_per_micro = 24;
            });
            let what = format!("{preset} mini_batch {mini_batch} epochs {epochs}");
            assert_same_update(&what, &before, (&padded, &m_padded), (&budget, &m_budget));
        }
    }
}

/// The same under two ranks (threads), each holding half of the groups and cutting its
/// part of every mini-batch by the budget: the one-process padded update.
#[test]
fn token_budget_micro_batches_on_two_ranks_equal_one_padded_process() {
    use stapo::dist::ThreadComm;
    use stapo::train::update::{update_on, Policy};
    for (preset, tau_p) in [("stapo", Some(0.03)), ("grpo", None), ("gspo", None), ("entropy20", None)] {
        let (before, padded, m_padded) = run_with(preset, tau_p, 1e3, |c| c.actor.micro_batch = 5);
        let all = seqs();
        let parts = [all[..8].to_vec(), all[8..].to_vec()]; // groups 0-1 and group 2
        let comms = ThreadComm::group(2);
        let outs: Vec<(Vec<f32>, train::UpdateMetrics)> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&parts)
                .map(|(c, part)| {
                    sc.spawn(move || {
                        let m = tiny_model(true, DType::F32, 31);
                        let mut opt = linearish_opt(&m);
                        let mut cfg = UpdateConfig::for_objective(objective(preset, tau_p));
                        cfg.actor.max_tokens_per_micro = 24;
                        let policy = Policy { model: &m, opt: &mut opt, reference: None };
                        let out = update_on(c, policy, part, &cfg, 1e3, 0).unwrap();
                        (flat_params(&m), out.metrics)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (w, m)) in outs.iter().enumerate() {
            let what = format!("{preset} rank {rank}");
            assert_same_update(&what, &before, (&padded, &m_padded), (w, m));
        }
    }
}

#[test]
fn micro_batched_accumulation_equals_the_full_batch() {
    for (preset, tau_p) in [
        ("grpo", None),
        ("dapo", None),
        ("stapo", Some(0.03)),
        ("dapo_s2t", Some(0.03)),
        ("entropy20", None),
        ("gspo", None),
    ] {
        let (before, full, m_full) = run(preset, 0, tau_p);
        let (_, micro, m_micro) = run(preset, 5, tau_p);
        let mut max_delta = 0f32;
        let mut max_diff = 0f32;
        for ((b, f), u) in before.iter().zip(&full).zip(&micro) {
            max_delta = max_delta.max((f - b).abs());
            max_diff = max_diff.max((f - u).abs());
        }
        assert!(max_delta > 1e-4, "{preset}: the update did not move the weights ({max_delta})");
        assert!(
            max_diff <= 1e-6 * max_delta.max(1.0),
            "{preset}: full vs micro-batched differ by {max_diff}"
        );
        assert_eq!(m_full.kept_tokens, m_micro.kept_tokens, "{preset}");
        assert_eq!(m_full.silenced_tokens, m_micro.silenced_tokens, "{preset}");
        assert!(
            (m_full.loss - m_micro.loss).abs() < 1e-5,
            "{preset}: loss {} vs {}",
            m_full.loss,
            m_micro.loss
        );
    }
}

#[test]
fn stapo_silences_tokens_and_renormalises_over_the_rest() {
    let (_, _, m) = run("stapo", 0, Some(0.03));
    assert!(m.silenced_tokens > 0, "no token silenced: {m:?}");
    assert_eq!(m.kept_tokens + m.silenced_tokens, m.response_tokens);
    assert!(m.tau_h.is_some());
    // The 20 most frequent ids: all of them when fewer than 20 distinct ids were silenced.
    let listed = m.silenced_token_ids.iter().map(|(_, c)| c).sum::<usize>();
    assert!(listed > 0 && listed <= m.silenced_tokens, "{listed} of {}", m.silenced_tokens);
    if m.silenced_token_ids.len() < 20 {
        assert_eq!(listed, m.silenced_tokens);
    }
    // The paper's population: tau_h over the candidates of the one mini-batch, so at most
    // floor(0.75 n) of the n candidates are silenced.
    assert_eq!(m.tau_h_population, Some(m.s2t_candidates));
    assert!(m.silenced_tokens <= m.s2t_candidates * 3 / 4, "{} of {}", m.silenced_tokens, m.s2t_candidates);
    assert_eq!((m.s2t_mini_batches, m.s2t_mini_batches_2plus), (1, 1));
    let (_, _, grpo) = run("dapo", 0, None);
    assert_eq!(grpo.silenced_tokens, 0);
    assert_eq!(grpo.kept_tokens, grpo.response_tokens);
}

#[test]
fn non_finite_loss_skips_the_step_and_leaves_weights_untouched() {
    let m = tiny_model(true, DType::F32, 37);
    // Poison one weight: every logit and so the loss become NaN.
    let (name, var) = m.params().into_iter().find(|(n, _)| n.ends_with("model.norm.weight")).unwrap();
    let mut w = var.as_tensor().to_vec1::<f32>().unwrap();
    w[0] = f32::NAN;
    var.set(&Tensor::from_vec(w, var.shape(), var.device()).unwrap()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let before = bits(&flat_params(&m));
    let mut opt = linearish_opt(&m);
    let cfg = UpdateConfig::for_objective(ObjectiveConfig::preset("grpo").unwrap());
    let metrics = train::update(&m, &mut opt, None, &seqs(), &cfg, 1e-3, 0).unwrap().metrics;
    assert_eq!(metrics.skipped_steps, 1, "{name}: {metrics:?}");
    assert_eq!(metrics.optimizer_steps, 0);
    assert_eq!(bits(&flat_params(&m)), before);
    assert_eq!(opt.step_count(), 0);
}

#[test]
fn rollout_old_logprobs_must_match_the_responses() {
    let m = tiny_model(true, DType::F32, 41);
    let mut opt = linearish_opt(&m);
    let mut data = seqs();
    data[0].rollout_logprobs = Some(vec![-1.0; 2]);
    let mut cfg = UpdateConfig::default();
    cfg.actor.old_logp = OldLogp::Rollout;
    let err = train::update(&m, &mut opt, None, &data, &cfg, 1e-3, 0).unwrap_err().to_string();
    assert!(err.contains("rollout log-probs"), "{err}");
}

/// seq-MIS drops exactly the sequences whose weight `exp(sum_t (old - rollout))` lies
/// outside [0.5, 2]: rollout log-probs made from the model's own (the old ones) shifted per
/// sequence by a known total, so sequence 1 sits at weight 3, sequence 6 at 0.25 and the
/// others at 1.5 or 1. Their tokens leave the kept mask and the normaliser; the metrics
/// count 2 of 12 outside, and the mismatch metrics are the shifts' own.
#[test]
fn seq_mis_drops_exactly_the_sequences_outside_the_bounds() {
    use stapo::train::update::{RolloutCorrMode, RolloutCorrection};
    let m = tiny_model(true, DType::F32, 31);
    let mut seqs = seqs();
    let old = train::token_analysis(&m, &seqs, 0, 1.0, 4).unwrap();
    let shift = |i: usize| match i {
        1 => 3f32.ln(),
        6 => 0.25f32.ln(),
        i if i % 2 == 0 => 1.5f32.ln(),
        _ => 0.0,
    };
    for (i, (s, a)) in seqs.iter_mut().zip(&old).enumerate() {
        // The whole shift on the first token: rollout = old - d.
        let d = |j: usize| if j == 0 { shift(i) } else { 0.0 };
        s.rollout_logprobs = Some(a.p.iter().enumerate().map(|(j, p)| p.ln() - d(j)).collect());
    }
    let mut opt = linearish_opt(&m);
    let corr = RolloutCorrection { mode: RolloutCorrMode::SeqMis, ..RolloutCorrection::default() };
    let mut cfg = UpdateConfig::for_objective(objective("dapo", None));
    cfg.actor.rollout_correction = corr;
    let out = train::update(&m, &mut opt, None, &seqs, &cfg, 1e3, 0).unwrap();
    let (metrics, rec) = (out.metrics, out.record);
    for (i, s) in seqs.iter().enumerate() {
        let kept = rec.kept[i].iter().filter(|&&k| k).count();
        let want = if i == 1 || i == 6 { 0 } else { s.response_ids.len() };
        assert_eq!(kept, want, "sequence {i}");
    }
    let dropped: usize = seqs[1].response_ids.len() + seqs[6].response_ids.len();
    assert_eq!(metrics.kept_tokens, metrics.response_tokens - dropped);
    let rc = metrics.rollout_corr.expect("rollout_corr metrics");
    assert!((rc.seq_outside_fraction - 2.0 / 12.0).abs() < 1e-6, "{rc:?}");
    // Token figures over the 12 sequences' tokens: d is the shift on first tokens, else ~0
    // (the recomputed old log-probs equal token_analysis's up to summation order).
    let n: usize = seqs.iter().map(|s| s.response_ids.len()).sum();
    let shifts: Vec<f64> = (0..12).map(|i| shift(i) as f64).collect();
    let k1 = -shifts.iter().sum::<f64>() / n as f64;
    let abs_max = shifts.iter().fold(0f64, |a, d| a.max(d.abs()));
    let w_mean = (shifts.iter().map(|d| d.exp() - 1.0).sum::<f64>() + n as f64) / n as f64;
    let high = shifts.iter().filter(|d| d.exp() > 2.0).count() as f64 / n as f64;
    assert!((rc.kl as f64 - k1).abs() < 1e-5, "kl {} vs {k1}", rc.kl);
    assert!((rc.log_ratio_abs_max as f64 - abs_max).abs() < 1e-5, "{rc:?}");
    assert!((rc.rollout_is_mean as f64 - w_mean).abs() < 1e-5, "{rc:?}");
    assert!((rc.fraction_high as f64 - high).abs() < 1e-6, "{rc:?}");
}

/// token-TIS with rollout log-probs equal to the old ones is the uncorrected update (every
/// weight 1); with the rollout's lowered by ln 3 on every token every weight is capped at
/// 2, so the loss and its gradient are twice the uncorrected ones.
#[test]
fn token_tis_with_matching_rollouts_is_the_plain_update() {
    use stapo::train::update::{RolloutCorrMode, RolloutCorrection};
    let m0 = tiny_model(true, DType::F32, 31);
    let mut seqs = seqs();
    let old = train::token_analysis(&m0, &seqs, 0, 1.0, 4).unwrap();
    for (s, a) in seqs.iter_mut().zip(&old) {
        s.rollout_logprobs = Some(a.p.iter().map(|p| p.ln()).collect());
    }
    let run = |mode: RolloutCorrMode, seqs: &[Sequence]| {
        let m = tiny_model(true, DType::F32, 31);
        let before = flat_params(&m);
        let mut opt = linearish_opt(&m);
        let rollout_correction = RolloutCorrection { mode, ..RolloutCorrection::default() };
        let mut cfg = UpdateConfig::for_objective(objective("grpo", None));
        cfg.actor.rollout_correction = rollout_correction;
        let metrics = train::update(&m, &mut opt, None, seqs, &cfg, 1e3, 0).unwrap().metrics;
        (before, flat_params(&m), metrics)
    };
    let (before, plain, m_plain) = run(RolloutCorrMode::Off, &seqs);
    let (_, tis, m_tis) = run(RolloutCorrMode::TokenTis, &seqs);
    assert_same_update("token_tis, rollout = old", &before, (&plain, &m_plain), (&tis, &m_tis));
    let rc = m_tis.rollout_corr.expect("metrics");
    assert!(rc.log_ratio_abs_max < 1e-5 && (rc.rollout_is_mean - 1.0).abs() < 1e-5, "{rc:?}");
    // Every token's weight min(3, 2) = 2: the loss and its gradient double (grpo with
    // on-policy ratios: no clipping), so the loss is twice the plain one.
    for s in seqs.iter_mut() {
        let lp = s.rollout_logprobs.as_mut().unwrap();
        lp.iter_mut().for_each(|l| *l -= 3f32.ln());
    }
    let (_, _, m_cap) = run(RolloutCorrMode::TokenTis, &seqs);
    assert!(
        (m_cap.loss - 2.0 * m_plain.loss).abs() < 1e-5 * m_plain.loss.abs().max(1.0),
        "{} vs {}",
        m_cap.loss,
        m_plain.loss
    );
    assert!(
        (m_cap.grad_norm - 2.0 * m_plain.grad_norm).abs() < 1e-4 * m_plain.grad_norm,
        "{} vs {}",
        m_cap.grad_norm,
        m_plain.grad_norm
    );
    assert_eq!(m_cap.rollout_corr.unwrap().fraction_high, 1.0);
}
