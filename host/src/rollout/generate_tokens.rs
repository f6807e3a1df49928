//! The entry point of generation: checks the inputs and hands them to the
//! engine (`rollout::engine`: continuous batching over a paged KV cache).
//!
//! Each response owns a generator seeded by (seed, prompt index, sample index)
//! and draws exactly one number per token, so its tokens depend neither on the
//! other prompts in the batch nor on when other rows finish or are preempted
//! (up to float rounding of batched matmuls, which can only flip a draw that
//! lands within ~1e-6 of a boundary).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::batch::Sample;
use super::config::EngineConfig;
use super::engine::{self, GenerateOptions};
use super::partial::{PartialRollout, PartialStep};
use super::stats::EngineStats;
use super::SamplingParams;
use crate::model::Qwen3;
use crate::{Error, Result};

/// Samples `params.n` responses for each prompt (token ids, any lengths).
///
/// `pad_id` is checked against the vocabulary (the engine needs no padding);
/// `decode` turns token ids into text (for the response text and for stop
/// strings); `progress` receives the number of tokens sampled so far after
/// each step. Returns the samples ordered by prompt, then sample index;
/// `group` is the prompt's index.
pub fn generate(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    pad_id: u32,
    decode: &dyn Fn(&[u32]) -> String,
    progress: Option<&dyn Fn(usize)>,
) -> Result<Vec<Sample>> {
    generate_with(
        model,
        prompts,
        params,
        pad_id,
        decode,
        &GenerateOptions { progress, ..GenerateOptions::default() },
    )
}

/// [`generate`] with cancellation and engine controls.
pub fn generate_with(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    pad_id: u32,
    decode: &dyn Fn(&[u32]) -> String,
    opts: &GenerateOptions,
) -> Result<Vec<Sample>> {
    Ok(generate_stats(model, prompts, params, pad_id, decode, opts)?.0)
}

/// [`generate_with`], also returning the engine's figures (tokens/s, rows per
/// step, cache blocks, preemptions).
pub fn generate_stats(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    pad_id: u32,
    decode: &dyn Fn(&[u32]) -> String,
    opts: &GenerateOptions,
) -> Result<(Vec<Sample>, EngineStats)> {
    let eos = check_inputs(model, prompts, params, pad_id)?;
    let (mut out, stats) = engine::run(model, prompts, params, decode, opts, eos)?;
    out.sort_by_key(|s| (s.prompt_index, s.sample_index));
    Ok((out, stats))
}

/// Checks a generation's inputs (sampling, pad id, prompts against the
/// vocabulary, lengths against the model and the machine); returns the EOS id
/// that ends a response (`None` with `ignore_eos`).
fn check_inputs(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    pad_id: u32,
) -> Result<Option<u32>> {
    let vocab = model.config().vocab_size;
    params.validate(vocab)?;
    if pad_id as usize >= vocab {
        return Err(Error::invalid(format!(
            "generate: pad id {pad_id} is outside the vocabulary of {vocab}"
        )));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::invalid(format!("generate: prompt {i} is empty")));
        }
        if let Some((j, t)) = p.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(Error::invalid(format!(
                "generate: prompt {i} token {j} is {t}, outside the vocabulary of {vocab}"
            )));
        }
    }
    // Lengths bounded, and one sequence's KV cache against the machine, before anything
    // is allocated (rollout::bounds); the engine's paged pool budgets the batch.
    super::bounds::check_generation(
        model.config(),
        model.activation_dtype(),
        model.device().is_cpu(),
        prompts,
        params,
        1,
    )?;
    let eos = if params.ignore_eos { None } else { model.config().eos_token_id };
    Ok(eos)
}

/// One step of partial rollouts at policy `version`: the groups in flight in
/// `partial` run (continuous batching) until `wanted` of them have all their
/// responses, which are returned (`rollout::partial`); the unfinished ones stay
/// in `partial` for the next call. `opts.policy` is replaced by the partial
/// policy; every token records `version`.
#[allow(clippy::too_many_arguments)]
pub fn generate_partial(
    model: &Qwen3,
    partial: &mut PartialRollout,
    params: &SamplingParams,
    pad_id: u32,
    decode: &dyn Fn(&[u32]) -> String,
    opts: &GenerateOptions,
    version: u64,
    wanted: usize,
) -> Result<PartialStep> {
    let prompts: Vec<Vec<u32>> = partial.groups().iter().map(|g| g.prompt_ids.clone()).collect();
    let eos = check_inputs(model, &prompts, params, pad_id)?;
    partial.step(model, params, decode, opts, eos, version, wanted)
}

