//! String normalisation of final answers before they are compared.
//!
//! Follows the Hendrycks MATH `strip_string` / `is_equiv` normaliser and the
//! LaTeX normalisation step of math-verify (Hugging Face): drop sizing and
//! spacing commands (`\left`, `\right`, `\!`, `\,`, `~`), unify `\dfrac`/`\tfrac`,
//! remove units in `\text{...}` (also symbol units such as `\mathrm{~\AA}`),
//! degrees, dollar signs, thousands separators (`10,080`, `1{,}600`, `10\,000`),
//! base subscripts and a leading `x \in`. The result is still LaTeX; the
//! parser in [`super::expr`] reads it.

/// Depth to which nested `\text{...}` groups are rewritten.
const MAX_TEXT_DEPTH: usize = 4;

/// Unit words stripped when they trail a number (`18 dollars`, `5 cm`).
const UNIT_WORDS: &[&str] = &[
    "mm", "cm", "km", "meter", "meters", "metre", "metres", "inch", "inches", "ft", "foot", "feet", "yard",
    "yards", "mile", "miles", "mph", "kg", "gram", "grams", "pound", "pounds", "lb", "lbs", "ounce",
    "ounces", "ml", "liter", "liters", "litre", "litres", "second", "seconds", "minute", "minutes", "hour",
    "hours", "hr", "hrs", "day", "days", "week", "weeks", "month", "months", "year", "years", "dollar",
    "dollars", "cent", "cents", "degree", "degrees", "unit", "units", "square", "sq", "cubic", "percent",
];

/// LaTeX symbols that name a unit (or begin one, `\mu m`) inside `\text{...}`.
const UNIT_COMMANDS: &[&str] = &["\\AA", "\\angstrom", "\\mu", "\\micro", "\\Omega", "\\ohm"];

/// Normalises an answer string (see the module docs).
pub(crate) fn normalize(s: &str) -> String {
    let mut s = rewrite_commands(s.trim(), 0);
    for (from, to) in [
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\circ", ""),
        ("°", ""),
        ("^{\\prime\\prime}", "''"),
        ("^{\\prime}", "'"),
        ("^\\prime", "'"),
        ("np.", ""),
        // `1{,}600`: braces keep TeX from spacing a comma used as a separator.
        ("{,}", ","),
        ("{.}", "."),
        // `~` is a non-breaking space.
        ("~", " "),
    ] {
        if s.contains(from) {
            s = s.replace(from, to);
        }
    }
    let mut s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    while let Some(t) = s.strip_suffix(['.', ' ']) {
        s = t.to_string();
    }
    let s = strip_set_membership(&s);
    let s = strip_base_subscripts(s);
    let s = strip_thousands(s);
    let s = strip_unit_words(s);
    choice_letter(&s).unwrap_or(s)
}

