//! A tiny reasoning task for laptop-scale RL: multi-step integer arithmetic
//! worked out one operation per line, with the answer in `\boxed{}`.
//!
//! ```text
//! problem:  Compute 17+25-9.
//! solution: 17+25=42
//!           42-9=33
//!           \boxed{33}
//! ```
//!
//! Expressions are evaluated left to right; when a `*` follows a `+`/`-` the
//! prefix is parenthesised in the problem (`(17+25)*3`) so that the usual
//! precedence agrees with the written steps. The generator is seeded
//! (`rand::rngs::StdRng`) and deterministic for a seed and [`TaskConfig`].
//!
//! Also here: the byte-level BPE tokenizer trained on this task's text
//! ([`train_tokenizer`]) with Qwen3's special tokens, so that the prompt code
//! written for real Qwen3 ([`crate::data::Tokenizer`],
//! [`crate::data::PromptTemplate`]) serves the tiny model unchanged.
//! Digits are split one per token (as Qwen2/Qwen3's pre-tokenizer does), which
//! is what lets a small transformer learn column arithmetic.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, DecoderWrapper, TokenizerBuilder, TokenizerImpl};

use super::tokenizer::{Tokenizer, END_OF_TEXT, IM_END};
use crate::{Error, Result};

/// The Qwen3 special tokens every stapo tokenizer carries, in Qwen3's id order.
pub const SPECIAL_TOKENS: &[&str] = &[END_OF_TEXT, "<|im_start|>", IM_END, "<think>", "</think>"];

/// The `source` field written for generated problems.
pub const SOURCE: &str = "arith";

/// Difficulty knobs of the arithmetic generator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskConfig {
    /// Fewest operands in an expression (at least 2).
    pub min_operands: usize,
    /// Most operands in an expression; the count is uniform in `[min, max]`.
    pub max_operands: usize,
    /// Operands of `+` and `-` (and the first operand) are uniform in `[min_value, max_value]`.
    pub min_value: i64,
    /// See `min_value`.
    pub max_value: i64,
    /// The right operand of `*` is uniform in `[2, max_factor]`.
    pub max_factor: i64,
    /// The operators to draw from, each equally likely: any of `+`, `-`, `*`.
    pub ops: String,
    /// When false, a `-` never takes the running value below zero (its operand is
    /// drawn from `[min_value, running value]`, or the operator becomes `+`).
    pub allow_negative: bool,
}

impl Default for TaskConfig {
    /// 2 to 4 operands in 1..=99 with `+` and `-`, never negative: the mix used
    /// for `data/arith` and `models/tiny-qwen3`.
    fn default() -> Self {
        Self {
            min_operands: 2,
            max_operands: 4,
            min_value: 1,
            max_value: 99,
            max_factor: 9,
            ops: "+-".into(),
            allow_negative: false,
        }
    }
}

impl TaskConfig {
    /// Checks the knobs once, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| {
            Err(Error::Config { file: "task config".into(), field: field.into(), msg })
        };
        if self.min_operands < 2 {
            return bad("min_operands", format!("expected at least 2, found {}", self.min_operands));
        }
        if self.max_operands < self.min_operands {
            return bad(
                "max_operands",
                format!(
                    "expected at least min_operands ({}), found {}",
                    self.min_operands, self.max_operands
                ),
            );
        }
        if self.min_value < 0 || self.max_value < self.min_value {
            return bad(
                "max_value",
                format!(
                    "expected 0 <= min_value <= max_value, found {}..={}",
                    self.min_value, self.max_value
                ),
            );
        }
        if self.max_value > 1_000_000 || self.max_factor > 1_000 {
            return bad(
                "max_value",
                "values above 1e6 (factors above 1e3) could overflow long chains".into(),
            );
        }
        if self.ops.is_empty() || self.ops.chars().any(|c| !matches!(c, '+' | '-' | '*')) {
            return bad("ops", format!("expected a non-empty string of + - *, found {:?}", self.ops));
        }
        if self.ops.contains('*') && self.max_factor < 2 {
            return bad(
                "max_factor",
                format!("expected at least 2 when ops contain '*', found {}", self.max_factor),
            );
        }
        Ok(())
    }
}

/// One generated problem, in the dataset schema plus its worked solution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// The problem's id.
    pub id: String,
    /// The question, e.g. `Compute 17+25-9.` (no instruction suffix).
    pub problem: String,
    /// The integer answer as text, e.g. `33`.
    pub answer: String,
    /// Always [`SOURCE`].
    pub source: String,
    /// The step-by-step response, one `a op b = c` per line, ending in `\boxed{answer}`.
    pub solution: String,
}

