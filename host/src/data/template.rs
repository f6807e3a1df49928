//! Prompt templates: how a dataset problem becomes the text given to a model.
//!
//! - [`ChatTemplate`]: a Hugging Face Jinja `chat_template`, rendered with
//!   minijinja the way `transformers`' `apply_chat_template` renders it
//!   (`trim_blocks`, `lstrip_blocks`, the special tokens and `raise_exception`
//!   in scope, Python's `json.dumps` as `tojson`, and the Python string and
//!   dict methods templates call, from `minijinja-contrib`'s pycompat).
//! - [`PromptTemplate`]: the user's choice, spelled the same in every entry
//!   point: a name (`"model"`, `"none"`, `"raw"`, `"chat"`, `"chat-think"`)
//!   or a map (`{"kind": "raw", "suffix": ""}`).
//! - [`ModelPrompt`]: what a model folder declares. `tokenizer_config.json`
//!   may say `"stapo_template": <template>` (models/tiny-qwen3 says `"none"`:
//!   it was trained on the bare problem); otherwise a folder with a
//!   `chat_template` (or `chat_template.jinja`) takes chat prompts, and one
//!   with neither takes raw text with the paper's instruction.
//! - [`Prompter`]: a template resolved against a folder, ready to render
//!   [`Prompt`]s (a plain problem or a list of chat messages, as verl's
//!   datasets carry them).
//!
//! The tests compare renderings with strings and token ids produced by
//! `transformers` (fixtures under `host/tests/fixtures/chat/`).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The instruction the STAPO paper (and DAPO) appends to every math problem.
pub const BOXED_SUFFIX: &str = "Please reason step by step, and put your final answer within \\boxed{}.";

/// What goes between the problem text and the suffix: one newline.
pub const SUFFIX_SEPARATOR: &str = "\n";

/// The field of `tokenizer_config.json` in which a model folder declares its
/// prompt template (any spelling [`PromptTemplate`] accepts).
pub const DECLARATION_FIELD: &str = "stapo_template";

/// Qwen3's chat template (from `models/qwen3-tokenizer/tokenizer_config.json`),
/// used by `"chat"` when a model folder has no `chat_template` of its own.
pub const QWEN3_CHAT_TEMPLATE: &str = include_str!("qwen3_chat_template.jinja");

/// One chat message. `role` is `system`, `user`, `assistant` or `tool`.
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

/// A problem as a dataset gives it: plain text (`"problem": "..."`) or a
/// list of chat messages (verl's `"prompt": [{"role": "user", ...}]`).
/// In JSON it is either a string or an array of `{role, content}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A problem statement; templates add the instruction and chat markup.
    Text(String),
    /// A conversation that already carries its instructions; chat templates
    /// render it as given (no suffix, no extra system turn if it has one).
    Messages(Vec<Message>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Prompt::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Prompt::Text(s)
    }
}

impl From<Vec<Message>> for Prompt {
    fn from(m: Vec<Message>) -> Self {
        Prompt::Messages(m)
    }
}

impl Prompt {
    /// The text of the prompt without markup: the problem, or the message
    /// contents joined by newlines.
    pub fn plain_text(&self) -> String {
        match self {
            Prompt::Text(t) => t.clone(),
            Prompt::Messages(ms) => ms.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"),
        }
    }
}

// ---------------------------------------------------------------------------
// Jinja chat templates
// ---------------------------------------------------------------------------

/// A compiled Hugging Face chat template plus the special tokens it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from, for error messages.
    origin: String,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as tokenizer_config.json gives them.
    special: BTreeMap<String, String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).field("special", &self.special).finish()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`. `origin` names it in errors (e.g.
    /// `models/x/tokenizer_config.json`); `special` holds the special-token
    /// strings (`bos_token`, ...) the template sees as variables.
    pub fn new(source: &str, origin: impl Into<String>, special: BTreeMap<String, String>) -> Result<Self> {
        let origin = origin.into();
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&origin, &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| template_error(&origin, &e))?;
        Ok(Self { env, origin, special })
    }

    /// Qwen3's template ([`QWEN3_CHAT_TEMPLATE`]) with Qwen3's special tokens.
    pub fn qwen3() -> Self {
        let special = BTreeMap::from([
            ("eos_token".to_string(), "<|im_end|>".to_string()),
            ("pad_token".to_string(), "<|endoftext|>".to_string()),
        ]);
        Self::new(QWEN3_CHAT_TEMPLATE, "the built-in Qwen3 chat template", special)
            .expect("the built-in Qwen3 template compiles (tested)")
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=..., **vars)` does. `vars` are extra template
    /// variables (e.g. `enable_thinking`); a variable left out is undefined
    /// to the template, as in Python.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &[(&str, serde_json::Value)],
    ) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        ctx.insert("messages".into(), Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        for (k, v) in vars {
            ctx.insert(k.to_string(), Value::from(Serde(v)));
        }
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_error(&self.origin, &e))?;
        tmpl.render(Value::from_object(ctx)).map_err(|e| template_error(&self.origin, &e))
    }
}

