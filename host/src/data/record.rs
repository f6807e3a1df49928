//! One dataset record (a JSONL line or a Parquet row, both seen as a JSON
//! object) turned into an [`Example`].
//!
//! Field names are paths (`reward_model.ground_truth` walks into nested
//! objects), tried in order, so one default list reads both the flat
//! `{"problem","answer","id","source"}` layout of `data/benchmarks` and verl's
//! schema (`data_source`, `prompt` as a list of chat messages, `ability`,
//! `reward_model.ground_truth`, `extra_info.index`) as DAPO-Math-17k and verl's
//! preprocessed GSM8K/MATH ship it.
//!
//! A problem given as chat messages keeps the messages ([`Example::messages`])
//! and takes the last `user` message as its text. DAPO-Math-17k wraps every
//! problem in its "Answer:" instruction ([`DAPO_PREFIX`] … [`DAPO_REMINDER`]);
//! [`DatasetOptions::strip_instruction`] removes that wrapper so another
//! instruction (the STAPO paper's `\boxed{}` one) can be put in its place.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::template::{Message, Prompt};

/// The start of DAPO-Math-17k's instruction, up to the blank line before the problem.
pub const DAPO_PREFIX: &str = "Solve the following math problem step by step. The last line of your response should be of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.";

/// DAPO-Math-17k's closing reminder, after a blank line following the problem.
pub const DAPO_REMINDER: &str = "Remember to put your answer on its own line after \"Answer:\".";

/// One task: a problem and its reference answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// The record's id (string or integer), else `"{file stem}-{index}"`.
    pub id: String,
    /// The problem text, without an instruction suffix (for a chat-message
    /// prompt: the last `user` message, its DAPO wrapper removed when asked).
    pub problem: String,
    /// The reference answer (numbers are kept as their JSON text, e.g. `"18"`).
    pub answer: String,
    /// The record's source (`source`, verl's `data_source`), else the file stem.
    pub source: String,
    /// The prompt as the dataset gives it when that is a list of chat
    /// messages (verl's `prompt` column), unchanged; `None` for a plain problem
    /// and under [`DatasetOptions::strip_instruction`]. When present, it is the
    /// prompt ([`Example::prompt`]): chat templates render it as given, as verl does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<Message>>,
}

impl Example {
    /// An example with a plain-text problem.
    pub fn new(
        id: impl Into<String>,
        problem: impl Into<String>,
        answer: impl Into<String>,
        source: impl Into<String>,
    ) -> Self {
        Example {
            id: id.into(),
            problem: problem.into(),
            answer: answer.into(),
            source: source.into(),
            messages: None,
        }
    }

    /// What the model is prompted with: the dataset's chat messages when it gave
    /// them, else the problem text (to which templates add their instruction).
    pub fn prompt(&self) -> Prompt {
        match &self.messages {
            Some(m) => Prompt::Messages(m.clone()),
            None => Prompt::Text(self.problem.clone()),
        }
    }
}

/// What to do with a record that is not a valid example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadLinePolicy {
    /// Skip it and return a `file:line: ...` warning.
    #[default]
    Skip,
    /// Fail the load with an error naming the file and line (or row).
    Reject,
}

/// How to read a dataset: which fields hold what, and what to do with bad
/// records. Every `*_fields` list accepts one name or a list (`"question"`
/// or `["question", "problem"]`); dotted names walk into nested objects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatasetOptions {
    /// Candidates for the problem: a string, or a list of chat messages.
    #[serde(deserialize_with = "one_or_many")]
    pub problem_fields: Vec<String>,
    /// Candidates for the reference answer: a string or a number.
    #[serde(deserialize_with = "one_or_many")]
    pub answer_fields: Vec<String>,
    /// Candidates for the id: a string or an integer.
    #[serde(alias = "id_field", deserialize_with = "one_or_many")]
    pub id_fields: Vec<String>,
    /// Candidates for the source label: a string.
    #[serde(alias = "source_field", deserialize_with = "one_or_many")]
    pub source_fields: Vec<String>,
    /// Remove DAPO-Math's "Answer:" instruction around the problem text.
    pub strip_instruction: bool,
    /// Keep only the first of records with the same problem and answer
    /// (DAPO-Math-17k's parquet holds each of its 17k problems 100 times).
    pub dedupe: bool,
    /// With a folder of Hugging Face shards (`train-00000-of-00002.parquet`,
    /// `test-...`): the split to load. Needed only when the folder holds several.
    pub split: Option<String>,
    /// Skip or reject bad records.
    pub bad_lines: BadLinePolicy,
}

impl Default for DatasetOptions {
    fn default() -> Self {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect();
        DatasetOptions {
            problem_fields: v(&["problem", "question", "prompt"]),
            answer_fields: v(&["answer", "final_answer", "reward_model.ground_truth", "solution"]),
            id_fields: v(&["id", "extra_info.index"]),
            source_fields: v(&["source", "data_source"]),
            strip_instruction: false,
            dedupe: false,
            split: None,
            bad_lines: BadLinePolicy::Skip,
        }
    }
}