/// Draws one problem from `rng`.
fn draw(rng: &mut impl Rng, cfg: &TaskConfig) -> (String, i64, String) {
    let ops: Vec<char> = cfg.ops.chars().collect();
    let n = rng.random_range(cfg.min_operands..=cfg.max_operands);
    let mut value = rng.random_range(cfg.min_value..=cfg.max_value);
    let mut expr = value.to_string();
    let mut steps = String::new();
    for _ in 1..n {
        let mut op = ops[rng.random_range(0..ops.len())];
        let operand = match op {
            '*' => rng.random_range(2..=cfg.max_factor),
            '-' if !cfg.allow_negative => {
                if value < cfg.min_value {
                    op = '+';
                    rng.random_range(cfg.min_value..=cfg.max_value)
                } else {
                    rng.random_range(cfg.min_value..=value.min(cfg.max_value))
                }
            }
            _ => rng.random_range(cfg.min_value..=cfg.max_value),
        };
        let next = match op {
            '+' => value + operand,
            '-' => value - operand,
            _ => value * operand,
        };
        steps.push_str(&format!("{value}{op}{operand}={next}\n"));
        if op == '*' && (expr.contains('+') || expr.contains('-')) {
            expr = format!("({expr})");
        }
        expr.push(op);
        expr.push_str(&operand.to_string());
        value = next;
    }
    steps.push_str(&format!("\\boxed{{{value}}}"));
    (format!("Compute {expr}."), value, steps)
}

/// `n` problems drawn with `seed`, ids `"{prefix}-{i}"`. Deterministic for a
/// seed and config; problems may repeat (see [`generate_split`] for disjoint sets).
pub fn generate(n: usize, seed: u64, cfg: &TaskConfig) -> Result<Vec<Problem>> {
    generate_excluding(n, seed, cfg, "arith", &HashSet::new(), false)
}

/// `n` problems drawn with `seed`, skipping any whose text is in `exclude`
/// (and repeats, when `unique`), ids `"{prefix}-{i}"`.
pub(crate) fn generate_excluding(
    n: usize,
    seed: u64,
    cfg: &TaskConfig,
    prefix: &str,
    exclude: &HashSet<String>,
    unique: bool,
) -> Result<Vec<Problem>> {
    cfg.validate()?;
    draw_problems(n, seed, prefix, exclude, unique, SOURCE, |rng| {
        let (problem, answer, solution) = draw(rng, cfg);
        (problem, answer.to_string(), solution)
    })
}

/// `n` problems from `draw` (problem, answer, solution) over a generator seeded
/// with `seed`, skipping any whose text is in `exclude` (and repeats, when
/// `unique`), ids `"{prefix}-{i}"`, `source` as given. A generator too narrow
/// for `n` distinct problems is an error, not a hang.
pub(crate) fn draw_problems(
    n: usize,
    seed: u64,
    prefix: &str,
    exclude: &HashSet<String>,
    unique: bool,
    source: &str,
    mut draw: impl FnMut(&mut rand::rngs::StdRng) -> (String, String, String),
) -> Result<Vec<Problem>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut seen: HashSet<String> = HashSet::new();
    let mut out = Vec::with_capacity(n);
    let max_draws = n.saturating_mul(50).max(1000);
    let mut draws = 0usize;
    while out.len() < n {
        draws += 1;
        if draws > max_draws {
            return Err(Error::invalid(format!(
                "{source} task: found only {} of {n} new distinct problems in {max_draws} draws; widen the task config",
                out.len()
            )));
        }
        let (problem, answer, solution) = draw(&mut rng);
        if exclude.contains(&problem) || (unique && !seen.insert(problem.clone())) {
            continue;
        }
        out.push(Problem {
            id: format!("{prefix}-{}", out.len()),
            problem,
            answer,
            source: source.into(),
            solution,
        });
    }
    Ok(out)
}