fn template_error(origin: &str, e: &minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    Error::Config { file: origin.to_string(), field: "chat_template".into(), msg }
}

/// `tojson` as transformers defines it: Python's `json.dumps(x,
/// ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`.
fn python_tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    python_dumps(value, &PyJson { indent, item, key, sort_keys: sort_keys.unwrap_or(false) }, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn python_dumps(
    v: &Value,
    f: &PyJson,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind as K;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = f.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number => out.push_str(&v.to_string()),
        K::String => out.push_str(&quote(v.as_str().unwrap_or_default())),
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if f.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, level + 1);
                out.push_str(&quote(&k.to_string()));
                out.push_str(&f.key);
                python_dumps(&v.get_item(k)?, f, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        K::Seq | K::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&f.item);
                }
                newline(out, level + 1);
                python_dumps(x, f, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", v.kind()),
            ))
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The template option
// ---------------------------------------------------------------------------

/// How a problem becomes the prompt text: the one option every entry point
/// (CLI `--template`, script option maps, run configs) takes, as a name or a map.
///
/// | name | map | prompt |
/// |---|---|---|
/// | `"model"` | `{kind: "model"}` | what the model folder declares (the default) |
/// | `"none"` | `{kind: "none"}` | the problem text as is |
/// | `"raw"` | `{kind: "raw", suffix}` | problem, newline, suffix (default: the paper's `\boxed{}` instruction) |
/// | `"chat"` | `{kind: "chat", system, suffix, enable_thinking}` | the model's chat template, thinking off |
/// | `"chat-think"` | `{kind: "chat", enable_thinking: true}` | the same with thinking on |
///
/// An empty suffix leaves the problem alone (no separator either); a chat
/// prompt's suffix may also be `null`. Chat-message prompts are used as given:
/// `suffix` and `system` apply to plain problems only (a message list keeps
/// its own instructions and gets `system` only if it has no system turn).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PromptTemplate {
    /// Whatever the model folder declares ([`ModelPrompt::default_template`]).
    #[default]
    Model,
    /// The problem text as is.
    None,
    /// Plain text, no chat markup: problem, separator, suffix.
    Raw {
        /// Appended after the separator; empty means nothing (and no separator).
        suffix: String,
    },
    /// The model's chat template: optional system turn, the user turn, and
    /// the generation prompt.
    Chat {
        /// The system message, if any.
        system: Option<String>,
        /// Appended to the problem inside the user turn (`None`: nothing).
        suffix: Option<String>,
        /// Passed to the template as `enable_thinking` (Qwen3: `false` adds
        /// an empty `<think>` block after the generation prompt).
        enable_thinking: bool,
    },
}

/// One named template: what `--template NAME` and `template: "NAME"` select.
pub struct TemplateName {
    /// The name (`chat_think` is accepted for `chat-think`).
    pub name: &'static str,
    /// What it builds, for help texts.
    pub summary: &'static str,
    /// The template itself.
    pub build: fn() -> PromptTemplate,
}

/// The registry of named templates: [`PromptTemplate::from_name`], the error messages and
/// every `--template` help text come from this one table.
pub const TEMPLATES: &[TemplateName] = &[
    TemplateName {
        name: "model",
        summary: "what the model folder declares: its stapo_template, else its chat template, else raw",
        build: || PromptTemplate::Model,
    },
    TemplateName { name: "none", summary: "the problem as is", build: || PromptTemplate::None },
    TemplateName {
        name: "raw",
        summary: "the problem + the boxed-answer instruction",
        build: PromptTemplate::raw,
    },
    TemplateName {
        name: "chat",
        summary: "the model's chat template, thinking off, + the boxed-answer instruction",
        build: || PromptTemplate::chat(false),
    },
    TemplateName {
        name: "chat-think",
        summary: "the chat template with thinking on",
        build: || PromptTemplate::chat(true),
    },
];

/// The template names, quoted and joined for error messages (`"model", ... or "chat-think"`).
fn names() -> String {
    let quoted: Vec<String> = TEMPLATES.iter().map(|t| format!("{:?}", t.name)).collect();
    match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => quoted.join(""),
    }
}

/// `--template`'s help text: every named template with its summary, and the JSON form.
pub fn templates_help() -> String {
    let lines: Vec<String> = TEMPLATES.iter().map(|t| format!("  {:<11} {}", t.name, t.summary)).collect();
    format!(
        "Prompt template, one of:\n{}\nor a JSON map such as '{{\"kind\":\"raw\",\"suffix\":\"\"}}' (docs/data.md)",
        lines.join("\n")
    )
}

impl PromptTemplate {
    /// `Raw` with the paper's suffix ([`BOXED_SUFFIX`]).
    pub fn raw() -> Self {
        PromptTemplate::Raw { suffix: BOXED_SUFFIX.to_string() }
    }

    /// `Chat` with no system message, the paper's suffix, and the given thinking mode.
    pub fn chat(enable_thinking: bool) -> Self {
        PromptTemplate::Chat { system: None, suffix: Some(BOXED_SUFFIX.to_string()), enable_thinking }
    }

