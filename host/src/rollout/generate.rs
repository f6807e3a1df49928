//! The generation loop: one prefill per chunk of prompts, the prefilled cache
//! replicated into GRPO groups, then batched one-token decode steps.
//!
//! Each response owns a generator seeded by (seed, prompt index, sample index)
//! and draws exactly one number per token, so its tokens depend neither on the
//! other prompts in the batch nor on when other rows finish (up to float
//! rounding of batched matmuls, which can only flip a draw that lands within
//! ~1e-6 of a boundary).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::batch::{Finish, Sample};
use super::device::StepLogits;
use super::sampler::{row_seed, Sampler, TokenDraw};
use super::SamplingParams;
use crate::model::{KvCache, Qwen3, TokenBatch};
use crate::{Error, Result};

/// Optional controls of [`generate_with`].
#[derive(Clone, Copy)]
pub struct GenerateHooks<'a> {
    /// Called after every decode step with the number of tokens sampled so far.
    pub progress: Option<&'a dyn Fn(usize)>,
    /// When set to true, generation stops at the next step with an error.
    pub cancel: Option<&'a AtomicBool>,
    /// Most sequences decoded at once (bounds KV-cache memory): prompts are
    /// processed in chunks of `max(1, max_rows / n)`.
    pub max_rows: usize,
    /// Rows that have finished stay in the cache (fed a pad token, output
    /// ignored) until they are at least this fraction of it; then the cache is
    /// compacted. Compaction copies the whole cache, so doing it for every
    /// finished row would cost more than it saves on long caches.
    pub compact_fraction: f64,
    /// Index of `prompts[0]` in the whole batch, for the per-response seeds: a
    /// data-parallel rank that samples prompts `[lo, hi)` of a step's batch
    /// passes `lo`, so every response is drawn as in a one-process run.
    pub first_prompt_index: usize,
}

impl Default for GenerateHooks<'_> {
    fn default() -> Self {
        Self { progress: None, cancel: None, max_rows: 256, compact_fraction: 0.125, first_prompt_index: 0 }
    }
}

/// Samples `params.n` responses for each prompt (token ids, any lengths).
///
/// `pad_id` fills the left padding; `decode` turns token ids into text (for the
/// response text and for stop strings); `progress` receives the number of
/// tokens sampled so far after each step. Returns the samples ordered by
/// prompt, then sample index; `group` is the prompt's index.
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
        &GenerateHooks { progress, ..GenerateHooks::default() },
    )
}

/// [`generate`] with cancellation, chunking and compaction controls.
pub fn generate_with(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    pad_id: u32,
    decode: &dyn Fn(&[u32]) -> String,
    hooks: &GenerateHooks,
) -> Result<Vec<Sample>> {
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
    if hooks.max_rows == 0 {
        return Err(Error::invalid("generate: max_rows must be at least 1"));
    }
    // Lengths and memory bounded before anything is allocated (rollout::bounds).
    let rows = (prompts.len() * params.n).min((hooks.max_rows / params.n).max(1) * params.n);
    super::bounds::check_generation(
        model.config(),
        model.dtype(),
        model.device().is_cpu(),
        prompts,
        params,
        rows,
    )?;
    let eos = if params.ignore_eos { None } else { model.config().eos_token_id };
    let run = Run {
        model,
        params,
        sampler: Sampler::new(params),
        stops: StopRules::new(params, eos),
        pad_id,
        decode,
        hooks,
    };
    let per_chunk = (hooks.max_rows / params.n).max(1);
    let mut out = Vec::with_capacity(prompts.len() * params.n);
    let mut tokens = 0;
    for (c, chunk) in prompts.chunks(per_chunk).enumerate() {
        run.chunk(chunk, c * per_chunk, &mut tokens, &mut out)?;
    }
    out.sort_by_key(|s| (s.prompt_index, s.sample_index));
    Ok(out)
}

/// When a response ends.
struct StopRules {
    eos: Option<u32>,
    tokens: Vec<u32>,
    strings: Vec<String>,
    /// Tokens decoded from the end of a response to look for stop strings.
    window: usize,
}

