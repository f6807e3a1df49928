//! Rule-based rewards for math answers: final-answer extraction and
//! mathematical equivalence against a reference.
//!
//! This is the verifier behind the binary correctness reward of DAPO/GRPO
//! math RL (R = 1 when the last `\boxed{}` equals the reference). It aims at
//! the behaviour of the Python tools researchers use — Hendrycks MATH
//! `is_equiv`, the Minerva/DAPO normalisers and Hugging Face math-verify —
//! without Python: extraction in `extract`, normalisation in `normalize`,
//! a LaTeX expression evaluator in `expr` and structural/numeric comparison
//! in `equiv`. Every verdict is bounded work: no panics, no unbounded
//! recursion, long inputs fall back to plain string comparison.

mod equiv;
mod expr;
mod extract;
mod normalize;

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub use extract::has_boxed;

/// Boxed answers nested inside each other that are unwrapped (`\boxed{\boxed{5}}`).
const MAX_UNBOX: usize = 3;

/// How the final answer is found in a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExtractMode {
    /// Only the last `\boxed{...}` counts (the STAPO/DAPO setting).
    #[default]
    Strict,
    /// The last `\boxed{...}`, else "the answer is X" / "Answer: X" / "#### X",
    /// else the last number in the response.
    Flexible,
    /// DAPO-Math's last "Answer: X" line (verl's `math_dapo` reward), for
    /// prompts that ask for that format instead of `\boxed{}`.
    #[serde(rename = "answer_line")]
    AnswerLine,
}

impl FromStr for ExtractMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "strict" => Ok(ExtractMode::Strict),
            "flexible" => Ok(ExtractMode::Flexible),
            "answer_line" | "answer-line" => Ok(ExtractMode::AnswerLine),
            other => Err(Error::invalid(format!(
                "extract mode: expected `strict`, `flexible` or `answer_line`, found `{other}`"
            ))),
        }
    }
}

impl fmt::Display for ExtractMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExtractMode::Strict => "strict",
            ExtractMode::Flexible => "flexible",
            ExtractMode::AnswerLine => "answer_line",
        })
    }
}

/// The final answer of `response`, or `None` when there is none under `mode`.
///
/// ```
/// # use stapo::reward::{extract_answer, ExtractMode};
/// assert_eq!(extract_answer("so $\\boxed{\\frac{1}{2}}$.", ExtractMode::Strict).as_deref(), Some("\\frac{1}{2}"));
/// assert_eq!(extract_answer("The answer is 7.", ExtractMode::Strict), None);
/// assert_eq!(extract_answer("The answer is 7.", ExtractMode::Flexible).as_deref(), Some("7"));
/// ```
pub fn extract_answer(response: &str, mode: ExtractMode) -> Option<String> {
    match mode {
        ExtractMode::Strict => extract::last_boxed(response),
        ExtractMode::Flexible => extract::flexible(response),
        ExtractMode::AnswerLine => extract::answer_line(response),
    }
}

/// Whether `answer` is mathematically equivalent to the reference `gold`.
/// A `\boxed{}` around either is tolerated.
///
/// ```
/// # use stapo::reward::is_equivalent;
/// assert!(is_equivalent("\\frac{1}{2}", "0.5"));
/// assert!(is_equivalent("(-\\infty, 2) \\cup (3, \\infty)", "(3,\\infty)\\cup(-\\infty,2)"));
/// assert!(!is_equivalent("[2, 4]", "(2, 4)"));
/// ```
pub fn is_equivalent(gold: &str, answer: &str) -> bool {
    equiv::equivalent(&unbox(gold), &unbox(answer))
}

/// Strips enclosing `\boxed{...}` layers.
fn unbox(s: &str) -> String {
    let mut s = s.trim().to_string();
    for _ in 0..MAX_UNBOX {
        if !(s.contains("\\boxed") || s.contains("\\fbox")) {
            break;
        }
        match extract::last_boxed(&s) {
            Some(inner) => s = inner,
            None => break,
        }
    }
    s
}

