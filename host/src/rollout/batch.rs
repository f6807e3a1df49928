//! Sampled responses, their groups, and the JSONL file a batch is saved to so
//! that it can be inspected or replayed offline.
//!
//! File layout, one JSON object per line, `kind` first:
//!
//! ```text
//! {"kind":"prompt","index":0,"id":"gsm8k-12","text":"...","answer":"42"}
//! {"kind":"sample","group":0,"prompt_index":0,"sample_index":0,"prompt_ids":[..],
//!  "response_ids":[..],"logprobs":[..],"old_logprobs":[..],"entropies":[..],
//!  "text":"...","finish":"eos","truncated":false,"reward":1.0}
//! ```
//!
//! Prompt lines come first, in index order. Floats are written by serde_json
//! in their shortest round-trip form, so save → load gives back identical
//! `f32`s (tested over random bit patterns below).

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// The model's EOS token (kept as the response's last token).
    Eos,
    /// A caller's stop token, e.g. `<|im_end|>` (kept as the last token).
    Stop,
    /// The decoded text came to contain a stop string; the response ends with
    /// the token that completed it.
    StopString,
    /// `max_new_tokens` reached: the response is truncated.
    Length,
}

/// One sampled response and what RL needs of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The GRPO group: samples of one group share a prompt and are normalised together.
    pub group: usize,
    /// Index of the prompt in the batch (into [`RolloutBatch::prompts`]).
    pub prompt_index: usize,
    /// Index of this sample within its group, `0..n`.
    pub sample_index: usize,
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The sampled tokens, stop token included.
    pub response_ids: Vec<u32>,
    /// Per token: log-prob under the distribution it was sampled from (after
    /// temperature and top-k/top-p renormalisation; 0 when greedy).
    pub logprobs: Vec<f32>,
    /// Per token: log-prob under the untempered model over the full vocabulary
    /// (temperature 1, no filter), i.e. pi_old of the PPO ratio.
    pub old_logprobs: Vec<f32>,
    /// Per token: entropy (nats) of the untempered full-vocabulary distribution.
    pub entropies: Vec<f32>,
    /// Per token: the policy version (updates applied) whose weights drew it,
    /// under partial rollouts (`rollout.partial`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<u64>,
    /// The decoded response (stop token or stop string included).
    pub text: String,
    /// Why generation stopped.
    pub finish: Finish,
    /// True when the response hit `max_new_tokens` without stopping.
    pub truncated: bool,
    /// Set by the reward stage.
    pub reward: Option<f32>,
}

impl Sample {
    /// Number of response tokens.
    pub fn response_len(&self) -> usize {
        self.response_ids.len()
    }
}

/// What a batch knows about one prompt besides its tokens.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PromptInfo {
    /// The dataset's id of the problem.
    pub id: String,
    /// The prompt text (as templated for the model, or the raw problem).
    pub text: String,
    /// The reference answer, when the task has one.
    pub answer: Option<String>,
}

/// The samples of one rollout phase and the prompts they answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RolloutBatch {
    /// The samples, ordered by prompt, then sample index.
    pub samples: Vec<Sample>,
    /// Indexed by [`Sample::prompt_index`]; may be empty when unknown.
    pub prompts: Vec<PromptInfo>,
}

