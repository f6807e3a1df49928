//! Qwen3 chat prompts, rendered byte for byte as the Jinja `chat_template` in
//! `models/qwen3-tokenizer/tokenizer_config.json` renders them (Hugging Face
//! `apply_chat_template`), for text messages without tool definitions.
//!
//! The template's quirks reproduced here:
//! - a leading `system` message becomes the system turn; a later one is an
//!   ordinary `system` turn;
//! - the "last query" is the last `user` message whose content is not a
//!   `<tool_response>…</tool_response>` wrapper; assistant turns *before* it lose
//!   their `<think>…</think>` reasoning, assistant turns *after* it keep it
//!   (the last assistant turn always gets a `<think>` block, possibly empty);
//! - consecutive `tool` messages are folded into one `user` turn of
//!   `<tool_response>` blocks;
//! - `enable_thinking = false` appends an empty `<think>\n\n</think>\n\n` after
//!   the generation prompt, which is how Qwen3 is told not to reason.
//!
//! Also the prompt templates that turn a dataset problem into model input
//! ([`PromptTemplate`]), with the STAPO/DAPO instruction suffix
//! "Please reason step by step, and put your final answer within \boxed{}.".
//! The tests compare every rendering with strings and token ids produced by
//! `transformers` (fixture `host/tests/fixtures/chat/qwen3_chat.json`).

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// The instruction the STAPO paper (and DAPO) appends to every math problem.
pub const BOXED_SUFFIX: &str = "Please reason step by step, and put your final answer within \\boxed{}.";

/// What goes between the problem text and the suffix: one newline.
pub const SUFFIX_SEPARATOR: &str = "\n";

/// One chat message. `role` is `system`, `user`, `assistant` or `tool`; other
/// roles are skipped, as the Qwen3 template skips them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks: `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text. Assistant text may contain `<think>…</think>` reasoning.
    pub content: String,
}

impl Message {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message { role: role.into(), content: content.into() }
    }
    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

/// True for a user message that only wraps a tool result (not a real query).
fn is_tool_response(content: &str) -> bool {
    content.starts_with("<tool_response>") && content.ends_with("</tool_response>")
}

/// Splits assistant text into (reasoning, answer) the way the template does:
/// answer = text after the last `</think>`, leading newlines removed;
/// reasoning = text before the first `</think>`, after the last `<think>` in
/// it, with newlines trimmed at the outer ends. Without `</think>`, reasoning
/// is empty and the text is returned unchanged.
fn split_reasoning(text: &str) -> (&str, &str) {
    if !text.contains("</think>") {
        return ("", text);
    }
    // Python's `s.split('</think>')[-1]` / `[0]`.
    let after_last = text.rsplit("</think>").next().unwrap_or("");
    let before_first = text.split("</think>").next().unwrap_or("");
    let answer = after_last.trim_start_matches('\n');
    let reasoning =
        before_first.trim_end_matches('\n').rsplit("<think>").next().unwrap_or("").trim_start_matches('\n');
    (reasoning, answer)
}

