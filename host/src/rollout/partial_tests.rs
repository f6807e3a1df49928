//! Partial rollouts against references: one uninterrupted call, the full
//! forward of the policy version that drew each token, whole groups.

use candle_core::Tensor;

use super::partial::{OnStale, PartialConfig, PartialRollout, PartialStep};
use super::test_support::{angle_decode, tiny_model};
use super::{generate_partial, generate_with, row_seed, GenerateOptions, Sample, SamplingParams};
use crate::model::{logprob_entropy, Grad, Qwen3, TokenBatch};

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 9, 13], vec![2, 40, 41, 42, 43], vec![77], vec![60, 61, 3, 3, 8], vec![11, 12]]
}

fn params() -> SamplingParams {
    SamplingParams {
        n: 2,
        max_new_tokens: 40,
        temperature: 1.0,
        seed: 21,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Puts prompt `p` of [`prompts`] in flight, seeded as a one-call batch would seed it.
fn admit(partial: &mut PartialRollout, p: usize, params: &SamplingParams) {
    let seeds: Vec<u64> = (0..params.n).map(|s| row_seed(params.seed, p, s)).collect();
    partial.admit(p as u64, p, prompts()[p].clone(), &seeds);
}

/// Prompts `0..k` of [`prompts`] in flight.
fn in_flight(k: usize, params: &SamplingParams) -> PartialRollout {
    let mut partial = PartialRollout::default();
    for p in 0..k {
        admit(&mut partial, p, params);
    }
    partial
}

fn step(
    model: &Qwen3,
    partial: &mut PartialRollout,
    lengths: &dyn Fn(usize, usize) -> usize,
    version: u64,
    wanted: usize,
) -> PartialStep {
    let opts = GenerateOptions { lengths: Some(lengths), ..GenerateOptions::default() };
    generate_partial(model, partial, &params(), 0, &angle_decode, &opts, version, wanted)
        .expect("partial step")
}

/// The untempered log-prob `model` gives each response token after the prompt
/// and the tokens before it (a full forward, no cache).
fn forward_logprobs(model: &Qwen3, s: &Sample) -> Vec<f32> {
    let ids: Vec<u32> = s.prompt_ids.iter().chain(&s.response_ids).copied().collect();
    let batch = TokenBatch::left_padded(&[ids], 0, model.device()).expect("batch");
    let hidden = model.forward_hidden(&batch, Grad::Off).expect("forward");
    let hidden = hidden.narrow(1, s.prompt_ids.len() - 1, s.response_len()).expect("narrow");
    let logits = model.lm_head(&hidden, Grad::Off).expect("lm_head");
    let targets =
        Tensor::new(s.response_ids.as_slice(), model.device()).and_then(|t| t.unsqueeze(0)).expect("t");
    let (logp, _) = logprob_entropy(&logits, &targets).expect("logprob_entropy");
    logp.flatten_all().and_then(|t| t.to_vec1()).expect("logp")
}

/// Lengths by prompt: prompt `p` answers in `5 * (p + 1)` tokens.
fn staggered(p: usize, _s: usize) -> usize {
    5 * (p + 1)
}

#[test]
fn with_no_extra_groups_a_step_is_one_synchronous_call() {
    let model = tiny_model(Some(1), 4);
    let params = SamplingParams { ignore_eos: false, ..params() };
    let mut partial = in_flight(4, &params);
    let opts = GenerateOptions::default();
    let got =
        generate_partial(&model, &mut partial, &params, 0, &angle_decode, &opts, 3, 4).expect("partial");
    let want = generate_with(&model, &prompts()[..4], &params, 0, &angle_decode, &opts).expect("generate");
    let samples: Vec<Sample> = got.groups.iter().flat_map(|(_, s)| s.clone()).collect();
    assert_eq!(got.groups.iter().map(|g| g.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(samples.len(), want.len());
    for (a, b) in samples.iter().zip(&want) {
        assert!(a.versions.iter().all(|&v| v == 3) && a.versions.len() == a.response_len());
        let a = Sample { versions: Vec::new(), ..a.clone() };
        assert_eq!(&a, b, "the same samples, bit for bit");
    }
    assert_eq!((partial.in_flight(), got.figures.staleness_max, got.figures.carried_responses), (0, 0, 0));
}

/// A response that spans two policy versions records, for each token, the
/// log-prob of the version that drew it: the full forward of that version's
/// weights over the prompt and the tokens before it.
#[test]
fn a_response_spanning_two_versions_has_each_versions_logprobs() {
    let (a, b) = (tiny_model(None, 1), tiny_model(None, 2));
    let mut partial = in_flight(4, &params());
    // Version 0 (weights a): prompt 0 ends at 5 tokens; the others stop part-way.
    let first = step(&a, &mut partial, &staggered, 0, 1);
    assert_eq!(first.groups.len(), 1);
    assert_eq!(first.groups[0].0, 0);
    assert_eq!((first.figures.carried_groups, first.figures.carried_responses), (3, 6));
    // Version 1 (weights b): prompt 1 ends at 10 tokens, 5 of each version.
    let second = step(&b, &mut partial, &staggered, 1, 1);
    assert_eq!(second.groups.len(), 1);
    let (key, samples) = &second.groups[0];
    assert_eq!(*key, 1);
    assert_eq!(second.figures.resumed_responses, 6);
    assert!(second.figures.recomputed_tokens >= 2 * 5, "{:?}", second.figures);
    for s in samples {
        assert_eq!(s.response_len(), 10);
        let drawn_by_a = s.versions.iter().filter(|&&v| v == 0).count();
        assert!((5..10).contains(&drawn_by_a), "{:?}", s.versions);
        assert!(s.versions.windows(2).all(|w| w[0] <= w[1]), "{:?}", s.versions);
        let (la, lb) = (forward_logprobs(&a, s), forward_logprobs(&b, s));
        for (t, &v) in s.versions.iter().enumerate() {
            let want = if v == 0 { la[t] } else { lb[t] };
            let other = if v == 0 { lb[t] } else { la[t] };
            assert!(
                (s.old_logprobs[t] - want).abs() < 1e-4,
                "token {t} (version {v}): {} vs {want}",
                s.old_logprobs[t]
            );
            assert!((want - other).abs() > 1e-3, "the two versions must differ at token {t}");
        }
    }
    // Its tokens: 5 of version 0 seen at version 1 (staleness 1), the rest fresh.
    let f = &second.figures;
    assert_eq!(f.staleness_max, 1);
    assert_eq!(f.tokens, 20);
    let stale = f.staleness_hist.get("1").copied().unwrap_or(0);
    assert!((f.off_policy_token_frac - stale as f64 / 20.0).abs() < 1e-12, "{f:?}");
}

/// Carried over steps under the same weights, a response is the one an
/// uninterrupted call draws (its generator resumed, its cache recomputed).
#[test]
fn a_carried_response_continues_as_uninterrupted() {
    let model = tiny_model(None, 3);
    let mut partial = in_flight(5, &params());
    let mut got: Vec<Sample> = Vec::new();
    for v in 0..5 {
        let s = step(&model, &mut partial, &staggered, v, 1);
        got.extend(s.groups.into_iter().flat_map(|(_, g)| g));
    }
    let opts = GenerateOptions { lengths: Some(&staggered), ..GenerateOptions::default() };
    let want = generate_with(&model, &prompts(), &params(), 0, &angle_decode, &opts).expect("generate");
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.response_ids, b.response_ids);
        for (x, y) in a.old_logprobs.iter().zip(&b.old_logprobs) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
    }
}

/// A state saved between steps (as a checkpoint holds it) and loaded again
/// continues exactly as the state that was never saved.
#[test]
fn a_saved_state_resumes_bit_for_bit() {
    let model = tiny_model(None, 5);
    let mut partial = in_flight(5, &params());
    step(&model, &mut partial, &staggered, 0, 2);
    let json = serde_json::to_string(&partial).expect("save");
    let mut loaded: PartialRollout = serde_json::from_str(&json).expect("load");
    assert_eq!(loaded, partial);
    for v in 1..3 {
        let (x, y) =
            (step(&model, &mut partial, &staggered, v, 1), step(&model, &mut loaded, &staggered, v, 1));
        assert_eq!(x.groups, y.groups);
    }
    assert_eq!(loaded, partial);
}

/// Every group returned is whole (its n responses, each finished), and each
/// group is returned once, over steps that admit new groups as others leave.
#[test]
fn groups_are_never_split() {
    let model = tiny_model(Some(1), 6);
    let params = SamplingParams { ignore_eos: false, ..params() };
    let mut partial = PartialRollout::default();
    let lengths = |p: usize, s: usize| 3 + (p * 7 + s * 11) % 23;
    let opts = GenerateOptions { lengths: Some(&lengths), ..GenerateOptions::default() };
    let (mut next, mut seen) = (0usize, Vec::new());
    for v in 0..6 {
        while partial.in_flight() < 5 {
            let seeds: Vec<u64> = (0..params.n).map(|s| row_seed(params.seed, next, s)).collect();
            partial.admit(next as u64, next, prompts()[next % 5].clone(), &seeds);
            next += 1;
        }
        let out =
            generate_partial(&model, &mut partial, &params, 0, &angle_decode, &opts, v, 2).expect("step");
        assert_eq!(out.groups.len(), 2);
        for (pos, (key, samples)) in out.groups.iter().enumerate() {
            let idx: Vec<usize> = samples.iter().map(|s| s.sample_index).collect();
            assert_eq!(idx, [0, 1], "group {key}");
            assert!(samples.iter().all(|s| s.group == pos && s.prompt_index == pos));
            assert!(samples.iter().all(|s| s.versions.len() == s.response_len()));
            seen.push(*key);
        }
        assert!(partial.groups().iter().all(|g| !out.groups.iter().any(|(k, _)| *k == g.key)));
    }
    let mut unique = seen.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "a group returned twice: {seen:?}");
    assert_eq!(seen.len() + partial.in_flight(), next);
}

/// With `max_staleness` 1, a response still running two versions after its
/// first token restarts (or its group is dropped), and no token returned is
/// older than one version.
#[test]
fn the_staleness_limit_restarts_or_drops() {
    let model = tiny_model(None, 7);
    // Prompt 0 needs 40 tokens; each later one 3.
    let lengths = |p: usize, _s: usize| if p == 0 { 40 } else { 3 };
    for on_stale in [OnStale::Restart, OnStale::Drop] {
        let cfg = PartialConfig { enable: true, extra_prompts: Some(1), max_staleness: 1, on_stale };
        let mut partial = PartialRollout::default();
        admit(&mut partial, 0, &params());
        let (mut restarted, mut dropped) = (0, Vec::new());
        for v in 0..6u64 {
            let o = partial.enforce_staleness(v, &cfg);
            restarted += o.restarted;
            dropped.extend(o.dropped);
            let p = 1 + v as usize % 4;
            admit(&mut partial, p, &params());
            let out = step(&model, &mut partial, &lengths, v, 1);
            for (_, samples) in &out.groups {
                for s in samples {
                    assert!(s.versions.iter().all(|&t| v - t <= 1), "{:?} at {v}", s.versions);
                }
            }
            assert!(out.figures.staleness_max <= 1);
        }
        match on_stale {
            OnStale::Restart => {
                assert!(restarted >= 2 && dropped.is_empty(), "{restarted} {dropped:?}");
                assert!(partial.groups().iter().any(|g| g.key == 0), "restarted, still in flight");
            }
            OnStale::Drop => {
                assert_eq!((restarted, dropped.as_slice()), (0, &[0u64][..]));
                assert!(partial.groups().iter().all(|g| g.key != 0));
            }
        }
    }
}