/// A line of the JSONL file, as written.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Record<'a> {
    Prompt { index: usize, id: &'a str, text: &'a str, answer: Option<&'a str> },
    Sample(&'a Sample),
}

impl RolloutBatch {
    /// A batch of `samples` answering `prompts`.
    pub fn new(samples: Vec<Sample>, prompts: Vec<PromptInfo>) -> Self {
        Self { samples, prompts }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True when there is no sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Total number of response tokens.
    pub fn num_response_tokens(&self) -> usize {
        self.samples.iter().map(Sample::response_len).sum()
    }

    /// Mean response length in tokens (0 for an empty batch).
    pub fn mean_response_len(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        self.num_response_tokens() as f64 / self.samples.len() as f64
    }

    /// Longest response in tokens.
    pub fn max_response_len(&self) -> usize {
        self.samples.iter().map(Sample::response_len).max().unwrap_or(0)
    }

    /// Fraction of responses cut at `max_new_tokens` (0 for an empty batch).
    pub fn truncation_rate(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        self.samples.iter().filter(|s| s.truncated).count() as f64 / self.samples.len() as f64
    }

    /// Mean reward over the samples that have one (None if none has).
    pub fn mean_reward(&self) -> Option<f64> {
        let r: Vec<f64> = self.samples.iter().filter_map(|s| s.reward.map(f64::from)).collect();
        (!r.is_empty()).then(|| r.iter().sum::<f64>() / r.len() as f64)
    }

    /// The groups in order of first appearance: `(group id, its samples)`.
    pub fn groups(&self) -> impl Iterator<Item = (usize, Vec<&Sample>)> + '_ {
        let mut order: Vec<usize> = Vec::new();
        let mut members: std::collections::HashMap<usize, Vec<&Sample>> = std::collections::HashMap::new();
        for s in &self.samples {
            members
                .entry(s.group)
                .or_insert_with(|| {
                    order.push(s.group);
                    Vec::new()
                })
                .push(s);
        }
        order.into_iter().map(move |g| (g, members.remove(&g).unwrap_or_default()))
    }

    /// Writes the batch to `path` as JSONL, atomically: a temporary file in the
    /// same folder, synced, then renamed over `path`. Refuses non-finite floats,
    /// which JSON cannot represent.
    pub fn save_jsonl(&self, path: &Path) -> Result<()> {
        for (i, s) in self.samples.iter().enumerate() {
            for (field, values) in
                [("logprobs", &s.logprobs), ("old_logprobs", &s.old_logprobs), ("entropies", &s.entropies)]
            {
                if let Some(j) = values.iter().position(|v| !v.is_finite()) {
                    return Err(Error::invalid(format!(
                        "save {}: sample {i} field `{field}`[{j}] is {}, which JSON cannot hold",
                        path.display(),
                        values[j]
                    )));
                }
            }
            if let Some(r) = s.reward.filter(|r| !r.is_finite()) {
                return Err(Error::invalid(format!(
                    "save {}: sample {i} field `reward` is {r}",
                    path.display()
                )));
            }
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut w = BufWriter::new(std::fs::File::create(&tmp)?);
            for (index, p) in self.prompts.iter().enumerate() {
                let rec = Record::Prompt { index, id: &p.id, text: &p.text, answer: p.answer.as_deref() };
                serde_json::to_writer(&mut w, &rec)?;
                w.write_all(b"\n")?;
            }
            for s in &self.samples {
                serde_json::to_writer(&mut w, &Record::Sample(s))?;
                w.write_all(b"\n")?;
            }
            w.into_inner().map_err(|e| e.into_error())?.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io(&tmp, e));
        }
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    /// Reads a batch written by [`Self::save_jsonl`]. Errors name the file, the
    /// line and the field. Blank lines are skipped; unknown fields are ignored.
    pub fn load_jsonl(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let parse_err = |line: usize, msg: String| Error::Parse { path: path.to_path_buf(), line, msg };
        let mut batch = RolloutBatch::default();
        let mut sample_lines = Vec::new();
        for (i, line) in BufReader::new(file).lines().enumerate() {
            let line_no = i + 1;
            let line = line.map_err(|e| Error::io(path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: Value =
                serde_json::from_str(&line).map_err(|e| parse_err(line_no, format!("invalid JSON: {e}")))?;
            let Value::Object(map) = value else {
                return Err(parse_err(line_no, "expected a JSON object".into()));
            };
            let obj = Fields(&map);
            match obj.req::<String>("kind").map_err(|m| parse_err(line_no, m))?.as_str() {
                "prompt" => {
                    let (index, info) = obj.prompt().map_err(|m| parse_err(line_no, m))?;
                    if index != batch.prompts.len() {
                        let msg = format!(
                            "field `index`: expected {} (prompts in order), found {index}",
                            batch.prompts.len()
                        );
                        return Err(parse_err(line_no, msg));
                    }
                    batch.prompts.push(info);
                }
                "sample" => {
                    let sample = obj.sample().map_err(|m| parse_err(line_no, m))?;
                    if let Some(r) = sample.reward.filter(|r| !r.is_finite()) {
                        let raw = map.get("reward").map_or(String::new(), |v| format!(" ({v})"));
                        let msg = format!(
                            "field `reward` of sample {} is {r}{raw}: a reward must be a finite f32 \
                             (|r| < 3.4e38)",
                            batch.samples.len()
                        );
                        return Err(parse_err(line_no, msg));
                    }
                    batch.samples.push(sample);
                    sample_lines.push(line_no);
                }
                other => {
                    let msg = format!("field `kind`: expected \"prompt\" or \"sample\", found {other:?}");
                    return Err(parse_err(line_no, msg));
                }
            }
        }
        if !batch.prompts.is_empty() {
            for (s, &line) in batch.samples.iter().zip(&sample_lines) {
                if s.prompt_index >= batch.prompts.len() {
                    let msg = format!(
                        "field `prompt_index`: {} but the file has {} prompts",
                        s.prompt_index,
                        batch.prompts.len()
                    );
                    return Err(parse_err(line, msg));
                }
            }
        }
        Ok(batch)
    }
}

/// Typed access to the fields of one JSON object, with errors naming the field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn req<T: DeserializeOwned>(&self, name: &str) -> std::result::Result<T, String> {
        let v = self.0.get(name).ok_or_else(|| format!("missing field `{name}`"))?;
        T::deserialize(v).map_err(|e| format!("field `{name}`: {e}"))
    }

    fn opt<T: DeserializeOwned>(&self, name: &str) -> std::result::Result<Option<T>, String> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => T::deserialize(v).map(Some).map_err(|e| format!("field `{name}`: {e}")),
        }
    }

    fn prompt(&self) -> std::result::Result<(usize, PromptInfo), String> {
        Ok((
            self.req("index")?,
            PromptInfo { id: self.req("id")?, text: self.req("text")?, answer: self.opt("answer")? },
        ))
    }

    fn sample(&self) -> std::result::Result<Sample, String> {
        let s = Sample {
            group: self.req("group")?,
            prompt_index: self.req("prompt_index")?,
            sample_index: self.req("sample_index")?,
            prompt_ids: self.req("prompt_ids")?,
            response_ids: self.req("response_ids")?,
            logprobs: self.req("logprobs")?,
            old_logprobs: self.req("old_logprobs")?,
            entropies: self.req("entropies")?,
            versions: self.opt("versions")?.unwrap_or_default(),
            text: self.req("text")?,
            finish: self.req("finish")?,
            truncated: self.req("truncated")?,
            reward: self.opt("reward")?,
        };
        let n = s.response_ids.len();
        for (field, len) in [
            ("logprobs", s.logprobs.len()),
            ("old_logprobs", s.old_logprobs.len()),
            ("entropies", s.entropies.len()),
        ] {
            if len != n {
                return Err(format!("field `{field}`: {len} values for {n} response tokens"));
            }
        }
        if !s.versions.is_empty() && s.versions.len() != n {
            return Err(format!("field `versions`: {} values for {n} response tokens", s.versions.len()));
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    fn random_batch(seed: u64) -> RolloutBatch {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut f = || {
            // Random finite f32 bit patterns, including subnormals and extremes.
            loop {
                let v = f32::from_bits(rng.random());
                if v.is_finite() {
                    return v;
                }
            }
        };
        let samples = (0..6)
            .map(|i| {
                let len = i * 3;
                Sample {
                    group: i / 2,
                    prompt_index: i / 2,
                    sample_index: i % 2,
                    prompt_ids: vec![1, 2, 3 + i as u32],
                    response_ids: (0..len as u32).collect(),
                    logprobs: (0..len).map(|_| f()).collect(),
                    old_logprobs: (0..len).map(|_| f()).collect(),
                    entropies: (0..len).map(|_| f()).collect(),
                    versions: if i % 2 == 0 { Vec::new() } else { (0..len as u64).map(|t| t / 2).collect() },
                    text: format!("line \"{i}\"\n\tunicode: é ∑ 😀"),
                    finish: [Finish::Eos, Finish::Stop, Finish::StopString, Finish::Length][i % 4],
                    truncated: i % 4 == 3,
                    reward: (i % 3 != 0).then(&mut f),
                }
            })
            .collect();
        let prompts = (0..3)
            .map(|i| PromptInfo {
                id: format!("p{i}"),
                text: format!("What is {i}+{i}?\n"),
                answer: (i != 1).then(|| (2 * i).to_string()),
            })
            .collect();
        RolloutBatch::new(samples, prompts)
    }

    #[test]
    fn f32_survives_a_json_round_trip() {
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..200_000 {
            let v = f32::from_bits(rng.random());
            if v.is_finite() {
                let back: f32 =
                    serde_json::from_str(&serde_json::to_string(&v).expect("write")).expect("read");
                assert_eq!(back.to_bits(), v.to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn jsonl_round_trip_is_identical() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rollouts.jsonl");
        let batch = random_batch(5);
        batch.save_jsonl(&path).expect("save");
        let back = RolloutBatch::load_jsonl(&path).expect("load");
        assert_eq!(back, batch);
        // Bit-identical floats, not just ==.
        for (a, b) in back.samples.iter().zip(&batch.samples) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.logprobs), bits(&b.logprobs));
            assert_eq!(bits(&a.entropies), bits(&b.entropies));
        }
        // Saving again over the file works and leaves no temporary behind.
        back.save_jsonl(&path).expect("save again");
        let names: Vec<_> =
            std::fs::read_dir(dir.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("rollouts.jsonl")]);
    }

    #[test]
    fn bad_lines_name_file_line_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.jsonl");
        let good = random_batch(1);
        good.save_jsonl(&path).expect("save");
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<&str> = text.lines().collect();
        let cases = [
            (lines[4].replace("\"logprobs\":[", "\"logprobs\":[\"x\","), "field `logprobs`"),
            (lines[4].replace("\"finish\":\"stop\"", "\"finish\":\"done\""), "field `finish`"),
            (lines[4].replace("\"group\":0,", ""), "missing field `group`"),
            (lines[4].replace("\"entropies\":[", "\"entropies\":[1.0,"), "field `entropies`: 4 values for 3"),
            (lines[4].replace("\"prompt_index\":0", "\"prompt_index\":7"), "field `prompt_index`"),
            (lines[4].replace("\"kind\":\"sample\"", "\"kind\":\"sampel\""), "field `kind`"),
            ("{not json".to_string(), "invalid JSON"),
        ];
        for (bad, expect) in cases {
            let mut edited: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
            edited[4] = bad;
            std::fs::write(&path, edited.join("\n")).expect("write");
            let err = RolloutBatch::load_jsonl(&path).expect_err(expect);
            let msg = err.to_string();
            assert!(matches!(err, Error::Parse { line: 5, .. }), "{msg}");
            assert!(msg.starts_with(&format!("{}:5: ", path.display())), "{msg}");
            assert!(msg.contains(expect), "{msg} lacks {expect}");
        }
    }

    #[test]
    fn non_finite_values_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut batch = random_batch(2);
        batch.samples[2].old_logprobs[1] = f32::NEG_INFINITY;
        let err = batch.save_jsonl(&dir.path().join("x.jsonl")).expect_err("-inf").to_string();
        assert!(err.contains("sample 2 field `old_logprobs`[1]"), "{err}");
    }

    #[test]
    fn summaries_and_groups() {
        let batch = random_batch(3);
        assert_eq!(batch.num_response_tokens(), 3 * (1 + 2 + 3 + 4 + 5));
        assert!((batch.mean_response_len() - 7.5).abs() < 1e-12);
        assert_eq!(batch.max_response_len(), 15);
        assert!((batch.truncation_rate() - 1.0 / 6.0).abs() < 1e-12);
        let groups: Vec<(usize, Vec<usize>)> =
            batch.groups().map(|(g, s)| (g, s.iter().map(|s| s.sample_index).collect())).collect();
        assert_eq!(groups, vec![(0, vec![0, 1]), (1, vec![0, 1]), (2, vec![0, 1])]);
        assert_eq!(RolloutBatch::default().mean_response_len(), 0.0);
    }
}
