//! The Hugging Face tokenizer (`tokenizer.json`) behind a small, error-typed
//! API, with the Qwen3 special ids the rollout and training code need
//! (end-of-sequence set, padding id), and the prompt format its model folder
//! declares (read from `tokenizer_config.json` next to `tokenizer.json`, see
//! [`crate::data::template`]).
//!
//! Ids match `transformers`' `AutoTokenizer` for the Qwen3 tokenizer (checked in
//! the tests against `host/tests/fixtures/chat/qwen3_chat.json`). Note that
//! [`Tokenizer::vocab_size`] counts tokenizer entries (151,669 for Qwen3), which
//! is smaller than a Qwen3 model's padded embedding table (151,936 rows).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::data::template::{ModelPrompt, PromptTemplate, Prompter};
use crate::{Error, Result};

/// Qwen3's end-of-turn token.
pub const IM_END: &str = "<|im_end|>";
/// Qwen3's end-of-text token, also its padding token.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// A loaded tokenizer plus its special ids.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    eos: Vec<u32>,
    pad: u32,
    prompt: Arc<ModelPrompt>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` and the prompt format of its folder
    /// (`tokenizer_config.json`, `chat_template.jinja`). Errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        // Report a missing file as an I/O error with its path, not as a parse failure.
        std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: cannot load tokenizer: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let prompt = ModelPrompt::load(dir)?;
        Ok(Self { prompt: Arc::new(prompt), ..Self::from_inner(inner, path.to_path_buf()) })
    }

    /// Wraps an already-built `tokenizers::Tokenizer`; `label` names it in
    /// errors. It belongs to no folder, so it declares no prompt format.
    pub fn from_inner(inner: tokenizers::Tokenizer, label: impl Into<PathBuf>) -> Self {
        let eos: Vec<u32> = [IM_END, END_OF_TEXT].iter().filter_map(|t| inner.token_to_id(t)).collect();
        let pad = inner.token_to_id(END_OF_TEXT).unwrap_or(0);
        Tokenizer { inner, path: label.into(), eos, pad, prompt: Arc::new(ModelPrompt::undeclared()) }
    }

    /// The prompt format the tokenizer's model folder declares.
    pub fn model_prompt(&self) -> &ModelPrompt {
        &self.prompt
    }

    /// `template` resolved against the folder's declaration (`"model"` becomes
    /// the folder's own format); see [`Prompter::note`] for a forced template.
    pub fn prompter(&self, template: &PromptTemplate) -> Result<Prompter> {
        template.resolve(&self.prompt)
    }

    /// Where the tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapped `tokenizers` object, for anything this API does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`. Special-token strings in the text (`<|im_start|>`,
    /// `<think>`) become their single ids. `add_special` runs the tokenizer's
    /// post-processor (for Qwen3 it adds nothing; chat markup comes from
    /// the chat template, [`crate::data::Prompter`]).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special).map_err(|e| {
            Error::Tokenizer(format!(
                "{}: cannot encode {} bytes of text: {e}",
                self.path.display(),
                text.len()
            ))
        })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special` drops special tokens such as `<|im_end|>`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| {
            Error::Tokenizer(format!("{}: cannot decode {} ids: {e}", self.path.display(), ids.len()))
        })
    }

    /// A readable form of one token for token tables: its decoded text, or the
    /// raw vocabulary piece (e.g. `Ġthe`, `âĢ`) when the token alone is not
    /// valid UTF-8, or `<unk:ID>` for an id outside the vocabulary.
    pub fn token_str(&self, id: u32) -> String {
        match self.inner.decode(&[id], false) {
            Ok(s) if !s.is_empty() && !s.contains('\u{FFFD}') => s,
            _ => self.inner.id_to_token(id).unwrap_or_else(|| format!("<unk:{id}>")),
        }
    }

    /// The id of a token string (vocabulary piece or added token), if any.
    pub fn id_of(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of tokens including added/special tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids that end a sequence: `<|im_end|>` and `<|endoftext|>`, those present, in that order.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// The padding id: `<|endoftext|>` when present, else 0.
    pub fn pad_id(&self) -> u32 {
        self.pad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_support::{chat_fixture, repo_root};

    fn qwen3() -> Tokenizer {
        Tokenizer::from_file(repo_root().join("models/qwen3-tokenizer/tokenizer.json"))
            .expect("tokenizer loads")
    }

    #[test]
    fn special_ids_and_vocab_match_hugging_face() {
        let tok = qwen3();
        let fx = chat_fixture();
        for (name, id) in fx["special"].as_object().expect("special map") {
            assert_eq!(tok.id_of(name).map(u64::from), id.as_u64(), "{name}");
        }
        assert_eq!(Some(tok.vocab_size() as u64), fx["vocab_size"].as_u64());
        assert_eq!(tok.vocab_size(), 151_669);
        assert_eq!(tok.eos_ids(), &[151_645, 151_643]);
        assert_eq!(tok.pad_id(), 151_643);
        assert_eq!(tok.id_of("definitely not a token"), None);
    }

    #[test]
    fn encode_and_decode_match_hugging_face() {
        let tok = qwen3();
        let fx = chat_fixture();
        for c in fx["encode"].as_array().expect("encode cases") {
            let text = c["text"].as_str().expect("text");
            let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).expect("ids");
            assert_eq!(tok.encode(text, true).expect("encode"), want, "{text:?}");
            assert_eq!(tok.encode(text, false).expect("encode"), want, "{text:?} (no specials)");
            assert_eq!(tok.decode(&want, false).expect("decode"), text);
            assert_eq!(
                tok.decode(&want, true).expect("decode"),
                c["decoded_skip_special"].as_str().expect("decoded"),
                "{text:?}"
            );
        }
    }

    #[test]
    fn token_str_is_readable() {
        let tok = qwen3();
        assert_eq!(tok.token_str(151_667), "<think>");
        assert_eq!(tok.token_str(151_645), "<|im_end|>");
        let hello = tok.encode(" hello", false).expect("encode");
        assert_eq!(hello.len(), 1);
        assert_eq!(tok.token_str(hello[0]), " hello");
        // A lone byte of a multi-byte character is not valid UTF-8: show the raw piece.
        let rocket = tok.encode("🚀", false).expect("encode");
        if rocket.len() > 1 {
            let s = tok.token_str(rocket[0]);
            assert!(!s.is_empty() && !s.contains('\u{FFFD}'), "{s:?}");
        }
        assert_eq!(tok.token_str(u32::MAX), format!("<unk:{}>", u32::MAX));
    }

    #[test]
    fn missing_file_error_names_the_path() {
        let err = Tokenizer::from_file("/nonexistent/dir/tokenizer.json").expect_err("must fail");
        assert!(err.to_string().contains("/nonexistent/dir/tokenizer.json"), "{err}");
        let bad = std::env::temp_dir().join(format!("stapo-bad-tokenizer-{}.json", std::process::id()));
        std::fs::write(&bad, "{not json").expect("write temp");
        let err = Tokenizer::from_file(&bad).expect_err("must fail");
        assert!(err.to_string().contains(&bad.display().to_string()), "{err}");
        let _ = std::fs::remove_file(&bad);
    }
}
