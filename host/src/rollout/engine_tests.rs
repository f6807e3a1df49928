//! The engine's schedules against the dense one-at-a-time engine: every
//! schedule (refills, preemption, the static policy, prefix caching off and
//! on) samples the same responses with the same log-probs; the cache holds the
//! live tokens; the budget and its errors.

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::blocks::blocks_for;
use super::device::StepLogits;
use super::kv_cache_manager::{budget_bytes, pool_blocks, Memory};
use super::test_support::{angle_decode, tiny_model};
use super::{
    generate_stats, row_seed, EngineConfig, EngineStats, Finish, GenerateOptions, KvCacheDtype, Sample,
    Sampler, SamplingParams, SchedulePolicy,
};
use crate::model::{KvCache, Qwen3};

/// Bytes per token of the tiny model's cache (2 layers x 2 kv heads x 16 x f32, k and v).
const TINY_TOKEN_BYTES: f64 = 512.0;

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32).map(|p| (0..(3 + 2 * p)).map(|i| (p * 13 + i * 7) % 90 + 5).collect()).collect()
}

fn budget(blocks: f64, block_size: usize) -> Option<f64> {
    Some(blocks * block_size as f64 * TINY_TOKEN_BYTES / 1e9)
}

/// The engine this one replaced, one response at a time: a dense cache
/// per response, the same per-response generator. Returns each response's
/// tokens and log-probs, by prompt then sample.
fn dense_reference(m: &Qwen3, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<(Vec<u32>, Vec<f32>)> {
    let sampler = Sampler::new(params);
    let eos = m.config().eos_token_id;
    let mut out = Vec::new();
    for (p, prompt) in prompts.iter().enumerate() {
        for s in 0..params.n {
            let mut rng = StdRng::seed_from_u64(row_seed(params.seed, p, s));
            let mut cache = KvCache::new(m, 1, prompt.len() + params.max_new_tokens).expect("cache");
            let ids = Tensor::from_vec(prompt.clone(), (1, prompt.len()), m.device()).expect("ids");
            let mut logits = m.decode(&ids, None, &mut cache).expect("prefill");
            let (mut toks, mut lps) = (Vec::new(), Vec::new());
            loop {
                let d = StepLogits::new(&logits, &sampler)
                    .and_then(|l| l.draw(&sampler, vec![(0, &mut rng)]))
                    .expect("draw")[0];
                toks.push(d.id);
                lps.push(d.logprob_raw);
                if Some(d.id) == eos || toks.len() == params.max_new_tokens {
                    break;
                }
                let next = Tensor::from_vec(vec![d.id], (1, 1), m.device()).expect("next");
                logits = m.decode(&next, None, &mut cache).expect("decode");
            }
            out.push((toks, lps));
        }
    }
    out
}

/// Every schedule (all rows at once, refills through 2 rows, a cache so
/// small that sequences are preempted and recomputed, the static policy)
/// samples exactly the responses of the dense one-at-a-time engine with
/// the same seeds. A draw could differ only where batched rounding flips a
/// near-tie; the test counts such flips and none occur here.
#[test]
fn every_schedule_samples_what_the_dense_engine_samples() {
    let m = tiny_model(Some(3), 11);
    let params = SamplingParams { n: 3, max_new_tokens: 20, seed: 7, ..SamplingParams::default() };
    let want = dense_reference(&m, &prompts(), &params);
    let lens: Vec<usize> = want.iter().map(|w| w.0.len()).collect();
    assert!(lens.iter().any(|&l| l < 20), "some responses should end at EOS: {lens:?}");
    let cases = [
        (EngineConfig::default(), SchedulePolicy::Continuous),
        (EngineConfig { max_rows: Some(2), ..EngineConfig::default() }, SchedulePolicy::Continuous),
        (
            EngineConfig {
                max_rows: Some(6),
                block_size: 4,
                kv_cache_gb: budget(10.5, 4),
                ..EngineConfig::default()
            },
            SchedulePolicy::Continuous,
        ),
        (
            EngineConfig { max_rows: Some(6), block_size: 4, ..EngineConfig::default() },
            SchedulePolicy::Static,
        ),
    ];
    for (i, (engine, policy)) in cases.into_iter().enumerate() {
        let opts = GenerateOptions { engine, policy, ..GenerateOptions::default() };
        let (got, stats) =
            generate_stats(&m, &prompts(), &params, 0, &angle_decode, &opts).expect("generate");
        assert_eq!(got.len(), want.len());
        let flips = got.iter().zip(&want).filter(|(g, w)| g.response_ids != w.0).count();
        assert_eq!(flips, 0, "case {i}: {flips} responses differ from the dense engine's");
        for (g, w) in got.iter().zip(&want) {
            for (a, b) in g.old_logprobs.iter().zip(&w.1) {
                assert!((a - b).abs() < 1e-4, "case {i}: log-prob {a} vs {b}");
            }
        }
        assert_eq!(stats.tokens, lens.iter().sum::<usize>());
        if i == 2 {
            assert!(stats.preemptions > 0, "the 10-block cache should preempt");
            assert!(stats.peak_blocks <= 10 && stats.pool_blocks == 10, "{stats:?}");
        }
        if i == 1 {
            // A group of 3 is admitted alone when nothing runs, so up to 3 rows.
            assert!(stats.mean_rows() <= 3.0 + 1e-9, "{stats:?}");
        }
    }
}

/// A group's prompt is prefilled once and its samples share its blocks:
/// the cache holds about the live tokens (a shared prompt once), while the
/// static policy reserves every sequence's maximum length.
#[test]
fn shared_prompts_are_prefilled_once_and_the_cache_follows_live_tokens() {
    let m = tiny_model(None, 12);
    let long: Vec<Vec<u32>> = (0..3u32).map(|p| (0..40).map(|i| (p + i * 3) % 90 + 5).collect()).collect();
    let params = SamplingParams { n: 4, max_new_tokens: 30, seed: 1, ignore_eos: true, ..Default::default() };
    let forced = |p: usize, s: usize| 5 + (p * 7 + s * 5) % 20;
    let opts = GenerateOptions { lengths: Some(&forced), ..GenerateOptions::default() };
    let (got, stats) = generate_stats(&m, &long, &params, 0, &angle_decode, &opts).expect("generate");
    for s in &got {
        assert_eq!(s.response_len(), forced(s.prompt_index, s.sample_index));
        assert_eq!(s.finish, Finish::Length);
    }
    assert_eq!(stats.preemptions, 0);
    assert_eq!(stats.prefill_tokens, 3 * 40, "each prompt prefilled once");
    // 12 rows at once: at most the live tokens (shared prompts counted per
    // sample) plus one partly filled block per sequence.
    let bs = stats.block_size;
    assert!(
        stats.peak_blocks * bs <= stats.peak_live_tokens + 12 * bs,
        "{} blocks held for {} live tokens",
        stats.peak_blocks,
        stats.peak_live_tokens
    );
    let statik = GenerateOptions { policy: SchedulePolicy::Static, ..opts };
    let (same, st) = generate_stats(&m, &long, &params, 0, &angle_decode, &statik).expect("generate");
    let ids = |v: &[Sample]| v.iter().map(|s| s.response_ids.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&same), ids(&got));
    assert_eq!(st.peak_reserved_blocks, 12 * blocks_for(40 + 29, bs));
    assert!(st.peak_cache_bytes() > stats.peak_cache_bytes());
}

