//! Task datasets: JSONL files (one object a line, as `data/benchmarks/*.jsonl`)
//! and Parquet files (as Hugging Face and verl ship them: DAPO-Math-17k,
//! verl's preprocessed GSM8K/MATH), one file, a folder of Hugging Face
//! shards (`data/train-00000-of-00002.parquet`, ...) or a `*` pattern, loaded
//! as one [`Dataset`].
//!
//! Records become [`Example`]s through [`super::record`] (configurable field
//! names, verl's schema understood by default). A bad JSONL line or Parquet
//! row is reported as `file:line: what was wrong` (`file: row N: ...`), and
//! [`BadLinePolicy`] decides whether it is skipped (returned as a warning) or
//! stops the load. A Parquet column that is missing or of the wrong type stops
//! the load with one error naming the file and the column.

use std::collections::{BTreeSet, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::parquet;
use super::record::{kind, parse_record};
pub use super::record::{BadLinePolicy, DatasetOptions, Example};
use crate::{Error, Result};

/// A loaded dataset: examples in file order (shards in name order).
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    path: PathBuf,
    examples: Vec<Example>,
    /// Where each example is (`file:line`, `file: row N`), for messages.
    places: Vec<String>,
}

/// A Parquet file ends (and starts) with these four bytes.
const PARQUET_MAGIC: &[u8; 4] = b"PAR1";

fn is_parquet(path: &Path) -> bool {
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet")) {
        return true;
    }
    let mut head = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok() && &head == PARQUET_MAGIC
}

fn is_data_file(path: &Path) -> bool {
    path.is_file()
        && path.extension().is_some_and(|e| {
            let e = e.to_string_lossy().to_ascii_lowercase();
            e == "parquet" || e == "jsonl"
        })
}

/// The split a Hugging Face data file belongs to: `train` for
/// `train-00000-of-00002.parquet` and for `train.jsonl`.
fn split_of(path: &Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.split('.').next().unwrap_or(&name);
    // `<split>-NNNNN-of-NNNNN`
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    if parts.len() == 4
        && parts[1] == "of"
        && [parts[0], parts[2]].iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        return parts[3].to_string();
    }
    stem.to_string()
}

fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.flatten().map(|e| e.path()).collect();
    files.sort();
    Ok(files)
}

/// The files `path` names: the file itself; a folder's `.parquet`/`.jsonl`
/// files (or its `data/` folder's, the Hugging Face repository layout) of one
/// split; or the files matching a final component with one `*`
/// (`data/train-*.parquet`).
pub fn resolve_files(path: &Path, opts: &DatasetOptions) -> Result<Vec<PathBuf>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name.contains('*') {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (pre, post) = name.split_once('*').unwrap_or((&name, ""));
        if post.contains('*') {
            return Err(Error::invalid(format!("{}: only one `*` is supported", path.display())));
        }
        let files: Vec<PathBuf> = list_dir(&dir)?
            .into_iter()
            .filter(|p| {
                let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                p.is_file() && n.len() >= pre.len() + post.len() && n.starts_with(pre) && n.ends_with(post)
            })
            .collect();
        if files.is_empty() {
            return Err(Error::invalid(format!("{}: no file matches", path.display())));
        }
        return Ok(files);
    }
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = list_dir(path)?.into_iter().filter(|p| is_data_file(p)).collect();
    if files.is_empty() && path.join("data").is_dir() {
        files = list_dir(&path.join("data"))?.into_iter().filter(|p| is_data_file(p)).collect();
    }
    if files.is_empty() {
        return Err(Error::invalid(format!(
            "{}: the folder holds no .parquet or .jsonl files (nor does its data/ folder)",
            path.display()
        )));
    }
    let splits: Vec<String> =
        files.iter().map(|p| split_of(p)).collect::<BTreeSet<_>>().into_iter().collect();
    match &opts.split {
        Some(s) => {
            files.retain(|p| &split_of(p) == s);
            if files.is_empty() {
                return Err(Error::invalid(format!(
                    "{}: no files of split {s:?} (the folder has splits {splits:?})",
                    path.display()
                )));
            }
        }
        None if splits.len() > 1 => {
            return Err(Error::invalid(format!(
                "{}: the folder holds several splits {splits:?}; choose one with data.options.split \
                 in a run config, --split on the command line (or give a pattern such as {}/train-*.parquet)",
                path.display(),
                files[0].parent().unwrap_or(path).display()
            )))
        }
        None => {}
    }
    Ok(files)
}

