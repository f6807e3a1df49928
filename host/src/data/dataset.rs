//! JSONL task datasets (one `{"problem": ..., "answer": ...}` object a line, as
//! in `data/benchmarks/*.jsonl` and DAPO-Math-17k) and the seeded epoch
//! sampler that feeds training.
//!
//! Field names are configurable because public sets disagree (`problem` /
//! `question` / `prompt`, `answer` / `final_answer` / `solution`). A bad line is
//! reported as `file:line: what was wrong`, and [`BadLinePolicy`] decides
//! whether it is skipped (returned as a warning) or stops the load.
//!
//! The [`Sampler`] walks a fresh permutation every epoch, seeded by
//! `(seed, epoch)`, so a run restored from its [`SamplerState`] continues with
//! exactly the batches it would have drawn (for the same `rand` version).

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Error, Result};

/// One task: a problem and its reference answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Example {
    /// The line's `id` (string or integer), else `"{file stem}-{line - 1}"`.
    pub id: String,
    /// The problem text, without any instruction suffix.
    pub problem: String,
    /// The reference answer (numbers are kept as their JSON text, e.g. `"18"`).
    pub answer: String,
    /// The line's `source`, else the file stem.
    pub source: String,
}

/// What to do with a line that is not a valid example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BadLinePolicy {
    /// Skip it and return a `file:line: ...` warning.
    #[default]
    Skip,
    /// Fail the load with [`Error::Parse`].
    Reject,
}

/// How to read a dataset file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DatasetOptions {
    /// Candidate names for the problem; the first one present (and not null) is used.
    pub problem_fields: Vec<String>,
    /// Candidate names for the answer; the first one present (and not null) is used.
    pub answer_fields: Vec<String>,
    /// Name of the optional id field.
    pub id_field: String,
    /// Name of the optional source field.
    pub source_field: String,
    /// Skip or reject bad lines.
    pub bad_lines: BadLinePolicy,
}

impl Default for DatasetOptions {
    fn default() -> Self {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect();
        DatasetOptions {
            problem_fields: v(&["problem", "question", "prompt"]),
            answer_fields: v(&["answer", "final_answer", "solution"]),
            id_field: "id".into(),
            source_field: "source".into(),
            bad_lines: BadLinePolicy::Skip,
        }
    }
}

/// A loaded dataset: examples in file order.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    path: PathBuf,
    examples: Vec<Example>,
}

/// Text of a field that must be a string (`problem`, `source`).
fn field_str<'a>(
    obj: &'a serde_json::Map<String, Value>,
    name: &str,
) -> std::result::Result<Option<&'a str>, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!("field `{name}`: expected a string, found {}", kind(other))),
    }
}