impl StopRules {
    fn new(params: &SamplingParams, eos: Option<u32>) -> Self {
        let longest = params.stop_strings.iter().map(String::len).max().unwrap_or(0);
        // A stop string completed by the newest token lies within its last
        // `len` tokens if every token decodes to at least one byte; the margin
        // covers tokens that decode to nothing (e.g. skipped special tokens).
        Self {
            eos,
            tokens: params.stop_token_ids.clone(),
            strings: params.stop_strings.clone(),
            window: 2 * longest + 8,
        }
    }

    /// Whether `ids` (a response so far) has just been ended by its last token.
    /// Only the tail is decoded, so the check costs O(window) per token rather
    /// than O(length).
    fn check(&self, ids: &[u32], decode: &dyn Fn(&[u32]) -> String) -> Option<Finish> {
        let &last = ids.last()?;
        if Some(last) == self.eos {
            return Some(Finish::Eos);
        }
        if self.tokens.contains(&last) {
            return Some(Finish::Stop);
        }
        if !self.strings.is_empty() {
            let text = decode(&ids[ids.len().saturating_sub(self.window)..]);
            if self.strings.iter().any(|s| text.contains(s.as_str())) {
                return Some(Finish::StopString);
            }
        }
        None
    }
}

/// One response being generated.
struct Row {
    prompt_index: usize,
    sample_index: usize,
    rng: StdRng,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    old_logprobs: Vec<f32>,
    entropies: Vec<f32>,
    done: bool,
}

impl Row {
    fn push(&mut self, d: TokenDraw) {
        self.ids.push(d.id);
        self.logprobs.push(d.logprob);
        self.old_logprobs.push(d.logprob_raw);
        self.entropies.push(d.entropy);
    }

    /// Moves the response out into a [`Sample`].
    fn finish(&mut self, finish: Finish, prompt: &[u32], decode: &dyn Fn(&[u32]) -> String) -> Sample {
        self.done = true;
        let response_ids = std::mem::take(&mut self.ids);
        Sample {
            group: self.prompt_index,
            prompt_index: self.prompt_index,
            sample_index: self.sample_index,
            prompt_ids: prompt.to_vec(),
            text: decode(&response_ids),
            response_ids,
            logprobs: std::mem::take(&mut self.logprobs),
            old_logprobs: std::mem::take(&mut self.old_logprobs),
            entropies: std::mem::take(&mut self.entropies),
            finish,
            truncated: finish == Finish::Length,
            reward: None,
        }
    }
}

/// Everything one call of [`generate_with`] shares across chunks.
struct Run<'a> {
    model: &'a Qwen3,
    params: &'a SamplingParams,
    sampler: Sampler,
    stops: StopRules,
    pad_id: u32,
    decode: &'a dyn Fn(&[u32]) -> String,
    hooks: &'a GenerateHooks<'a>,
}

