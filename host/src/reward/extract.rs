//! Final-answer extraction from a model response.
//!
//! The strict rule is the Hendrycks MATH `last_boxed_only_string` used by
//! DAPO/GRPO-style math rewards: the content of the last `\boxed{...}`
//! (nested braces balanced), `\boxed 5` or `\fbox{...}`. The flexible rule
//! falls back, as math-verify and lm-eval-harness do, to "the answer is X",
//! "Answer: X", GSM8K's "#### X", and finally the last number in the text.
//! Every scan is linear in the response length.

use super::normalize::matching_brace;

/// Boxed occurrences tried from the end when the last one is unbalanced.
const MAX_BOX_TRIES: usize = 4;

/// Markers introducing a final answer in free text (matched case-insensitively).
const ANSWER_MARKERS: &[&str] =
    &["final answer is", "the answer is", "answer is", "final answer:", "answer:", "####"];

/// Content of the last well-formed `\boxed{...}`, `\boxed x` or `\fbox{...}`.
pub(crate) fn last_boxed(s: &str) -> Option<String> {
    let mut limit = s.len();
    for _ in 0..MAX_BOX_TRIES {
        let head = &s[..limit];
        let (pos, cmd) =
            [head.rfind("\\boxed").map(|p| (p, "\\boxed")), head.rfind("\\fbox").map(|p| (p, "\\fbox"))]
                .into_iter()
                .flatten()
                .max()?;
        if let Some(content) = box_content(&s[pos + cmd.len()..]) {
            let content = content.trim();
            return (!content.is_empty()).then(|| content.to_string());
        }
        limit = pos;
    }
    None
}

/// The argument after `\boxed`: a balanced braced group, or (`\boxed 5`) text
/// up to the next `$` or line end.
fn box_content(rest: &str) -> Option<&str> {
    if rest.starts_with('{') {
        return matching_brace(rest, 0).map(|close| &rest[1..close]);
    }
    let arg = rest.strip_prefix(' ')?;
    let end = arg.find(['$', '\n']).unwrap_or(arg.len());
    Some(&arg[..end])
}

/// The answer after the last "the answer is" / "Answer:" / "####" marker.
fn after_marker(s: &str) -> Option<String> {
    let lower = s.to_ascii_lowercase();
    let (pos, len) = ANSWER_MARKERS.iter().filter_map(|m| lower.rfind(m).map(|p| (p, m.len()))).max()?;
    let rest = s[pos + len..].trim_start_matches(|c: char| c.is_whitespace() || matches!(c, ':' | '*'));
    let span = if let Some(r) = rest.strip_prefix("$$").or_else(|| rest.strip_prefix('$')) {
        &r[..r.find('$').unwrap_or(r.len())]
    } else if let Some(r) = rest.strip_prefix("\\(").or_else(|| rest.strip_prefix("\\[")) {
        &r[..r.find("\\)").or_else(|| r.find("\\]")).unwrap_or(r.len())]
    } else {
        let line = &rest[..rest.find('\n').unwrap_or(rest.len())];
        // A sentence ends at ". " — a decimal point is followed by a digit.
        &line[..line.find(". ").unwrap_or(line.len())]
    };
    let ans = span.trim().trim_end_matches(['.', '*', '$', ' ']).trim();
    (!ans.is_empty()).then(|| ans.to_string())
}

/// The last number in the text: `-12`, `1,234`, `3.5`, `3/4`.
fn last_number(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let end = b.iter().rposition(u8::is_ascii_digit)? + 1;
    let body = |c: &u8| c.is_ascii_digit() || matches!(c, b',' | b'.' | b'/');
    let mut start = end - b[..end].iter().rev().take_while(|c| body(c)).count();
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    let num = s[start..end].trim_start_matches([',', '.', '/']);
    (!num.is_empty()).then(|| num.to_string())
}

/// Whether the response contains a complete `\boxed{...}` answer.
pub fn has_boxed(response: &str) -> bool {
    last_boxed(response).is_some()
}

/// Extraction with fallbacks, for [`super::ExtractMode::Flexible`].
pub(crate) fn flexible(s: &str) -> Option<String> {
    last_boxed(s).or_else(|| after_marker(s)).or_else(|| last_number(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_cases() {
        let cases: &[(&str, Option<&str>)] = &[
            ("so \\boxed{5}.", Some("5")),
            ("\\boxed{1} then \\boxed{2}", Some("2")),
            ("$\\boxed{\\frac{1}{2}}$", Some("\\frac{1}{2}")),
            ("\\boxed{\\{1, 2\\}}", Some("\\{1, 2\\}")),
            ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", Some("\\left( 3, \\frac{\\pi}{2} \\right)")),
            ("answer: $\\boxed 7$ done", Some("7")),
            ("\\fbox{42}", Some("42")),
            ("\\boxed{7} and later \\boxed{8", Some("7")),
            ("\\boxed{}", None),
            ("\\boxed{ x = 3 }", Some("x = 3")),
            ("no box here, answer is 5", None),
            ("\\boxed", None),
        ];
        for (input, want) in cases {
            assert_eq!(last_boxed(input).as_deref(), *want, "input {input:?}");
            assert_eq!(has_boxed(input), want.is_some());
        }
    }

    #[test]
    fn flexible_cases() {
        let cases: &[(&str, Option<&str>)] = &[
            ("The answer is 42.", Some("42")),
            ("Thus the final answer is $\\frac{3}{4}$. Done", Some("\\frac{3}{4}")),
            ("Answer: 3.5", Some("3.5")),
            ("**Answer:** 12", Some("12")),
            ("She earns 16 - 3 - 4 = 9 eggs, so 9 * 2 = 18\n#### 18", Some("18")),
            ("the total is 1,234 apples", Some("1,234")),
            ("we get -7 here", Some("-7")),
            ("ratio 3/4", Some("3/4")),
            ("nothing numeric", None),
            ("\\boxed{9}. The answer is 10", Some("9")),
        ];
        for (input, want) in cases {
            assert_eq!(flexible(input).as_deref(), *want, "input {input:?}");
        }
    }
}