/// A training set of `n_train` problems (seed `seed`) and a held-out test set
/// of `n_test` distinct problems (seed `seed + 1`) none of which occurs in the
/// training set. Ids are `train-{i}` and `test-{i}`.
pub fn generate_split(
    n_train: usize,
    n_test: usize,
    seed: u64,
    cfg: &TaskConfig,
) -> Result<(Vec<Problem>, Vec<Problem>)> {
    let train = generate_excluding(n_train, seed, cfg, "train", &HashSet::new(), false)?;
    let seen: HashSet<String> = train.iter().map(|p| p.problem.clone()).collect();
    let test = generate_excluding(n_test, seed.wrapping_add(1), cfg, "test", &seen, true)?;
    Ok((train, test))
}

/// Writes problems as JSONL, one `{"id","problem","answer","source","solution"}`
/// object a line (the schema [`crate::data::Dataset`] reads).
pub fn write_jsonl(path: &Path, problems: &[Problem]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let mut text = String::with_capacity(problems.len() * 96);
    for p in problems {
        text.push_str(
            &serde_json::to_string(p)
                .map_err(|e| Error::invalid(format!("task: cannot serialise {}: {e}", p.id)))?,
        );
        text.push('\n');
    }
    let tmp = path.with_extension("jsonl.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(text.as_bytes()).map_err(|e| Error::io(&tmp, e))?;
    f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Reads problems written by [`write_jsonl`] (all five fields required).
pub fn read_jsonl(path: &Path) -> Result<Vec<Problem>> {
    crate::files::read_jsonl(path)
}

/// How the tokenizer is trained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerConfig {
    /// Total vocabulary, including the 256 byte symbols and the special tokens.
    pub vocab_size: usize,
    /// A pair must occur this often to be merged.
    pub min_frequency: u64,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        Self { vocab_size: 384, min_frequency: 2 }
    }
}

/// Trains a byte-level BPE tokenizer on `corpus`: Qwen3's special tokens first
/// (ids 0..5, [`SPECIAL_TOKENS`]), then all 256 byte symbols (so any text
/// encodes), then merges up to `vocab_size`. Digits are pre-split one per token.
/// Deterministic: the trainer breaks ties between equally frequent pairs by
/// token id, and its alphabet is sorted.
pub fn train_tokenizer<S: AsRef<str> + Send>(
    corpus: impl Iterator<Item = S> + Send,
    cfg: &TokenizerConfig,
) -> Result<Tokenizer> {
    let min = SPECIAL_TOKENS.len() + 256;
    if cfg.vocab_size < min {
        return Err(Error::Config {
            file: "tokenizer config".into(),
            field: "vocab_size".into(),
            msg: format!("expected at least {min} (specials + 256 bytes), found {}", cfg.vocab_size),
        });
    }
    let specials: Vec<AddedToken> =
        SPECIAL_TOKENS.iter().map(|t| AddedToken::from(t.to_string(), true)).collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(cfg.vocab_size)
        .min_frequency(cfg.min_frequency)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let pre = PreTokenizerWrapper::Sequence(PreSequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, true)),
    ]));
    let mut tok: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(pre))
        .with_post_processor(None)
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(false, false, true))))
        .build()
        .map_err(|e| Error::Tokenizer(format!("cannot build the BPE tokenizer: {e}")))?;
    tok.train(&mut trainer, corpus).map_err(|e| Error::Tokenizer(format!("BPE training failed: {e}")))?;
    Ok(Tokenizer::from_inner(tokenizers::Tokenizer::from(tok), "<trained bpe>"))
}

/// The text a tokenizer for this task should see: every prompt (rendered with
/// `render`) and every solution.
pub fn tokenizer_corpus<'a>(
    problems: &'a [Problem],
    render: impl Fn(&str) -> String + 'a,
) -> impl Iterator<Item = String> + 'a {
    problems.iter().flat_map(move |p| [render(&p.problem), p.solution.clone()])
}