    /// A template by name, from [`TEMPLATES`] (`_` accepted for `-`).
    pub fn from_name(name: &str) -> Result<Self> {
        let key = name.replace('_', "-");
        match TEMPLATES.iter().find(|t| t.name == key) {
            Some(t) => Ok((t.build)()),
            None => Err(Error::invalid(format!("template: expected {}, found {name:?}", names()))),
        }
    }

    /// A template from JSON: a name (string) or a map with `kind`. Errors name
    /// the offending key.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        use serde_json::Value as J;
        let m = match v {
            J::String(s) => return Self::from_name(s),
            J::Object(m) => m,
            other => {
                return Err(Error::invalid(format!(
                    "template: expected a name ({}) or a map with `kind`, found {other}",
                    names()
                )))
            }
        };
        let kind = match m.get("kind") {
            Some(J::String(k)) => k.as_str(),
            Some(other) => {
                return Err(Error::invalid(format!("template.kind: expected a string, found {other}")))
            }
            None => return Err(Error::invalid("template: a map needs `kind` (model, none, raw or chat)")),
        };
        let allowed: &[&str] = match kind {
            "model" | "none" => &["kind"],
            "raw" => &["kind", "suffix"],
            "chat" => &["kind", "system", "suffix", "enable_thinking"],
            other => {
                return Err(Error::invalid(format!(
                    "template.kind: expected \"model\", \"none\", \"raw\" or \"chat\", found {other:?}"
                )))
            }
        };
        if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(Error::invalid(format!(
                "template: unknown key `{k}` for kind {kind:?} (allowed: {})",
                allowed.join(", ")
            )));
        }
        let string = |key: &str| -> Result<Option<Option<String>>> {
            match m.get(key) {
                None => Ok(None),
                Some(J::Null) => Ok(Some(None)),
                Some(J::String(s)) => Ok(Some(Some(s.clone()))),
                Some(other) => {
                    Err(Error::invalid(format!("template.{key}: expected a string, found {other}")))
                }
            }
        };
        Ok(match kind {
            "model" => PromptTemplate::Model,
            "none" => PromptTemplate::None,
            "raw" => PromptTemplate::Raw {
                suffix: string("suffix")?.map_or(BOXED_SUFFIX.to_string(), Option::unwrap_or_default),
            },
            _ => PromptTemplate::Chat {
                system: string("system")?.flatten(),
                suffix: string("suffix")?.unwrap_or_else(|| Some(BOXED_SUFFIX.to_string())),
                enable_thinking: match m.get("enable_thinking") {
                    None => false,
                    Some(J::Bool(b)) => *b,
                    Some(other) => {
                        return Err(Error::invalid(format!(
                            "template.enable_thinking: expected true or false, found {other}"
                        )))
                    }
                },
            },
        })
    }

    /// A command-line value: a name, or a JSON map (`'{"kind":"raw","suffix":""}'`).
    pub fn parse_arg(s: &str) -> Result<Self> {
        let t = s.trim();
        if t.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(t)
                .map_err(|e| Error::invalid(format!("template: {s:?} is not a JSON map: {e}")))?;
            Self::from_json(&v)
        } else {
            Self::from_name(t)
        }
    }

    /// The kind's name: `model`, `none`, `raw` or `chat`.
    pub fn kind(&self) -> &'static str {
        match self {
            PromptTemplate::Model => "model",
            PromptTemplate::None => "none",
            PromptTemplate::Raw { .. } => "raw",
            PromptTemplate::Chat { .. } => "chat",
        }
    }

    /// The kind by what it renders: `raw` with an empty suffix is `none`.
    fn effective_kind(&self) -> &'static str {
        match self {
            PromptTemplate::Raw { suffix } if suffix.is_empty() => "none",
            t => t.kind(),
        }
    }

    /// The shortest spelling in JSON (what `Serialize` writes): the name when
    /// the template has one, else the map.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            PromptTemplate::Model => json!("model"),
            PromptTemplate::None => json!("none"),
            PromptTemplate::Raw { suffix } if suffix == BOXED_SUFFIX => json!("raw"),
            PromptTemplate::Raw { suffix } => json!({"kind": "raw", "suffix": suffix}),
            PromptTemplate::Chat { system: None, suffix: Some(s), enable_thinking } if s == BOXED_SUFFIX => {
                json!(if *enable_thinking { "chat-think" } else { "chat" })
            }
            PromptTemplate::Chat { system, suffix, enable_thinking } => {
                json!({"kind": "chat", "system": system, "suffix": suffix, "enable_thinking": enable_thinking})
            }
        }
    }

    /// Resolves `Model` against what a folder declares and builds the renderer.
    pub fn resolve(&self, model: &ModelPrompt) -> Result<Prompter> {
        Prompter::new(self, model)
    }
}

impl fmt::Display for PromptTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_json())
    }
}

impl Serialize for PromptTemplate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl<'de> Deserialize<'de> for PromptTemplate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        PromptTemplate::from_json(&v).map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------
// What a model folder declares
// ---------------------------------------------------------------------------