/// Accepts `"name"` as well as `["name", ...]`.
fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect(),
        OneOrMany::Many(v) => v,
    })
}

/// The JSON type of a value, for messages ("found an array").
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The value at a dotted path (`reward_model.ground_truth`); a top-level key
/// that itself contains dots wins over walking.
pub(crate) fn lookup<'a>(obj: &'a Map<String, Value>, path: &str) -> Option<&'a Value> {
    if let Some(v) = obj.get(path) {
        return Some(v);
    }
    let mut parts = path.split('.');
    let mut cur = obj.get(parts.next()?)?;
    for p in parts {
        cur = cur.as_object()?.get(p)?;
    }
    Some(cur)
}

/// Text of a value that may be a string or a number (answers, ids).
fn text_of(name: &str, v: &Value) -> Result<Option<String>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Number(n) => Ok(Some(n.to_string())),
        other => Err(format!("field `{name}`: expected a string or number, found {}", kind(other))),
    }
}

/// A list of `{"role", "content"}` objects.
fn messages_of(name: &str, items: &[Value]) -> Result<Vec<Message>, String> {
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let get = |key: &str| match m.get(key) {
                Some(Value::String(s)) => Ok(s.clone()),
                Some(other) => Err(format!(
                    "field `{name}`: message {i}: `{key}` should be a string, found {}",
                    kind(other)
                )),
                None => {
                    Err(format!("field `{name}`: message {i}: expected an object with `role` and `content`"))
                }
            };
            Ok(Message::new(get("role")?, get("content")?))
        })
        .collect()
}

/// The problem text inside DAPO-Math's instruction wrapper, if `text` is wrapped.
pub fn strip_dapo_instruction(text: &str) -> Option<&str> {
    let rest = text.trim_start().strip_prefix(DAPO_PREFIX)?;
    let rest = rest.trim_start_matches([' ', '\n']);
    let body = match rest.rfind(DAPO_REMINDER) {
        Some(p) => &rest[..p],
        None => rest,
    };
    let body = body.trim();
    (!body.is_empty()).then_some(body)
}

/// The problem: (field used, text, messages when given as chat).
type Problem = (String, String, Option<Vec<Message>>);

fn problem_of(obj: &Map<String, Value>, opts: &DatasetOptions) -> Result<Option<Problem>, String> {
    for name in &opts.problem_fields {
        match lookup(obj, name) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => return Ok(Some((name.clone(), s.clone(), None))),
            Some(Value::Array(items)) => {
                let msgs = messages_of(name, items)?;
                let last_user = msgs
                    .iter()
                    .rev()
                    .find(|m| m.role == "user")
                    .ok_or_else(|| format!("field `{name}`: the chat messages have no `user` message"))?;
                return Ok(Some((name.clone(), last_user.content.clone(), Some(msgs))));
            }
            Some(other) => {
                return Err(format!(
                    "field `{name}`: expected a string or a list of chat messages, found {}",
                    kind(other)
                ))
            }
        }
    }
    Ok(None)
}

fn first_text(obj: &Map<String, Value>, names: &[String]) -> Result<Option<(String, String)>, String> {
    for name in names {
        if let Some(text) = lookup(obj, name).map(|v| text_of(name, v)).transpose()?.flatten() {
            return Ok(Some((name.clone(), text)));
        }
    }
    Ok(None)
}