/// Renders `messages` exactly as Qwen3's chat template does (no tools).
///
/// `add_generation_prompt` appends `<|im_start|>assistant\n`; with
/// `enable_thinking == false` it is followed by the empty think block
/// `<think>\n\n</think>\n\n`. `enable_thinking == true` matches the template's
/// default (the variable left undefined).
///
/// ```ignore
/// let s = render_chat(&[Message::user("2+2?")], true, true);
/// assert_eq!(s, "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
/// ```
pub fn render_chat(messages: &[Message], add_generation_prompt: bool, enable_thinking: bool) -> String {
    let mut out = String::new();
    if let Some(first) = messages.first() {
        if first.role == "system" {
            out.push_str(&format!("{IM_START}system\n{}{IM_END}\n", first.content));
        }
    }

    // Index of the last real user query; the template's default is len - 1.
    let last_query: isize = messages
        .iter()
        .rposition(|m| m.role == "user" && !is_tool_response(&m.content))
        .map_or(messages.len() as isize - 1, |i| i as isize);

    for (i, m) in messages.iter().enumerate() {
        let is_last = i + 1 == messages.len();
        match m.role.as_str() {
            "user" => push_turn(&mut out, "user", &m.content),
            "system" if i > 0 => push_turn(&mut out, "system", &m.content),
            "assistant" => {
                let (reasoning, answer) = split_reasoning(&m.content);
                out.push_str(IM_START);
                out.push_str("assistant\n");
                if (i as isize) > last_query && (is_last || !reasoning.is_empty()) {
                    out.push_str("<think>\n");
                    out.push_str(reasoning.trim_matches('\n'));
                    out.push_str("\n</think>\n\n");
                    out.push_str(answer.trim_start_matches('\n'));
                } else {
                    out.push_str(answer);
                }
                out.push_str(IM_END);
                out.push('\n');
            }
            "tool" => {
                let prev_is_tool = i > 0 && messages[i - 1].role == "tool";
                if !prev_is_tool {
                    out.push_str(IM_START);
                    out.push_str("user");
                }
                out.push_str("\n<tool_response>\n");
                out.push_str(&m.content);
                out.push_str("\n</tool_response>");
                let next_is_tool = messages.get(i + 1).is_some_and(|n| n.role == "tool");
                if is_last || !next_is_tool {
                    out.push_str(IM_END);
                    out.push('\n');
                }
            }
            // A leading system message was rendered above; unknown roles are
            // skipped by the template.
            _ => {}
        }
    }

    if add_generation_prompt {
        out.push_str(IM_START);
        out.push_str("assistant\n");
        if !enable_thinking {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
    out
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END);
    out.push('\n');
}

fn default_suffix() -> String {
    BOXED_SUFFIX.to_string()
}

/// How a dataset problem becomes the prompt text given to the model.
///
/// Both variants build the same user text: `problem`, then
/// [`SUFFIX_SEPARATOR`] (one newline), then the suffix; an empty or absent
/// suffix leaves the problem alone (no separator).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PromptTemplate {
    /// Plain text, no chat markup: for base models and tiny test models.
    Raw {
        /// Appended after the separator; defaults to [`BOXED_SUFFIX`].
        #[serde(default = "default_suffix")]
        suffix: String,
    },
    /// A Qwen3 chat prompt: optional system turn, the user turn, and the
    /// generation prompt (with the empty think block when thinking is off).
    Chat {
        /// The system message, if any.
        #[serde(default)]
        system: Option<String>,
        /// Appended to the problem inside the user turn (`None`: nothing).
        #[serde(default = "default_chat_suffix")]
        suffix: Option<String>,
        /// `false` renders `<think>\n\n</think>\n\n` after the generation prompt.
        #[serde(default = "default_true")]
        enable_thinking: bool,
    },
}

fn default_chat_suffix() -> Option<String> {
    Some(BOXED_SUFFIX.to_string())
}

fn default_true() -> bool {
    true
}

impl Default for PromptTemplate {
    /// `Raw` with the paper's suffix.
    fn default() -> Self {
        PromptTemplate::raw()
    }
}

impl PromptTemplate {
    /// `Raw` with the paper's suffix ([`BOXED_SUFFIX`]).
    pub fn raw() -> Self {
        PromptTemplate::Raw { suffix: BOXED_SUFFIX.to_string() }
    }

    /// A template by name: `raw` (problem + the paper's suffix), `bare` (the
    /// problem only, as models/tiny-qwen3 expects), `chat`, `chat-think`; `none`
    /// gives `None` (callers use their default).
    pub fn from_name(name: &str) -> Result<Option<Self>> {
        Ok(match name {
            "raw" => Some(PromptTemplate::raw()),
            "bare" => Some(PromptTemplate::Raw { suffix: String::new() }),
            "chat" => Some(PromptTemplate::chat(false)),
            "chat-think" | "chat_think" => Some(PromptTemplate::chat(true)),
            "none" => None,
            other => {
                return Err(Error::invalid(format!(
                    "template: expected raw, bare, chat, chat-think or none, found {other:?}"
                )))
            }
        })
    }

    /// `Chat` with no system message, the paper's suffix, and the given thinking mode.
    pub fn chat(enable_thinking: bool) -> Self {
        PromptTemplate::Chat { system: None, suffix: Some(BOXED_SUFFIX.to_string()), enable_thinking }
    }

    /// The user text: problem, separator, suffix (separator only if the suffix is non-empty).
    fn user_text(problem: &str, suffix: Option<&str>) -> String {
        match suffix {
            Some(s) if !s.is_empty() => format!("{problem}{SUFFIX_SEPARATOR}{s}"),
            _ => problem.to_string(),
        }
    }

