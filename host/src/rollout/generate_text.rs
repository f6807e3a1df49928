//! Problems in, responses out: the one path from prompts to samples that the
//! trainer, evaluation, the tiny model's SFT, the `rollout` script binding and
//! `stapo generate` all take.
//!
//! prompt → template ([`Prompter`]) → token ids → stop at the tokenizer's
//! end-of-sequence ids → [`generate_stats`] → response text (special tokens
//! skipped).

use crate::data::{Prompt, PromptTemplate, Prompter, Tokenizer};
use crate::model::Qwen3;
use crate::Result;

use super::batch::Sample;
use super::engine::GenerateOptions;
use super::generate_tokens::{generate_partial, generate_stats};
use super::partial::{PartialRollout, PartialStep};
use super::stats::EngineStats;
use super::SamplingParams;

/// What [`Generator::generate`] returns: the samples (ordered by prompt, then
/// sample index; `prompt_index` indexes `prompt_texts`) and the rendered prompts.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The samples, ordered by prompt, then sample index.
    pub samples: Vec<Sample>,
    /// The rendered prompts, indexed by `Sample::prompt_index`.
    pub prompt_texts: Vec<String>,
    /// What the engine did (tokens/s, rows per step, cache blocks, preemptions).
    pub stats: EngineStats,
}

/// A policy, its tokenizer and the prompt template resolved against the
/// model folder.
///
/// ```ignore
/// let gen = Generator::new(&model, &tok, &PromptTemplate::Model)?;
/// if let Some(note) = gen.note() { eprintln!("{note}") }
/// let out = gen.generate(&["Compute 1+2.".into()], &SamplingParams::greedy(32), &GenerateOptions::default())?;
/// ```
pub struct Generator<'a> {
    model: &'a Qwen3,
    tokenizer: &'a Tokenizer,
    prompter: Prompter,
}

/// Checks that every id `tokenizer` can produce indexes the model's embedding: a
/// tokenizer of another model would otherwise fail deep in a tensor op (or sample ids the
/// tokenizer cannot decode). The model's vocabulary may be larger (Qwen3 pads it).
pub fn check_vocab(model: &Qwen3, tokenizer: &Tokenizer) -> Result<()> {
    let vocab = model.config().vocab_size;
    let max_id = tokenizer.inner().get_vocab(true).into_values().max();
    match max_id {
        Some(id) if id as usize >= vocab => Err(crate::Error::Config {
            file: tokenizer.path().display().to_string(),
            field: "vocabulary".into(),
            msg: format!(
                "the tokenizer has token ids up to {id} but the model's config.json says vocab_size {vocab}: \
                 the tokenizer belongs to another model"
            ),
        }),
        _ => Ok(()),
    }
}

impl<'a> Generator<'a> {
    /// Resolves `template` against the tokenizer's folder (`"model"`: the
    /// folder's declared format).
    pub fn new(model: &'a Qwen3, tokenizer: &'a Tokenizer, template: &PromptTemplate) -> Result<Self> {
        check_vocab(model, tokenizer)?;
        Ok(Self::with_prompter(model, tokenizer, tokenizer.prompter(template)?))
    }

    /// With an already resolved template (e.g. one a trainer keeps).
    pub fn with_prompter(model: &'a Qwen3, tokenizer: &'a Tokenizer, prompter: Prompter) -> Self {
        Self { model, tokenizer, prompter }
    }

    /// The template in use.
    pub fn prompter(&self) -> &Prompter {
        &self.prompter
    }

    /// A line for the user when the template in use is not the folder's own.
    pub fn note(&self) -> Option<&str> {
        self.prompter.note()
    }

    /// The model.
    pub fn model(&self) -> &Qwen3 {
        self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.tokenizer
    }

    /// Token ids of each prompt, and its text.
    pub fn encode(&self, prompts: &[Prompt]) -> Result<(Vec<Vec<u32>>, Vec<String>)> {
        let texts: Vec<String> = prompts.iter().map(|p| self.prompter.render(p)).collect::<Result<_>>()?;
        let ids = texts.iter().map(|t| self.tokenizer.encode(t, false)).collect::<Result<_>>()?;
        Ok((ids, texts))
    }