/// Text of a field that may be a string or a number (`answer`, `id`).
fn field_text(
    obj: &serde_json::Map<String, Value>,
    name: &str,
) -> std::result::Result<Option<String>, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(other) => Err(format!("field `{name}`: expected a string or number, found {}", kind(other))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The first candidate field present; `Err` if it has the wrong type, `Ok(None)` if none is present.
fn first_of(
    obj: &serde_json::Map<String, Value>,
    names: &[String],
    numbers_ok: bool,
) -> std::result::Result<Option<(String, String)>, String> {
    for name in names {
        let found =
            if numbers_ok { field_text(obj, name)? } else { field_str(obj, name)?.map(str::to_string) };
        if let Some(text) = found {
            return Ok(Some((name.clone(), text)));
        }
    }
    Ok(None)
}

impl Dataset {
    /// Loads a JSONL file. Returns the dataset and one `file:line: ...` warning
    /// per skipped line (always empty under [`BadLinePolicy::Reject`]). Blank
    /// lines are ignored silently. A file with no valid example is an error.
    pub fn load(path: impl AsRef<Path>, opts: &DatasetOptions) -> Result<(Dataset, Vec<String>)> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_jsonl_str(path, &text, opts)
    }

    /// Parses JSONL text as if read from `path` (which names it in messages
    /// and gives the default source).
    pub fn from_jsonl_str(
        path: impl AsRef<Path>,
        text: &str,
        opts: &DatasetOptions,
    ) -> Result<(Dataset, Vec<String>)> {
        let path = path.as_ref();
        if opts.problem_fields.is_empty() || opts.answer_fields.is_empty() {
            return Err(Error::invalid(format!(
                "{}: dataset options need at least one problem field and one answer field",
                path.display()
            )));
        }
        let stem =
            path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into());
        let mut examples = Vec::new();
        let mut warnings = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            if line.trim().is_empty() {
                continue;
            }
            match Self::parse_line(line, line_no, &stem, opts) {
                Ok(ex) => examples.push(ex),
                Err(msg) => match opts.bad_lines {
                    BadLinePolicy::Reject => {
                        return Err(Error::Parse { path: path.to_path_buf(), line: line_no, msg })
                    }
                    BadLinePolicy::Skip => warnings.push(format!("{}:{line_no}: {msg}", path.display())),
                },
            }
        }
        if examples.is_empty() {
            return Err(Error::invalid(format!(
                "{}: no valid examples ({} bad lines skipped; problem fields {:?}, answer fields {:?})",
                path.display(),
                warnings.len(),
                opts.problem_fields,
                opts.answer_fields
            )));
        }
        Ok((Dataset { path: path.to_path_buf(), examples }, warnings))
    }

    fn parse_line(
        line: &str,
        line_no: usize,
        stem: &str,
        opts: &DatasetOptions,
    ) -> std::result::Result<Example, String> {
        let value: Value = serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
        let Value::Object(obj) = value else {
            return Err(format!("expected a JSON object, found {}", kind(&value)));
        };
        let (pf, problem) = first_of(&obj, &opts.problem_fields, false)?
            .ok_or_else(|| format!("no problem field (looked for {:?})", opts.problem_fields))?;
        let (af, answer) = first_of(&obj, &opts.answer_fields, true)?
            .ok_or_else(|| format!("no answer field (looked for {:?})", opts.answer_fields))?;
        if problem.trim().is_empty() {
            return Err(format!("field `{pf}` is empty"));
        }
        if answer.trim().is_empty() {
            return Err(format!("field `{af}` is empty"));
        }
        let id = field_text(&obj, &opts.id_field)?.unwrap_or_else(|| format!("{stem}-{}", line_no - 1));
        let source =
            field_str(&obj, &opts.source_field)?.map(str::to_string).unwrap_or_else(|| stem.to_string());
        Ok(Example { id, problem, answer, source })
    }

    /// A dataset from examples already in memory; `path` is only a label.
    pub fn from_examples(path: impl Into<PathBuf>, examples: Vec<Example>) -> Dataset {
        Dataset { path: path.into(), examples }
    }

    /// The file it came from (or the label given to [`Dataset::from_examples`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    /// True when there are no examples.
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The `i`-th example in file order.
    pub fn get(&self, i: usize) -> Option<&Example> {
        self.examples.get(i)
    }

    /// All examples in file order.
    pub fn examples(&self) -> &[Example] {
        &self.examples
    }

    /// The examples at `indices` (e.g. a [`Sampler`] batch); out-of-range
    /// indices are an error naming the dataset.
    pub fn select(&self, indices: &[usize]) -> Result<Vec<&Example>> {
        indices
            .iter()
            .map(|&i| {
                self.examples.get(i).ok_or_else(|| {
                    Error::invalid(format!(
                        "{}: index {i} out of range (len {})",
                        self.path.display(),
                        self.len()
                    ))
                })
            })
            .collect()
    }
}

/// The serialisable state of a [`Sampler`]: enough to continue exactly where
/// it stopped. The permutation itself is recomputed from `(seed, epoch)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Base seed of the run.
    pub seed: u64,
    /// Dataset length the sampler was built for (checked on restore).
    pub len: usize,
    /// Whether epochs are shuffled (`false`: file order every epoch).
    pub shuffle: bool,
    /// Current epoch, from 0.
    pub epoch: u64,
    /// Next position inside the current epoch's order.
    pub pos: usize,
}

/// An endless stream of example indices: each epoch visits every index once,
/// in an order shuffled from `(seed, epoch)`. A batch that runs past the end
/// of an epoch continues into the next one, so every batch has the size asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SamplerState", into = "SamplerState")]
pub struct Sampler {
    state: SamplerState,
    order: Vec<usize>,
}

impl From<Sampler> for SamplerState {
    fn from(s: Sampler) -> Self {
        s.state
    }
}

