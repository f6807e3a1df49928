//! Data: the tokenizer, prompt templates (Jinja chat templates), task
//! datasets (JSONL and Parquet, verl's schema included) and the seeded,
//! resumable epoch sampler.
//!
//! - [`tokenizer`]: Hugging Face `tokenizer.json` with Qwen3's special ids and
//!   the prompt format its folder declares.
//! - [`template`]: Hugging Face chat templates rendered with minijinja, the
//!   prompt-template option (`"model"`, `"none"`, `"raw"`, `"chat"` or a map)
//!   and prompts as plain problems or chat-message lists.
//! - [`dataset`]: loading JSONL and Parquet files, folders of Hugging Face
//!   shards and `*` patterns, with a bad-record policy.
//! - [`record`]: one record to an [`Example`]: field names (dotted paths),
//!   verl's `prompt` chat messages, DAPO-Math's instruction wrapper.
//! - [`parquet`]: Parquet rows as JSON objects, with schema checks.
//! - [`sampler`]: the epoch sampler whose state goes into checkpoints.
//! - [`task`]: the generated multi-step arithmetic task and its small BPE
//!   tokenizer (for `data/arith` and `models/tiny-qwen3`).
//! - [`long_task`]: the long-answer task (long multiplication and division,
//!   Euclid, word problems; worked solutions of 150-600 tokens, `data/long`).

pub mod dataset;
pub mod long_task;
pub mod parquet;
pub mod record;
pub mod sampler;
pub mod task;
pub mod template;
pub mod tokenizer;

pub use dataset::{resolve_files, Dataset};
pub use long_task::{generate_long, generate_long_split, LongTaskConfig, LONG_KINDS};
pub use record::{
    strip_dapo_instruction, BadLinePolicy, DatasetOptions, Example, DAPO_PREFIX, DAPO_REMINDER,
};
pub use sampler::{EpochSampler, SamplerState};
pub use task::{
    generate, generate_split, read_jsonl, save_tokenizer, tokenizer_corpus, train_tokenizer, write_jsonl,
    Problem, TaskConfig, TokenizerConfig,
};
pub use template::{
    templates_help, ChatTemplate, Message, ModelPrompt, Prompt, PromptTemplate, Prompter, TemplateName,
    BOXED_SUFFIX, SUFFIX_SEPARATOR, TEMPLATES,
};
pub use tokenizer::Tokenizer;

/// Shared helpers for this module's unit tests.
#[cfg(test)]
pub(crate) mod test_support {
    use std::path::PathBuf;

    /// The repository root: `CARGO_MANIFEST_DIR/..` in the real crate, else
    /// `/work/main` (when compiled from a scratch crate elsewhere).
    pub fn repo_root() -> PathBuf {
        let up = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        if up.join("models/qwen3-tokenizer").is_dir() {
            up
        } else {
            PathBuf::from("/work/main")
        }
    }

    /// The Hugging Face reference renderings (made with `transformers`).
    pub fn chat_fixture() -> serde_json::Value {
        let p = repo_root().join("host/tests/fixtures/chat/qwen3_chat.json");
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }
}
