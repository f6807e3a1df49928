//! Where a run's prompts come from: the training set in epoch order (the sampler's
//! position is part of every checkpoint), the held-out set, the tokenizer and the
//! prompt template resolved against the model folder. Depends on `data`, `rollout` (the
//! generator it hands out), `model` and `dist` (each rank's share of the prompts).

use std::ops::Range;

use crate::data::{Dataset, EpochSampler, Example, Prompter, SamplerState, Tokenizer};
use crate::dist::{self, Comm};
use crate::model::Qwen3;
use crate::rollout::Generator;
use crate::train::RunConfig;
use crate::{Error, Result};

/// Training and held-out problems, their order, and how they become prompts.
pub struct PromptSource {
    tokenizer: Tokenizer,
    /// `cfg.data.template` resolved against the model folder.
    prompter: Prompter,
    train: Dataset,
    test: Option<Dataset>,
    sampler: EpochSampler,
}

impl PromptSource {
    /// Loads the tokenizer of `cfg.model.path` and the data files of `cfg`; the sampler starts
    /// a new epoch order from `cfg.seed` or continues from `resumed`. Returns the notes
    /// to report with the first step (data lines skipped, how the template was chosen).
    pub fn load(cfg: &RunConfig, resumed: Option<SamplerState>) -> Result<(Self, Vec<String>)> {
        let tokenizer = Tokenizer::from_file(cfg.model.path.join("tokenizer.json"))?;
        let prompter = tokenizer.prompter(&cfg.data.template)?;
        let (train, mut notes) = Dataset::load(&cfg.data.train, &cfg.data.options)?;
        notes.extend(prompter.note().map(str::to_string));
        let test = match &cfg.data.test {
            Some(p) => Some(Dataset::load(p, &cfg.data.options)?.0),
            None => None,
        };
        let sampler = match resumed {
            Some(s) => EpochSampler::restore(s, train.len())?,
            None => EpochSampler::new(train.len(), cfg.seed)?,
        };
        Ok((Self { tokenizer, prompter, train, test, sampler }, notes))
    }

    /// The tokenizer prompts are encoded with.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Where the epoch order stands (saved with a checkpoint).
    pub fn sampler_state(&self) -> SamplerState {
        self.sampler.state()
    }

    /// Puts the epoch order back where `state` says (a step that failed gives back the
    /// prompts it drew).
    pub fn restore_sampler(&mut self, state: SamplerState) -> Result<()> {
        self.sampler = EpochSampler::restore(state, self.train.len())?;
        Ok(())
    }

    /// Checks, when the run starts, that every prompt of the training set fits the model's
    /// positions with `train_max_new` response tokens (and every held-out prompt with
    /// `eval_max_new`): a prompt that does not is an error naming its `file:line`, not a
    /// failed rollout steps later.
    pub fn check_lengths(&self, model: &Qwen3, train_max_new: usize, eval_max_new: usize) -> Result<()> {
        let positions = model.config().max_position_embeddings;
        let gen = self.generator(model);
        let sets = [
            ("data.train", Some(&self.train), train_max_new),
            ("data.test", self.test.as_ref(), eval_max_new),
        ];
        for (what, set, max_new) in sets {
            let Some(set) = set else { continue };
            for (i, e) in set.examples().iter().enumerate() {
                let (ids, _) = gen.encode(std::slice::from_ref(&e.prompt()))?;
                let len = ids[0].len();
                if len + max_new > positions {
                    let (key, fix) = if what == "data.train" {
                        ("rollout.sampling.max_tokens", "lower it, shorten or drop the prompt")
                    } else {
                        ("evaluation.sampling.max_tokens", "lower it, shorten or drop the prompt")
                    };
                    return Err(Error::invalid(format!(
                        "{}: the prompt ({what}) is {len} tokens; with {key} = {max_new} it needs {} \
                         positions, more than the model's max_position_embeddings ({positions}): {fix}",
                        set.place(i),
                        len + max_new
                    )));
                }
            }
        }
        Ok(())
    }

    /// A generator sampling from `model` with this run's prompt template.
    pub fn generator<'a>(&'a self, model: &'a Qwen3) -> Generator<'a> {
        Generator::with_prompter(model, &self.tokenizer, self.prompter.clone())
    }

    /// The next `n` problems of the global batch (the same on every rank) and this rank's
    /// contiguous share of them, so that a GRPO group stays on one rank; returns the share's
    /// problems and its range in the global batch.
    pub fn next_share(&mut self, n: usize, comm: &dyn Comm) -> Result<(Vec<Example>, Range<usize>)> {
        let idx = self.sampler.next_batch(n)?;
        let share = dist::shard(idx.len(), comm.rank(), comm.size());
        let examples = self.train.select(&idx[share.clone()])?.into_iter().cloned().collect();
        Ok((examples, share))
    }

    /// Whether the run has held-out problems.
    pub fn has_test(&self) -> bool {
        self.test.is_some()
    }

    /// The first `limit` held-out problems (all when `None`).
    pub fn test_examples(&self, limit: Option<usize>) -> Result<Vec<Example>> {
        let t = self.test.as_ref().ok_or_else(|| Error::invalid("evaluate: the run has no test_data"))?;
        let n = limit.unwrap_or(t.len()).min(t.len());
        Ok(t.examples()[..n].to_vec())
    }
}
