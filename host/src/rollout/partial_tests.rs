//! Partial rollouts against references: one uninterrupted call, the full
//! forward of the policy version that drew each token, whole groups.

use candle_core::Tensor;

use super::partial::{OnStale, PartialConfig, PartialKv, PartialRollout, PartialStep};
use super::test_support::{angle_decode, tiny_model};
use super::{generate_partial, generate_with, row_seed, GenerateOptions, Sample, SamplingParams};
use crate::model::{logprob_entropy, Grad, KvCache, Qwen3, TokenBatch};

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
        let cfg = PartialConfig {
            enable: true,
            extra_prompts: Some(1),
            max_staleness: 1,
            on_stale,
            ..PartialConfig::default()
        };
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

/// Lengths by prompt for the kept-cache tests: prompt 0 answers in 4 tokens, the
/// others in 12, so a step that wants one group ends with the others part-way.
fn short_then_long(p: usize, _s: usize) -> usize {
    if p == 0 {
        4
    } else {
        12
    }
}

/// Prompts `0..k` in flight, their keys and values kept between calls.
fn kept_in_flight(k: usize) -> PartialRollout {
    let mut partial = in_flight(k, &params());
    partial.set_kv(PartialKv::Keep);
    partial
}

/// The blocks of the kept pool are all accounted for by its units (no block
/// leaked, no reference lost); returns the blocks held.
fn accounted(partial: &PartialRollout) -> usize {
    match partial.kept_accounting() {
        None => 0,
        Some((used, distinct, refs, made)) => {
            assert_eq!((used, refs), (distinct, made), "kept pool: held vs the units' blocks and references");
            used
        }
    }
}

/// With the keys and values kept and the weights unchanged, a response carried
/// over kept blocks continues exactly as an uninterrupted call draws it: the
/// second call decodes the same rows over the same cache as the uninterrupted
/// call's later steps, so tokens, log-probs and entropies agree bit for bit.
#[test]
fn kept_blocks_continue_an_uninterrupted_generation_bit_for_bit() {
    let model = tiny_model(None, 8);
    let mut partial = kept_in_flight(2);
    let first = step(&model, &mut partial, &short_then_long, 0, 1);
    assert_eq!(first.groups[0].0, 0);
    assert_eq!(first.figures.carried_responses, 2);
    assert!(partial.kept_blocks() > 0, "the unfinished responses' blocks stay");
    let second = step(&model, &mut partial, &short_then_long, 1, 1);
    let f = &second.figures;
    assert_eq!((f.resumed_responses, f.kept_tokens, f.recomputed_tokens), (2, 8, 0), "{f:?}");
    let got: Vec<Sample> =
        first.groups.iter().chain(&second.groups).flat_map(|(_, g)| g.iter().cloned()).collect();
    let opts = GenerateOptions { lengths: Some(&short_then_long), ..GenerateOptions::default() };
    let want = generate_with(&model, &prompts()[..2], &params(), 0, &angle_decode, &opts).expect("generate");
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.prompt_ids, b.prompt_ids);
        assert_eq!(a.response_ids, b.response_ids);
        assert_eq!(
            (&a.logprobs, &a.old_logprobs, &a.entropies),
            (&b.logprobs, &b.old_logprobs, &b.entropies)
        );
    }
    assert_eq!((partial.in_flight(), accounted(&partial)), (0, 0), "every block back in the pool");
}

/// After a weight update a response whose keys and values were kept draws its
/// next tokens from the new weights attending to the old weights' keys and
/// values: the reference prefills the prompt and the tokens drawn before the
/// update through the old model's contiguous cache (`Qwen3::decode`, not the
/// paged engine), then feeds each later token through the new model over that
/// same cache. Recomputing (the new weights' keys and values throughout) gives
/// other log-probs. A group admitted after the update with the same prompt does
/// not share the old weights' cached prompt blocks: it draws from the new
/// weights alone.
#[test]
fn kept_keys_and_values_of_the_old_weights_are_what_the_new_weights_attend_to() {
    let (a, b) = (tiny_model(None, 1), tiny_model(None, 2));
    let mut partial = kept_in_flight(2);
    // Blocks of 2 tokens, so that the prompts fill blocks the prefix cache names.
    let opts = GenerateOptions {
        lengths: Some(&short_then_long),
        engine: crate::rollout::EngineConfig { block_size: 2, ..Default::default() },
        ..GenerateOptions::default()
    };
    let call = |m: &Qwen3, partial: &mut PartialRollout, v: u64, wanted: usize| {
        generate_partial(m, partial, &params(), 0, &angle_decode, &opts, v, wanted).expect("partial step")
    };
    call(&a, &mut partial, 0, 1);
    // Prompt 1 again, as a new group (forced lengths of prompt 0: 4 tokens).
    let seeds: Vec<u64> = (0..2).map(|s| row_seed(21, 7, s)).collect();
    partial.admit(7, 0, prompts()[1].clone(), &seeds);
    let second = call(&b, &mut partial, 1, 2);
    assert_eq!((second.figures.kept_tokens, second.figures.recomputed_tokens), (8, 0));
    assert_eq!(second.groups.iter().map(|g| g.0).collect::<Vec<_>>(), [1, 7]);
    for s in &second.groups[1].1 {
        let want = forward_logprobs(&b, s);
        for (t, (x, y)) in s.old_logprobs.iter().zip(&want).enumerate() {
            assert!((x - y).abs() < 1e-4, "new group, token {t}: {x} vs {y}");
        }
    }
    let mut differ = 0.0f32;
    for s in &second.groups[0].1 {
        let old = s.versions.iter().filter(|&&v| v == 0).count();
        assert_eq!((old, s.response_len()), (4, 12), "{:?}", s.versions);
        let mut cache = KvCache::new(&a, 1, 64).expect("cache");
        let head: Vec<u32> = s.prompt_ids.iter().chain(&s.response_ids[..old - 1]).copied().collect();
        let ids = |t: &[u32]| Tensor::new(t, a.device()).and_then(|x| x.unsqueeze(0)).expect("ids");
        a.decode(&ids(&head), None, &mut cache).expect("old weights over the prefix");
        let recomputed = forward_logprobs(&b, s);
        for t in old..s.response_len() {
            let logits = b.decode(&ids(&s.response_ids[t - 1..t]), None, &mut cache).expect("new weights");
            let logits: Vec<f32> = logits.flatten_all().and_then(|x| x.to_vec1()).expect("logits");
            let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            let want = (logits[s.response_ids[t] as usize] as f64 - lse) as f32;
            assert!((s.old_logprobs[t] - want).abs() < 1e-4, "token {t}: {} vs {want}", s.old_logprobs[t]);
            differ = differ.max((want - recomputed[t]).abs());
        }
    }
    assert!(differ > 1e-3, "keeping and recomputing must differ under new weights ({differ})");
}

