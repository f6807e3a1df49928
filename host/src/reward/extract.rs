//! Final-answer extraction from a model response.
//!
//! The strict rule is the Hendrycks MATH `last_boxed_only_string` used by
//! DAPO/GRPO-style math rewards: the content of the last `\boxed{...}`
//! (nested braces balanced), `\boxed 5` or `\fbox{...}`. The flexible rule
//! falls back, as math-verify and lm-eval-harness do, to "the answer is X",
//! "Answer: X", GSM8K's "#### X", and finally the last number in the text.
//! The answer-line rule is DAPO-Math's (verl `reward_score/math_dapo.py`,
//! `is_correct_minerva`): the last match of `(?i)Answer\s*:\s*([^\n]+)` in
//! the response's last 300 characters.
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

/// verl's math_dapo only reads the end of a response (its longest MATH-500
/// answer has 159 characters).
const ANSWER_LINE_WINDOW: usize = 300;

/// The answer on DAPO-Math's last "Answer:" line: the last non-overlapping
/// match of `(?i)Answer\s*:\s*([^\n]+)` in the last 300 characters, as verl's
/// `math_dapo.is_correct_minerva` finds it. A match runs to the end of its
/// line, so an "Answer:" later on the same line is part of the earlier match.
pub(crate) fn answer_line(s: &str) -> Option<String> {
    let start = s.char_indices().rev().nth(ANSWER_LINE_WINDOW - 1).map_or(0, |(i, _)| i);
    let tail = &s[start..];
    let lower = tail.to_ascii_lowercase();
    let b = lower.as_bytes();
    let mut found = None;
    let mut from = 0;
    while let Some(p) = lower[from..].find("answer").map(|p| p + from) {
        let mut i = p + "answer".len();
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b.get(i) != Some(&b':') {
            from = p + 1;
            continue;
        }
        i += 1;
        // `\s*` then `[^\n]+`: whitespace may run over newlines, but the
        // capture needs one character that is not a newline (backtracking
        // gives back a trailing space or tab when nothing else follows).
        let ws_end = i + b[i..].iter().take_while(|c| c.is_ascii_whitespace()).count();
        let cap_start = if ws_end < b.len() && b[ws_end] != b'\n' {
            ws_end
        } else {
            match b[i..ws_end].iter().rposition(|&c| c != b'\n') {
                Some(k) => i + k,
                None => {
                    from = p + 1;
                    continue;
                }
            }
        };
        let cap_end = cap_start + b[cap_start..].iter().take_while(|&&c| c != b'\n').count();
        found = Some(tail[cap_start..cap_end].trim().to_string());
        from = cap_end;
    }
    found.filter(|a| !a.is_empty())
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
    fn answer_line_cases() {
        let cases: &[(&str, Option<&str>)] = &[
            ("Work...\nAnswer: 42", Some("42")),
            ("answer: 1\nmore work\nANSWER :  $\\frac{1}{2}$\n", Some("$\\frac{1}{2}$")),
            // `\s*` runs over the newline after the colon.
            ("Answer:\n7", Some("7")),
            // One match to the end of the line: the later "Answer:" is inside it.
            ("Answer: 3, Answer: 5", Some("3, Answer: 5")),
            ("Final Answer: 12", Some("12")),
            ("the answer is 4", None),
            ("Answer:", None),
            ("\\boxed{9}", None),
            ("Answer: 8 \u{00e9}t\u{00e9}", Some("8 \u{00e9}t\u{00e9}")),
        ];
        for (input, want) in cases {
            assert_eq!(answer_line(input).as_deref(), *want, "input {input:?}");
        }
        // Only the last 300 characters are read, as verl does.
        let early = format!("Answer: 1\n{}", "x".repeat(300));
        assert_eq!(answer_line(&early), None);
        let multibyte = format!("Answer: 2\n{}", "\u{00e9}".repeat(280));
        assert_eq!(answer_line(&multibyte).as_deref(), Some("2"));
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