    /// Samples `params.n` responses per prompt. The tokenizer's
    /// end-of-sequence ids are added to `params.stop_token_ids`.
    pub fn generate(
        &self,
        prompts: &[Prompt],
        params: &SamplingParams,
        opts: &GenerateOptions,
    ) -> Result<Generation> {
        let (ids, prompt_texts) = self.encode(prompts)?;
        let params = self.with_eos_stops(params);
        let tok = self.tokenizer;
        let decode = |x: &[u32]| tok.decode(x, true).unwrap_or_default();
        let (samples, stats) = generate_stats(self.model, &ids, &params, tok.pad_id(), &decode, opts)?;
        Ok(Generation { samples, prompt_texts, stats })
    }

    /// One step of partial rollouts ([`generate_partial`]) over the groups in
    /// flight in `partial` (admitted with [`Generator::encode`]'s token ids), the
    /// tokenizer's end-of-sequence ids added to `params.stop_token_ids`.
    pub fn generate_partial(
        &self,
        partial: &mut PartialRollout,
        params: &SamplingParams,
        opts: &GenerateOptions,
        version: u64,
        wanted: usize,
    ) -> Result<PartialStep> {
        let params = self.with_eos_stops(params);
        let tok = self.tokenizer;
        let decode = |x: &[u32]| tok.decode(x, true).unwrap_or_default();
        generate_partial(self.model, partial, &params, tok.pad_id(), &decode, opts, version, wanted)
    }

    /// `params` with the tokenizer's end-of-sequence ids among its stop tokens.
    fn with_eos_stops(&self, params: &SamplingParams) -> SamplingParams {
        let mut params = params.clone();
        for &e in self.tokenizer.eos_ids() {
            if !params.stop_token_ids.contains(&e) {
                params.stop_token_ids.push(e);
            }
        }
        params
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_support::repo_root;
    use crate::data::BOXED_SUFFIX;
    use crate::rollout::generate;

    /// A random model over the real Qwen3 tokenizer's id range would be slow;
    /// the tiny model's folder is small and declares its template.
    fn tiny() -> (Qwen3, Tokenizer) {
        let dir = repo_root().join("models/tiny-qwen3");
        let m = crate::model::load(&dir, candle_core::DType::F32, &candle_core::Device::Cpu).expect("model");
        let t = Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
        (m, t)
    }

    #[test]
    fn generator_equals_the_steps_done_by_hand() {
        let (m, tok) = tiny();
        let prompts: Vec<Prompt> = vec!["Compute 3+4.".into(), "Compute 12-5*2.".into()];
        let params = SamplingParams { n: 2, max_new_tokens: 12, seed: 3, ..SamplingParams::default() };
        for template in [PromptTemplate::Model, PromptTemplate::raw(), PromptTemplate::chat(false)] {
            let gen = Generator::new(&m, &tok, &template).expect("generator");
            let out = gen.generate(&prompts, &params, &GenerateOptions::default()).expect("generate");
            // By hand: render, encode, eos ids as stops, generate, decode.
            let texts: Vec<String> =
                prompts.iter().map(|p| gen.prompter().render(p).expect("render")).collect();
            assert_eq!(out.prompt_texts, texts);
            let ids: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, false).expect("encode")).collect();
            let by_hand_params = SamplingParams { stop_token_ids: tok.eos_ids().to_vec(), ..params.clone() };
            let decode = |x: &[u32]| tok.decode(x, true).unwrap_or_default();
            let want = generate(&m, &ids, &by_hand_params, tok.pad_id(), &decode, None).expect("generate");
            assert_eq!(out.samples.len(), 4);
            for (a, b) in out.samples.iter().zip(&want) {
                assert_eq!(
                    (&a.prompt_ids, &a.response_ids, &a.text),
                    (&b.prompt_ids, &b.response_ids, &b.text)
                );
            }
        }
        // The tiny folder declares the bare problem; forcing raw says so.
        let gen = Generator::new(&m, &tok, &PromptTemplate::Model).expect("generator");
        assert_eq!((gen.prompter().template(), gen.note()), (&PromptTemplate::None, None));
        let raw = Generator::new(&m, &tok, &PromptTemplate::raw()).expect("generator");
        assert!(raw.note().is_some_and(|n| n.contains("\"none\"")), "{:?}", raw.note());
        assert_eq!(raw.encode(&["Q".into()]).expect("encode").1, vec![format!("Q\n{BOXED_SUFFIX}")]);
    }
}