    /// Renders the prompt for one problem.
    ///
    /// ```ignore
    /// let p = PromptTemplate::raw().render("1+1?");
    /// assert_eq!(p, "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.");
    /// ```
    pub fn render(&self, problem: &str) -> String {
        match self {
            PromptTemplate::Raw { suffix } => Self::user_text(problem, Some(suffix)),
            PromptTemplate::Chat { system, suffix, enable_thinking } => {
                let mut msgs = Vec::with_capacity(2);
                if let Some(s) = system {
                    msgs.push(Message::system(s.clone()));
                }
                msgs.push(Message::user(Self::user_text(problem, suffix.as_deref())));
                render_chat(&msgs, true, *enable_thinking)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_support::{chat_fixture, repo_root};
    use crate::data::Tokenizer;

    #[test]
    fn renders_every_fixture_conversation_like_hugging_face() {
        let fx = chat_fixture();
        let cases = fx["chat"].as_array().expect("fixture has chat cases");
        assert!(cases.len() >= 6);
        for c in cases {
            let name = c["name"].as_str().expect("name");
            let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).expect("messages");
            let gen = c["add_generation_prompt"].as_bool().expect("flag");
            let think = c["enable_thinking"].as_bool().expect("flag");
            let got = render_chat(&msgs, gen, think);
            assert_eq!(got, c["text"].as_str().expect("text"), "case {name}");
        }
    }

    #[test]
    fn rendered_fixture_conversations_tokenize_to_hugging_face_ids() {
        let tok = Tokenizer::from_file(repo_root().join("models/qwen3-tokenizer/tokenizer.json"))
            .expect("tokenizer loads");
        let fx = chat_fixture();
        for c in fx["chat"].as_array().expect("cases") {
            let name = c["name"].as_str().expect("name");
            let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).expect("messages");
            let text = render_chat(
                &msgs,
                c["add_generation_prompt"].as_bool().expect("flag"),
                c["enable_thinking"].as_bool().expect("flag"),
            );
            let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).expect("ids");
            assert_eq!(tok.encode(&text, false).expect("encode"), want, "case {name}");
            // Chat markup round-trips when special tokens are kept.
            assert_eq!(tok.decode(&want, false).expect("decode"), text, "case {name}");
        }
    }

    #[test]
    fn reasoning_split_follows_python_split_semantics() {
        assert_eq!(split_reasoning("no think here"), ("", "no think here"));
        assert_eq!(split_reasoning("<think>\nr\n</think>\n\nans"), ("r", "ans"));
        assert_eq!(split_reasoning("a <think>x</think> b <think>y</think>\nc"), ("x", "c"));
        assert_eq!(split_reasoning("</think>only answer"), ("", "only answer"));
    }

    #[test]
    fn thinking_off_adds_empty_think_block_only_with_generation_prompt() {
        let m = [Message::user("hi")];
        assert_eq!(
            render_chat(&m, true, false),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        assert_eq!(render_chat(&m, false, false), "<|im_start|>user\nhi<|im_end|>\n");
        assert_eq!(render_chat(&[], true, true), "<|im_start|>assistant\n");
    }

    #[test]
    fn prompt_templates_render_problem_separator_suffix() {
        let raw = PromptTemplate::raw().render("What is 1+1?");
        assert_eq!(raw, format!("What is 1+1?\n{BOXED_SUFFIX}"));
        assert!(raw.ends_with("within \\boxed{}."));
        let bare = PromptTemplate::Raw { suffix: String::new() }.render("Q");
        assert_eq!(bare, "Q");

        let chat = PromptTemplate::Chat { system: Some("S".into()), suffix: None, enable_thinking: false };
        assert_eq!(
            chat.render("Q"),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        // The fixture's user_only_no_thinking case is the chat template with the paper's suffix.
        let fx = chat_fixture();
        let case = fx["chat"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == "user_only_no_thinking"))
            .expect("case present");
        assert_eq!(
            PromptTemplate::chat(false).render("Compute 17 * 23."),
            case["text"].as_str().expect("text")
        );
    }

    #[test]
    fn prompt_template_serde_defaults() {
        let t: PromptTemplate = serde_json::from_str(r#"{"kind":"raw"}"#).expect("raw");
        assert_eq!(t, PromptTemplate::raw());
        let t: PromptTemplate =
            serde_json::from_str(r#"{"kind":"chat","enable_thinking":false}"#).expect("chat");
        assert_eq!(t, PromptTemplate::chat(false));
        let back: PromptTemplate =
            serde_json::from_str(&serde_json::to_string(&t).expect("ser")).expect("de");
        assert_eq!(back, t);
    }
}