impl Run<'_> {
    /// Generates the groups of `prompts`, whose first has global index `first`.
    fn chunk(
        &self,
        prompts: &[Vec<u32>],
        first: usize,
        tokens: &mut usize,
        out: &mut Vec<Sample>,
    ) -> Result<()> {
        let (model, n) = (self.model, self.params.n);
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        // The last sampled token is never fed back, hence the - 1.
        let mut cache = KvCache::new(model, prompts.len(), longest + self.params.max_new_tokens - 1)?;
        let batch = TokenBatch::left_padded(prompts, self.pad_id, model.device())?;
        let mut logits =
            StepLogits::new(&model.decode(&batch.ids, Some(&batch.mask), &mut cache)?, &self.sampler)?;
        // Row r of the group cache is sample r % n of prompt r / n; before the
        // first step its logits are its prompt's row of the prefill.
        let mut logits_row: Vec<usize> = (0..prompts.len() * n).map(|r| r / n).collect();
        if n > 1 {
            cache.select_rows(&logits_row)?;
        }
        let mut rows: Vec<Row> = logits_row
            .iter()
            .enumerate()
            .map(|(r, &p)| {
                let (prompt_index, sample_index) = (first + p, r % n);
                Row {
                    prompt_index,
                    sample_index,
                    rng: StdRng::seed_from_u64(row_seed(
                        self.params.seed,
                        self.hooks.first_prompt_index + prompt_index,
                        sample_index,
                    )),
                    ids: Vec::with_capacity(self.params.max_new_tokens),
                    logprobs: Vec::with_capacity(self.params.max_new_tokens),
                    old_logprobs: Vec::with_capacity(self.params.max_new_tokens),
                    entropies: Vec::with_capacity(self.params.max_new_tokens),
                    done: false,
                }
            })
            .collect();
        loop {
            let sampler = self.sampler;
            let wanted: Vec<(usize, &mut StdRng)> = rows
                .iter_mut()
                .zip(&logits_row)
                .filter(|(row, _)| !row.done)
                .map(|(row, &l)| (l, &mut row.rng))
                .collect();
            let mut draws = logits.draw(&sampler, wanted)?.into_iter();
            for row in rows.iter_mut().filter(|r| !r.done) {
                let Some(draw) = draws.next() else { break };
                row.push(draw);
                *tokens += 1;
                let finish = self
                    .stops
                    .check(&row.ids, self.decode)
                    .or_else(|| (row.ids.len() >= self.params.max_new_tokens).then_some(Finish::Length));
                if let Some(finish) = finish {
                    out.push(row.finish(finish, &prompts[row.prompt_index - first], self.decode));
                }
            }
            if let Some(progress) = self.hooks.progress {
                progress(*tokens);
            }
            if rows.iter().all(|r| r.done) {
                return Ok(());
            }
            if self.hooks.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::invalid(format!("generate: cancelled after {tokens} tokens")));
            }
            let dead = rows.iter().filter(|r| r.done).count();
            if dead > 0 && dead as f64 >= self.hooks.compact_fraction * rows.len() as f64 {
                let keep: Vec<usize> = (0..rows.len()).filter(|&r| !rows[r].done).collect();
                cache.select_rows(&keep)?;
                rows.retain(|r| !r.done);
            }
            let next: Vec<u32> = rows.iter().map(|r| r.ids.last().copied().unwrap_or(self.pad_id)).collect();
            let next = Tensor::from_vec(next, (rows.len(), 1), model.device())?;
            logits = StepLogits::new(&model.decode(&next, None, &mut cache)?, &self.sampler)?;
            logits_row = (0..rows.len()).collect();
        }
    }
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
    let hooks = GenerateHooks { max_rows: batch.max(1), ..GenerateHooks::default() };
    let start = Instant::now();
    let samples = generate_with(model, &prompts, &params, 0, &|_| String::new(), &hooks)?;
    let secs = start.elapsed().as_secs_f64();
    Ok(samples.iter().map(|s| s.response_ids.len()).sum::<usize>() as f64 / secs)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::model::{logprob_entropy, Grad};
    use crate::rollout::test_support::{angle_decode, tiny_model};

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
        for compact_fraction in [0.0, 0.125, 1.0] {
            let hooks = GenerateHooks { compact_fraction, ..GenerateHooks::default() };
            let batched =
                generate_with(&model, &prompts(), &params, 0, &angle_decode, &hooks).expect("generate");
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
        let hooks = GenerateHooks { max_rows: 3, ..GenerateHooks::default() };
        let chunked = generate_with(&model, &prompts(), &params, 0, &angle_decode, &hooks).expect("generate");
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
        let hooks = GenerateHooks { first_prompt_index: lo, ..GenerateHooks::default() };
        let shard =
            generate_with(&model, &prompts()[lo..], &params, 0, &angle_decode, &hooks).expect("generate");
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
        let hooks = GenerateHooks { cancel: Some(&cancel), ..GenerateHooks::default() };
        let err =
            generate_with(&model, &prompts(), &params, 0, &angle_decode, &hooks).expect_err("cancelled");
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