/// The outcome of checking one response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// The extracted answer equals the reference.
    pub correct: bool,
    /// The final answer found in the response, if any.
    pub extracted: Option<String>,
}

impl Verdict {
    /// The scalar reward: `right` when correct, else `wrong` (1/0 or 1/-1).
    pub fn reward(&self, right: f64, wrong: f64) -> f64 {
        if self.correct {
            right
        } else {
            wrong
        }
    }
}

/// Extracts the final answer of `response` and compares it with `gold`.
pub fn verify(gold: &str, response: &str, mode: ExtractMode) -> Verdict {
    let extracted = extract_answer(response, mode);
    let correct = extracted.as_deref().is_some_and(|a| is_equivalent(gold, a));
    Verdict { correct, extracted }
}

/// One output line of [`verify_jsonl`].
#[derive(Serialize)]
struct Row<'a> {
    gold: &'a str,
    pred: &'a str,
    extracted: Option<&'a str>,
    correct: bool,
}

/// Reads a JSONL file with fields `gold` and `pred` (a JSON string, or a
/// number for `gold`), writes one JSON line `{"gold","pred","extracted","correct"}`
/// per input line to `out`, and returns `(n_correct, n_total)`. Blank lines
/// are skipped; bad JSON or a missing field is an error naming `file:line`.
pub fn verify_jsonl(input: &Path, mode: ExtractMode, out: &mut dyn Write) -> Result<(usize, usize)> {
    let file = std::fs::File::open(input).map_err(|e| Error::io(input, e))?;
    let parse_err = |line: usize, msg: String| Error::Parse { path: input.to_path_buf(), line, msg };
    let out_err = |e: std::io::Error| Error::io("<verify output>", e);
    let (mut n_correct, mut n_total) = (0, 0);
    for (idx, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(input, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| parse_err(idx + 1, format!("invalid JSON: {e}")))?;
        let field = |name: &str| match value.get(name) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(serde_json::Value::Number(n)) if name == "gold" => Ok(n.to_string()),
            Some(other) => {
                Err(parse_err(idx + 1, format!("field `{name}`: expected a string, found {other}")))
            }
            None => Err(parse_err(idx + 1, format!("missing field `{name}`"))),
        };
        let (gold, pred) = (field("gold")?, field("pred")?);
        let verdict = verify(&gold, &pred, mode);
        let row = Row {
            gold: &gold,
            pred: &pred,
            extracted: verdict.extracted.as_deref(),
            correct: verdict.correct,
        };
        serde_json::to_writer(&mut *out, &row).map_err(|e| out_err(e.into()))?;
        out.write_all(b"\n").map_err(out_err)?;
        n_total += 1;
        n_correct += usize::from(verdict.correct);
    }
    Ok((n_correct, n_total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("stapo-reward-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    #[test]
    fn extract_mode_parses_and_prints() {
        assert_eq!("strict".parse::<ExtractMode>().ok(), Some(ExtractMode::Strict));
        assert_eq!(" Flexible ".parse::<ExtractMode>().ok(), Some(ExtractMode::Flexible));
        assert!("loose".parse::<ExtractMode>().is_err());
        assert_eq!(ExtractMode::default(), ExtractMode::Strict);
        assert_eq!(ExtractMode::Flexible.to_string(), "flexible");
        let json = serde_json::to_string(&ExtractMode::Flexible).unwrap_or_default();
        assert_eq!(json, "\"flexible\"");
        assert_eq!(serde_json::from_str::<ExtractMode>("\"strict\"").ok(), Some(ExtractMode::Strict));
        assert_eq!("answer_line".parse::<ExtractMode>().ok(), Some(ExtractMode::AnswerLine));
        assert_eq!(ExtractMode::AnswerLine.to_string(), "answer_line");
        assert_eq!(
            serde_json::from_str::<ExtractMode>("\"answer_line\"").ok(),
            Some(ExtractMode::AnswerLine)
        );
    }

    #[test]
    fn verify_answer_line_as_dapo_math_asks() {
        let response = "Let x = 3, then 2x = 6.\nAnswer: $\\frac{6}{2}$";
        let v = verify("3", response, ExtractMode::AnswerLine);
        assert_eq!(v, Verdict { correct: true, extracted: Some("$\\frac{6}{2}$".into()) });
        // A boxed answer without the line does not count under this mode, and vice versa.
        assert!(!verify("3", "so \\boxed{3}", ExtractMode::AnswerLine).correct);
        assert!(!verify("3", response, ExtractMode::Strict).correct);
    }

    #[test]
    fn verify_strict_and_flexible() {
        let response = "We compute 2+2. The answer is 4.";
        assert_eq!(verify("4", response, ExtractMode::Strict), Verdict { correct: false, extracted: None });
        assert_eq!(
            verify("4", response, ExtractMode::Flexible),
            Verdict { correct: true, extracted: Some("4".into()) }
        );
        let boxed = "First \\boxed{3}, corrected: $\\boxed{\\dfrac{1}{2}}$";
        let v = verify("0.5", boxed, ExtractMode::Strict);
        assert!(v.correct);
        assert_eq!(v.extracted.as_deref(), Some("\\dfrac{1}{2}"));
        assert!(!verify("3", boxed, ExtractMode::Strict).correct);
        assert!(verify("\\boxed{10}", "\\boxed{10}", ExtractMode::Strict).correct);
        assert_eq!(v.reward(1.0, -1.0), 1.0);
        assert_eq!(verify("3", boxed, ExtractMode::Strict).reward(1.0, -1.0), -1.0);
    }

    /// Every reference answer of the shipped benchmarks, boxed at the end of a
    /// response, is judged equal to itself (extraction and normalisation keep it).
    #[test]
    fn benchmark_answers_equal_themselves() {
        let dir = crate::data::test_support::repo_root().join("data/benchmarks");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        files.sort();
        assert!(files.len() >= 7, "benchmarks in {}", dir.display());
        let (mut n, mut failures) = (0, Vec::new());
        for path in &files {
            let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let row: serde_json::Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("{}:{}: {e}", path.display(), i + 1));
                let gold = match &row["answer"] {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                n += 1;
                let response = format!("So the answer is $\\boxed{{{gold}}}$.");
                if !verify(&gold, &response, ExtractMode::Strict).correct || !is_equivalent(&gold, &gold) {
                    failures.push(format!("{}:{}: {gold}", path.display(), i + 1));
                }
            }
        }
        assert!(n > 2800, "{n} answers");
        assert!(failures.is_empty(), "{} of {n} not equal to themselves: {failures:#?}", failures.len());
    }

    #[test]
    fn is_equivalent_unboxes() {
        assert!(is_equivalent("\\boxed{\\frac{1}{2}}", "0.5"));
        assert!(is_equivalent("5", "\\boxed{\\boxed{5}}"));
        assert!(!is_equivalent("5", "\\boxed{6}"));
        assert!(has_boxed("\\boxed{5}") && !has_boxed("\\boxed{5"));
    }

    #[test]
    fn verify_jsonl_writes_rows() {
        let path = temp_file(
            "ok.jsonl",
            concat!(
                r#"{"gold": "\\frac{1}{2}", "pred": "so \\boxed{0.5}"}"#,
                "\n\n",
                "{\"gold\": 18, \"pred\": \"#### 18\"}",
                "\n",
                r#"{"gold": "3", "pred": "\\boxed{4}"}"#,
                "\n",
            ),
        );
        let mut out = Vec::new();
        let counts = verify_jsonl(&path, ExtractMode::Strict, &mut out);
        let _ = std::fs::remove_file(&path);
        assert_eq!(counts.ok(), Some((1, 3)));
        let text = String::from_utf8(out).unwrap_or_default();
        let rows: Vec<serde_json::Value> =
            text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0]["extracted"], "0.5");
        assert_eq!(rows[0]["correct"], true);
        assert_eq!(rows[1]["gold"], "18");
        assert!(rows[1]["extracted"].is_null());
        assert_eq!(rows[2]["correct"], false);
        assert!(text.starts_with("{\"gold\":"));
    }

    #[test]
    fn verify_jsonl_errors_name_file_and_line() {
        let path = temp_file("bad.jsonl", "{\"gold\": \"1\", \"pred\": \"1\"}\n{not json}\n");
        let err = verify_jsonl(&path, ExtractMode::Flexible, &mut Vec::new()).err();
        assert!(matches!(err, Some(Error::Parse { line: 2, .. })), "{err:?}");
        let msg = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("bad.jsonl:2:"), "{msg}");
        let _ = std::fs::remove_file(&path);

        let path = temp_file("missing.jsonl", "{\"gold\": \"1\"}\n");
        let err = verify_jsonl(&path, ExtractMode::Flexible, &mut Vec::new()).err();
        let _ = std::fs::remove_file(&path);
        assert!(matches!(&err, Some(Error::Parse { line: 1, msg, .. }) if msg.contains("`pred`")), "{err:?}");

        let err = verify_jsonl(Path::new("/nonexistent/x.jsonl"), ExtractMode::Strict, &mut Vec::new()).err();
        assert!(matches!(err, Some(Error::Io { .. })));
    }

    #[test]
    fn adversarial_responses_return() {
        // 10k nested braces inside a box.
        let deep = format!("\\boxed{{{}1{}}}", "{".repeat(10_000), "}".repeat(10_000));
        let v = verify("1", &deep, ExtractMode::Strict);
        assert!(v.extracted.is_some() && !v.correct);
        // Huge exponent: not comparable, so not equal to a finite number.
        assert!(!verify("1", "\\boxed{2^{99999999}}", ExtractMode::Strict).correct);
        assert!(verify("2^{99999999}", "\\boxed{2^{99999999}}", ExtractMode::Strict).correct);
        // 100 kB of text with the answer at the end, and 100 kB of opening boxes.
        let long = "blah 1 + 1 = 2. ".repeat(6_500) + "\\boxed{42}";
        assert!(long.len() > 100_000);
        assert!(verify("42", &long, ExtractMode::Strict).correct);
        assert!(verify("2", &"x 2 ".repeat(25_000), ExtractMode::Flexible).correct);
        let boxes = "\\boxed{".repeat(15_000);
        assert_eq!(verify("1", &boxes, ExtractMode::Flexible), Verdict { correct: false, extracted: None });
        let alphabet = ['(', ')', '{', '^', '\\', '1', 'x', ','];
        let garbage: String = (0..100_000usize).map(|i| alphabet[i * 7 % alphabet.len()]).collect();
        let v = verify("1", &format!("\\boxed {garbage}"), ExtractMode::Flexible);
        assert!(!v.correct);
    }
}