/// The answer without any whitespace, for exact comparison.
pub(crate) fn canonical(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// Rewrites or drops LaTeX commands in one left-to-right pass.
fn rewrite_commands(s: &str, depth: usize) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'$' => i += 1,
            b'\\' => i = rewrite_one(s, i, depth, &mut out),
            _ => {
                let ch = s[i..].chars().next().unwrap_or(' ');
                out.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    out
}

/// Rewrites the command starting at byte `i` (a backslash) into `out`;
/// returns the byte index after it.
fn rewrite_one(s: &str, i: usize, depth: usize, out: &mut String) -> usize {
    let b = s.as_bytes();
    let start = i + 1;
    let end = start + b[start..].iter().take_while(|c| c.is_ascii_alphabetic()).count();
    if end == start {
        return match b.get(start) {
            // `10,\!080` and `11,\! 111`: the thin negative space binds digits.
            Some(b'!') => start + 1 + b[start + 1..].iter().take_while(|c| c.is_ascii_whitespace()).count(),
            Some(b',' | b';' | b':' | b' ') => {
                out.push(' ');
                start + 1
            }
            Some(b'$') => start + 1,
            Some(b'%') => {
                out.push('%');
                start + 1
            }
            _ => {
                let ch = s[start..].chars().next();
                out.push('\\');
                ch.map_or(start, |c| {
                    out.push(c);
                    start + c.len_utf8()
                })
            }
        };
    }
    let name = &s[start..end];
    let replacement = match name {
        "left" | "right" => {
            // `\left.` and `\right.` are invisible delimiters.
            return if b.get(end) == Some(&b'.') { end + 1 } else { end };
        }
        "big" | "Big" | "bigg" | "Bigg" | "bigl" | "bigr" | "Bigl" | "Bigr" | "biggl" | "biggr"
        | "displaystyle" | "textstyle" | "limits" | "nolimits" => "",
        "quad" | "qquad" => " ",
        "dfrac" | "tfrac" | "cfrac" => "\\frac",
        "dbinom" | "tbinom" => "\\binom",
        "leq" | "leqslant" | "le" => "\\le",
        "geq" | "geqslant" | "ge" => "\\ge",
        "neq" | "ne" => "\\ne",
        "lvert" | "rvert" | "vert" | "mid" => "|",
        "lbrace" => "\\{",
        "rbrace" => "\\}",
        "varnothing" | "emptyset" => "\\emptyset",
        "ldots" | "cdots" | "dots" => "\\dots",
        "infin" => "\\infty",
        "degree" => "",
        // `1.5~\AA`: a symbol unit after a number.
        "AA" | "angstrom" if ends_with_number(out) => return skip_exponent(s, end),
        "text" | "textbf" | "textrm" | "textit" | "textnormal" | "textsf" | "mbox" | "mathrm" | "mathbf"
        | "mathit" | "mathsf" | "boldsymbol" | "operatorname" => return rewrite_text(s, end, depth, out),
        _ => {
            out.push_str(&s[i..end]);
            return end;
        }
    };
    out.push_str(replacement);
    end
}

/// Handles `\text{...}` whose name ends at byte `end`: a unit after a number
/// is dropped (with any exponent, `\mbox{ cm}^2`), "and"/"or" become commas,
/// anything else is unwrapped.
fn rewrite_text(s: &str, end: usize, depth: usize, out: &mut String) -> usize {
    let open = end + s[end..].bytes().take_while(|c| *c == b' ').count();
    let Some(close) = matching_brace(s, open) else {
        return end;
    };
    let content = &s[open + 1..close];
    let inner = content.trim_matches(|c: char| c.is_whitespace() || c == '~');
    let after_number = ends_with_number(out);
    if matches!(inner, "and" | "or" | ",") {
        out.push(',');
        close + 1
    } else if after_number && is_unit(inner) {
        skip_unit_tail(s, skip_exponent(s, close + 1))
    } else if depth < MAX_TEXT_DEPTH {
        out.push_str(&rewrite_commands(content, depth + 1));
        close + 1
    } else {
        out.push_str(content);
        close + 1
    }
}

/// Whether the text written so far ends with a number (or a group that may hold one).
fn ends_with_number(out: &str) -> bool {
    out.trim_end_matches(|c: char| c.is_whitespace() || c == '~')
        .ends_with(|c: char| c.is_ascii_digit() || matches!(c, '}' | ')' | '.'))
}

/// Text that reads as a unit: words, possibly with `/`, `^2`, `-`, or a symbol
/// unit (`\AA`, `\mu m`, `k\Omega`).
fn is_unit(t: &str) -> bool {
    let symbol_unit = |t: &str| {
        UNIT_COMMANDS.iter().any(|c| {
            t.strip_prefix(c).is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_alphabetic()))
        })
    };
    (t.starts_with(|c: char| c.is_ascii_alphabetic()) || symbol_unit(t))
        && t.char_indices().all(|(i, c)| {
            c.is_ascii_alphanumeric()
                || matches!(c, ' ' | '~' | '/' | '^' | '.' | '-' | '{' | '}')
                || (c == '\\' && symbol_unit(&t[i..]))
        })
}

/// Skips the rest of a compound unit after a dropped one: `/ \mathrm{s}`,
/// `\cdot \text{m}^{-2}`, each part only when it is itself a unit.
fn skip_unit_tail(s: &str, mut i: usize) -> usize {
    loop {
        let rest = s[i..].trim_start();
        let Some(after_op) = rest.strip_prefix('/').or_else(|| rest.strip_prefix("\\cdot")) else {
            return i;
        };
        let after_op = after_op.trim_start();
        let Some(cmd) = ["\\text", "\\mathrm", "\\mbox"].iter().find(|c| after_op.starts_with(**c)) else {
            return i;
        };
        let open = s.len() - after_op.len() + cmd.len();
        let Some(close) = matching_brace(s, open) else {
            return i;
        };
        if !is_unit(s[open + 1..close].trim_matches(|c: char| c.is_whitespace() || c == '~')) {
            return i;
        }
        i = skip_exponent(s, close + 1);
    }
}