/// The prompt format a model folder declares, read from its
/// `tokenizer_config.json` (and `chat_template.jinja`, which transformers
/// prefers when present).
#[derive(Debug, Clone, Default)]
pub struct ModelPrompt {
    /// The folder (for notes and errors); empty for in-memory tokenizers.
    dir: PathBuf,
    /// `stapo_template` of tokenizer_config.json.
    declared: Option<PromptTemplate>,
    /// The folder's chat template; `Err` holds why it could not be compiled
    /// (reported when the template is used, so "raw" still works).
    chat: Option<std::result::Result<Arc<ChatTemplate>, String>>,
}

/// A special-token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn special_token(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl ModelPrompt {
    /// A folder that declares nothing (raw text with the paper's instruction).
    pub fn undeclared() -> Self {
        Self::default()
    }

    /// Reads `dir/tokenizer_config.json` and `dir/chat_template.jinja`, both
    /// optional. Errors name the file and field.
    pub fn load(dir: &Path) -> Result<Self> {
        let mut out = ModelPrompt { dir: dir.to_path_buf(), ..Self::default() };
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Map<String, serde_json::Value> = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Parse {
                path: cfg_path.clone(),
                line: e.line(),
                msg: format!("tokenizer_config.json must be a JSON object: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Map::new(),
            Err(e) => return Err(Error::io(&cfg_path, e)),
        };
        let file = cfg_path.display().to_string();
        if let Some(v) = cfg.get(DECLARATION_FIELD) {
            let t = PromptTemplate::from_json(v).map_err(|e| Error::Config {
                file: file.clone(),
                field: DECLARATION_FIELD.into(),
                msg: e.to_string(),
            })?;
            if t == PromptTemplate::Model {
                return Err(Error::Config {
                    file,
                    field: DECLARATION_FIELD.into(),
                    msg: "a folder must declare a concrete template (none, raw or chat), not \"model\""
                        .into(),
                });
            }
            out.declared = Some(t);
        }
        let special: BTreeMap<String, String> = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .iter()
            .filter_map(|k| cfg.get(*k).and_then(special_token).map(|v| (k.to_string(), v)))
            .collect();
        let jinja_path = dir.join("chat_template.jinja");
        let source: Option<(String, String)> = if jinja_path.is_file() {
            let text = std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?;
            Some((text, jinja_path.display().to_string()))
        } else {
            match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some((s.clone(), file.clone())),
                // A list of named templates: transformers uses the one named "default".
                Some(serde_json::Value::Array(named)) => {
                    let default =
                        named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str());
                    match default {
                        Some(s) => Some((s.to_string(), file.clone())),
                        None => {
                            return Err(Error::Config {
                                file,
                                field: "chat_template".into(),
                                msg: "a list of templates needs one named \"default\"".into(),
                            })
                        }
                    }
                }
                Some(other) => {
                    return Err(Error::Config {
                        file,
                        field: "chat_template".into(),
                        msg: format!("expected a string or a list of {{name, template}}, found {other}"),
                    })
                }
            }
        };
        out.chat = source.map(|(src, origin)| {
            ChatTemplate::new(&src, origin, special).map(Arc::new).map_err(|e| e.to_string())
        });
        Ok(out)
    }

    /// The folder this was read from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The folder's own chat template, if it has one (and it compiles).
    pub fn chat_template(&self) -> Option<Result<Arc<ChatTemplate>>> {
        self.chat.as_ref().map(|c| c.clone().map_err(Error::invalid))
    }

    /// What `"model"` means for this folder: its `stapo_template`, else chat
    /// (thinking off, the paper's instruction) when it has a chat template,
    /// else raw text with the paper's instruction.
    pub fn default_template(&self) -> PromptTemplate {
        match (&self.declared, &self.chat) {
            (Some(t), _) => t.clone(),
            (None, Some(_)) => PromptTemplate::chat(false),
            (None, None) => PromptTemplate::raw(),
        }
    }

    /// Where the default comes from, in words (for notes).
    fn default_source(&self) -> String {
        let dir = self.dir.display();
        match (&self.declared, &self.chat) {
            (Some(_), _) => format!("{dir}/tokenizer_config.json `{DECLARATION_FIELD}`"),
            (None, Some(_)) => format!("{dir} has a chat_template"),
            (None, None) => format!("{dir} declares no template"),
        }
    }
}

/// Declares `template` as the prompt format of the model folder `dir`: sets
/// `stapo_template` in `dir/tokenizer_config.json` (created if absent; other
/// fields kept).
pub fn declare(dir: &Path, template: &PromptTemplate) -> Result<()> {
    if *template == PromptTemplate::Model {
        return Err(Error::invalid("declare: a folder must declare a concrete template, not \"model\""));
    }
    let path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Map<String, serde_json::Value> = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Parse {
            path: path.clone(),
            line: e.line(),
            msg: format!("tokenizer_config.json must be a JSON object: {e}"),
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Map::new(),
        Err(e) => return Err(Error::io(&path, e)),
    };
    cfg.insert(DECLARATION_FIELD.into(), template.to_json());
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| Error::invalid(e.to_string()))?;
    crate::files::write_file_atomically(&path, text.as_bytes())
}