/// Collects examples and warnings, applying the bad-record policy and `dedupe`.
struct Collector<'a> {
    opts: &'a DatasetOptions,
    examples: Vec<Example>,
    places: Vec<String>,
    warnings: Vec<String>,
    seen: HashSet<(String, String)>,
    /// Valid records seen (duplicates included).
    parsed: usize,
}

impl<'a> Collector<'a> {
    fn new(opts: &'a DatasetOptions) -> Self {
        Collector {
            opts,
            examples: Vec::new(),
            places: Vec::new(),
            warnings: Vec::new(),
            seen: HashSet::new(),
            parsed: 0,
        }
    }

    /// Adds one parsed record; `place` names it in messages (`file:3`, `file: row 2`).
    fn add(
        &mut self,
        parsed: std::result::Result<Example, String>,
        place: impl Fn() -> String,
    ) -> Result<()> {
        match parsed {
            Ok(ex) => {
                self.parsed += 1;
                if !self.opts.dedupe || self.seen.insert((ex.problem.clone(), ex.answer.clone())) {
                    self.examples.push(ex);
                    self.places.push(place());
                }
                Ok(())
            }
            Err(msg) => match self.opts.bad_lines {
                BadLinePolicy::Reject => Err(Error::invalid(format!("{}: {msg}", place()))),
                BadLinePolicy::Skip => {
                    self.warnings.push(format!("{}: {msg}", place()));
                    Ok(())
                }
            },
        }
    }
}

/// The longest JSONL line a record may be (1 MiB): far above any problem of the math sets
/// (DAPO-Math-17k's longest is a few kB), far below what would exhaust memory as a prompt.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The text of a data file; bytes that are not UTF-8 are an error naming the line and
/// byte offset (the tokenizer and the JSON parser read UTF-8 only).
fn read_utf8(file: &Path) -> Result<String> {
    let bytes = std::fs::read(file).map_err(|e| Error::io(file, e))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let bytes = e.as_bytes();
        let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        let col = at - bytes[..at].iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1) + 1;
        Error::Parse {
            path: file.to_path_buf(),
            line,
            msg: format!("byte {col} of the line is not valid UTF-8 (data files must be UTF-8 text)"),
        }
    })
}

fn stem_of(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into())
}

impl Dataset {
    /// Loads a dataset: a JSONL or Parquet file, a folder of shards, or a `*`
    /// pattern (see [`resolve_files`]). Returns the dataset and one warning per
    /// skipped record (always empty under [`BadLinePolicy::Reject`]). Blank
    /// JSONL lines are ignored silently. A file with no valid example is an error.
    pub fn load(path: impl AsRef<Path>, opts: &DatasetOptions) -> Result<(Dataset, Vec<String>)> {
        let path = path.as_ref();
        check_options(path, opts)?;
        let files = resolve_files(path, opts)?;
        let mut c = Collector::new(opts);
        for file in &files {
            let (parsed, warned) = (c.parsed, c.warnings.len());
            if is_parquet(file) {
                let stem = stem_of(file);
                parquet::for_each_row(file, opts, &mut |i, obj| {
                    c.add(parse_record(&obj, i, &stem, opts), || format!("{}: row {i}", file.display()))
                })?;
            } else {
                let text = read_utf8(file)?;
                Self::collect_jsonl(file, &text, &mut c)?;
            }
            if c.parsed == parsed {
                return Err(no_examples(file, c.warnings.len() - warned, opts));
            }
        }
        Ok((Dataset { path: path.to_path_buf(), examples: c.examples, places: c.places }, c.warnings))
    }