/// Kept blocks are all returned: over steps that admit groups, restart or drop
/// stale responses and finish the rest, the pool holds exactly its units'
/// blocks after every step, and nothing once no group is in flight.
#[test]
fn kept_blocks_all_return_to_the_pool() {
    let model = tiny_model(None, 9);
    let lengths = |p: usize, s: usize| if p.is_multiple_of(3) { 30 } else { 3 + (p * 7 + s * 5) % 11 };
    for on_stale in [OnStale::Restart, OnStale::Drop] {
        let cfg =
            PartialConfig { max_staleness: 1, on_stale, kv: PartialKv::Keep, ..PartialConfig::default() };
        let mut partial = PartialRollout::default();
        partial.set_kv(cfg.kv);
        let (mut next, mut held_max, mut kept, mut stale) = (0usize, 0, 0, 0);
        for v in 0..12u64 {
            let o = partial.enforce_staleness(v, &cfg);
            stale += o.restarted + o.dropped.len();
            accounted(&partial);
            while v < 6 && partial.in_flight() < 4 {
                let p = next % 5;
                let seeds: Vec<u64> = (0..2).map(|s| row_seed(21, next, s)).collect();
                partial.admit(next as u64, p, prompts()[p].clone(), &seeds);
                next += 1;
            }
            if partial.in_flight() == 0 {
                break;
            }
            let out = step(&model, &mut partial, &lengths, v, 1);
            kept += out.figures.kept_tokens;
            held_max = held_max.max(accounted(&partial));
        }
        assert!(
            stale > 0 && kept > 0 && held_max > 0,
            "{on_stale:?}: {stale} stale, {kept} kept, {held_max}"
        );
        assert_eq!((partial.in_flight(), accounted(&partial)), (0, 0), "{on_stale:?}: blocks leaked");
    }
}

/// A checkpoint holds no kept blocks: a rollout loaded from a saved state
/// recomputes the carried responses' keys and values once (then keeps them
/// again), and draws the same tokens as the one that kept them, the weights
/// being unchanged. A pool that no longer serves the call (another block size)
/// is dropped the same way.
#[test]
fn a_resumed_rollout_recomputes_what_was_kept() {
    let model = tiny_model(None, 5);
    let mut partial = kept_in_flight(5);
    step(&model, &mut partial, &staggered, 0, 2);
    assert!(partial.kept_blocks() > 0);
    let json = serde_json::to_string(&partial).expect("save");
    let mut loaded: PartialRollout = serde_json::from_str(&json).expect("load");
    assert_eq!(loaded.kept_blocks(), 0, "no blocks in a checkpoint");
    loaded.set_kv(PartialKv::Keep);
    let (x, y) = (step(&model, &mut partial, &staggered, 1, 1), step(&model, &mut loaded, &staggered, 1, 1));
    assert!(x.figures.kept_tokens > 0 && x.figures.recomputed_tokens == 0, "{:?}", x.figures);
    assert_eq!((y.figures.kept_tokens, y.figures.recomputed_tokens), (0, x.figures.kept_tokens));
    for ((_, gx), (_, gy)) in x.groups.iter().zip(&y.groups) {
        for (a, b) in gx.iter().zip(gy) {
            assert_eq!(a.response_ids, b.response_ids);
            for (p, q) in a.old_logprobs.iter().zip(&b.old_logprobs) {
                assert!((p - q).abs() < 1e-4, "{p} vs {q}");
            }
        }
    }
    let z = step(&model, &mut loaded, &staggered, 2, 1);
    assert!(z.figures.kept_tokens > 0 && z.figures.recomputed_tokens == 0, "{:?}", z.figures);
    // Another block size: the kept pool cannot serve the call.
    let opts = GenerateOptions {
        lengths: Some(&staggered),
        engine: crate::rollout::EngineConfig { block_size: 8, ..Default::default() },
        ..GenerateOptions::default()
    };
    let w = generate_partial(&model, &mut loaded, &params(), 0, &angle_decode, &opts, 3, 1).expect("step");
    assert!(w.figures.kept_tokens == 0 && w.figures.recomputed_tokens > 0, "{:?}", w.figures);
    accounted(&loaded);
}
