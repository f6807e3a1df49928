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
    let m = tiny_model(true, DType::F32, 31);
    let before = flat_params(&m);
    let mut opt = linearish_opt(&m);
    let mut objective = ObjectiveConfig::preset(preset).unwrap();
    if let Some(tp) = tau_p {
        objective.set("tau_p", &tp.to_string()).unwrap();
    }
    objective.dynamic_sampling = false;
    let cfg = UpdateConfig { objective, micro_batch: micro, ..Default::default() };
    let metrics = train::update(&m, &mut opt, None, &seqs(), &cfg, 1e3, 0).unwrap().metrics;
    (before, flat_params(&m), metrics)
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
    // The response population: tau_h over every response token of the one mini-batch.
    assert_eq!(m.tau_h_population, Some(m.response_tokens));
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
    let cfg = UpdateConfig { objective: ObjectiveConfig::preset("grpo").unwrap(), ..Default::default() };
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
    let cfg = UpdateConfig { old_logp: OldLogp::Rollout, ..Default::default() };
    let err = train::update(&m, &mut opt, None, &data, &cfg, 1e-3, 0).unwrap_err().to_string();
    assert!(err.contains("rollout log-probs"), "{err}");
}