/// Saves `tok` as `tokenizer.json` (pretty, byte-stable) in `dir`, with a
/// `tokenizer_config.json` naming the special tokens for Hugging Face.
pub fn save_tokenizer(tok: &Tokenizer, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join("tokenizer.json");
    let text = tok
        .inner()
        .to_string(true)
        .map_err(|e| Error::Tokenizer(format!("{}: cannot serialise: {e}", path.display())))?;
    std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
    let added: serde_json::Map<String, serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .filter_map(|t| tok.id_of(t).map(|id| (id, t)))
        .map(|(id, t)| {
            (
                id.to_string(),
                serde_json::json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}),
            )
        })
        .collect();
    let cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": null,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "additional_special_tokens": [IM_END, "<|im_start|>", "<think>", "</think>"],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": false,
    });
    let cpath = dir.join("tokenizer_config.json");
    let text = serde_json::to_string_pretty(&cfg).map_err(|e| Error::invalid(e.to_string()))?;
    std::fs::write(&cpath, text).map_err(|e| Error::io(&cpath, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{BOXED_SUFFIX, SUFFIX_SEPARATOR};

    /// Replays a solution's steps and checks each line's arithmetic.
    fn check_solution(p: &Problem) {
        let lines: Vec<&str> = p.solution.lines().collect();
        let last = lines.last().expect("non-empty solution");
        assert_eq!(*last, format!("\\boxed{{{}}}", p.answer), "{p:?}");
        let mut prev: Option<i64> = None;
        for l in &lines[..lines.len() - 1] {
            let (lhs, rhs) = l.split_once('=').expect("a = line");
            let op_pos = lhs.rfind(['+', '-', '*']).expect("an operator");
            let a: i64 = lhs[..op_pos].parse().expect("left operand");
            let b: i64 = lhs[op_pos + 1..].parse().expect("right operand");
            let c: i64 = rhs.parse().expect("result");
            let want = match &lhs[op_pos..op_pos + 1] {
                "+" => a + b,
                "-" => a - b,
                _ => a * b,
            };
            assert_eq!(c, want, "{l}");
            if let Some(pv) = prev {
                assert_eq!(a, pv, "steps chain: {p:?}");
            }
            prev = Some(c);
        }
        assert_eq!(prev.map(|v| v.to_string()), Some(p.answer.clone()));
    }

    #[test]
    fn problems_are_correct_and_deterministic() {
        let cfg = TaskConfig::default();
        let a = generate(300, 7, &cfg).expect("generate");
        let b = generate(300, 7, &cfg).expect("generate");
        let c = generate(300, 8, &cfg).expect("generate");
        assert_eq!(a, b);
        assert_ne!(a, c);
        for p in &a {
            check_solution(p);
            let n_ops = p.solution.lines().count() - 1;
            assert!((1..=3).contains(&n_ops), "{p:?}");
            assert!(p.answer.parse::<i64>().expect("int") >= 0, "{p:?}");
            assert!(p.problem.starts_with("Compute ") && p.problem.ends_with('.'));
        }
        // Every operand count appears.
        for k in 1..=3 {
            assert!(a.iter().any(|p| p.solution.lines().count() - 1 == k), "no problem with {k} steps");
        }
    }

    #[test]
    fn multiplication_is_parenthesised_to_match_the_steps() {
        let cfg = TaskConfig { ops: "+*".into(), allow_negative: true, ..TaskConfig::default() };
        let ps = generate(200, 3, &cfg).expect("generate");
        for p in &ps {
            check_solution(p);
        }
        assert!(ps.iter().any(|p| p.problem.contains(")*")), "some prefix sum gets multiplied");
        let p = ps.iter().find(|p| p.problem.contains(")*")).expect("one");
        // Evaluate the written problem with standard precedence: parentheses first.
        let expr = p.problem.trim_start_matches("Compute ").trim_end_matches('.');
        let inner_end = expr.rfind(')').expect(")");
        let inner = &expr[expr.rfind('(').expect("(") + 1..inner_end];
        assert!(!inner.contains('*') || inner.contains('('), "{expr}");
    }

    #[test]
    fn split_is_disjoint_and_files_round_trip() {
        let cfg = TaskConfig::default();
        let (train, test) = generate_split(2000, 200, 11, &cfg).expect("split");
        assert_eq!((train.len(), test.len()), (2000, 200));
        let seen: HashSet<&str> = train.iter().map(|p| p.problem.as_str()).collect();
        assert!(test.iter().all(|p| !seen.contains(p.problem.as_str())));
        let distinct: HashSet<&str> = test.iter().map(|p| p.problem.as_str()).collect();
        assert_eq!(distinct.len(), test.len());
        assert_eq!(test[5].id, "test-5");

        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/test.jsonl");
        write_jsonl(&path, &test).expect("write");
        assert_eq!(read_jsonl(&path).expect("read"), test);
        // The dataset loader reads the same file.
        let (ds, bad) =
            crate::data::Dataset::load(&path, &crate::data::DatasetOptions::default()).expect("dataset");
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(ds.len(), 200);
        assert_eq!(ds.examples()[3].answer, test[3].answer);
        assert_eq!(ds.examples()[3].problem, test[3].problem);
    }

    #[test]
    fn bad_configs_are_rejected() {
        for cfg in [
            TaskConfig { min_operands: 1, ..TaskConfig::default() },
            TaskConfig { max_operands: 1, ..TaskConfig::default() },
            TaskConfig { ops: "+/".into(), ..TaskConfig::default() },
            TaskConfig { min_value: 5, max_value: 4, ..TaskConfig::default() },
        ] {
            assert!(generate(1, 0, &cfg).is_err(), "{cfg:?}");
        }
        // Too narrow for the requested number of distinct test problems.
        let narrow = TaskConfig {
            min_operands: 2,
            max_operands: 2,
            min_value: 1,
            max_value: 2,
            ops: "+".into(),
            ..TaskConfig::default()
        };
        let err = generate_split(1, 50, 0, &narrow).expect_err("only 4 distinct problems exist");
        assert!(err.to_string().contains("distinct"), "{err}");
    }

    fn small_tokenizer() -> (Tokenizer, Vec<Problem>) {
        let ps = generate(500, 1, &TaskConfig::default()).expect("generate");
        let raw = |q: &str| format!("{q}{SUFFIX_SEPARATOR}{BOXED_SUFFIX}");
        let tok = train_tokenizer(tokenizer_corpus(&ps, raw), &TokenizerConfig::default()).expect("train");
        (tok, ps)
    }

    #[test]
    fn tokenizer_has_qwen_specials_and_round_trips() {
        let (tok, ps) = small_tokenizer();
        // The task's text has fewer mergeable pairs than the budget allows.
        assert!(
            (SPECIAL_TOKENS.len() + 256 + 20..=TokenizerConfig::default().vocab_size)
                .contains(&tok.vocab_size()),
            "{}",
            tok.vocab_size()
        );
        let prompt = format!("{}{SUFFIX_SEPARATOR}{BOXED_SUFFIX}", ps[0].problem);
        let ids = tok.encode(&prompt, false).expect("encode");
        // "Compute 79-34+77+96.\nPlease reason step by step, ..." is about 30 tokens.
        assert!(ids.len() < 40, "{}", ids.len());
        for (i, s) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.id_of(s), Some(i as u32), "{s}");
        }
        assert_eq!(tok.pad_id(), 0);
        assert_eq!(tok.eos_ids(), &[2, 0]);
        for p in ps.iter().take(50) {
            let ids = tok.encode(&p.solution, false).expect("encode");
            assert_eq!(tok.decode(&ids, false).expect("decode"), p.solution);
            // Digits are single tokens: every number costs one token per digit.
            let digits = p.solution.chars().filter(char::is_ascii_digit).count();
            let digit_tokens =
                ids.iter().filter(|&&i| tok.token_str(i).chars().all(|c| c.is_ascii_digit())).count();
            assert_eq!(digit_tokens, digits, "{:?}", p.solution);
        }
        // Specials are single ids, skipped on request; text outside the corpus survives.
        let text = "<|im_start|>user\nWhat is 12 × 3? é 🚀\\boxed{36}<|im_end|>";
        let ids = tok.encode(text, false).expect("encode");
        assert_eq!(ids[0], 1);
        assert_eq!(*ids.last().expect("ids"), 2);
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
        assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nWhat is 12 × 3? é 🚀\\boxed{36}");
        // The instruction suffix merges into a handful of tokens.
        let suffix = tok.encode(crate::data::BOXED_SUFFIX, false).expect("encode");
        assert!(suffix.len() < 30, "{}", suffix.len());
    }

    #[test]
    fn tokenizer_training_is_deterministic_and_saves() {
        let (a, _) = small_tokenizer();
        let (b, _) = small_tokenizer();
        let ja = a.inner().to_string(true).expect("json");
        assert_eq!(ja, b.inner().to_string(true).expect("json"));
        let dir = tempfile::tempdir().expect("tempdir");
        save_tokenizer(&a, dir.path()).expect("save");
        let loaded = Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("load");
        let s = "17+25=42\n42-9=33\n\\boxed{33}";
        assert_eq!(loaded.encode(s, false).expect("encode"), a.encode(s, false).expect("encode"));
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).expect("read"),
        )
        .expect("json");
        assert_eq!(cfg["eos_token"], END_OF_TEXT);
        assert!(train_tokenizer(["x"].into_iter(), &TokenizerConfig { vocab_size: 10, min_frequency: 1 })
            .is_err());
    }
}