#[test]
fn a_sequence_larger_than_the_budget_is_an_error() {
    let m = tiny_model(None, 13);
    let params = SamplingParams { n: 2, max_new_tokens: 100, ..Default::default() };
    let engine = EngineConfig { kv_cache_gb: budget(3.5, 16), ..EngineConfig::default() };
    let opts = GenerateOptions { engine, ..GenerateOptions::default() };
    let err = generate_stats(&m, &prompts(), &params, 0, &angle_decode, &opts).expect_err("too long");
    let err = err.to_string();
    assert!(
        err.contains("112 tokens needs 7 cache blocks") && err.contains("kv_cache_gb = 0.0000286"),
        "{err}"
    );
    for (bad, field) in [
        (EngineConfig { kv_cache_gb: Some(-1.0), ..Default::default() }, "kv_cache_gb"),
        (EngineConfig { max_rows: Some(0), ..Default::default() }, "max_rows"),
        (EngineConfig { block_size: 0, ..Default::default() }, "block_size"),
    ] {
        let err = bad.validate().expect_err(field).to_string();
        assert!(err.contains(&format!("rollout.engine.{field}")), "{err}");
    }
    for u in [0.0, 1.5, f64::NAN] {
        let bad = EngineConfig { gpu_memory_utilization: u, ..Default::default() };
        let err = bad.validate().expect_err("utilization").to_string();
        assert!(err.contains("rollout.engine.gpu_memory_utilization"), "{err}");
    }
    let parsed: EngineConfig = serde_json::from_str(r#"{"kv_cache_gb": 2.5, "max_rows": 8}"#).expect("parse");
    assert_eq!((parsed.kv_cache_gb, parsed.max_rows, parsed.block_size), (Some(2.5), Some(8), 16));
    assert!(serde_json::from_str::<EngineConfig>(r#"{"max_row": 8}"#).is_err());
    let bf16: EngineConfig = serde_json::from_str(r#"{"kv_cache_dtype": "bfloat16"}"#).expect("bf16");
    assert_eq!(bf16.kv_cache_dtype, KvCacheDtype::Bfloat16);
    assert!(serde_json::from_str::<EngineConfig>(r#"{"kv_cache_dtype": "fp8"}"#).is_err());
    assert!(parsed.enable_prefix_caching, "on by default");
    let off: EngineConfig = serde_json::from_str(r#"{"enable_prefix_caching": false}"#).expect("off");
    assert!(!off.enable_prefix_caching);
    let err = KvCacheDtype::parse("fp8", "--kv-cache-dtype").expect_err("fp8").to_string();
    assert!(err.contains("--kv-cache-dtype") && err.contains("bfloat16"), "{err}");
}

/// `kv_cache_dtype = "bfloat16"` under an f32 model: the pool holds twice
/// the tokens of the same budget (half the bytes per token), and the
/// responses are those of the f32 cache up to draws that the keys' and
/// values' rounding flips (counted: most stay equal in this small model).
#[test]
fn a_bf16_cache_halves_the_bytes_per_token() {
    let m = tiny_model(None, 13);
    let params = SamplingParams { n: 2, max_new_tokens: 12, seed: 5, ..Default::default() };
    let run = |kv_cache_dtype| {
        let engine = EngineConfig { kv_cache_gb: Some(0.01), kv_cache_dtype, ..EngineConfig::default() };
        let opts = GenerateOptions { engine, ..GenerateOptions::default() };
        generate_stats(&m, &prompts(), &params, 0, &angle_decode, &opts).expect("rollout")
    };
    let ((f32_out, f32_stats), (bf16_out, bf16_stats)) =
        (run(KvCacheDtype::Auto), run(KvCacheDtype::Bfloat16));
    assert_eq!(f32_stats.bytes_per_token, 2 * bf16_stats.bytes_per_token);
    assert_eq!(f32_stats.tokens, bf16_stats.tokens);
    let same = f32_out.iter().zip(&bf16_out).filter(|(a, b)| a.response_ids == b.response_ids).count();
    assert!(2 * same >= f32_out.len(), "{same} of {} responses unchanged by the bf16 cache", f32_out.len());
}

/// Prompts that share a system prompt of three blocks (of 4 tokens), then
/// differ; one prompt has the same tokens as the others' second and third
/// blocks after a different first block.
fn shared_prefix_prompts() -> Vec<Vec<u32>> {
    let system: Vec<u32> = (0..12u32).map(|i| (i * 11 + 3) % 90 + 5).collect();
    let mut out: Vec<Vec<u32>> = (0..5u32)
        .map(|p| system.iter().copied().chain((0..(2 + 3 * p)).map(|i| (p * 17 + i * 5) % 90 + 5)).collect())
        .collect();
    let mut other = out[1].clone();
    other[..4].copy_from_slice(&[1, 2, 3, 4]);
    out.push(other);
    out
}

fn run_with(
    m: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    engine: EngineConfig,
) -> (Vec<Sample>, EngineStats) {
    let opts = GenerateOptions { engine, ..GenerateOptions::default() };
    generate_stats(m, prompts, params, 0, &angle_decode, &opts).expect("rollout")
}

/// Prefix caching on samples exactly what it samples off, with the same
/// log-probs, for prompts sharing a prefix of three blocks: all rows at
/// once, refills through 2 rows, and a pool so small that sequences are
/// preempted, recomputed from their cached blocks, and cached blocks are
/// evicted. Both equal the dense one-at-a-time engine. The log-probs agree
/// within 1e-5, not bit for bit, in this tiny model only: gemm multiplies a
/// product of at most 16 x 16 outputs (here a call of up to 8 tokens through
/// the 32-wide key projection) with another kernel, so a shorter prefill
/// (the cached blocks skipped) rounds its own tokens differently. Models
/// with projections wider than 128 take one kernel for every call of 2 or
/// more tokens, and `stapo bench rollout --prefix-caching off,on` counts the
/// responses and log-probs that differ there.
#[test]
fn prefix_caching_changes_no_draw() {
    let m = tiny_model(Some(3), 21);
    let prompts = shared_prefix_prompts();
    let params = SamplingParams { n: 2, max_new_tokens: 24, seed: 3, ..SamplingParams::default() };
    let want = dense_reference(&m, &prompts, &params);
    let cases = [
        EngineConfig { block_size: 4, ..EngineConfig::default() },
        EngineConfig { block_size: 4, max_rows: Some(2), ..EngineConfig::default() },
        EngineConfig {
            block_size: 4,
            max_rows: Some(6),
            kv_cache_gb: budget(14.5, 4),
            ..EngineConfig::default()
        },
    ];
    for (i, engine) in cases.into_iter().enumerate() {
        let (off, off_stats) =
            run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: false, ..engine });
        let (on, on_stats) =
            run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: true, ..engine });
        assert_eq!(on.len(), want.len());
        for ((a, b), w) in on.iter().zip(&off).zip(&want) {
            assert_eq!(a.response_ids, b.response_ids, "case {i}: caching changed a response");
            assert_eq!(a.response_ids, w.0, "case {i}: differs from the dense engine");
            for (x, y) in a.old_logprobs.iter().zip(&b.old_logprobs) {
                assert!((x - y).abs() < 1e-5, "case {i}: log-prob {x} with caching, {y} without");
            }
            for (x, y) in a.old_logprobs.iter().zip(&w.1) {
                assert!((x - y).abs() < 1e-4, "case {i}: log-prob {x} vs dense {y}");
            }
        }
        assert_eq!((off_stats.prefix_cache_queried_tokens, off_stats.prefix_cache_hit_tokens), (0, 0));
        assert!(on_stats.prefix_cache_hit_tokens > 0, "case {i}: {on_stats:?}");
        if i < 2 {
            // The same schedule: the cached tokens are exactly those not prefilled.
            assert_eq!(
                on_stats.prefill_tokens + on_stats.prefix_cache_hit_tokens,
                off_stats.prefill_tokens,
                "case {i}"
            );
        } else {
            assert!(on_stats.prefill_tokens < off_stats.prefill_tokens, "{on_stats:?}\n{off_stats:?}");
            assert!(on_stats.preemptions > 0 && off_stats.preemptions > 0, "case 2 should preempt");
            assert!(on_stats.prefix_cache_evictions > 0, "case 2 should evict: {on_stats:?}");
            assert!(
                on_stats.peak_blocks <= on_stats.pool_blocks && on_stats.pool_blocks == 14,
                "{on_stats:?}"
            );
        }
    }
}

/// Each prompt's prefill skips the three blocks of system prompt the first
/// one computed (and only those); the prompt whose second and third blocks
/// hold the same tokens after a different first block hits nothing.
#[test]
fn a_cached_prefix_is_shared_only_after_the_same_tokens() {
    let m = tiny_model(None, 22);
    let prompts = shared_prefix_prompts();
    let params = SamplingParams { n: 3, max_new_tokens: 6, seed: 9, ..SamplingParams::default() };
    let engine = EngineConfig { block_size: 4, ..EngineConfig::default() };
    let (_, off) = run_with(&m, &prompts, &params, EngineConfig { enable_prefix_caching: false, ..engine });
    let (_, on) = run_with(&m, &prompts, &params, engine);
    assert_eq!(off.preemptions + on.preemptions, 0);
    let total: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(off.prefill_tokens, total, "each prompt prefilled once");
    // Prompts 1..5 share the first one's 3 blocks; the last shares none.
    assert_eq!(on.prefix_cache_hit_tokens, 4 * 12, "{on:?}");
    assert_eq!(on.prefix_cache_queried_tokens, total);
    assert_eq!(on.prefill_tokens, total - 4 * 12);
    assert!((on.prefix_cache_hit_rate() - 48.0 / total as f64).abs() < 1e-12);
    // The last block of a prompt never comes from the cache: its last token
    // must run to give the first draw's logits. Twice the same prompt of
    // exactly 3 blocks: the second reuses 2 blocks and prefills the third.
    let same = vec![prompts[0][..12].to_vec(); 2];
    let (got, st) = run_with(&m, &same, &params, engine);
    assert_eq!(st.prefix_cache_hit_tokens, 8);
    assert_eq!(st.prefill_tokens, 12 + 4);
    assert_eq!(got.len(), 6);
}

/// With `kv_cache_gb` unset, a GPU's pool is `gpu_memory_utilization` of the
/// free device memory (0.9 by default), the CPU's a quarter of the available
/// memory; a set budget wins everywhere. The pool then holds whole blocks of
/// that budget, capped by what the call can use.
#[test]
fn an_unset_budget_is_a_share_of_the_free_memory() {
    let gb = 1_000_000_000u64;
    let unset = EngineConfig::default();
    assert_eq!(budget_bytes(&unset, Memory::Device(80 * gb)), 72e9);
    assert_eq!(budget_bytes(&unset, Memory::Host(8 * gb)), 2e9);
    assert_eq!(budget_bytes(&unset, Memory::Unknown), f64::INFINITY);
    let half = EngineConfig { gpu_memory_utilization: 0.5, ..unset };
    assert_eq!(budget_bytes(&half, Memory::Device(80 * gb)), 40e9);
    let set = EngineConfig { kv_cache_gb: Some(3.0), ..half };
    assert_eq!(budget_bytes(&set, Memory::Device(80 * gb)), 3e9);
    assert_eq!(budget_bytes(&set, Memory::Host(gb)), 3e9);
    // 1,000 blocks of 16 tokens x 1,000 bytes are free: 0.9 of them is 900 blocks,
    // fewer than 64 prompts x 4 samples x 100 blocks would use.
    let prompts = vec![vec![1u32; 600]; 64];
    let params = SamplingParams { n: 4, max_new_tokens: 1001, ..SamplingParams::default() };
    let free = budget_bytes(&unset, Memory::Device(16_000_000));
    assert_eq!(pool_blocks(free, &prompts, &params, &unset, 256, 1000).expect("pool"), 900);
    // Two rows at most: the pool stops at (2 + 4) sequences of 100 blocks.
    assert_eq!(pool_blocks(free, &prompts, &params, &unset, 2, 1000).expect("pool"), 600);
    let tiny = budget_bytes(&unset, Memory::Device(1_000_000));
    let err = pool_blocks(tiny, &prompts, &params, &unset, 2, 1000).expect_err("too small").to_string();
    assert!(err.contains("needs 100 cache blocks") && err.contains("holds 56"), "{err}");
}