/// Skips `^2`, `^{2}` after a dropped unit.
fn skip_exponent(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    if b.get(i) != Some(&b'^') {
        return i;
    }
    match b.get(i + 1) {
        Some(b'{') => matching_brace(s, i + 1).map_or(i, |c| c + 1),
        Some(c) if c.is_ascii_alphanumeric() => i + 2,
        _ => i,
    }
}

/// Byte index of the `}` matching the `{` at `open`, skipping `\{` and `\}`.
pub(crate) fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let b = s.as_bytes();
    if b.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0usize;
    let mut i = open;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 1,
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// `x \in [-2, 7]` → `[-2, 7]`.
fn strip_set_membership(s: &str) -> String {
    let mut cs = s.chars();
    if cs.next().is_some_and(|c| c.is_ascii_alphabetic()) {
        let rest = cs.as_str().trim_start();
        if let Some(r) = rest.strip_prefix("\\in") {
            if !r.starts_with(|c: char| c.is_ascii_alphabetic()) {
                return r.trim_start().to_string();
            }
        }
    }
    s.to_string()
}

/// `204_5`, `4210_{5}` → the digits alone, when every digit is below the base.
fn strip_base_subscripts(s: String) -> String {
    if !s.contains('_') {
        return s;
    }
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut last = 0;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'_' && i > 0 && b[i - 1].is_ascii_digit() {
            let digits_start = i - b[..i].iter().rev().take_while(|c| c.is_ascii_digit()).count();
            let standalone = digits_start == 0
                || !(b[digits_start - 1].is_ascii_alphanumeric() || b[digits_start - 1] == b'_');
            let (base_text, next) = if b.get(i + 1) == Some(&b'{') {
                match matching_brace(&s, i + 1) {
                    Some(c) => (&s[i + 2..c], c + 1),
                    None => ("", i + 1),
                }
            } else {
                let n = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                (&s[i + 1..i + 1 + n], i + 1 + n)
            };
            let base = base_text.trim().parse::<u32>().ok().filter(|b| (2..=36).contains(b));
            let digits_ok = base.is_some_and(|base| {
                s[digits_start..i].chars().all(|d| d.to_digit(36).is_some_and(|d| d < base))
            });
            if standalone && digits_ok {
                out.push_str(&s[last..i]);
                last = next;
                i = next;
                continue;
            }
        }
        i += 1;
    }
    out.push_str(&s[last..]);
    out
}

/// `10,080`, `11,111,111,100`, `10 000`, `3.141 592` → digits alone (a space
/// may also group the digits after the point, as `\,` does in SI style).
fn strip_thousands(s: String) -> String {
    let body = s.strip_prefix('-').unwrap_or(&s);
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    let sep = if int.contains(',') { ',' } else { ' ' };
    let digits = |g: &str| !g.is_empty() && g.bytes().all(|c| c.is_ascii_digit());
    let groups: Vec<&str> = int.split(sep).collect();
    let int_grouped = (1..=3).contains(&groups[0].len())
        && groups.iter().all(|g| digits(g))
        && groups[1..].iter().all(|g| g.len() == 3);
    let frac_groups: Vec<&str> = frac.split(' ').collect();
    let frac_ok = frac.is_empty()
        || (frac_groups.iter().all(|g| digits(g))
            && frac_groups[..frac_groups.len() - 1].iter().all(|g| g.len() == 3));
    let grouped = int_grouped && frac_ok && (groups.len() > 1 || frac_groups.len() > 1);
    if grouped {
        s.replace([sep, ' '], "")
    } else {
        s
    }
}

/// `18 dollars` → `18`, `864 square inches` → `864`.
fn strip_unit_words(mut s: String) -> String {
    while let Some((head, word)) = s.rsplit_once(' ') {
        let is_unit = UNIT_WORDS.contains(&word.to_ascii_lowercase().as_str());
        // Only strip when what remains still contains a number.
        if !is_unit || !head.contains(|c: char| c.is_ascii_digit()) {
            break;
        }
        s = head.trim_end().to_string();
    }
    s
}