    /// Parses JSONL text as if read from `path` (which names it in messages
    /// and gives the default source).
    pub fn from_jsonl_str(
        path: impl AsRef<Path>,
        text: &str,
        opts: &DatasetOptions,
    ) -> Result<(Dataset, Vec<String>)> {
        let path = path.as_ref();
        check_options(path, opts)?;
        let mut c = Collector::new(opts);
        Self::collect_jsonl(path, text, &mut c)?;
        if c.parsed == 0 {
            return Err(no_examples(path, c.warnings.len(), opts));
        }
        Ok((Dataset { path: path.to_path_buf(), examples: c.examples, places: c.places }, c.warnings))
    }

    fn collect_jsonl(path: &Path, text: &str, c: &mut Collector) -> Result<()> {
        let stem = stem_of(path);
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            // A byte-order mark (a file saved by Notepad, or files concatenated) is not data.
            let line = line.strip_prefix('\u{feff}').unwrap_or(line);
            if line.trim().is_empty() {
                continue;
            }
            // Checked before parsing: a huge line would become a huge prompt (and KV cache).
            let parsed = if line.len() > MAX_LINE_BYTES {
                Err(format!(
                    "the line is {:.1} MB, longer than a record may be ({} MiB)",
                    line.len() as f64 / 1e6,
                    MAX_LINE_BYTES >> 20
                ))
            } else {
                match serde_json::from_str::<Value>(line) {
                    Err(e) => Err(format!("invalid JSON: {e}")),
                    Ok(Value::Object(obj)) => parse_record(&obj, i, &stem, c.opts),
                    Ok(other) => Err(format!("expected a JSON object, found {}", kind(&other))),
                }
            };
            if let (Err(msg), BadLinePolicy::Reject) = (&parsed, c.opts.bad_lines) {
                return Err(Error::Parse { path: path.to_path_buf(), line: line_no, msg: msg.clone() });
            }
            c.add(parsed, || format!("{}:{line_no}", path.display()))?;
        }
        Ok(())
    }

    /// A dataset from examples already in memory; `path` is only a label.
    pub fn from_examples(path: impl Into<PathBuf>, examples: Vec<Example>) -> Dataset {
        let path = path.into();
        let places = (0..examples.len()).map(|i| format!("{}: example {i}", path.display())).collect();
        Dataset { path, examples, places }
    }

    /// Where the `i`-th example is: `file:line` for JSONL, `file: row N` for Parquet.
    pub fn place(&self, i: usize) -> &str {
        self.places.get(i).map_or("", String::as_str)
    }

    /// What it was loaded from (or the label given to [`Dataset::from_examples`]).
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

    /// The examples at `indices` (e.g. an [`super::EpochSampler`] batch);
    /// out-of-range indices are an error naming the dataset.
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

fn check_options(path: &Path, opts: &DatasetOptions) -> Result<()> {
    if opts.problem_fields.is_empty() || opts.answer_fields.is_empty() {
        return Err(Error::invalid(format!(
            "{}: dataset options need at least one problem field and one answer field",
            path.display()
        )));
    }
    Ok(())
}

fn no_examples(path: &Path, skipped: usize, opts: &DatasetOptions) -> Error {
    Error::invalid(format!(
        "{}: no valid examples ({skipped} bad lines skipped; problem fields {:?}, answer fields {:?})",
        path.display(),
        opts.problem_fields,
        opts.answer_fields
    ))
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
        assert_eq!(ds.get(0), Some(&Example::new("a", "1+1?", "2", "toy")));
        // Default id from the file stem and line; default source = stem; numeric answer kept as text.
        assert_eq!(ds.get(1), Some(&Example::new("toy-1", "2+2?", "4", "toy")));
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
        assert!(warns[2].contains("field `problem`: message 0: expected an object"), "{}", warns[2]);
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
            id_fields: vec!["uid".into()],
            source_fields: vec!["origin".into()],
            bad_lines: BadLinePolicy::Reject,
            ..Default::default()
        };
        let (ds, warns) = Dataset::from_jsonl_str("dir/my-set.jsonl", text, &opts).expect("loads");
        assert!(warns.is_empty());
        assert_eq!(
            ds.examples(),
            &[Example::new("u1", "first", "A", "X"), Example::new("my-set-1", "fallback", "B", "my-set"),]
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