// ---------------------------------------------------------------------------
// A template resolved against a folder
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Render {
    Text {
        suffix: String,
    },
    Chat {
        template: Arc<ChatTemplate>,
        system: Option<String>,
        suffix: Option<String>,
        enable_thinking: bool,
    },
}

/// A [`PromptTemplate`] bound to a model folder: renders prompts.
#[derive(Clone, Debug)]
pub struct Prompter {
    template: PromptTemplate,
    render: Render,
    note: Option<String>,
}

/// The user text: problem, separator, suffix (separator only if the suffix is non-empty).
fn with_suffix(problem: &str, suffix: Option<&str>) -> String {
    match suffix {
        Some(s) if !s.is_empty() => format!("{problem}{SUFFIX_SEPARATOR}{s}"),
        _ => problem.to_string(),
    }
}

impl Prompter {
    /// Resolves `template` against `model`. When the user forces a template
    /// other than the folder's declared one (or chat on a folder without a
    /// chat template), [`Prompter::note`] says so.
    pub fn new(template: &PromptTemplate, model: &ModelPrompt) -> Result<Self> {
        let declared = model.default_template();
        let forced = *template != PromptTemplate::Model;
        let concrete = if forced { template.clone() } else { declared.clone() };
        let mut note = None;
        let has_declaration = model.declared.is_some() || model.chat.is_some();
        if forced && has_declaration && concrete.effective_kind() != declared.effective_kind() {
            note = Some(format!(
                "note: the model's prompt template is {declared} ({}); using {concrete} as asked",
                model.default_source()
            ));
        }
        let render = match &concrete {
            PromptTemplate::Model => unreachable!("resolved above: a folder never declares \"model\""),
            PromptTemplate::None => Render::Text { suffix: String::new() },
            PromptTemplate::Raw { suffix } => Render::Text { suffix: suffix.clone() },
            PromptTemplate::Chat { system, suffix, enable_thinking } => {
                let template = match model.chat_template() {
                    Some(t) => t?,
                    None => {
                        let dir = if model.dir.as_os_str().is_empty() {
                            "this tokenizer".to_string()
                        } else {
                            model.dir.display().to_string()
                        };
                        note = Some(format!(
                            "note: {dir} has no chat_template; using the built-in Qwen3 chat template{}",
                            if forced && has_declaration {
                                format!(" (the model's prompt template is {declared})")
                            } else {
                                String::new()
                            }
                        ));
                        Arc::new(ChatTemplate::qwen3())
                    }
                };
                Render::Chat {
                    template,
                    system: system.clone(),
                    suffix: suffix.clone(),
                    enable_thinking: *enable_thinking,
                }
            }
        };
        Ok(Prompter { template: concrete, render, note })
    }

    /// A prompter for a tokenizer that belongs to no folder (`Model` means raw).
    pub fn standalone(template: &PromptTemplate) -> Result<Self> {
        Self::new(template, &ModelPrompt::undeclared())
    }

    /// The concrete template in use (never `Model`).
    pub fn template(&self) -> &PromptTemplate {
        &self.template
    }