#[cfg(test)]
mod fuzz {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Random strings mixing LaTeX pieces with multi-byte characters (a model's
    /// decoded bytes can hold `�`): no verdict may panic.
    #[test]
    fn random_unicode_and_latex_never_panics() {
        let pieces = [
            "\\boxed{",
            "}",
            "{",
            "\\frac",
            "\\cup",
            "\\{",
            "\\}",
            "(",
            ")",
            "[",
            "]",
            ",",
            "=",
            "\\pm",
            "x",
            "1",
            "18",
            "0.5",
            "\\sqrt",
            "^",
            "_",
            "\\text{",
            "é",
            "\u{fffd}",
            "π",
            "∞",
            "\\",
            " ",
            "-",
            "/",
            "%",
            "\\left(",
            "\\right)",
            "\\begin{pmatrix}",
            "&",
            "\\\\",
            "\\end{pmatrix}",
            "e",
            "i",
            "!",
            "\\$",
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let n = rng.random_range(1..14);
            let s: String = (0..n).map(|_| pieces[rng.random_range(0..pieces.len())]).collect();
            let g: String =
                (0..rng.random_range(1..6)).map(|_| pieces[rng.random_range(0..pieces.len())]).collect();
            let _ = verify(&g, &s, ExtractMode::Flexible);
            let _ = is_equivalent(&g, &s);
            let _ = is_equivalent(&s, &g);
        }
    }
}