impl TryFrom<SamplerState> for Sampler {
    type Error = Error;
    fn try_from(state: SamplerState) -> Result<Self> {
        if state.len == 0 {
            return Err(Error::invalid("sampler: dataset is empty"));
        }
        if state.pos > state.len {
            return Err(Error::invalid(format!(
                "sampler state: position {} is past the epoch length {}",
                state.pos, state.len
            )));
        }
        let order = epoch_order(state.seed, state.epoch, state.len, state.shuffle);
        Ok(Sampler { state, order })
    }
}

/// The index order of one epoch. The epoch is mixed into the seed with a
/// SplitMix64 step so neighbouring (seed, epoch) pairs give unrelated orders.
fn epoch_order(seed: u64, epoch: u64, len: usize, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let mut z = seed ^ epoch.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        order.shuffle(&mut StdRng::seed_from_u64(z));
    }
    order
}

impl Sampler {
    /// A shuffling sampler over `len` examples, at epoch 0, position 0.
    pub fn new(len: usize, seed: u64) -> Result<Self> {
        SamplerState { seed, len, shuffle: true, epoch: 0, pos: 0 }.try_into()
    }

    /// A sampler that yields file order every epoch (for evaluation).
    pub fn sequential(len: usize) -> Result<Self> {
        SamplerState { seed: 0, len, shuffle: false, epoch: 0, pos: 0 }.try_into()
    }

