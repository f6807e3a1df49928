//! Sampling flags shared by the commands that sample (`stapo eval`, `stapo generate`):
//! the temperature and the filters of `SamplingParams`, under its names and with its
//! defaults (a command may set its own default with clap's `mut_arg`).

use clap::Args;
use stapo::rollout::SamplingParams;

/// `--temperature`, `--top-p`, `--top-k`, `--min-p`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Softmax temperature; 0 means greedy.
    #[arg(long, default_value_t = SamplingParams::default().temperature)]
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability
    /// sums to at least top_p (1 = off).
    #[arg(long, default_value_t = SamplingParams::default().top_p)]
    pub top_p: f64,
    /// Keep only the k most likely tokens (default: off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Min-p: keep tokens with probability >= min_p x the top token's (0 = off).
    #[arg(long, default_value_t = SamplingParams::default().min_p)]
    pub min_p: f64,
}

impl SamplingArgs {
    /// `params` with these flags' temperature and filters.
    pub fn apply(&self, params: SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            ..params
        }
    }
}