/// Generation throughput in sampled tokens per second, prefill included:
/// `batch` random prompts of `prompt_len` tokens, one sample each at
/// temperature 1, exactly `new_tokens` new tokens each (EOS ignored).
pub fn bench_generate(model: &Qwen3, batch: usize, prompt_len: usize, new_tokens: usize) -> Result<f64> {
    let vocab = model.config().vocab_size as u32;
    let mut rng = StdRng::seed_from_u64(0);
    let prompts: Vec<Vec<u32>> =
        (0..batch).map(|_| (0..prompt_len.max(1)).map(|_| rng.random_range(0..vocab)).collect()).collect();
    let params =
        SamplingParams { n: 1, max_new_tokens: new_tokens, ignore_eos: true, ..SamplingParams::default() };
    let engine = EngineConfig { max_rows: Some(batch.max(1)), ..EngineConfig::default() };
    let opts = GenerateOptions { engine, ..GenerateOptions::default() };
    let (_, stats) = generate_stats(model, &prompts, &params, 0, &|_| String::new(), &opts)?;
    Ok(stats.tokens_per_sec())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::AtomicBool;

    use candle_core::Tensor;

    use super::*;
    use crate::model::{logprob_entropy, Grad, TokenBatch};
    use crate::rollout::test_support::{angle_decode, tiny_model};
    use crate::rollout::{Finish, SchedulePolicy};

    fn prompts() -> Vec<Vec<u32>> {
        vec![vec![5, 9, 13], vec![2, 40, 41, 42, 43, 44, 45], vec![77], vec![60, 61, 3, 3, 8]]
    }

    fn run(model: &Qwen3, prompts: &[Vec<u32>], params: &SamplingParams) -> Vec<Sample> {
        generate(model, prompts, params, 0, &angle_decode, None).expect("generate")
    }

    fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < tol, "{what}: {a:?} vs {b:?}");
        }
    }

    /// Same tokens, and stats equal up to batched-matmul rounding.
    fn assert_same_response(a: &Sample, b: &Sample) {
        assert_eq!(a.response_ids, b.response_ids, "prompt {}", a.prompt_index);
        assert_eq!((a.finish, a.truncated, &a.text), (b.finish, b.truncated, &b.text));
        assert_close(&a.logprobs, &b.logprobs, 1e-4, "logprobs");
        assert_close(&a.old_logprobs, &b.old_logprobs, 1e-4, "old_logprobs");
        assert_close(&a.entropies, &b.entropies, 1e-4, "entropies");
    }

    #[test]
    fn greedy_batched_equals_each_prompt_alone() {
        let model = tiny_model(None, 1);
        // A stop token from prompt 0's free run, so that rows finish at different
        // steps and the cache drops them.
        let free = run(&model, &prompts()[..1], &SamplingParams::greedy(24));
        let params =
            SamplingParams { stop_token_ids: vec![free[0].response_ids[4]], ..SamplingParams::greedy(24) };
        let alone: Vec<Sample> = prompts()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut s = run(&model, std::slice::from_ref(p), &params).remove(0);
                (s.group, s.prompt_index) = (i, i);
                s
            })
            .collect();
        let lens: Vec<usize> = alone.iter().map(Sample::response_len).collect();
        assert!(lens.iter().any(|&l| l != lens[0]), "rows should finish at different steps: {lens:?}");
        // Continuous batching with all rows, with 2 rows (refills), with a cache
        // of 3 blocks (preemptions), and the static policy.
        let engines = [
            (EngineConfig::default(), SchedulePolicy::Continuous),
            (EngineConfig { max_rows: Some(2), ..EngineConfig::default() }, SchedulePolicy::Continuous),
            (
                EngineConfig { kv_cache_gb: Some(3.5 * 16.0 * 512.0 / 1e9), ..EngineConfig::default() },
                SchedulePolicy::Continuous,
            ),
            (
                EngineConfig { max_rows: Some(2), block_size: 4, ..EngineConfig::default() },
                SchedulePolicy::Static,
            ),
        ];
        for (engine, policy) in engines {
            let opts = GenerateOptions { engine, policy, ..GenerateOptions::default() };
            let batched =
                generate_with(&model, &prompts(), &params, 0, &angle_decode, &opts).expect("generate");
            assert_eq!(batched.len(), alone.len());
            for (a, b) in batched.iter().zip(&alone) {
                assert_same_response(a, b);
                assert_eq!(a.logprobs.iter().sum::<f32>(), 0.0, "greedy logprobs are 0");
            }
        }
    }

    #[test]
    fn recorded_stats_match_a_full_forward() {
        let model = tiny_model(Some(1), 2);
        let params = SamplingParams {
            n: 3,
            temperature: 0.8,
            top_p: 0.9,
            max_new_tokens: 12,
            seed: 3,
            ..Default::default()
        };
        let samples = run(&model, &prompts(), &params);
        assert_eq!(samples.len(), 12);
        for s in &samples {
            let ids: Vec<u32> = s.prompt_ids.iter().chain(&s.response_ids).copied().collect();
            let batch = TokenBatch::left_padded(&[ids], 0, model.device()).expect("batch");
            let hidden = model.forward_hidden(&batch, Grad::Off).expect("forward");
            // The logits that predicted response token j sit at prompt_len - 1 + j.
            let hidden = hidden.narrow(1, s.prompt_ids.len() - 1, s.response_len()).expect("narrow");
            let logits = model.lm_head(&hidden, Grad::Off).expect("lm_head");
            let targets = Tensor::new(s.response_ids.as_slice(), model.device())
                .expect("targets")
                .unsqueeze(0)
                .expect("unsqueeze");
            let (logp, ent) = logprob_entropy(&logits, &targets).expect("logprob_entropy");
            let logp: Vec<f32> = logp.flatten_all().and_then(|t| t.to_vec1()).expect("logp");
            let ent: Vec<f32> = ent.flatten_all().and_then(|t| t.to_vec1()).expect("ent");
            assert_close(&s.old_logprobs, &logp, 1e-4, "old_logprobs vs forward");
            assert_close(&s.entropies, &ent, 1e-4, "entropies vs forward");
            assert!(s.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 1e-6), "{:?}", s.logprobs);
            assert_eq!(s.truncated, s.finish == Finish::Length);
            assert_eq!(s.text, angle_decode(&s.response_ids));
        }
    }

    #[test]
    fn seeds_make_runs_reproducible() {
        let model = tiny_model(Some(1), 3);
        let params = SamplingParams { n: 4, max_new_tokens: 10, seed: 42, ..Default::default() };
        let a = run(&model, &prompts(), &params);
        let b = run(&model, &prompts(), &params);
        assert_eq!(a, b);
        let c = run(&model, &prompts(), &SamplingParams { seed: 43, ..params.clone() });
        assert_ne!(
            a.iter().map(|s| &s.response_ids).collect::<Vec<_>>(),
            c.iter().map(|s| &s.response_ids).collect::<Vec<_>>()
        );
        // The samples of one group differ from each other.
        assert!(a[..4].iter().any(|s| s.response_ids != a[0].response_ids));
        assert_eq!(
            a.iter().map(|s| (s.group, s.sample_index)).collect::<Vec<_>>(),
            (0..16).map(|r| (r / 4, r % 4)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let model = tiny_model(Some(1), 4);
        let params =
            SamplingParams { n: 3, max_new_tokens: 16, top_k: Some(20), seed: 9, ..Default::default() };
        let target = prompts()[1].clone();
        // Same prompt index (1), different neighbours and padding.
        let a = run(&model, &[vec![3, 4], target.clone()], &params);
        let b = run(&model, &[vec![8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8], target.clone(), vec![1, 2, 3]], &params);
        let pick = |v: &[Sample]| v.iter().filter(|s| s.prompt_index == 1).cloned().collect::<Vec<_>>();
        for (x, y) in pick(&a).iter().zip(&pick(&b)) {
            assert_same_response(x, y);
        }
        // Chunked (one prompt per chunk) equals unchunked.
        let engine = EngineConfig { max_rows: Some(3), ..EngineConfig::default() };
        let opts = GenerateOptions { engine, ..GenerateOptions::default() };
        let chunked = generate_with(&model, &prompts(), &params, 0, &angle_decode, &opts).expect("generate");
        for (x, y) in chunked.iter().zip(&run(&model, &prompts(), &params)) {
            assert_same_response(x, y);
        }
    }

    /// A data-parallel rank samples a shard of the step's prompts with
    /// `first_prompt_index`: its responses are those of the whole batch.
    #[test]
    fn a_shard_samples_as_the_whole_batch() {
        let model = tiny_model(Some(1), 4);
        let params = SamplingParams { n: 2, max_new_tokens: 12, seed: 5, ..Default::default() };
        let all = run(&model, &prompts(), &params);
        let lo = 1;
        let opts = GenerateOptions { first_prompt_index: lo, ..GenerateOptions::default() };
        let shard =
            generate_with(&model, &prompts()[lo..], &params, 0, &angle_decode, &opts).expect("generate");
        let rest: Vec<&Sample> = all.iter().filter(|s| s.prompt_index >= lo).collect();
        assert_eq!(shard.len(), rest.len());
        for (x, y) in shard.iter().zip(rest) {
            assert_eq!(x.prompt_index + lo, y.prompt_index);
            assert_eq!(x.response_ids, y.response_ids);
        }
        // Without the offset the shard's draws differ (the seeds are per global index).
        let plain = run(&model, &prompts()[lo..], &params);
        assert!(plain.iter().zip(&shard).any(|(a, b)| a.response_ids != b.response_ids));
    }

    #[test]
    fn stop_tokens_eos_and_length() {
        let model = tiny_model(None, 5);
        let p = &prompts()[..1];
        let free = run(&model, p, &SamplingParams::greedy(20)).remove(0);
        assert_eq!((free.response_len(), free.finish, free.truncated), (20, Finish::Length, true));
        let stop = free.response_ids[6];
        let expect_len = free.response_ids.iter().position(|&t| t == stop).expect("present") + 1;
        let s = run(&model, p, &SamplingParams { stop_token_ids: vec![stop], ..SamplingParams::greedy(20) })
            .remove(0);
        assert_eq!(s.response_ids, free.response_ids[..expect_len]);
        assert_eq!((s.finish, s.truncated), (Finish::Stop, false));
        // The same weights with that token as the model's EOS.
        let eos_model = tiny_model(Some(stop), 5);
        let s = run(&eos_model, p, &SamplingParams::greedy(20)).remove(0);
        assert_eq!((s.response_len(), s.finish, s.truncated), (expect_len, Finish::Eos, false));
        let s =
            run(&eos_model, p, &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) }).remove(0);
        assert_eq!(s.response_ids, free.response_ids);
    }

    #[test]
    fn stop_strings_end_at_the_completing_token() {
        let model = tiny_model(None, 6);
        let p = &prompts()[2..3];
        let free = run(&model, p, &SamplingParams::greedy(30)).remove(0);
        let (a, b) = (free.response_ids[7], free.response_ids[8]);
        // Spans the boundary between two tokens and covers neither fully.
        for stop in [format!("{a}><{b}"), format!("<{b}>")] {
            let expect_len = (1..=free.response_len())
                .find(|&l| angle_decode(&free.response_ids[..l]).contains(&stop))
                .expect("found");
            let params = SamplingParams {
                stop_strings: vec!["never".into(), stop.clone()],
                ..SamplingParams::greedy(30)
            };
            let s = run(&model, p, &params).remove(0);
            assert_eq!(s.response_ids, free.response_ids[..expect_len], "stop {stop:?}");
            assert_eq!((s.finish, s.truncated), (Finish::StopString, false));
            assert!(
                s.text.ends_with(&format!("<{}>", s.response_ids[expect_len - 1])) && s.text.contains(&stop)
            );
        }
    }

    #[test]
    fn progress_cancel_and_bad_input() {
        let model = tiny_model(None, 7);
        let seen = Cell::new(0);
        let params = SamplingParams { n: 2, max_new_tokens: 5, ..Default::default() };
        let samples = generate(&model, &prompts(), &params, 0, &angle_decode, Some(&|t| seen.set(t)))
            .expect("generate");
        assert_eq!(seen.get(), 40);
        assert_eq!(samples.len(), 8);
        let cancel = AtomicBool::new(true);
        let opts = GenerateOptions { cancel: Some(&cancel), ..GenerateOptions::default() };
        let err = generate_with(&model, &prompts(), &params, 0, &angle_decode, &opts).expect_err("cancelled");
        assert!(err.to_string().contains("cancelled"), "{err}");
        let err = generate(&model, &[vec![1], vec![]], &params, 0, &angle_decode, None)
            .expect_err("empty")
            .to_string();
        assert!(err.contains("prompt 1 is empty"), "{err}");
        let err = generate(&model, &[vec![1, 500]], &params, 0, &angle_decode, None)
            .expect_err("vocab")
            .to_string();
        assert!(err.contains("prompt 0 token 1 is 500"), "{err}");
        assert!(generate(&model, &prompts(), &params, 97, &angle_decode, None).is_err());
        assert!(generate(&model, &[], &params, 0, &angle_decode, None).expect("no prompts").is_empty());
    }

    #[test]
    fn bench_generate_counts_tokens() {
        let model = tiny_model(Some(1), 8);
        let tps = bench_generate(&model, 3, 4, 6).expect("bench");
        assert!(tps.is_finite() && tps > 0.0);
    }
}
