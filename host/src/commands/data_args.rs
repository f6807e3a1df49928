//! Dataset flags shared by the commands that read task files: which columns
//! hold the problem, answer and id, and which split of a shard folder to load.

use clap::Args;
use stapo::data::{BadLinePolicy, DatasetOptions};

/// How to read `--data` files (JSONL, Parquet, folders of shards).
#[derive(Args, Debug, Clone, Default)]
pub struct DataArgs {
    /// Field(s) holding the problem, tried in order (comma-separated; dotted names reach into
    /// structs). Default: problem, question, prompt (verl's chat-message list).
    #[arg(long, value_name = "NAMES")]
    pub problem_field: Option<String>,
    /// Field(s) holding the reference answer. Default: answer, final_answer,
    /// reward_model.ground_truth, solution.
    #[arg(long, value_name = "NAMES")]
    pub answer_field: Option<String>,
    /// Field(s) holding the id. Default: id, extra_info.index.
    #[arg(long, value_name = "NAMES")]
    pub id_field: Option<String>,
    /// With a folder of Hugging Face shards: the split to load (train, test, ...).
    #[arg(long)]
    pub split: Option<String>,
    /// Remove DAPO-Math's "Answer:" instruction around each problem.
    #[arg(long)]
    pub strip_instruction: bool,
    /// Stop at the first bad record instead of skipping it with a warning.
    #[arg(long)]
    pub reject_bad: bool,
}

fn names(s: &str) -> Vec<String> {
    s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect()
}

impl DataArgs {
    /// The dataset options these flags give (defaults for flags not given).
    pub fn options(&self) -> DatasetOptions {
        let mut o = DatasetOptions::default();
        if let Some(s) = &self.problem_field {
            o.problem_fields = names(s);
        }
        if let Some(s) = &self.answer_field {
            o.answer_fields = names(s);
        }
        if let Some(s) = &self.id_field {
            o.id_fields = names(s);
        }
        o.split = self.split.clone();
        o.strip_instruction = self.strip_instruction;
        if self.reject_bad {
            o.bad_lines = BadLinePolicy::Reject;
        }
        o
    }
}