    /// A line for the user when the template in use is not the folder's own.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// The prompt text for one problem.
    ///
    /// ```ignore
    /// let p = Prompter::standalone(&PromptTemplate::raw())?.render(&"1+1?".into())?;
    /// assert_eq!(p, "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.");
    /// ```
    pub fn render(&self, prompt: &Prompt) -> Result<String> {
        match (&self.render, prompt) {
            (Render::Text { suffix }, Prompt::Text(p)) => Ok(with_suffix(p, Some(suffix))),
            (Render::Text { .. }, Prompt::Messages(_)) => Ok(prompt.plain_text()),
            (Render::Chat { template, system, suffix, enable_thinking }, _) => {
                let mut msgs = Vec::with_capacity(2);
                let has_system =
                    matches!(prompt, Prompt::Messages(m) if m.first().is_some_and(|m| m.role == "system"));
                if let (Some(s), false) = (system, has_system) {
                    msgs.push(Message::system(s.clone()));
                }
                match prompt {
                    Prompt::Text(p) => msgs.push(Message::user(with_suffix(p, suffix.as_deref()))),
                    Prompt::Messages(m) => msgs.extend(m.iter().cloned()),
                }
                template.render(&msgs, true, &[("enable_thinking", (*enable_thinking).into())])
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
    fn template_names_and_help_come_from_the_registry() {
        let want = [
            ("model", PromptTemplate::Model),
            ("none", PromptTemplate::None),
            ("raw", PromptTemplate::Raw { suffix: BOXED_SUFFIX.to_string() }),
            (
                "chat",
                PromptTemplate::Chat {
                    system: None,
                    suffix: Some(BOXED_SUFFIX.into()),
                    enable_thinking: false,
                },
            ),
            (
                "chat-think",
                PromptTemplate::Chat {
                    system: None,
                    suffix: Some(BOXED_SUFFIX.into()),
                    enable_thinking: true,
                },
            ),
            (
                "chat_think",
                PromptTemplate::Chat {
                    system: None,
                    suffix: Some(BOXED_SUFFIX.into()),
                    enable_thinking: true,
                },
            ),
        ];
        for (name, t) in want {
            assert_eq!(PromptTemplate::from_name(name).expect(name), t, "{name}");
        }
        let help = templates_help();
        let err = PromptTemplate::from_name("bogus").unwrap_err().to_string();
        for t in TEMPLATES {
            assert!(help.contains(t.name) && help.contains(t.summary), "{help}");
            assert!(err.contains(&format!("{:?}", t.name)), "{err}");
        }
        assert!(err.contains(r#""chat" or "chat-think""#), "{err}");
    }

    fn qwen3_folder() -> ModelPrompt {
        ModelPrompt::load(&repo_root().join("models/qwen3-tokenizer")).expect("qwen3 folder")
    }

    fn fixture_render(t: &ChatTemplate, c: &serde_json::Value) -> String {
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).expect("messages");
        let gen = c["add_generation_prompt"].as_bool().expect("flag");
        let think = c["enable_thinking"].as_bool().expect("flag");
        // The fixtures' `true` is the template's default: the variable left undefined.
        let vars: Vec<(&str, serde_json::Value)> =
            if think { vec![] } else { vec![("enable_thinking", false.into())] };
        t.render(&msgs, gen, &vars).expect("renders")
    }

    #[test]
    fn built_in_template_is_the_qwen3_tokenizer_config_template() {
        let text = std::fs::read_to_string(repo_root().join("models/qwen3-tokenizer/tokenizer_config.json"))
            .expect("read");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["chat_template"].as_str(), Some(QWEN3_CHAT_TEMPLATE));
    }

    #[test]
    fn renders_every_fixture_conversation_like_hugging_face() {
        let fx = chat_fixture();
        let cases = fx["chat"].as_array().expect("fixture has chat cases");
        assert!(cases.len() >= 6);
        let folder = qwen3_folder();
        let from_folder = folder.chat_template().expect("has a template").expect("compiles");
        for t in [&*from_folder, &ChatTemplate::qwen3()] {
            for c in cases {
                let name = c["name"].as_str().expect("name");
                assert_eq!(fixture_render(t, c), c["text"].as_str().expect("text"), "case {name}");
            }
        }
        // Explicit `enable_thinking: true` renders like the undefined default.
        let c = &cases[0];
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).expect("messages");
        assert_eq!(
            from_folder.render(&msgs, true, &[("enable_thinking", true.into())]).expect("render"),
            c["text"].as_str().expect("text")
        );
    }

    #[test]
    fn rendered_fixture_conversations_tokenize_to_hugging_face_ids() {
        let tok = Tokenizer::from_file(repo_root().join("models/qwen3-tokenizer/tokenizer.json"))
            .expect("tokenizer loads");
        let t = ChatTemplate::qwen3();
        let fx = chat_fixture();
        for c in fx["chat"].as_array().expect("cases") {
            let name = c["name"].as_str().expect("name");
            let text = fixture_render(&t, c);
            let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).expect("ids");
            assert_eq!(tok.encode(&text, false).expect("encode"), want, "case {name}");
            // Chat markup round-trips when special tokens are kept.
            assert_eq!(tok.decode(&want, false).expect("decode"), text, "case {name}");
        }
    }

    #[test]
    fn prompters_render_problem_separator_suffix() {
        let folder = qwen3_folder();
        let p = |t: &PromptTemplate, q: &str| {
            t.resolve(&folder).expect("resolve").render(&q.into()).expect("render")
        };
        let raw = p(&PromptTemplate::raw(), "What is 1+1?");
        assert_eq!(raw, format!("What is 1+1?\n{BOXED_SUFFIX}"));
        assert!(raw.ends_with("within \\boxed{}."));
        assert_eq!(p(&PromptTemplate::Raw { suffix: String::new() }, "Q"), "Q");
        assert_eq!(p(&PromptTemplate::None, "Q"), "Q");
        let chat = PromptTemplate::Chat { system: Some("S".into()), suffix: None, enable_thinking: false };
        assert_eq!(
            p(&chat, "Q"),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        // The fixture's user_only_no_thinking case is the chat template with the paper's suffix,
        // and "model" on a folder with a chat template means exactly that.
        let fx = chat_fixture();
        let case = fx["chat"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == "user_only_no_thinking"))
            .expect("case present");
        let want = case["text"].as_str().expect("text");
        assert_eq!(p(&PromptTemplate::chat(false), "Compute 17 * 23."), want);
        assert_eq!(p(&PromptTemplate::Model, "Compute 17 * 23."), want);
        assert_eq!(PromptTemplate::Model.resolve(&folder).expect("resolve").note(), None);
    }

    #[test]
    fn message_prompts_are_rendered_as_given() {
        let folder = qwen3_folder();
        let msgs = Prompt::Messages(vec![Message::user("Solve x+1=2. Answer: $Answer")]);
        let chat = PromptTemplate::chat(false).resolve(&folder).expect("resolve");
        assert_eq!(
            chat.render(&msgs).expect("render"),
            "<|im_start|>user\nSolve x+1=2. Answer: $Answer<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        let with_system =
            PromptTemplate::Chat { system: Some("S".into()), suffix: None, enable_thinking: true };
        let sys = Prompt::Messages(vec![Message::system("own"), Message::user("q")]);
        assert_eq!(
            with_system.resolve(&folder).expect("resolve").render(&sys).expect("render"),
            "<|im_start|>system\nown<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        );
        let raw = PromptTemplate::raw().resolve(&folder).expect("resolve");
        assert_eq!(raw.render(&sys).expect("render"), "own\nq");
        // Datasets give either form in JSON.
        let p: Prompt = serde_json::from_str(r#"[{"role": "user", "content": "hi"}]"#).expect("messages");
        assert_eq!(p, Prompt::Messages(vec![Message::user("hi")]));
        let p: Prompt = serde_json::from_str(r#""hi""#).expect("text");
        assert_eq!(p, Prompt::Text("hi".into()));
    }

    #[test]
    fn one_spelling_names_and_maps() {
        let cases = [
            (serde_json::json!("model"), PromptTemplate::Model),
            (serde_json::json!("none"), PromptTemplate::None),
            (serde_json::json!("raw"), PromptTemplate::raw()),
            (serde_json::json!("chat"), PromptTemplate::chat(false)),
            (serde_json::json!("chat-think"), PromptTemplate::chat(true)),
            (serde_json::json!({"kind": "model"}), PromptTemplate::Model),
            (serde_json::json!({"kind": "none"}), PromptTemplate::None),
            (serde_json::json!({"kind": "raw"}), PromptTemplate::raw()),
            (serde_json::json!({"kind": "raw", "suffix": ""}), PromptTemplate::Raw { suffix: String::new() }),
            (serde_json::json!({"kind": "chat", "enable_thinking": true}), PromptTemplate::chat(true)),
            (
                serde_json::json!({"kind": "chat", "system": "S", "suffix": null}),
                PromptTemplate::Chat { system: Some("S".into()), suffix: None, enable_thinking: false },
            ),
        ];
        for (json, want) in cases {
            assert_eq!(PromptTemplate::from_json(&json).expect("parses"), want, "{json}");
            let back: PromptTemplate =
                serde_json::from_str(&serde_json::to_string(&want).expect("ser")).expect("de");
            assert_eq!(back, want);
            assert_eq!(
                PromptTemplate::parse_arg(&json.to_string()).ok(),
                (json.is_object()).then(|| want.clone())
            );
        }
        assert_eq!(PromptTemplate::parse_arg("raw").expect("name"), PromptTemplate::raw());
        assert_eq!(
            PromptTemplate::parse_arg(r#"{"kind":"raw","suffix":""}"#).expect("map"),
            PromptTemplate::Raw { suffix: String::new() }
        );
        let errs = [
            (serde_json::json!("bogus"), "found \"bogus\""),
            (serde_json::json!(3), "expected a name"),
            (serde_json::json!({"suffix": ""}), "needs `kind`"),
            (serde_json::json!({"kind": "raw", "sufix": ""}), "unknown key `sufix`"),
            (serde_json::json!({"kind": "raw", "suffix": 1}), "template.suffix"),
            (serde_json::json!({"kind": "chat", "enable_thinking": "yes"}), "template.enable_thinking"),
            (serde_json::json!({"kind": "jinja"}), "template.kind"),
        ];
        for (json, want) in errs {
            let e = PromptTemplate::from_json(&json).expect_err("rejected").to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
        assert!(PromptTemplate::parse_arg("{not json").is_err());
    }

    fn folder_with(cfg: serde_json::Value) -> (tempfile::TempDir, ModelPrompt) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).expect("write");
        let m = ModelPrompt::load(dir.path()).expect("load");
        (dir, m)
    }

    #[test]
    fn folders_declare_their_default_and_forcing_another_leaves_a_note() {
        let (_d, bare) = folder_with(serde_json::json!({"stapo_template": "none"}));
        assert_eq!(bare.default_template(), PromptTemplate::None);
        let model = PromptTemplate::Model.resolve(&bare).expect("resolve");
        assert_eq!((model.template(), model.note()), (&PromptTemplate::None, None));
        assert_eq!(model.render(&"1+2".into()).expect("render"), "1+2");
        // The same rendering spelled as an empty raw suffix is not "forcing".
        assert_eq!(PromptTemplate::Raw { suffix: String::new() }.resolve(&bare).expect("r").note(), None);
        let raw = PromptTemplate::raw().resolve(&bare).expect("resolve");
        let note = raw.note().expect("a note");
        assert!(
            note.contains("\"none\"") && note.contains("stapo_template") && note.contains("\"raw\""),
            "{note}"
        );
        // chat on a folder without a chat template: the built-in Qwen3 one, with a note.
        let chat = PromptTemplate::chat(false).resolve(&bare).expect("resolve");
        assert!(chat.note().expect("note").contains("no chat_template"), "{:?}", chat.note());
        assert!(chat.render(&"q".into()).expect("render").starts_with("<|im_start|>user\nq\n"));

        let (_d, nothing) = folder_with(serde_json::json!({}));
        assert_eq!(nothing.default_template(), PromptTemplate::raw());
        assert_eq!(PromptTemplate::None.resolve(&nothing).expect("r").note(), None);

        let _d = tempfile::tempdir().expect("tempdir");
        std::fs::write(_d.path().join("tokenizer_config.json"), r#"{"stapo_template": "model"}"#).expect("w");
        let e = ModelPrompt::load(_d.path()).expect_err("model is not concrete").to_string();
        assert!(e.contains("stapo_template") && e.contains("tokenizer_config.json"), "{e}");
        std::fs::write(_d.path().join("tokenizer_config.json"), r#"{"stapo_template": {"kind": "rw"}}"#)
            .expect("w");
        let e = ModelPrompt::load(_d.path()).expect_err("bad kind").to_string();
        assert!(e.contains("template.kind"), "{e}");
        std::fs::write(_d.path().join("tokenizer_config.json"), "{oops").expect("w");
        let e = ModelPrompt::load(_d.path()).expect_err("bad json").to_string();
        assert!(e.contains("tokenizer_config.json:1"), "{e}");
    }

    #[test]
    fn broken_templates_fail_when_used_naming_the_file() {
        let (_d, m) =
            folder_with(serde_json::json!({"chat_template": "{% for m in messages %}{{ m.content }"}));
        // Raw still works.
        let raw = PromptTemplate::raw().resolve(&m).expect("raw");
        assert_eq!(raw.render(&"q".into()).expect("render"), format!("q\n{BOXED_SUFFIX}"));
        let e = PromptTemplate::Model.resolve(&m).expect_err("broken template").to_string();
        assert!(e.contains("tokenizer_config.json") && e.contains("chat_template"), "{e}");
        let (_d, m) =
            folder_with(serde_json::json!({"chat_template": "{{ raise_exception('no system role') }}"}));
        let e = PromptTemplate::Model.resolve(&m).expect("compiles").render(&"q".into()).expect_err("raises");
        assert!(e.to_string().contains("no system role"), "{e}");
    }

    #[test]
    fn other_chat_templates_render_like_transformers() {
        // Qwen2.5-Instruct, Llama-3-Instruct and Mistral-Instruct style templates, rendered by
        // transformers' apply_chat_template (fixture made in a throw-away virtualenv).
        let p = repo_root().join("host/tests/fixtures/chat/other_templates.json");
        let fx: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("json");
        let templates = fx["templates"].as_array().expect("templates");
        assert_eq!(templates.len(), 3);
        for t in templates {
            let name = t["name"].as_str().expect("name");
            let mut cfg = t["special_tokens"].clone();
            cfg["chat_template"] = t["chat_template"].clone();
            let (_dir, folder) = folder_with(cfg);
            let chat = folder.chat_template().expect("declared").expect("compiles");
            for c in t["cases"].as_array().expect("cases") {
                let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).expect("messages");
                let gen = c["add_generation_prompt"].as_bool().expect("flag");
                let got = chat.render(&msgs, gen, &[]).expect("renders");
                assert_eq!(got, c["text"].as_str().expect("text"), "{name} / {} / gen {gen}", c["name"]);
            }
            // "model" on such a folder: its chat template, the paper's instruction in the user turn.
            let prompter = PromptTemplate::Model.resolve(&folder).expect("resolve");
            assert_eq!(prompter.template(), &PromptTemplate::chat(false));
            let user_only = t["cases"]
                .as_array()
                .and_then(|cs| {
                    cs.iter().find(|c| c["name"] == "user_only" && c["add_generation_prompt"] == true)
                })
                .expect("user_only case");
            assert_eq!(
                prompter.render(&"Compute 17 * 23.".into()).expect("render"),
                user_only["text"].as_str().expect("text"),
                "{name}"
            );
            if let Some(r) = t["raises"].as_object() {
                let msgs: Vec<Message> = serde_json::from_value(r["messages"].clone()).expect("messages");
                let e = chat.render(&msgs, false, &[]).expect_err("the template raises").to_string();
                assert!(e.contains(r["error"].as_str().expect("error")), "{name}: {e}");
            }
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let t = ChatTemplate::new(
            "{% set x = {'b': [1, 2.5, none, true], 'a': {}, 'c': 'q\"\\n'} %}{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 'é<' | tojson }}",
            "test",
            BTreeMap::new(),
        )
        .expect("compiles");
        let out = t.render(&[], false, &[]).expect("render");
        // json.dumps(x, ensure_ascii=False) and json.dumps(x, ensure_ascii=False, indent=2).
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, null, true], \"a\": {}, \"c\": \"q\\\"\\n\"}|{\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"a\": {},\n  \"c\": \"q\\\"\\n\"\n}|\"é<\""
        );
    }
}
