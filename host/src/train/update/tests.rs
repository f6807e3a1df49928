//! Tests of the update's seams and of the whole update against hand-computed values.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};

use super::layout::layout;
use super::metrics::{finish_metrics, Totals};
use super::optimizer::optimizer_step;
use super::score::run_setting_warnings;
use super::*;
use crate::algo::ObjectiveConfig;
use crate::algo::{OverlongConfig, S2tThresholds, TauH};
use crate::model::Config;
use crate::model::TokenBatch;

const TOL: f32 = 1e-6;

fn seq(group: usize, reward: f32, prompt: &[u32], response: &[u32]) -> Sequence {
    Sequence {
        prompt_ids: prompt.to_vec(),
        response_ids: response.to_vec(),
        rollout_logprobs: None,
        reward,
        group,
        truncated: false,
    }
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol, "{what}[{i}]: {x} vs {y}");
    }
}

fn t2(v: &[f32], b: usize, l: usize) -> Tensor {
    Tensor::from_slice(v, (b, l), &Device::Cpu).unwrap()
}

#[test]
fn score_shapes_then_advantages_and_filters_unshaped() {
    // Overlong L_max 4, L_cache 2: penalty 0 up to 2 tokens, -0.5 at 3, -1 at 4 and beyond.
    // Group 0: R = [1, 0, 0, 0], lengths [1, 3, 4, 5] → shaped [1, -0.5, -1, -1];
    //   mean -0.375, sample std sqrt(2.6875 / 3) = 0.9464847,
    //   A = [1.4527425, -0.1320675, -0.6603375, -0.6603375].
    // Group 1: R = [1, 1], lengths [1, 4] → shaped [1, 0]: A = ±0.5 / (0.7071068 + 1e-6)
    //   = ±0.7071058, yet dynamic sampling drops it: its *unshaped* rewards are equal.
    let r = |n: usize| vec![3u32; n];
    let seqs = vec![
        seq(0, 1., &[1], &r(1)),
        seq(0, 0., &[1], &r(3)),
        seq(0, 0., &[1], &r(4)),
        seq(0, 0., &[1], &r(5)),
        seq(1, 1., &[1], &r(1)),
        seq(1, 1., &[1], &r(4)),
    ];
    let mut obj = ObjectiveConfig::preset("dapo").unwrap();
    obj.overlong = Some(OverlongConfig { max_len: 4, cache_len: 2, factor: 1.0 });
    let s = score(&seqs, &obj).unwrap();
    close(&s.unshaped, &[1., 0., 0., 0., 1., 1.], 0.0, "unshaped");
    close(&s.rewards, &[1., -0.5, -1., -1., 1., 0.], TOL, "shaped");
    let want = [1.4527425, -0.1320675, -0.6603375, -0.6603375, 0.7071058, -0.7071058];
    close(&s.advantages.values, &want, 2e-6, "advantages");
    assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 1, 2, 3]);
    obj.dynamic_sampling = false;
    assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 1, 2, 3, 4, 5]);

    // Batch metrics over the shaped rewards: mean -1/12, population std 0.8374896;
    // accuracy 3/6; lengths mean 18/6 = 3, max 5.
    let mut m = UpdateMetrics::default();
    assert_eq!(batch_metrics(&Local, &seqs, &s, &mut m).unwrap(), 6);
    assert!((m.reward_mean + 1. / 12.).abs() < TOL && (m.reward_std - 0.8374896).abs() < 1e-5, "{m:?}");
    assert!((m.accuracy - 0.5).abs() < TOL && (m.response_len_mean - 3.).abs() < TOL);
    assert_eq!(m.response_len_max, 5);
    assert_eq!(m.zero_var_group_frac, 0.0);

    // The same batch on two ranks, one group each: the same global figures on both.
    let comms = crate::dist::ThreadComm::group(2);
    let parts = [seqs[..4].to_vec(), seqs[4..].to_vec()];
    let ms: Vec<(usize, UpdateMetrics)> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&parts)
            .map(|(c, part)| {
                let obj = &obj;
                sc.spawn(move || {
                    let mut m = UpdateMetrics::default();
                    let n = batch_metrics(c, part, &score(part, obj).unwrap(), &mut m).unwrap();
                    (n, m)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (n, mr) in ms {
        assert_eq!(n, 6);
        assert!((mr.reward_mean - m.reward_mean).abs() < TOL && (mr.reward_std - m.reward_std).abs() < TOL);
        assert_eq!((mr.accuracy, mr.response_len_mean, mr.response_len_max), (0.5, 3.0, 5));
    }
}

#[test]
fn empty_responses_never_reach_the_loss() {
    let seqs = vec![seq(0, 1., &[1], &[2, 3]), seq(0, 0., &[1], &[]), seq(0, 0., &[1], &[4])];
    let mut obj = ObjectiveConfig::preset("grpo").unwrap();
    obj.dynamic_sampling = false;
    let s = score(&seqs, &obj).unwrap();
    assert_eq!(active_sequences(&seqs, &obj, &s).unwrap(), vec![0, 2]);
}

#[test]
fn layout_pads_prompts_left_and_responses_right() {
    // Prompts [5, 6] and [8] → P = 2; responses [7] and [9, 10] → T = 2.
    let (a, b) = (seq(0, 0., &[5, 6], &[7]), seq(0, 0., &[8], &[9, 10]));
    let mb = layout(&[&a, &b], 2, 2, 0, &Device::Cpu).unwrap();
    assert_eq!(mb.tokens.ids.to_vec2::<u32>().unwrap(), vec![vec![5, 6, 7, 0], vec![0, 8, 9, 10]]);
    assert_eq!(mb.tokens.mask, vec![vec![1, 1, 1, 0], vec![0, 1, 1, 1]]);
    assert_eq!(mb.targets.to_vec2::<u32>().unwrap(), vec![vec![7, 0], vec![9, 10]]);
    assert_eq!(mb.resp_mask.to_vec2::<f32>().unwrap(), vec![vec![1., 0.], vec![1., 1.]]);
    let empty_prompt = seq(0, 0., &[], &[1]);
    assert!(layout(&[&empty_prompt], 1, 1, 0, &Device::Cpu).is_err());
}

#[test]
fn token_budget_cuts_by_hand() {
    use super::layout::{Cut, Span};
    // (prompt, response) of rows 0..5; totals 7, 4, 9, 4, 4.
    let lens = [(2, 5), (3, 1), (1, 8), (2, 2), (1, 3)];
    let span = |start, len, p, t| Span { start, len, p, t };
    // Longest first; the three of total 4 by response length: 2 (9), 0 (7), 4, 3, 1.
    let budget = Cut::Tokens { budget: 20, max_seqs: 10 };
    let order = budget.order(&lens);
    assert_eq!(order, vec![2, 0, 4, 3, 1]);
    let sorted: Vec<(usize, usize)> = order.iter().map(|&i| lens[i]).collect();
    // Rows 2 + 0: 2 x (2 + 8) = 20 fits; + 4 would be 3 x 10 = 30. Rows 4, 3, 1: 3 x (3 + 3) = 18.
    assert_eq!(budget.spans(&sorted), vec![span(0, 2, 2, 8), span(2, 3, 3, 3)]);
    // At most two sequences: row 1 goes alone.
    let two = Cut::Tokens { budget: 20, max_seqs: 2 };
    assert_eq!(two.spans(&sorted), vec![span(0, 2, 2, 8), span(2, 2, 2, 3), span(4, 1, 3, 1)]);
    // A budget below the longest sequence: that sequence alone, the others as they fit
    // (rows 4 + 3 would be 2 x (2 + 3) = 10 > 5).
    let tight = Cut::Tokens { budget: 5, max_seqs: 10 };
    let want = vec![span(0, 1, 1, 8), span(1, 1, 2, 5), span(2, 1, 1, 3), span(3, 1, 2, 2), span(4, 1, 3, 1)];
    assert_eq!(tight.spans(&sorted), want);
    // A fixed count keeps the order and pads to the mini-batch's longest (3, 8).
    let count = Cut::Count(2);
    assert_eq!(count.order(&lens), vec![0, 1, 2, 3, 4]);
    assert_eq!(count.spans(&lens), vec![span(0, 2, 3, 8), span(2, 2, 3, 8), span(4, 1, 3, 8)]);
    // The shapes the bench reports: 38 tokens with the budget, 5 x 11 = 55 padded.
    assert_eq!(micro_batch_shapes(&lens, 0, 20), vec![(2, 10), (3, 6)]);
    assert_eq!(micro_batch_shapes(&lens, 0, 0), vec![(5, 11)]);
    assert_eq!(micro_batch_shapes(&lens, 2, 20), vec![(2, 10), (2, 5), (1, 4)]);
}

/// token-TIS by hand: PG loss, token-mean over 3 tokens, A = 1, logp = old (ratio 1);
/// old - rollout = [ln 3, ln 0.5, 0] gives weights [min(3, 2), 0.5, 1] = [2, 0.5, 1], so the
/// loss is -(2 + 0.5 + 1) / 3 = -7/6 and d loss / d logp = -w / 3.
#[test]
fn token_tis_loss_by_hand() {
    use crate::algo::compute_loss;
    use crate::algo::LossInputs;
    use crate::algo::Normaliser;
    let corr = RolloutCorrection { mode: RolloutCorrMode::TokenTis, ..RolloutCorrection::default() };
    let d = t2(&[3f32.ln(), 0.5f32.ln(), 0.0], 1, 3);
    let w = corr.weights(&d).unwrap().unwrap();
    close(&w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &[2.0, 0.5, 1.0], 1e-6, "weights");
    let logp = candle_core::Var::from_tensor(&t2(&[-0.5, -1.0, -2.0], 1, 3)).unwrap();
    let old = logp.as_tensor().detach();
    let adv = Tensor::from_slice(&[1f32], 1, &Device::Cpu).unwrap();
    let mask = t2(&[1., 1., 1.], 1, 3);
    let obj = ObjectiveConfig::preset("grpo").unwrap();
    let obj =
        ObjectiveConfig { loss: crate::algo::PolicyLoss::Pg, agg: crate::algo::AggMode::TokenMean, ..obj };
    let norm = Normaliser::from_masks(&[&mask], None).unwrap();
    let inp = LossInputs { pg_weights: Some(&w), ..LossInputs::new(logp.as_tensor(), &old, &adv, &mask) };
    let out = compute_loss(&obj, &inp, &norm).unwrap();
    assert!((out.loss.to_scalar::<f32>().unwrap() + 7.0 / 6.0).abs() < 1e-6, "{}", out.loss);
    let g = out.loss.backward().unwrap();
    let g = g.get(logp.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    close(&g, &[-2.0 / 3.0, -0.5 / 3.0, -1.0 / 3.0], 1e-6, "grad");
    // seq-MIS: the sequence weight exp(ln 3 + ln 0.5) = 1.5 on every token; kept within
    // [0.5, 2], rejected above 2 and below 0.5.
    let seq = RolloutCorrection { mode: RolloutCorrMode::SeqMis, ..corr };
    let w = seq.weights(&d).unwrap().unwrap();
    close(&w.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &[1.5; 3], 1e-5, "seq weights");
    assert!(seq.keeps_sequence(&[0.0, 0.0], &[-(1.5f32.ln()), 0.0]));
    assert!(!seq.keeps_sequence(&[0.0, 0.0], &[-(2.5f32.ln()), 0.0]));
    assert!(!seq.keeps_sequence(&[0.0], &[-(0.4f32.ln())]));
}

/// Which correction is in force: auto follows the rollout copy; an explicit mode where the
/// rollout's log-probs are not the sampling policy's is an error naming why.
#[test]
fn rollout_correction_resolves_auto_and_refuses_explicit_modes_at_t_not_1() {
    let auto = RolloutCorrection::default();
    let mode =
        |c: &RolloutCorrection, copy, t, old| c.resolve(copy, t, old).map(|(c, n)| (c.mode, n.is_some()));
    assert_eq!(mode(&auto, true, 1.0, OldLogp::Recompute).unwrap(), (RolloutCorrMode::TokenTis, false));
    assert_eq!(mode(&auto, false, 1.0, OldLogp::Recompute).unwrap(), (RolloutCorrMode::Off, false));
    assert_eq!(mode(&auto, true, 0.7, OldLogp::Recompute).unwrap(), (RolloutCorrMode::Off, true));
    assert_eq!(mode(&auto, true, 1.0, OldLogp::Rollout).unwrap(), (RolloutCorrMode::Off, true));
    let tis = RolloutCorrection { mode: RolloutCorrMode::TokenTis, ..auto };
    assert_eq!(mode(&tis, false, 1.0, OldLogp::Recompute).unwrap(), (RolloutCorrMode::TokenTis, false));
    let err = tis.resolve(true, 0.7, OldLogp::Recompute).unwrap_err().to_string();
    assert!(err.contains("rollout_correction.mode") && err.contains("temperature"), "{err}");
    let seq = RolloutCorrection { mode: RolloutCorrMode::SeqMis, ..auto };
    let err = seq.resolve(true, 1.0, OldLogp::Rollout).unwrap_err().to_string();
    assert!(err.contains("old_logp = rollout"), "{err}");
    let off = RolloutCorrection { mode: RolloutCorrMode::Off, ..auto };
    assert_eq!(mode(&off, true, 0.7, OldLogp::Recompute).unwrap(), (RolloutCorrMode::Off, false));
    for (bad, field) in [
        (RolloutCorrection { cap: 0.5, ..auto }, "cap"),
        (RolloutCorrection { seq_lower: 0.0, ..auto }, "seq_lower"),
        (RolloutCorrection { seq_upper: f32::NAN, ..auto }, "seq_upper"),
    ] {
        let err = bad.resolve(false, 1.0, OldLogp::Recompute).unwrap_err().to_string();
        assert!(err.contains(&format!("rollout_correction.{field}")), "{err}");
    }
}

#[test]
fn token_mask_by_hand() {
    // Row 0 (A = +1): p [0.001, 0.5, 0.001, 0.001], H [0.2, 0.1, 0.9, 0.3], last position padding.
    // Row 1 (A = -1): p [0.001, 0.001, 0.2, 0.2], H 0.1 everywhere, two response tokens.
    let ln = |p: f32| p.ln();
    let lp = t2(&[ln(0.001), ln(0.5), ln(0.001), ln(0.001), ln(0.001), ln(0.001), ln(0.2), ln(0.2)], 2, 4);
    let h = t2(&[0.2, 0.1, 0.9, 0.3, 0.1, 0.1, 0.1, 0.1], 2, 4);
    let adv = Tensor::from_slice(&[1f32, -1.], 2, &Device::Cpu).unwrap();
    let resp = t2(&[1., 1., 1., 0., 1., 1., 0., 0.], 2, 4);
    // S2T, tau_p 0.002, tau_h 0.5: candidates (0,0) H 0.2 and (0,2) H 0.9 (padding and A < 0
    // never are); only (0,0) is below tau_h.
    let s2t = MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: TauH::Abs(0.5) });
    let (m, st) = token_mask(&s2t, Some((&lp, &h)), &adv, &resp).unwrap();
    assert_eq!(m.to_vec2::<f32>().unwrap(), vec![vec![0., 1., 1., 0.], vec![1., 1., 0., 0.]]);
    let st = st.unwrap();
    assert_eq!((st.n_candidates, st.n_silenced, st.positions.clone()), (2, 1, vec![(0, 0)]));
    // Top-entropy rho 0.5 over 5 response tokens: k = ceil(2.5) = 3: H 0.9, 0.2, then the
    // first of the 0.1 ties in row-major order, (0, 1).
    let top = MaskConfig::TopEntropy { rho: 0.5 };
    let (m, st) = token_mask(&top, Some((&lp, &h)), &adv, &resp).unwrap();
    assert_eq!(m.to_vec2::<f32>().unwrap(), vec![vec![1., 1., 1., 0.], vec![0., 0., 0., 0.]]);
    assert!(st.is_none());
    // No mask: the response mask; no statistics needed.
    let (m, _) = token_mask(&MaskConfig::None, None, &adv, &resp).unwrap();
    assert_eq!(m.to_vec2::<f32>().unwrap(), resp.to_vec2::<f32>().unwrap());
    assert!(token_mask(&s2t, None, &adv, &resp).is_err());
}

/// The S2T quantile under two ranks, one row each: over the candidates (the paper's
/// rule) and over the response (a variant), each rank gathers the population, and mask,
/// tau_h and population size are the one-process ones.
#[test]
fn token_mask_on_ranks_takes_the_quantile_over_the_global_population() {
    use crate::algo::QuantileOver;
    // The rows of `token_mask_by_hand`. Response entropies: row 0 [0.2, 0.1, 0.9], row 1
    // [0.1, 0.1]; sorted [0.1, 0.1, 0.1, 0.2, 0.9], q 0.8: pos 3.2 → 0.2 + 0.2 · 0.7 = 0.34
    // (row 0 alone would give 0.62). Candidate (0,0) H 0.2 is silenced, (0,2) H 0.9 kept.
    let ln = |p: f32| p.ln();
    let lp = t2(&[ln(0.001), ln(0.5), ln(0.001), ln(0.001), ln(0.001), ln(0.001), ln(0.2), ln(0.2)], 2, 4);
    let h = t2(&[0.2, 0.1, 0.9, 0.3, 0.1, 0.1, 0.1, 0.1], 2, 4);
    let adv = Tensor::from_slice(&[1f32, -1.], 2, &Device::Cpu).unwrap();
    let resp = t2(&[1., 1., 1., 0., 1., 1., 0., 0.], 2, 4);
    for (over, q) in [(QuantileOver::Response, 0.8), (QuantileOver::Candidates, 0.75)] {
        let cfg = MaskConfig::S2t(S2tThresholds { tau_p: 0.002, tau_h: TauH::Quantile { q, over } });
        let (whole, ws) = token_mask(&cfg, Some((&lp, &h)), &adv, &resp).unwrap();
        let ws = ws.unwrap();
        if over == QuantileOver::Response {
            assert!((ws.tau_h.unwrap() - 0.34).abs() < 1e-6, "{ws:?}");
            assert_eq!((ws.tau_h_population, ws.positions.clone()), (Some(5), vec![(0, 0)]));
        } else {
            // Candidates H [0.2, 0.9]: pos 0.75 → 0.2 + 0.75 · 0.7 = 0.725.
            assert!((ws.tau_h.unwrap() - 0.725).abs() < 1e-6, "{ws:?}");
            assert_eq!((ws.tau_h_population, ws.positions.clone()), (Some(2), vec![(0, 0)]));
        }
        let comms = crate::dist::ThreadComm::group(2);
        let row = |t: &Tensor, i: usize| t.narrow(0, i, 1).unwrap();
        let outs: Vec<(Vec<f32>, Option<f32>, Option<usize>)> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (lp, h, adv, resp, cfg) =
                        (row(&lp, i), row(&h, i), row(&adv, i), row(&resp, i), &cfg);
                    sc.spawn(move || {
                        let (m, st) = token_mask_on(c, cfg, Some((&lp, &h, &adv, &resp))).unwrap().unwrap();
                        let st = st.unwrap();
                        (m.flatten_all().unwrap().to_vec1::<f32>().unwrap(), st.tau_h, st.tau_h_population)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut parts = Vec::new();
        for (m, tau_h, n) in outs {
            assert_eq!((tau_h, n), (ws.tau_h, ws.tau_h_population), "{over:?}");
            parts.extend(m);
        }
        assert_eq!(parts, whole.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{over:?}");
    }
}

#[test]
fn skipped_steps_become_warnings_not_prints() {
    let w = candle_core::Var::from_slice(&[1f32, 2.], 2, &Device::Cpu).unwrap();
    let mut opt = AdamW::new(vec![("w".into(), w.clone())], Default::default()).unwrap();
    let (mut m, mut totals) = (UpdateMetrics::default(), Totals::default());
    optimizer_step(&Local, &mut opt, &mut GradStore::default(), 0.1, None, &mut m, &mut totals).unwrap();
    assert_eq!((m.skipped_steps, m.optimizer_steps, opt.step_count()), (1, 0, 0));
    assert!(m.warnings[0].contains("non-finite loss"), "{:?}", m.warnings);
    let mut g = GradStore::default();
    g.insert(w.as_tensor(), Tensor::from_slice(&[f32::NAN, 1.], 2, &Device::Cpu).unwrap());
    optimizer_step(&Local, &mut opt, &mut g, 0.1, Some(1.0), &mut m, &mut totals).unwrap();
    assert_eq!((m.skipped_steps, opt.step_count()), (2, 0));
    assert!(m.warnings[1].contains("gradient norm is NaN"), "{:?}", m.warnings);
    assert_eq!(w.to_vec1::<f32>().unwrap(), vec![1., 2.]);
    // A finite gradient steps and counts its loss.
    g.insert(w.as_tensor(), Tensor::from_slice(&[0.5f32, 1.], 2, &Device::Cpu).unwrap());
    optimizer_step(&Local, &mut opt, &mut g, 0.1, Some(2.5), &mut m, &mut totals).unwrap();
    assert_eq!((m.optimizer_steps, opt.step_count(), m.warnings.len()), (1, 1, 2));
    assert_eq!(totals.loss_sum, 2.5);
    // Two f32 moments of two elements.
    assert_eq!(m.optimizer_bytes, 16);
}

#[test]
fn finish_metrics_by_hand() {
    let mut m =
        UpdateMetrics { optimizer_steps: 2, silenced_tokens: 3, response_tokens: 12, ..Default::default() };
    let totals = Totals {
        loss_sum: 3.0,
        grad_norm_sum: 1.5,
        entropy_sum: 6.0,
        entropy_count: 4,
        tau_h_sum: 1.2,
        tau_h_count: 2,
        silenced: [(5, 2), (3, 2), (9, 1)].into_iter().collect(),
        ..Default::default()
    };
    finish_metrics(&Local, &mut m, totals).unwrap();
    assert_eq!((m.loss, m.grad_norm, m.entropy, m.silenced_ratio), (1.5, 0.75, 1.5, 0.25));
    assert!((m.tau_h.unwrap() - 0.6).abs() < TOL);
    assert_eq!(m.silenced_token_ids, vec![(3, 2), (5, 2), (9, 1)]);
}

#[test]
fn options_build_the_config_and_reject_unknown_fields() {
    let opts = |j: serde_json::Value| UpdateOptions::from_json(&j);
    let o = opts(serde_json::json!({"actor": {"preset": "grpo", "objective": {"loss": {"eps_high": 0.28}},
        "epochs": 2}}))
    .unwrap();
    let (c, notes) = o.to_config().unwrap();
    assert!(notes.is_empty());
    assert_eq!(c.actor.objective.loss.clip_range(), Some((0.2, 0.28)));
    assert!(c.shuffle() && c.actor.epochs == 2 && o.actor.optim.lr == 1e-6);
    let e = opts(serde_json::json!({"actor": {"epoch": 2}})).unwrap_err().to_string();
    assert!(e.contains("actor.epoch") && e.contains("did you mean `epochs`?"), "{e}");
    assert!(opts(serde_json::json!({"actor": {"epochs": -1}})).is_err());
    // max_tokens sizes the preset's overlong buffer (dapo_s2t: 20480/4096 → 64/13).
    let o = opts(serde_json::json!({"actor": {"preset": "dapo_s2t"}, "max_tokens": 64, "temperature": 0.7}))
        .unwrap();
    let (c, _) = o.to_config().unwrap();
    assert_eq!(c.actor.objective.overlong.map(|o| (o.max_len, o.cache_len)), Some((64, 13)));
    assert_eq!(c.temperature, 0.7);
    assert!(UpdateOptions { temperature: 0.0, ..Default::default() }.to_config().is_err());
    let e = opts(serde_json::json!({"actor": {"objective": {"mask": {"tau_p": -1}}}})).unwrap_err();
    assert!(e.to_string().contains("actor.objective.mask.tau_p"), "{e}");
    let e = opts(serde_json::json!({"actor": {"preset": "ppo2"}})).unwrap_err().to_string();
    assert!(e.contains("actor.preset") && e.contains("ppo2"), "{e}");
}

/// A random 2-layer, 64-wide Qwen3 over 97 tokens.
fn tiny() -> Qwen3 {
    let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": true,
        "eos_token_id": 1, "torch_dtype": "float32"}"#;
    let cfg = Config::from_json_str(text, "tiny").unwrap();
    crate::model::init(&cfg, 5, 0.2, DType::F32, &Device::Cpu).unwrap()
}

/// Four groups of four sequences for [`tiny`]: group `g` has prompts of `3 + g` tokens,
/// its `i`-th response `4 + i + g` tokens, and the reward `reward(g, i)`.
fn four_groups_of_four(reward: impl Fn(u32, u32) -> f32) -> Vec<Sequence> {
    let mut seqs = Vec::new();
    for g in 0..4u32 {
        for i in 0..4u32 {
            let prompt: Vec<u32> = (0..3 + g).map(|t| (t * 13 + g * 7 + 2) % 97).collect();
            let response: Vec<u32> = (0..4 + i + g).map(|t| (t * 29 + i * 5 + g + 3) % 97).collect();
            seqs.push(seq(g as usize, reward(g, i), &prompt, &response));
        }
    }
    seqs
}

/// The token mask of a mini-batch of several micro-batches, decided from their gradient
/// forwards run ahead (while their activations fit) or from a no-grad pass over them first:
/// the same mask, the same thresholds and the same update.
#[test]
fn forwards_run_ahead_decide_the_mask_as_the_no_grad_pass() {
    let seqs = four_groups_of_four(|_, i| (i % 2) as f32);
    let flat = |m: &Qwen3| -> Vec<f32> {
        m.params().iter().flat_map(|p| p.1.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
    };
    let tau_p = serde_json::json!({"mask": {"tau_p": 0.03}});
    for (preset, budget) in [("stapo", 0), ("entropy20", 0), ("stapo", 24)] {
        let mut obj = ObjectiveConfig::preset(preset).unwrap();
        if preset == "stapo" {
            obj = obj.overlay("o", &tau_p).unwrap();
        }
        let mut cfg = UpdateConfig::for_objective(obj);
        match budget {
            0 => cfg.actor.micro_batch = 5,
            b => cfg.actor.max_tokens_per_micro = b,
        }
        let run = |fit: bool| {
            FORWARD_BUDGET.with(|b| b.set(if fit { Recompute::AUTO_BYTES } else { 0 }));
            let m = tiny();
            let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
            let out = update(&m, &mut opt, None, &seqs, &cfg, 1e-2, 0).unwrap();
            FORWARD_BUDGET.with(|b| b.set(Recompute::AUTO_BYTES));
            (out.record, flat(&m))
        };
        let ((ahead, w_ahead), (pass, w_pass)) = (run(true), run(false));
        let what = format!("{preset} budget {budget}");
        assert_eq!(ahead.kept, pass.kept, "{what}: kept tokens");
        assert_eq!(ahead.silenced, pass.silenced, "{what}: silenced tokens");
        assert!(
            ahead.silenced.iter().flatten().any(|&s| s) || preset == "entropy20",
            "{what}: nothing silenced"
        );
        assert_eq!(ahead.thresholds.len(), pass.thresholds.len(), "{what}");
        close(&w_ahead, &w_pass, 1e-6, &what);
        assert!(
            w_ahead.iter().zip(&flat(&tiny())).any(|(a, b)| a != b),
            "{what}: the update moved the weights"
        );
    }
}

#[test]
fn the_record_is_what_the_update_used() {
    // Groups 0-2 mixed (rewards [0, 1, 0, 1] → A = ±0.5 / (sqrt(1/3) + 1e-6) = ±0.8660239);
    // group 3 all correct, dropped by dynamic sampling.
    let seqs = four_groups_of_four(|g, i| if g == 3 { 1.0 } else { (i % 2) as f32 });
    let m = tiny();
    let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
    // dapo_s2t: dynamic sampling, tau_h over the candidates.
    let tau_p = serde_json::json!({"mask": {"tau_p": 0.03}});
    let obj = ObjectiveConfig::preset("dapo_s2t").unwrap().overlay("o", &tau_p).unwrap();
    let mut cfg = UpdateConfig::for_objective(obj.clone());
    cfg.actor.micro_batch = 5;
    let out = update(&m, &mut opt, None, &seqs, &cfg, 1e-3, 0).unwrap();
    let (rec, met) = (&out.record, &out.metrics);
    let a = 0.8660239f32;
    for (i, s) in seqs.iter().enumerate() {
        let g = s.group;
        let want = if g == 3 {
            0.0
        } else if i % 2 == 1 {
            a
        } else {
            -a
        };
        assert!((rec.advantages[i] - want).abs() < 2e-6, "A[{i}] = {}", rec.advantages[i]);
        assert_eq!(rec.active[i], g != 3, "active[{i}]");
        let n = if g == 3 { 0 } else { s.response_ids.len() };
        assert_eq!((rec.kept[i].len(), rec.silenced[i].len(), rec.p[i].len()), (n, n, n), "{i}");
    }
    assert_eq!(met.dropped_seqs, 4);
    // One mini-batch: one set of thresholds, and the S2T rule holds token by token.
    assert_eq!(rec.thresholds.len(), 1);
    let th = rec.thresholds[0];
    assert_eq!(th.tau_p, 0.03);
    let tau_h = th.tau_h.expect("candidates exist at tau_p 0.03");
    let mut silenced = 0;
    for i in (0..seqs.len()).filter(|&i| rec.active[i]) {
        for j in 0..rec.p[i].len() {
            let spurious = rec.advantages[i] > 0.0 && rec.p[i][j] < 0.03 && rec.entropy[i][j] < tau_h;
            assert_eq!(rec.silenced[i][j], spurious, "({i}, {j}): p {} H {}", rec.p[i][j], rec.entropy[i][j]);
            assert_eq!(rec.kept[i][j], !spurious);
            silenced += spurious as usize;
        }
    }
    assert!(silenced > 0);
    assert_eq!((silenced, th.silenced), (met.silenced_tokens, met.silenced_tokens));
    let kept: usize = rec.kept.iter().flatten().filter(|&&k| k).count();
    assert_eq!(kept, met.kept_tokens);
    // The population of the quantile is the candidates; the rates count from the record.
    assert_eq!((th.population, met.tau_h_population), (Some(met.s2t_candidates), Some(met.s2t_candidates)));
    check_rates(rec, met, 0.03);
    // One S2T mini-batch, which silenced, so it had at least two candidates (a lone one never is).
    assert_eq!((met.s2t_mini_batches, met.s2t_mini_batches_2plus), (1, 1));
    assert_eq!(met.candidates_per_mini_batch, met.s2t_candidates as f32);
    // The mini-batch's own figures: the active sequences' response tokens (groups 0-2: 4 + i + g
    // tokens each), its candidates and silenced tokens.
    let tokens: usize = (0..3).flat_map(|g| (0..4).map(move |i| 4 + i + g)).sum();
    assert_eq!(tokens, met.response_tokens);
    let seen = MiniBatchS2t { tokens, candidates: th.candidates, silenced };
    assert_eq!(met.s2t_by_mini_batch, [seen]);
    let per_10k = met.silenced_tokens as f32 / met.response_tokens as f32 * 1e4;
    assert!((met.silenced_per_10k - per_10k).abs() < 1e-3, "{}", met.silenced_per_10k);

    // The response variant (not the paper's rule): tau_h the 0.8-quantile over every response token.
    let obj =
        obj.overlay("o", &serde_json::json!({"mask": {"tau_h": {"over": "response", "q": 0.8}}})).unwrap();
    let mut cfg = UpdateConfig { token_grad_norms: true, ..UpdateConfig::for_objective(obj) };
    cfg.actor.micro_batch = 5;
    let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
    let out = update(&m, &mut opt, None, &seqs, &cfg, 1e-3, 0).unwrap();
    let (rec, met) = (&out.record, &out.metrics);
    let th = rec.thresholds[0];
    let all_h: Vec<f32> =
        (0..seqs.len()).filter(|&i| rec.active[i]).flat_map(|i| rec.entropy[i].clone()).collect();
    assert_eq!((th.population, met.tau_h_population), (Some(all_h.len()), Some(met.response_tokens)));
    let tau_h = th.tau_h.unwrap();
    assert!((tau_h - crate::algo::quantile_linear(&all_h, 0.8).unwrap()).abs() < 1e-6, "{tau_h}");
    for i in (0..seqs.len()).filter(|&i| rec.active[i]) {
        for j in 0..rec.p[i].len() {
            let spurious = rec.advantages[i] > 0.0 && rec.p[i][j] < 0.03 && rec.entropy[i][j] < tau_h;
            assert_eq!(rec.silenced[i][j], spurious, "({i}, {j})");
        }
    }
    check_rates(rec, met, 0.03);
}

/// The low-probability rates of the metrics against a count over the record (one
/// epoch, every active token).
fn check_rates(rec: &UpdateRecord, met: &UpdateMetrics, tau_p: f32) {
    let (mut pos, mut neg, mut n) = (0usize, 0usize, 0usize);
    for i in (0..rec.p.len()).filter(|&i| rec.active[i]) {
        for &p in &rec.p[i] {
            n += 1;
            pos += (p < tau_p && rec.advantages[i] > 0.0) as usize;
            neg += (p < tau_p && rec.advantages[i] < 0.0) as usize;
        }
    }
    assert_eq!((n, pos, neg), (met.response_tokens, met.s2t_candidates, met.low_p_negative));
    assert!(pos > 0 && neg > 0, "the test needs both signs: {pos} {neg}");
    let per = |k: usize| k as f32 / n as f32;
    assert!((met.candidates_per_10k - per(pos) * 1e4).abs() < 1e-2, "{}", met.candidates_per_10k);
    assert!((met.low_p_positive_share - per(pos)).abs() < 1e-6);
    assert!((met.low_p_negative_share - per(neg)).abs() < 1e-6);
    let all_h: Vec<f32> = rec.entropy.iter().flatten().copied().collect();
    assert_eq!(met.entropy_p99, crate::algo::quantile_linear(&all_h, 0.99));
    assert!(met.entropy_p99 > Some(met.entropy), "{:?} vs mean {}", met.entropy_p99, met.entropy);
    // With grad norms recorded: the candidates' share of Σ g, summed here from the record.
    if rec.grad_norm.iter().any(|g| !g.is_empty()) {
        let (mut cand, mut total) = (0f64, 0f64);
        for i in (0..rec.p.len()).filter(|&i| rec.active[i]) {
            for (&p, &g) in rec.p[i].iter().zip(&rec.grad_norm[i]) {
                total += g as f64;
                cand += if p < tau_p && rec.advantages[i] > 0.0 { g as f64 } else { 0.0 };
            }
        }
        let got = met.candidate_grad_share.expect("S2T on: a candidate share");
        assert!(cand > 0.0 && (got as f64 - cand / total).abs() < 1e-5, "{got} vs {}", cand / total);
        let (t1, t10) = (met.top_1pct_grad_share.unwrap(), met.top_10_grad_share.unwrap());
        assert!(met.top_grad_share.unwrap() <= t1 && t1 <= t10.max(t1) && t10 <= 1.0, "{met:?}");
    }
}

/// The tiny model, one group of two sequences (prompt [5, 6, 7], response [8, 9],
/// rewards 1 and 0) and the model's full logits of that sequence in f64.
fn tiny_pair() -> (Qwen3, Vec<Sequence>, Vec<Vec<Vec<f64>>>) {
    let m = tiny();
    let seqs = vec![seq(0, 1., &[5, 6, 7], &[8, 9]), seq(0, 0., &[5, 6, 7], &[8, 9])];
    let batch = TokenBatch::left_padded(&[vec![5, 6, 7, 8, 9]], 0, &Device::Cpu).unwrap();
    let logits = m.forward(&batch).unwrap().to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
    (m, seqs, logits)
}

/// `softmax(z / t)` of one row of logits, on the host in f64.
fn host_softmax(z: &[f64], t: f64) -> Vec<f64> {
    let z: Vec<f64> = z.iter().map(|x| x / t).collect();
    let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - mx).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

#[test]
fn the_update_sees_the_tempered_policy() {
    // One sequence, prompt [5, 6, 7], response [8, 9]; T = 2. The record's p must be the
    // sampled token's probability under softmax(logits / 2), computed here on the host
    // from the model's full logits; its H the entropy of that distribution.
    let (m, seqs, logits) = tiny_pair();
    let (mut want_p, mut want_h) = (Vec::new(), Vec::new());
    for (pos, target) in [(2usize, 8usize), (3, 9)] {
        let p = host_softmax(&logits[0][pos], 2.0);
        want_p.push(p[target] as f32);
        want_h.push(-p.iter().map(|q| q * q.ln()).sum::<f64>() as f32);
    }
    let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
    let mut cfg = UpdateConfig {
        temperature: 2.0,
        ..UpdateConfig::for_objective(ObjectiveConfig::preset("grpo").unwrap())
    };
    let out = update(&m, &mut opt, None, &seqs, &cfg, 0.0, 0).unwrap();
    close(&out.record.p[0], &want_p, 1e-5, "p at T = 2");
    close(&out.record.entropy[0], &want_h, 1e-4, "H at T = 2");
    // Log-probs recorded at T = 1 cannot serve as old log-probs of a tempered update.
    cfg.actor.old_logp = OldLogp::Rollout;
    let mut with_lp = seqs.clone();
    for s in &mut with_lp {
        s.rollout_logprobs = Some(vec![-1.0; 2]);
    }
    let e = update(&m, &mut opt, None, &with_lp, &cfg, 0.0, 0).unwrap_err().to_string();
    assert!(e.contains("temperature 1"), "{e}");
}

#[test]
fn settings_that_cannot_fire_are_warned() {
    // DAPO's preset buffer starts after 20480 - 4096 tokens; responses cut at 3 tokens.
    let mut s = seq(0, 1., &[1], &[2, 3, 4]);
    s.truncated = true;
    let w = run_setting_warnings(&ObjectiveConfig::preset("dapo").unwrap(), &[s.clone()]);
    assert!(w.len() == 1 && w[0].contains("never fire") && w[0].contains("16384"), "{w:?}");
    let mut fitted = ObjectiveConfig::preset("dapo").unwrap();
    assert!(fitted.fit_to_run(3).is_empty());
    assert!(run_setting_warnings(&fitted, &[s.clone()]).is_empty());
    let dr = ObjectiveConfig::preset("drgrpo").unwrap();
    assert!(run_setting_warnings(&dr, &[s])[0].contains("norm_len"));
}

#[test]
fn logit_grad_norm_and_shares_by_hand() {
    // p = [1/6, 2/6, 3/6], y = 2, A = 2: the gradient -A·(e_y - p) = [1/3, 2/3, -1] has norm
    // sqrt(1/9 + 4/9 + 1) = sqrt(14/9) = 1.2472191; collision = 14/36.
    let g = logit_grad_norm(2.0, 0.5, 14.0 / 36.0);
    assert!((g - 1.2472191).abs() < 1e-6, "{g}");
    assert_eq!(logit_grad_norm(0.0, 0.5, 0.4), 0.0);
    // g = [5, 1, 0, 3, 1] (sum 10), silenced 1 and 3 → 0.4, candidates 0 and 4 → 0.6; the top
    // 0.01% and the top 1% of 5 tokens are 1 token (5 → 0.5); the top 10 are all 5 → 1.
    let sh = grad_shares(
        &[5., 1., 0., 3., 1.],
        &[false, true, false, true, false],
        &[true, false, false, false, true],
    );
    let want = GradShares { silenced: 0.4, candidates: 0.6, top_frac: 0.5, top_1pct: 0.5, top_10: 1.0 };
    for (got, want) in [
        (sh.silenced, want.silenced),
        (sh.candidates, want.candidates),
        (sh.top_frac, want.top_frac),
        (sh.top_1pct, want.top_1pct),
        (sh.top_10, want.top_10),
    ] {
        assert!((got - want).abs() < 1e-7, "{sh:?}");
    }
    assert_eq!(grad_shares(&[0., 0.], &[true, false], &[]), GradShares::default());
    // g = 1..=250, shuffled (sum 31375): the top 1% is ceil(2.5) = 3 tokens (250 + 249 + 248),
    // the top 10 are 241..=250 (2455), the top 0.01% is 1 token (250); flags may be short.
    let mut g: Vec<f32> = (1..=250).map(|x| x as f32).collect();
    g.reverse();
    g.swap(0, 100);
    let sh = grad_shares(&g, &[], &[]);
    assert!((sh.top_1pct - 747.0 / 31375.0).abs() < 1e-7, "{sh:?}");
    assert!((sh.top_10 - 2455.0 / 31375.0).abs() < 1e-7, "{sh:?}");
    assert!((sh.top_frac - 250.0 / 31375.0).abs() < 1e-7, "{sh:?}");
    assert_eq!((sh.silenced, sh.candidates), (0.0, 0.0));
}

#[test]
fn grad_norms_are_recorded_from_the_collision_probability() {
    // One group of two, prompt [5, 6, 7]; the record's collision probability must be
    // Σ p² of softmax(logits), computed on the host from the model's full logits.
    let (m, seqs, logits) = tiny_pair();
    let want_c: Vec<f32> = [2usize, 3]
        .iter()
        .map(|&pos| host_softmax(&logits[0][pos], 1.0).iter().map(|q| q.powi(2)).sum::<f64>() as f32)
        .collect();
    let mut opt = AdamW::new(m.params(), Default::default()).unwrap();
    let cfg = UpdateConfig {
        token_grad_norms: true,
        ..UpdateConfig::for_objective(ObjectiveConfig::preset("grpo").unwrap())
    };
    let out = update(&m, &mut opt, None, &seqs, &cfg, 0.0, 0).unwrap();
    let rec = &out.record;
    close(&rec.collision[0], &want_c, 1e-6, "collision");
    for i in 0..2 {
        for j in 0..2 {
            let want = logit_grad_norm(rec.advantages[i], rec.p[i][j], rec.collision[i][j]);
            assert_eq!(rec.grad_norm[i][j], want);
            assert!(want > 0.0);
        }
    }
    // The analysis of the same sequences without an update agrees with the record.
    let an = token_analysis(&m, &seqs, 0, 1.0, 1).unwrap();
    for (i, a) in an.iter().enumerate().take(2) {
        close(&a.p, &rec.p[i], 1e-6, "p");
        close(&a.entropy, &rec.entropy[i], 1e-5, "H");
        close(&a.collision, &rec.collision[i], 1e-6, "collision");
    }
    assert_eq!(out.metrics.silenced_grad_share, Some(0.0));
    // The largest of 4 tokens, which come in equal pairs (the two responses are the same).
    let top = out.metrics.top_grad_share.unwrap();
    assert!((0.25..=0.5).contains(&top), "{top}");
}

/// The full update in mixed precision (bf16 weights for the forward
/// and backward, f32 master weights and moments) against the f32 update, from the same
/// bf16-representable weights, three updates of the S2T objective on the same batch.
/// The mixed run's master weights move as the f32 run's weights do (cosine of the two
/// weight changes over every parameter >= 0.998, their difference <= 5% of the f32
/// change: bf16's forward rounding and rounded gradients, which flip Adam's sign-like
/// first steps only where a gradient is near 0), and its losses agree to 1%.
#[test]
fn mixed_precision_update_tracks_the_f32_update() {
    use crate::model::rollout_copy::RolloutCopy;
    let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": true,
        "eos_token_id": 1, "torch_dtype": "bfloat16"}"#;
    let cfg = Config::from_json_str(text, "tiny").unwrap();
    let m16 = crate::model::init(&cfg, 5, 0.2, DType::BF16, &Device::Cpu).unwrap();
    let copy = RolloutCopy::new(&m16, DType::F32).unwrap();
    let m32 = copy.model();
    let w0: Vec<(String, Vec<f32>)> = m32
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let mut seqs = Vec::new();
    for g in 0..3u32 {
        for i in 0..4u32 {
            let prompt: Vec<u32> = (0..3 + g).map(|t| (t * 13 + g * 7 + 2) % 97).collect();
            let response: Vec<u32> = (0..6 + i + g).map(|t| (t * 29 + i * 5 + g + 3) % 97).collect();
            seqs.push(seq(g as usize, (i % 2) as f32, &prompt, &response));
        }
    }
    let ucfg = UpdateConfig::for_objective(ObjectiveConfig::preset("stapo").unwrap());
    let mut o32 = AdamW::new(m32.params(), Default::default()).unwrap();
    let mut o16 = AdamW::new(m16.params(), Default::default()).unwrap();
    for step in 0..3 {
        let a = update(m32, &mut o32, None, &seqs, &ucfg, 1e-3, 0).unwrap().metrics;
        let b = update(&m16, &mut o16, None, &seqs, &ucfg, 1e-3, 0).unwrap().metrics;
        assert_eq!((a.skipped_steps, b.skipped_steps), (0, 0), "step {step}");
        let rel = (a.loss - b.loss).abs() / a.loss.abs().max(1e-3);
        assert!(rel <= 1e-2, "step {step}: loss f32 {} vs mixed {}", a.loss, b.loss);
    }
    let (mut dot, mut n32, mut n16, mut diff) = (0f64, 0f64, 0f64, 0f64);
    for (name, w0) in &w0 {
        let w32 = m32.params().into_iter().find(|(n, _)| n == name).unwrap().1;
        let w32 = w32.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let master = o16.master(name).expect("a bf16 parameter has master weights");
        let wm = master.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for ((a, b), c) in w32.iter().zip(&wm).zip(w0) {
            let (d32, d16) = ((a - c) as f64, (b - c) as f64);
            dot += d32 * d16;
            n32 += d32 * d32;
            n16 += d16 * d16;
            diff += (d32 - d16) * (d32 - d16);
        }
    }
    let cos = dot / (n32.sqrt() * n16.sqrt());
    let rel = diff.sqrt() / n32.sqrt();
    eprintln!("mixed vs f32 update: cosine {cos:.5}, relative difference {rel:.4}");
    assert!(n32 > 0.0 && cos >= 0.998 && rel <= 0.05, "cosine {cos}, relative difference {rel}");
}