/// Reads one record. `index` is the 0-based record number (the default id is
/// `{stem}-{index}`); errors say which field was wrong.
pub(crate) fn parse_record(
    obj: &Map<String, Value>,
    index: usize,
    stem: &str,
    opts: &DatasetOptions,
) -> Result<Example, String> {
    let (pf, mut problem, mut messages) = problem_of(obj, opts)?
        .ok_or_else(|| format!("no problem field (looked for {:?})", opts.problem_fields))?;
    let (af, answer) = first_text(obj, &opts.answer_fields)?
        .ok_or_else(|| format!("no answer field (looked for {:?})", opts.answer_fields))?;
    if opts.strip_instruction {
        if let Some(inner) = strip_dapo_instruction(&problem) {
            problem = inner.to_string();
        }
        // The bare problem goes through the recipe's own template: the dataset's
        // messages (which carry the wrapper) are not the prompt any more.
        messages = None;
    }
    if problem.trim().is_empty() {
        return Err(format!("field `{pf}` is empty"));
    }
    if answer.trim().is_empty() {
        return Err(format!("field `{af}` is empty"));
    }
    let id = first_text(obj, &opts.id_fields)?.map_or_else(|| format!("{stem}-{index}"), |(_, t)| t);
    let mut source = None;
    for name in &opts.source_fields {
        match lookup(obj, name) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                source = Some(s.clone());
                break;
            }
            Some(other) => return Err(format!("field `{name}`: expected a string, found {}", kind(other))),
        }
    }
    Ok(Example { id, problem, answer, source: source.unwrap_or_else(|| stem.to_string()), messages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    /// A DAPO-Math-17k row as its parquet holds it (converted to JSON).
    fn dapo_row() -> Value {
        let content = format!("{DAPO_PREFIX}\n\nFind $x$ if $2x = 6$.\n\n{DAPO_REMINDER}");
        json!({
            "data_source": "math_dapo",
            "prompt": [{"content": content, "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "3", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}
        })
    }

    #[test]
    fn verl_rows_read_with_the_default_fields() {
        let ex = parse_record(&obj(dapo_row()), 0, "dapo", &DatasetOptions::default()).expect("parses");
        assert_eq!(ex.id, "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079");
        assert_eq!(ex.answer, "3");
        assert_eq!(ex.source, "math_dapo");
        let msgs = ex.messages.as_deref().expect("chat messages kept");
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].role, "user");
        // Without stripping, the problem is the user message as the dataset gives it.
        assert_eq!(ex.problem, msgs[0].content);
        assert_eq!(ex.prompt(), Prompt::Messages(msgs.to_vec()));

        let strip = DatasetOptions { strip_instruction: true, ..Default::default() };
        let ex = parse_record(&obj(dapo_row()), 0, "dapo", &strip).expect("parses");
        assert_eq!(ex.problem, "Find $x$ if $2x = 6$.");
        assert!(ex.messages.is_none(), "the recipe's template takes the bare problem");
        assert_eq!(ex.prompt(), Prompt::Text("Find $x$ if $2x = 6$.".into()));
    }

    #[test]
    fn the_last_user_message_is_the_problem_and_integer_index_is_the_id() {
        // verl's gsm8k preprocessing: a system turn may precede; extra_info.index is an integer.
        let row = json!({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "reward_model": {"ground_truth": 2, "style": "rule"},
            "extra_info": {"index": 17, "split": "train"}
        });
        let ex = parse_record(&obj(row), 3, "gsm8k", &DatasetOptions::default()).expect("parses");
        assert_eq!((ex.id.as_str(), ex.problem.as_str(), ex.answer.as_str()), ("17", "1+1?", "2"));
        assert_eq!(ex.messages.map(|m| m.len()), Some(2));
    }

    #[test]
    fn bad_records_name_the_field() {
        let opts = DatasetOptions::default();
        let cases = [
            (
                json!({"prompt": 5, "answer": "1"}),
                "field `prompt`: expected a string or a list of chat messages, found a number",
            ),
            (
                json!({"prompt": [{"role": "user"}], "answer": "1"}),
                "field `prompt`: message 0: expected an object with `role` and `content`",
            ),
            (json!({"prompt": [{"role": "system", "content": "x"}], "answer": "1"}), "no `user` message"),
            (
                json!({"problem": "p", "reward_model": {"ground_truth": [1]}}),
                "field `reward_model.ground_truth`: expected a string or number, found an array",
            ),
            (json!({"problem": "p", "reward_model": {"style": "rule"}}), "no answer field"),
            (
                json!({"problem": "p", "answer": "1", "data_source": 3}),
                "field `data_source`: expected a string",
            ),
            (json!({"problem": "p", "answer": " "}), "field `answer` is empty"),
        ];
        for (row, want) in cases {
            let err = parse_record(&obj(row.clone()), 0, "t", &opts).expect_err("bad");
            assert!(err.contains(want), "{row}: {err}");
        }
    }

    #[test]
    fn options_accept_one_name_or_a_list_and_the_old_singular_keys() {
        let o: DatasetOptions = serde_json::from_value(
            json!({"problem_fields": "q", "answer_fields": ["gold", "answer"], "id_field": "uid"}),
        )
        .expect("options");
        assert_eq!(o.problem_fields, ["q"]);
        assert_eq!(o.answer_fields, ["gold", "answer"]);
        assert_eq!(o.id_fields, ["uid"]);
        let o: DatasetOptions =
            serde_json::from_value(json!({"problem_fields": "q, question"})).expect("options");
        assert_eq!(o.problem_fields, ["q", "question"]);
        assert!(serde_json::from_value::<DatasetOptions>(json!({"problem_feilds": "q"})).is_err());
    }

    #[test]
    fn dapo_wrapper_is_recognised_exactly() {
        assert_eq!(strip_dapo_instruction(&format!("{DAPO_PREFIX}\n\nP\n\n{DAPO_REMINDER}")), Some("P"));
        assert_eq!(strip_dapo_instruction(&format!("{DAPO_PREFIX}\n\nP")), Some("P"));
        assert_eq!(strip_dapo_instruction("Solve the following: 1+1"), None);
        assert_eq!(strip_dapo_instruction(&format!("{DAPO_PREFIX}\n\n{DAPO_REMINDER}")), None);
        let nested = json!({"a": {"b": {"c": "deep"}}, "x.y": "literal"});
        assert_eq!(lookup(&obj(nested.clone()), "a.b.c"), Some(&json!("deep")));
        assert_eq!(lookup(&obj(nested.clone()), "x.y"), Some(&json!("literal")));
        assert_eq!(lookup(&obj(nested), "a.z"), None);
    }
}