    /// Restores a saved state; `len` is the current dataset's length, which
    /// must equal the one the state was saved with.
    pub fn restore(state: SamplerState, len: usize) -> Result<Self> {
        if state.len != len {
            return Err(Error::invalid(format!(
                "sampler state was saved for {} examples, dataset has {len}",
                state.len
            )));
        }
        state.try_into()
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// The current epoch (0-based). It advances when the last index of an epoch is handed out.
    pub fn epoch(&self) -> u64 {
        self.state.epoch
    }

    /// How many indices of the current epoch were handed out.
    pub fn position(&self) -> usize {
        self.state.pos
    }

    /// Dataset length.
    pub fn len(&self) -> usize {
        self.state.len
    }

    /// Never true: a sampler cannot be built over an empty dataset.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// The next `n` indices (`n > len` repeats indices across epochs).
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<usize>> {
        if n == 0 {
            return Err(Error::invalid("sampler: batch size must be at least 1"));
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.state.pos == self.state.len {
                self.state.epoch += 1;
                self.state.pos = 0;
                self.order =
                    epoch_order(self.state.seed, self.state.epoch, self.state.len, self.state.shuffle);
            }
            let take = (n - out.len()).min(self.state.len - self.state.pos);
            out.extend_from_slice(&self.order[self.state.pos..self.state.pos + take]);
            self.state.pos += take;
        }
        // Roll over eagerly so `epoch()` reports the epoch the next batch starts in.
        if self.state.pos == self.state.len {
            self.state.epoch += 1;
            self.state.pos = 0;
            self.order = epoch_order(self.state.seed, self.state.epoch, self.state.len, self.state.shuffle);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_support::repo_root;

    const GOOD_AND_BAD: &str = r#"{"id": "a", "problem": "1+1?", "answer": "2", "source": "toy"}
{"question": "2+2?", "final_answer": 4}
not json at all

{"problem": "no answer here"}
{"problem": ["not", "a", "string"], "answer": "x"}
[1, 2, 3]
{"prompt": "3+3?", "solution": "6", "id": 17}
{"problem": "   ", "answer": "1"}
{"problem": "bool answer", "answer": true}
"#;

    #[test]
    fn skip_policy_keeps_good_lines_and_reports_bad_ones_with_line_numbers() {
        let (ds, warns) = Dataset::from_jsonl_str("sets/toy.jsonl", GOOD_AND_BAD, &DatasetOptions::default())
            .expect("loads");
        assert_eq!(ds.len(), 3);
        assert_eq!(
            ds.get(0),
            Some(&Example {
                id: "a".into(),
                problem: "1+1?".into(),
                answer: "2".into(),
                source: "toy".into()
            })
        );
        // Default id from the file stem and line; default source = stem; numeric answer kept as text.
        assert_eq!(
            ds.get(1),
            Some(&Example {
                id: "toy-1".into(),
                problem: "2+2?".into(),
                answer: "4".into(),
                source: "toy".into()
            })
        );
        assert_eq!(ds.get(2).map(|e| (e.id.as_str(), e.answer.as_str())), Some(("17", "6")));
        assert_eq!(ds.get(3), None);

        let lines: Vec<&str> = warns.iter().map(|w| w.split(": ").next().unwrap_or("")).collect();
        assert_eq!(
            lines,
            [
                "sets/toy.jsonl:3",
                "sets/toy.jsonl:5",
                "sets/toy.jsonl:6",
                "sets/toy.jsonl:7",
                "sets/toy.jsonl:9",
                "sets/toy.jsonl:10"
            ]
        );
        assert!(warns[0].contains("invalid JSON"), "{}", warns[0]);
        assert!(warns[1].contains("no answer field"), "{}", warns[1]);
        assert!(warns[2].contains("field `problem`: expected a string, found an array"), "{}", warns[2]);
        assert!(warns[3].contains("expected a JSON object"), "{}", warns[3]);
        assert!(warns[4].contains("`problem` is empty"), "{}", warns[4]);
        assert!(warns[5].contains("found a boolean"), "{}", warns[5]);
    }

    #[test]
    fn reject_policy_fails_at_the_first_bad_line() {
        let opts = DatasetOptions { bad_lines: BadLinePolicy::Reject, ..Default::default() };
        let err = Dataset::from_jsonl_str("toy.jsonl", GOOD_AND_BAD, &opts).expect_err("rejects");
        match &err {
            Error::Parse { path, line, msg } => {
                assert_eq!(path, Path::new("toy.jsonl"));
                assert_eq!(*line, 3);
                assert!(msg.contains("invalid JSON"), "{msg}");
            }
            other => panic!("expected Parse, got {other:?}"),
        }
        assert!(err.to_string().starts_with("toy.jsonl:3: "), "{err}");
    }

    #[test]
    fn field_names_are_configurable_and_tried_in_order() {
        let text = r#"{"q": "first", "problem": "ignored", "gold": "A", "origin": "X", "uid": "u1"}
{"problem": "fallback", "gold": "B"}
"#;
        let opts = DatasetOptions {
            problem_fields: vec!["q".into(), "problem".into()],
            answer_fields: vec!["gold".into()],
            id_field: "uid".into(),
            source_field: "origin".into(),
            bad_lines: BadLinePolicy::Reject,
        };
        let (ds, warns) = Dataset::from_jsonl_str("dir/my-set.jsonl", text, &opts).expect("loads");
        assert!(warns.is_empty());
        assert_eq!(
            ds.examples(),
            &[
                Example { id: "u1".into(), problem: "first".into(), answer: "A".into(), source: "X".into() },
                Example {
                    id: "my-set-1".into(),
                    problem: "fallback".into(),
                    answer: "B".into(),
                    source: "my-set".into()
                },
            ]
        );
        // With the default names, neither line has an answer field: nothing loads.
        let err =
            Dataset::from_jsonl_str("dir/my-set.jsonl", text, &DatasetOptions::default()).expect_err("empty");
        assert!(err.to_string().contains("no valid examples (2 bad lines skipped"), "{err}");
    }

    #[test]
    fn null_counts_as_absent_and_wrong_typed_source_is_bad() {
        let text = "{\"problem\": null, \"question\": \"Q\", \"answer\": \"1\"}\n{\"problem\": \"P\", \"answer\": \"1\", \"source\": 3}\n";
        let (ds, warns) =
            Dataset::from_jsonl_str("t.jsonl", text, &DatasetOptions::default()).expect("loads");
        assert_eq!(ds.get(0).map(|e| e.problem.as_str()), Some("Q"));
        assert_eq!(warns.len(), 1);
        assert!(warns[0].starts_with("t.jsonl:2: field `source`"), "{}", warns[0]);
    }

    #[test]
    fn loads_every_benchmark_file_without_warnings() {
        let dir = repo_root().join("data/benchmarks");
        let expected = [
            ("aime24", 30, "AIME 2024"),
            ("aime25", 30, "AIME 2025"),
            ("amc23", 40, "AMC 2023"),
            ("math500", 500, "MATH-500"),
            ("minerva", 272, "Minerva Math (OCW)"),
            ("olympiadbench", 675, "OlympiadBench (OE_TO_maths_en_COMP)"),
            ("gsm8k", 1319, "GSM8K test"),
        ];
        for (name, n, source) in expected {
            let opts = DatasetOptions { bad_lines: BadLinePolicy::Reject, ..Default::default() };
            let (ds, warns) = Dataset::load(dir.join(format!("{name}.jsonl")), &opts).expect(name);
            assert!(warns.is_empty());
            assert_eq!(ds.len(), n, "{name}");
            let ids: std::collections::HashSet<&str> = ds.examples().iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids.len(), n, "{name}: ids are unique");
            assert!(ds.examples().iter().all(|e| e.source == source), "{name}");
        }
        let err = Dataset::load(dir.join("missing.jsonl"), &DatasetOptions::default()).expect_err("missing");
        assert!(err.to_string().contains("missing.jsonl"), "{err}");
    }

    #[test]
    fn sampler_covers_each_epoch_exactly_once_and_reshuffles() {
        let len = 10;
        let mut s = Sampler::new(len, 7).expect("sampler");
        let mut seen: Vec<usize> = Vec::new();
        for _ in 0..5 {
            seen.extend(s.next_batch(4).expect("batch"));
        }
        // 20 indices = exactly two epochs; the third batch straddles epochs 0 and 1.
        assert_eq!(s.epoch(), 2);
        assert_eq!(s.position(), 0);
        let (e0, e1) = seen.split_at(len);
        let sorted = |xs: &[usize]| {
            let mut v = xs.to_vec();
            v.sort_unstable();
            v
        };
        assert_eq!(sorted(e0), (0..len).collect::<Vec<_>>());
        assert_eq!(sorted(e1), (0..len).collect::<Vec<_>>());
        assert_ne!(e0, e1, "epochs should be shuffled differently");
        assert_ne!(e0, (0..len).collect::<Vec<_>>().as_slice(), "epoch 0 should be shuffled");

        let mut seq = Sampler::sequential(3).expect("sampler");
        assert_eq!(seq.next_batch(5).expect("batch"), vec![0, 1, 2, 0, 1]);
        assert_eq!((seq.epoch(), seq.position()), (1, 2));
        assert!(seq.next_batch(0).is_err());
        assert!(Sampler::new(0, 1).is_err());
    }

    #[test]
    fn sampler_is_deterministic_and_resumes_exactly() {
        let draw = |s: &mut Sampler, k: usize| -> Vec<Vec<usize>> {
            (0..k).map(|_| s.next_batch(3).expect("batch")).collect()
        };
        let mut a = Sampler::new(17, 42).expect("sampler");
        let mut b = Sampler::new(17, 42).expect("sampler");
        assert_eq!(draw(&mut a, 20), draw(&mut b, 20));
        let mut c = Sampler::new(17, 43).expect("sampler");
        let mut a2 = Sampler::new(17, 42).expect("sampler");
        assert_ne!(draw(&mut a2, 3), draw(&mut c, 3), "different seeds give different orders");

        // Save mid-epoch through JSON, restore, continue: same stream as uninterrupted.
        let mut full = Sampler::new(17, 5).expect("sampler");
        let reference = draw(&mut full, 15);
        let mut first = Sampler::new(17, 5).expect("sampler");
        let mut got = draw(&mut first, 7);
        let json = serde_json::to_string(&first).expect("serialize");
        assert!(!json.contains('['), "only the state is saved, not the permutation: {json}");
        let mut resumed: Sampler = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(resumed, first);
        got.extend(draw(&mut resumed, 8));
        assert_eq!(got, reference);

        let restored = Sampler::restore(first.state(), 17).expect("restore");
        assert_eq!(restored, first);
        assert!(Sampler::restore(first.state(), 18).is_err());
        let bad = SamplerState { pos: 99, ..first.state() };
        assert!(Sampler::try_from(bad).is_err());
    }

    #[test]
    fn select_maps_batch_indices_to_examples() {
        let (ds, _) = Dataset::from_jsonl_str(
            "t.jsonl",
            "{\"problem\":\"a\",\"answer\":\"1\"}\n{\"problem\":\"b\",\"answer\":\"2\"}\n",
            &DatasetOptions::default(),
        )
        .expect("loads");
        let picked = ds.select(&[1, 0, 1]).expect("in range");
        assert_eq!(picked.iter().map(|e| e.problem.as_str()).collect::<Vec<_>>(), ["b", "a", "b"]);
        assert!(ds.select(&[2]).is_err());
    }
}