/// `(B)` or `(b)` → `B`.
fn choice_letter(s: &str) -> Option<String> {
    let inner = s.strip_prefix('(')?.strip_suffix(')')?.to_ascii_uppercase();
    matches!(inner.as_str(), "A" | "B" | "C" | "D" | "E").then_some(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_noise() {
        let cases: &[(&str, &str)] = &[
            ("\\left( 3, \\frac{\\pi}{2} \\right)", "( 3, \\frac{\\pi}{2} )"),
            ("\\dfrac{17}{50}", "\\frac{17}{50}"),
            ("10,\\!080", "10080"),
            ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
            ("\\$32,\\!348", "32348"),
            ("58,500", "58500"),
            ("10\\,000", "10000"),
            ("1,250.5", "1250.5"),
            ("1,3", "1,3"),
            ("2500,7500", "2500,7500"),
            ("3, 5, 7", "3, 5, 7"),
            ("106^\\circ", "106"),
            ("90^{\\circ}", "90"),
            ("5.4 \\text{ cents}", "5.4"),
            ("15\\mbox{ cm}^2", "15"),
            ("864 \\mbox{ inches}^2", "864"),
            ("\\frac{270}7\\text{ degrees}", "\\frac{270}7"),
            ("6.5 \\mathrm{~m}", "6.5"),
            ("4.5 \\times 10^{33} \\mathrm{~erg} / \\mathrm{s}", "4.5 \\times 10^{33}"),
            ("9.8 \\text{m} \\cdot \\text{s}^{-2}", "9.8"),
            ("3 \\text{ cm} / 2", "3 / 2"),
            ("18 dollars", "18"),
            ("27 miles.", "27"),
            ("\\text{(B)}", "B"),
            ("(c)", "C"),
            ("864 square inches", "864"),
            ("2 m", "2 m"),
            ("\\text{Evelyn}", "Evelyn"),
            ("x \\in [-2,7]", "[-2,7]"),
            ("204_5", "204"),
            ("4210_{5}", "4210"),
            ("x_5", "x_5"),
            ("209_{3}", "209_{3}"),
            ("$\\frac{1}{2}$", "\\frac{1}{2}"),
            ("\\left\\{1,2\\right\\}", "\\{1,2\\}"),
            ("3 \\text{ and } 5", "3 , 5"),
            ("50\\%", "50%"),
            ("y^{\\prime}+r y", "y'+r y"),
            ("\\left\\lfloor\\log _{2} n\\right\\rfloor", "\\lfloor\\log _{2} n\\rfloor"),
            ("\\left.\\frac{1}{2}\\right|", "\\frac{1}{2}|"),
            ("x \\leqslant 3", "x \\le 3"),
            ("1{,}600", "1600"),
            ("\\$1{,}600{,}000", "1600000"),
            ("1\\,234\\,567.5", "1234567.5"),
            ("3.141\\,592\\,65", "3.14159265"),
            ("3.14\\,15", "3.14 15"),
            ("5.4 \\mathrm{~\\AA}", "5.4"),
            ("5.4 \\text{ \\AA}", "5.4"),
            ("5.4 \\mathrm{~\\AA}^{2}", "5.4"),
            ("1.5~\\AA", "1.5"),
            ("2.1 \\mathrm{~\\mu m}", "2.1"),
            ("3 \\mathrm{~k \\Omega}", "3"),
            ("\\text{\\AA}", "\\AA"),
            ("2 \\text{\\pi}", "2 \\pi"),
            ("6.5~m", "6.5 m"),
        ];
        for (input, want) in cases {
            assert_eq!(normalize(input), *want, "input {input:?}");
        }
    }

    #[test]
    fn canonical_drops_whitespace() {
        assert_eq!(canonical(" 1 + x \n"), "1+x");
    }

    #[test]
    fn pathological_text_is_bounded() {
        let nested = "\\text{".repeat(5000) + "}".repeat(5000).as_str();
        let n = normalize(&nested);
        assert!(n.len() <= nested.len());
        let unclosed = "\\text{".repeat(2000);
        assert!(normalize(&unclosed).len() <= unclosed.len());
        assert_eq!(normalize("\\"), "\\");
    }
}
