//! Mathematical equivalence of two final answers.
//!
//! Mirrors what math-verify (Hugging Face) and the Hendrycks MATH / DAPO
//! graders accept, without sympy: answers are normalised
//! ([`super::normalize`]), split into structure (tuples and intervals whose
//! bracket types matter, unordered sets and answer lists, unions, matrices,
//! equations, `\pm`), and the leaves are compared as numbers or, when they
//! contain variables, by evaluation at seeded random points
//! (probabilistic identity testing) with a relative tolerance. A decimal
//! compared with an exact value must also round to it at six decimal places of
//! its written scale, as math-verify rounds floats (`float_rounding = 6`): a
//! rounded decimal such as `6366.20` is not the closed form `\frac{20000}{\pi}`.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::expr::{Expr, C};
use super::normalize::{canonical, matching_brace, normalize};

/// Answers longer than this (bytes) are only compared as trimmed strings.
pub(crate) const MAX_ANSWER_LEN: usize = 2000;
/// Relative tolerance for numeric agreement (math-verify rounds to 6 digits).
const REL_TOL: f64 = 1e-6;
/// Decimal places (of a decimal's written scale) at which a decimal must agree
/// with an exact value: math-verify's `float_rounding`.
const DECIMAL_PLACES: i32 = 6;
/// Floating-point noise allowed when evaluating an exact closed form.
const EVAL_NOISE: f64 = 1e-12;
/// Rounding noise tolerated against an exact zero (`\sin\pi` vs `0`); tiny
/// nonzero values (`1e-27` kg) still compare relatively.
const ABS_TOL: f64 = 1e-14;
/// Random points per identity test, and how many must be finite in both.
const N_POINTS: usize = 8;
const MIN_VALID_POINTS: usize = 3;
/// Fixed seed: a verdict is a pure function of its inputs.
const SEED: u64 = 0x5EED_A115;
/// Nesting of structure (a list of tuples of ...) that is split.
const MAX_STRUCT_DEPTH: usize = 4;
/// Most items in a list, set or tuple.
const MAX_ITEMS: usize = 64;

/// Whether `gold` and `answer` denote the same mathematical answer.
pub(crate) fn equivalent(gold: &str, answer: &str) -> bool {
    let (gold, answer) = (gold.trim(), answer.trim());
    if gold.len() > MAX_ANSWER_LEN || answer.len() > MAX_ANSWER_LEN {
        return gold == answer;
    }
    let (g, a) = (normalize(gold), normalize(answer));
    if g.is_empty() || a.is_empty() {
        return false;
    }
    if canonical(&g) == canonical(&a) {
        return true;
    }
    compare(&Ans::parse(&g, 0), &Ans::parse(&a, 0))
}

/// The structure of an answer; leaves are normalised LaTeX strings.
#[derive(Clone, Debug, PartialEq)]
enum Ans {
    Expr(String),
    /// Prose ("Evelyn", "even"), compared case-insensitively.
    Text(String),
    /// `lhs = rhs`.
    Eq(String, String),
    /// `(a, b)`, `[a, b)`, ...: ordered, bracket types significant.
    Tuple {
        open: char,
        close: char,
        items: Vec<Ans>,
    },
    /// `\{a, b\}` or the two values of `a \pm b`: unordered.
    Set(Vec<Ans>),
    /// A bare comma list `3, 5, 7`: unordered, as math-verify treats it.
    List(Vec<Ans>),
    /// `A \cup B`: unordered pieces.
    Union(Vec<Ans>),
    /// `\begin{pmatrix} ... \end{pmatrix}`, row-major.
    Matrix(Vec<Vec<Ans>>),
}

impl Ans {
    fn parse(s: &str, depth: usize) -> Ans {
        let s = s.trim();
        if depth >= MAX_STRUCT_DEPTH {
            return Ans::Expr(s.to_string());
        }
        let sub = |items: Vec<&str>| items.into_iter().map(|x| Ans::parse(x, depth + 1)).collect::<Vec<_>>();
        if let Some(rows) = matrix_rows(s) {
            return Ans::Matrix(rows.into_iter().map(sub).collect());
        }
        let pieces = split_top(s, "\\cup");
        if pieces.len() > 1 {
            return Ans::Union(sub(pieces));
        }
        if let Some((open, inner, close)) = wrapped(s) {
            let items = split_top(inner, ",");
            if open == '{' {
                return Ans::Set(sub(items).into_iter().flat_map(Ans::expand_pm).collect());
            }
            if items.len() > 1 {
                return Ans::Tuple { open, close, items: sub(items) };
            }
            if open == '(' && close == ')' {
                return Ans::parse(inner, depth + 1);
            }
        }
        let items = split_top(s, ",");
        if items.len() > 1 {
            return Ans::List(sub(items).into_iter().flat_map(Ans::expand_pm).collect());
        }
        let sides = split_top(s, "=");
        if sides.len() >= 2 {
            // `a = b = c` keeps the last value, as math-verify does.
            return Ans::Eq(sides[0].trim().to_string(), sides[sides.len() - 1].trim().to_string());
        }
        let pm = expand_pm_str(s);
        if pm.len() > 1 {
            return Ans::Set(pm.into_iter().map(Ans::Expr).collect());
        }
        if is_text(s) {
            return Ans::Text(s.to_string());
        }
        Ans::Expr(s.to_string())
    }

    /// Splits an item `a \pm b` of a list or set into its two values.
    fn expand_pm(self) -> Vec<Ans> {
        match self {
            Ans::Set(items) if items.iter().all(|i| matches!(i, Ans::Expr(_))) => items,
            other => vec![other],
        }
    }
}

/// Splits at `sep` outside brackets; `\{`, `(`, `[`, `{` open and their
/// mirrors close, without requiring matching kinds (`[0, 1)` is fine).
fn split_top<'a>(s: &'a str, sep: &str) -> Vec<&'a str> {
    let b = s.as_bytes();
    let mut parts = Vec::new();
    let mut depth = 0i64;
    let (mut start, mut i) = (0, 0);
    while i < b.len() {
        match b[i] {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
        // A command separator must end there: `\cup` but not `\cupcake`.
        // Compared as bytes: `i` may sit inside a multi-byte character.
        let at_sep = depth == 0
            && b[i..].starts_with(sep.as_bytes())
            && !(sep.ends_with(|c: char| c.is_ascii_alphabetic())
                && b.get(i + sep.len()).is_some_and(|c| c.is_ascii_alphabetic()));
        if at_sep && parts.len() < MAX_ITEMS {
            parts.push(&s[start..i]);
            i += sep.len();
            start = i;
            continue;
        }
        // `\{` and `\}` count as brackets (next iteration); other escaped
        // characters, such as the second `\` of `\\`, are skipped.
        i += if b[i] == b'\\' && !matches!(b.get(i + 1), Some(b'{' | b'}')) { 2 } else { 1 };
    }
    parts.push(&s[start..]);
    parts
}

/// `(inner)`, `[inner)`, `\{inner\}` when the outer brackets enclose all of `s`.
/// Returns the opening and closing characters (`{` for `\{`).
fn wrapped(s: &str) -> Option<(char, &str, char)> {
    let (open, body) = if let Some(r) = s.strip_prefix("\\{") {
        ('{', r)
    } else {
        let c = s.chars().next().filter(|c| matches!(c, '(' | '['))?;
        (c, &s[1..])
    };
    let (close, inner) = if open == '{' {
        ('}', body.strip_suffix("\\}")?)
    } else {
        let c = body.chars().last().filter(|c| matches!(c, ')' | ']'))?;
        (c, &body[..body.len() - 1])
    };
    // The outer pair must not close early, as in `(a+5)(b+2)`.
    let mut depth = 0i64;
    for c in inner.bytes() {
        match c {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return None;
        }
    }
    (depth == 0).then_some((open, inner, close))
}

/// Rows of a `pmatrix`/`bmatrix`/`matrix`, split at `\\` and `&`.
fn matrix_rows(s: &str) -> Option<Vec<Vec<&str>>> {
    let rest = s.strip_prefix("\\begin{")?;
    let (env, rest) = rest.split_once('}')?;
    if !matches!(env, "pmatrix" | "bmatrix" | "Bmatrix" | "vmatrix" | "matrix" | "smallmatrix") {
        return None;
    }
    let body = rest.strip_suffix(&format!("\\end{{{env}}}"))?;
    let rows: Vec<Vec<&str>> = split_top(body, "\\\\")
        .into_iter()
        .filter(|r| !r.trim().is_empty())
        .map(|r| split_top(r, "&"))
        .collect();
    (!rows.is_empty()).then_some(rows)
}

/// Both values of the first (and second) `\pm`/`\mp` in `s`.
fn expand_pm_str(s: &str) -> Vec<String> {
    let mut out = vec![s.to_string()];
    for _ in 0..2 {
        let mut next = Vec::new();
        for e in &out {
            let hit = ["\\pm", "\\mp"].iter().filter_map(|op| e.find(op).map(|p| (p, *op))).min();
            match hit {
                Some((p, op)) if !e[p + 3..].starts_with(|c: char| c.is_ascii_alphabetic()) => {
                    let (plus, minus) = if op == "\\pm" { ("+", "-") } else { ("-", "+") };
                    next.push(format!("{}{plus}{}", &e[..p], &e[p + 3..]));
                    next.push(format!("{}{minus}{}", &e[..p], &e[p + 3..]));
                }
                _ => next.push(e.clone()),
            }
        }
        out = next;
    }
    out
}

/// Prose rather than mathematics: only letters and spaces, with a word of
/// three or more letters that is not a function name (or "no"); shorter
/// letter runs such as `ab` are products.
fn is_text(s: &str) -> bool {
    const FUNCTION_WORDS: &[&str] =
        &["sin", "cos", "tan", "cot", "sec", "csc", "exp", "log", "sinh", "cosh", "tanh"];
    s.chars().all(|c| c.is_ascii_alphabetic() || c == ' ')
        && s.split(' ').any(|w| {
            let w = w.to_ascii_lowercase();
            (w.len() >= 3 && !FUNCTION_WORDS.contains(&w.as_str())) || w == "no"
        })
}

/// `y`, `f(x)`, `x_0`, `\theta`: a name that an equation's value is given for.
fn is_simple_lhs(s: &str) -> bool {
    let s = canonical(s);
    let name = match s.strip_suffix(')').and_then(|r| r.split_once('(')) {
        Some((name, args)) if !args.contains(['(', ')']) => name,
        _ => s.as_str(),
    };
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '\\')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '{' | '}' | '\\' | '\''))
}

/// A name with one-token subscripts unbraced: `X_{d}` and `X_d` are one name,
/// as are `\omega_{n}` and `\omega_n`.
fn name_key(s: &str) -> String {
    let s = canonical(s);
    let mut out = String::with_capacity(s.len());
    let mut rest = s.as_str();
    while let Some(p) = rest.find("_{") {
        out.push_str(&rest[..=p]);
        let group = &rest[p + 1..];
        let inner = matching_brace(group, 0).map(|c| &group[1..c]);
        let one_token = inner.is_some_and(|t| {
            t.chars().count() == 1
                || t.strip_prefix('\\')
                    .is_some_and(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_alphabetic()))
        });
        match inner {
            Some(t) if one_token => {
                out.push_str(t);
                rest = &group[t.len() + 2..];
            }
            _ => rest = group,
        }
    }
    out.push_str(rest);
    out
}

fn compare(g: &Ans, p: &Ans) -> bool {
    use Ans::*;
    match (g, p) {
        (Expr(a), Expr(b)) => expr_equiv(a, b),
        (Text(a), Text(b)) | (Text(a), Expr(b)) | (Expr(a), Text(b)) => {
            canonical(a).eq_ignore_ascii_case(&canonical(b))
        }
        (Eq(gl, gr), Eq(pl, pr)) => eq_equiv(gl, gr, pl, pr),
        (Eq(l, r), other) | (other, Eq(l, r)) => is_simple_lhs(l) && compare(&Ans::parse(r, 1), other),
        (Tuple { open: go, close: gc, items: gi }, Tuple { open: po, close: pc, items: pi }) => {
            go == po && gc == pc && ordered(gi, pi)
        }
        // `(2, 4)` answered as `2, 4`.
        (Tuple { open: '(', close: ')', items: t }, List(l))
        | (List(l), Tuple { open: '(', close: ')', items: t }) => ordered(t, l),
        (Set(a) | List(a), Set(b) | List(b)) | (Union(a), Union(b)) => unordered(a, b),
        (Set(a), other) | (other, Set(a)) if a.len() == 1 => compare(&a[0], other),
        (Matrix(a), Matrix(b)) => a.len() == b.len() && a.iter().zip(b).all(|(ra, rb)| ordered(ra, rb)),
        // A column or row vector answered as a tuple.
        (Matrix(m), Tuple { open: '(', close: ')', items: t })
        | (Tuple { open: '(', close: ')', items: t }, Matrix(m)) => {
            let vector: Option<Vec<Ans>> = match m.as_slice() {
                [row] => Some(row.clone()),
                rows => rows.iter().map(|r| (r.len() == 1).then(|| r[0].clone())).collect(),
            };
            vector.is_some_and(|v| ordered(&v, t))
        }
        _ => false,
    }
}

fn ordered(a: &[Ans], b: &[Ans]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| compare(x, y))
}

/// Multiset equality by greedy matching (equivalence is transitive, so
/// greedy matching finds a perfect matching whenever one exists).
fn unordered(a: &[Ans], b: &[Ans]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut used = vec![false; b.len()];
    a.iter().all(|x| {
        let hit = (0..b.len()).find(|&j| !used[j] && compare(x, &b[j]));
        hit.map(|j| used[j] = true).is_some()
    })
}

fn eq_equiv(gl: &str, gr: &str, pl: &str, pr: &str) -> bool {
    if is_simple_lhs(gl) && is_simple_lhs(pl) {
        return name_key(gl) == name_key(pl) && compare(&Ans::parse(gr, 1), &Ans::parse(pr, 1));
    }
    let parse = |s: &str| Expr::parse(s);
    let (Some(gl), Some(gr), Some(pl), Some(pr)) = (parse(gl), parse(gr), parse(pl), parse(pr)) else {
        return false;
    };
    // Same equation up to a nonzero factor: `y = 2x + 3` and `2x - y + 3 = 0`.
    proportional(&gl.minus(&gr), &pl.minus(&pr))
}

/// Whether two numeric/symbolic leaves are equal.
fn expr_equiv(a: &str, b: &str) -> bool {
    if canonical(a) == canonical(b) {
        return true;
    }
    if a.contains('%') || b.contains('%') {
        // `50\%` matches `50` and `0.5`.
        let (a2, b2) = (a.replace('%', ""), b.replace('%', ""));
        if expr_equiv(&a2, &b2) {
            return true;
        }
    }
    let (Some(x), Some(y)) = (Expr::parse(a), Expr::parse(b)) else {
        return false;
    };
    // Integers beyond f64 precision compare by their digits.
    if let (Some(da), Some(db)) = (integer_digits(a), integer_digits(b)) {
        return da == db;
    }
    if !same_function(&x, &y) {
        return false;
    }
    // A decimal against an exact value (an integer, a fraction, a closed form):
    // it must also round to that value at its written scale.
    match (decimal_scale(a), decimal_scale(b)) {
        (Some(scale), None) | (None, Some(scale)) => rounds_to(&x, &y, scale),
        _ => true,
    }
}

/// `10^e` for a number written as a decimal with exponent `e` (0 when there is
/// none): `6366.20`, `-.5`, `1.24e-8`, `1.24 \times 10^{-8}`, `12.5%`. `None`
/// for integers (also `3 \times 10^{5}`) and anything else, which are exact.
fn decimal_scale(s: &str) -> Option<f64> {
    let s = canonical(s);
    let s = s.strip_prefix(['-', '+']).unwrap_or(&s);
    let s = s.strip_suffix('%').unwrap_or(s);
    let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
    let (mut rest, mut has_point, mut digits) = (&s[int_len..], false, int_len);
    if let Some(r) = rest.strip_prefix('.') {
        let frac_len = r.bytes().take_while(u8::is_ascii_digit).count();
        (rest, has_point, digits) = (&r[frac_len..], true, digits + frac_len);
    }
    if digits == 0 {
        return None;
    }
    let exponent = |t: &str| -> Option<i32> {
        let t = t.strip_prefix('{').and_then(|t| t.strip_suffix('}')).unwrap_or(t);
        let body = t.strip_prefix(['-', '+']).unwrap_or(t);
        (!body.is_empty() && body.len() <= 4 && body.bytes().all(|c| c.is_ascii_digit()))
            .then(|| t.parse().ok())?
    };
    let (e, decimal) = if rest.is_empty() {
        (0, has_point)
    } else if let Some(t) = rest.strip_prefix(['e', 'E']) {
        (exponent(t)?, true)
    } else {
        let t = ["\\times", "\\cdot", "*"].iter().find_map(|op| rest.strip_prefix(op))?;
        let t = t.strip_prefix("10^")?;
        // `10^5` but not `10^12` (TeX reads that as 10^1 \cdot 2).
        if !t.starts_with('{') && t.len() != 1 {
            return None;
        }
        (exponent(t)?, has_point)
    };
    decimal.then(|| 10f64.powi(e))
}

/// Whether constants `x` and `y` agree to [`DECIMAL_PLACES`] places at `scale`
/// (half a unit there, plus evaluation noise); true when either has variables,
/// where the identity test alone decides.
fn rounds_to(x: &Expr, y: &Expr, scale: f64) -> bool {
    if !(x.vars.is_empty() && y.vars.is_empty()) {
        return true;
    }
    let env = HashMap::new();
    let (a, b) = (x.eval(&env), y.eval(&env));
    let tol = 0.5 * scale * 10f64.powi(-DECIMAL_PLACES) + EVAL_NOISE * a.norm().max(b.norm());
    a.sub(b).norm() <= tol
}

/// Digits of an integer literal with its sign, leading zeros dropped.
fn integer_digits(s: &str) -> Option<String> {
    let s = canonical(s);
    let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let digits = digits.trim_start_matches('0');
    Some(if digits.is_empty() { "0".to_string() } else { format!("{sign}{digits}") })
}

fn close(a: C, b: C) -> bool {
    if !a.is_finite() || !b.is_finite() {
        return false;
    }
    let (na, nb) = (a.norm(), b.norm());
    let d = a.sub(b).norm();
    d <= REL_TOL * na.max(nb) || (na.min(nb) == 0.0 && d <= ABS_TOL)
}

/// Seeded random assignments of the variables of `x` and `y`. Answers with
/// floor, factorial or binomials are sampled at integers, where they live.
fn sample_points(x: &Expr, y: &Expr) -> Vec<HashMap<String, C>> {
    let vars: Vec<&String> = x.vars.union(&y.vars).collect();
    let discrete = x.discrete || y.discrete;
    let mut rng = StdRng::seed_from_u64(SEED);
    (0..N_POINTS)
        .map(|_| {
            vars.iter()
                .map(|v| {
                    let val = if discrete {
                        f64::from(rng.random_range(1u32..=25))
                    } else {
                        rng.random_range(0.3..2.7)
                    };
                    ((*v).clone(), C::real(val))
                })
                .collect()
        })
        .collect()
}

/// Equal values everywhere (constants once, otherwise at random points).
fn same_function(x: &Expr, y: &Expr) -> bool {
    if x.vars.is_empty() && y.vars.is_empty() {
        let env = HashMap::new();
        let (a, b) = (x.eval(&env), y.eval(&env));
        // `-\infty` as an interval end equals itself; an overflow (`2^{10^9}`)
        // is not comparable.
        let same_infinity =
            x.infinite && y.infinite && a.im == 0.0 && b.im == 0.0 && a.re.is_infinite() && a.re == b.re;
        return same_infinity || close(a, b);
    }
    let mut valid = 0;
    for env in sample_points(x, y) {
        let (a, b) = (x.eval(&env), y.eval(&env));
        match (a.is_finite(), b.is_finite()) {
            (true, true) if close(a, b) => valid += 1,
            (false, false) => {}
            _ => return false,
        }
    }
    valid >= MIN_VALID_POINTS
}

/// Whether `y = c·x` for one nonzero constant `c` at every sample point.
fn proportional(x: &Expr, y: &Expr) -> bool {
    let mut ratio: Option<C> = None;
    let mut valid = 0;
    for env in sample_points(x, y) {
        let (a, b) = (x.eval(&env), y.eval(&env));
        if !a.is_finite() || !b.is_finite() {
            continue;
        }
        match (a.norm() <= ABS_TOL, b.norm() <= ABS_TOL) {
            (true, true) => continue,
            (false, false) => {}
            _ => return false,
        }
        let r = b.div(a);
        match ratio {
            None => ratio = Some(r),
            Some(r0) if close(r0, r) => {}
            Some(_) => return false,
        }
        valid += 1;
    }
    valid >= MIN_VALID_POINTS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (gold, prediction) pairs that must be judged equivalent.
    const EQUAL: &[(&str, &str)] = &[
        // integers, decimals, separators
        ("204", "204"),
        ("204", " 204 "),
        ("-3", "-3"),
        ("007", "7"),
        ("0", "-0"),
        ("12345678901234567890123", "12345678901234567890123"),
        ("1.25", "1.250"),
        ("0.5", ".5"),
        (".0000672", "0.0000672"),
        ("10080", "10,080"),
        ("10,\\!080", "10080"),
        ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
        ("58,500", "58500"),
        ("\\$32,\\!348", "32348"),
        ("\\$18.90", "18.9"),
        ("4005", "4005."),
        // fractions and mixed numbers
        ("\\frac{1}{2}", "0.5"),
        ("\\frac{1}{2}", "1/2"),
        ("\\frac{1}{2}", "\\dfrac{1}{2}"),
        ("\\frac{1}{2}", "\\tfrac12"),
        ("\\frac 34", "\\frac{3}{4}"),
        ("\\frac9{19}", "9/19"),
        ("\\frac{14}{3}", "\\frac{28}{6}"),
        ("-\\frac{3}{8}", "\\frac{-3}{8}"),
        ("-\\frac{3}{8}", "-0.375"),
        ("\\dfrac{33}{100}", "0.33"),
        ("137 \\frac{1}{2}", "137.5"),
        ("1\\frac{4}{5}", "\\frac{9}{5}"),
        ("1\\frac{4}{5}", "1.8"),
        ("-1./3", "-\\frac13"),
        // percentages and scientific notation
        ("50\\%", "50"),
        ("50\\%", "0.5"),
        ("12.5", "12.5\\%"),
        ("4.5e33", "4.5 \\times 10^{33}"),
        ("3.83e35", "3.83 \\cdot 10^{35}"),
        ("1e-5", "0.00001"),
        ("2.7778e-6", "2.7778 \\times 10^{-6}"),
        ("0", "\\sin \\pi"),
        ("1.325e-27", "1.325 \\times 10^{-27}"),
        // radicals, pi, powers
        ("2\\sqrt{5}", "\\sqrt{20}"),
        ("11\\sqrt2", "11 \\sqrt{2}"),
        ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
        ("\\frac{3\\sqrt{3}}{4}", "\\frac{3}{4}\\sqrt3"),
        ("\\sqrt[3]{8}", "2"),
        ("\\frac{8}{\\sqrt[3]{7}}", "8 \\cdot 7^{-1/3}"),
        ("12\\pi", "12 \\pi"),
        ("12\\pi", "\\pi \\cdot 12"),
        ("288 \\pi", "288\\pi"),
        ("\\frac{20000}{\\pi}", "20000/\\pi"),
        ("18+2\\pi", "2\\pi + 18"),
        ("2^{1009}", "2^{1009}"),
        ("2^{10}", "1024"),
        ("\\frac{100!}{2^{50}}", "\\frac{100!}{2^{50}}"),
        ("\\binom{6}{2}", "15"),
        // units, text, degrees, noise
        ("5.4 \\text{ cents}", "5.4"),
        ("15\\mbox{ cm}^2", "15"),
        ("864 \\mbox{ inches}^2", "864"),
        ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
        ("18", "18 dollars"),
        ("27", "27 miles"),
        ("106^\\circ", "106"),
        ("90^\\circ", "90^{\\circ}"),
        ("30^\\circ", "30°"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("\\text{(B)}", "B"),
        ("\\text{(C)}", "(C)"),
        ("\\text{Evelyn}", "Evelyn"),
        ("\\text{east}", "East"),
        ("\\text{No}", "no"),
        ("4.5e33", "4.5 \\times 10^{33} \\mathrm{~erg} / \\mathrm{s}"),
        ("\\text{ellipse}", "\\text{ellipse}"),
        ("204_5", "204"),
        ("2516_8", "2516_{8}"),
        // equations and x = 5
        ("x=5", "5"),
        ("5", "x = 5"),
        ("k = 3", "k=3"),
        ("y = -2x", "y=-2x"),
        ("y = 2x + 3", "y = 3 + 2x"),
        ("y = 2x + 3", "2x - y + 3 = 0"),
        ("5x - 7y + 11z + 4 = 0", "-10x + 14y - 22z - 8 = 0"),
        ("f(x)=2 x", "2x"),
        ("f(x)=\\frac{1}{x}", "f(x) = 1/x"),
        ("M=\\frac{9}{32} \\sqrt{2}", "\\frac{9\\sqrt2}{32}"),
        // tuples, intervals, unions
        ("(2,4)", "(2, 4)"),
        ("(8,-2)", "\\left(8, -2\\right)"),
        ("\\left( \\frac{3}{2}, -13 \\right)", "(1.5,-13)"),
        ("(1,-16,-4,43)", "(1, -16, -4, 43)"),
        ("(3,4]", "\\left(3, 4\\right]"),
        ("[0.5, 3)", "[\\frac12, 3)"),
        ("(-\\infty, 0]", "(-\\infty,0]"),
        ("(-\\infty, 2) \\cup (3, \\infty)", "(3,\\infty)\\cup(-\\infty,2)"),
        ("(0,9) \\cup (9,36)", "(0, 9) \\cup (9, 36)"),
        ("x \\in [-2,7]", "[-2,7]"),
        ("\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]", "[\\pi^2/8, 5\\pi^2/4]"),
        ("\\left(\\frac{3}{5},\\frac{8}{3}\\right]", "(0.6, 8/3]"),
        // sets, lists, plus-minus
        ("3, 5, 7", "7, 5, 3"),
        ("3, 5, 7", "\\{3, 5, 7\\}"),
        ("-2,1", "1, -2"),
        ("1 \\pm \\sqrt{19}", "1 + \\sqrt{19}, 1 - \\sqrt{19}"),
        ("3 \\pm 2 \\sqrt{2}", "3-2\\sqrt2, 3+2\\sqrt2"),
        ("\\{1\\pm\\sqrt{5},-2\\}", "-2, 1-\\sqrt5, 1+\\sqrt5"),
        ("(1,8,19), (2,7,13), (4,5,7)", "(4,5,7), (1,8,19), (2,7,13)"),
        ("2500,7500", "7500, 2500"),
        ("3 \\text{ and } 5", "3, 5"),
        // matrices
        (
            "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
            "\\begin{bmatrix} -1 & 0 \\\\ 0 & -1 \\end{bmatrix}",
        ),
        (
            "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
            "\\begin{pmatrix} \\frac{1}{5} \\\\ -\\frac{18}{5} \\end{pmatrix}",
        ),
        ("\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", "(-1/3, 2/3, 5/3)"),
        // LaTeX thousands separators `{,}` and `\,`
        ("1600", "1{,}600"),
        ("1{,}600{,}000", "1600000"),
        ("\\$1{,}600", "1600"),
        ("1600", "1\\,600"),
        ("1234567", "1\\,234\\,567"),
        ("1\\,234.5", "1234.5"),
        ("3.141\\,592", "3.141592"),
        ("1\\,600", "1{,}600"),
        // units written with LaTeX symbols
        ("5.4", "5.4 \\mathrm{~\\AA}"),
        ("5.4", "5.4 \\text{ \\AA}"),
        ("1.5", "1.5~\\AA"),
        ("2.1", "2.1 \\mathrm{~\\mu m}"),
        ("3", "3 \\mathrm{~k \\Omega}"),
        // subscripted names with and without braces
        ("X_{d}=125-1.25 P", "X_d = 125 - 1.25P"),
        ("v_{0}=3", "v_0 = 3"),
        ("\\omega_{n}=2", "\\omega_n=2"),
        // scientific notation
        ("1.24e-8", "1.24 \\times 10^{-8}"),
        ("1.24e-8", "1.24 \\cdot 10^{-8}"),
        ("1.24e-8", "1.24\\times10^{-8}"),
        ("1.24e-8", "1.24E-8"),
        ("1.24e-8", "1.24 \\times 10^{-8} \\mathrm{~m}"),
        ("1.24e-8", "0.0000000124"),
        ("1.24e-8", "\\frac{31}{25} \\times 10^{-8}"),
        ("3 \\times 10^{5}", "300000"),
        ("6.5e-2", "0.065"),
        // a decimal equals an exact value when it is that value, or rounds to it at
        // six decimal places of its written scale (math-verify's float_rounding = 6)
        ("\\frac{3}{8}", "0.375"),
        ("\\frac{1}{3}", "0.3333333"),
        ("\\frac{\\pi}{2}", "1.5707963"),
        ("\\sqrt{2}", "1.41421356"),
        ("\\frac{20000}{\\pi}", "6366.197724"),
        ("\\frac{1}{30000}", "3.333333 \\times 10^{-5}"),
        ("\\frac{31}{25} \\times 10^{-8}", "1.2400001e-8"),
        ("2^{100}", "1.2676506e30"),
        // complex numbers
        ("-2 + 7i", "7i - 2"),
        ("1 - 12i", "1-12 i"),
        ("6 - 5i", "\\frac{(6-5i)(1+i)}{1+i}"),
        ("1+\\sqrt{3} i", "1 + i\\sqrt{3}"),
        // algebraic expressions
        ("2k+2", "2(k+1)"),
        ("-13x+3", "3 - 13x"),
        ("(a+5)(b+2)", "ab + 2a + 5b + 10"),
        ("x^3+3x-6", "x^{3}+3x-6"),
        ("6r^2-4r-24", "2(3r^2-2r-12)"),
        ("x^8 + x^7 + x^6 + x^5 + x^4 + x^3 + x^2 + x + 1", "\\frac{x^9-1}{x-1}"),
        ("\\frac{11+9a}{20}", "\\frac{11}{20} + \\frac{9a}{20}"),
        ("\\frac{n(n+1)(2 n+1)}{6}", "\\frac{2n^3+3n^2+n}{6}"),
        ("\\frac{1}{2 n+2}", "\\frac{1}{2(n+1)}"),
        ("p - q", "-(q - p)"),
        ("\\cot x", "\\frac{\\cos x}{\\sin x}"),
        ("\\sin^2 x", "1 - \\cos^2 x"),
        ("e^{t} / 3", "\\frac{1}{3} e^t"),
        ("\\ln 2 + i\\pi / 3", "\\log 2 + \\frac{\\pi i}{3}"),
        ("2 \\cos (\\pi t+\\pi / 3)", "\\cos(\\pi t) - \\sqrt{3} \\sin(\\pi t)"),
        ("\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", "\\cosh(a t)"),
        ("\\left\\lfloor\\log _{2} n\\right\\rfloor+1", "1 + \\lfloor \\log_2 n \\rfloor"),
        ("\\lfloor n / 2\\rfloor", "\\lceil (n-1)/2 \\rceil"),
        ("\\binom{2n}{n}", "\\frac{(2n)!}{(n!)^2}"),
        ("2\\alpha + \\beta", "\\beta + \\alpha + \\alpha"),
        ("x_{0} \\cos (\\omega t)", "\\cos(t \\omega) x_0"),
        ("\\sqrt{x^2}", "x"),
        ("\\frac{a M^{1 / 3}}{G M^{2 / 3}+b}", "\\frac{a}{G M^{1/3} + b M^{-1/3}}"),
    ];

    /// (gold, prediction) pairs that must be judged different.
    const DIFFERENT: &[(&str, &str)] = &[
        // numbers
        ("204", "205"),
        ("204", "2040"),
        ("-3", "3"),
        ("12345678901234567890123", "12345678901234567890124"),
        ("1.25", "1.2"),
        (".0000672", "0.0000673"),
        ("10080", "10,081"),
        ("1,3", "13"),
        ("0.15", "0.16"),
        ("\\$18.90", "1890"),
        // fractions
        ("\\frac{1}{2}", "\\frac{1}{3}"),
        ("\\frac{1}{3}", "0.333"),
        ("\\frac{1}{3}", "0.33"),
        ("\\frac 34", "34"),
        ("\\frac9{19}", "\\frac{9}{1}9"),
        ("-\\frac{3}{8}", "\\frac{3}{8}"),
        ("137 \\frac{1}{2}", "68.5"),
        ("1\\frac{4}{5}", "0.8"),
        // percent and scientific
        ("50\\%", "5"),
        ("4.5e33", "4.5e32"),
        ("3.83e35", "3.84 \\times 10^{35}"),
        ("2.88e-19", "1.325e-27"),
        ("1e-13", "0"),
        // radicals, pi, powers
        ("2\\sqrt{5}", "\\sqrt{10}"),
        ("\\sqrt{51}", "51"),
        ("\\sqrt{2}", "1.414"),
        ("12\\pi", "12"),
        ("12\\pi", "37.7"),
        ("2^{1009}", "2^{1008}"),
        ("\\binom{6}{2}", "30"),
        // units, text, degrees
        ("5.4 \\text{ cents}", "54"),
        ("106^\\circ", "107"),
        ("\\text{(B)}", "C"),
        ("\\text{(B)}", "(D)"),
        ("\\text{Evelyn}", "Navin"),
        ("\\text{even}", "odd"),
        ("\\text{even}", "neve"),
        ("\\text{No}", "\\text{Yes}"),
        ("204_5", "205"),
        // equations
        ("x=5", "6"),
        ("x=5", "x=-5"),
        ("y = -2x", "y = 2x"),
        ("y = 2x + 3", "y = 2x - 3"),
        ("5x - 7y + 11z + 4 = 0", "5x - 7y + 11z - 4 = 0"),
        ("f(x)=2 x", "f(x) = x"),
        // tuples, intervals, unions
        ("(2,4)", "(4,2)"),
        ("(2,4)", "[2,4]"),
        ("(3,4]", "(3,4)"),
        ("(3,4]", "[3,4]"),
        ("(-\\infty, 0]", "(-\\infty, 0)"),
        ("(-\\infty, 0]", "(\\infty, 0]"),
        ("(1,-16,-4,43)", "(1,-16,-4)"),
        ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty, 2] \\cup (3, \\infty)"),
        ("(0,9) \\cup (9,36)", "(0,36)"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi)"),
        // sets and lists
        ("3, 5, 7", "3, 5"),
        ("3, 5, 7", "3, 5, 8"),
        ("3, 5, 7", "3, 5, 7, 7"),
        ("1 \\pm \\sqrt{19}", "1 + \\sqrt{19}"),
        ("\\{1\\pm\\sqrt{5},-2\\}", "1+\\sqrt5, 1-\\sqrt5, 2"),
        ("(1,8,19), (2,7,13)", "(1,8,19), (2,13,7)"),
        ("2500,7500", "2500"),
        // matrices
        (
            "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
            "\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
        ),
        (
            "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}",
            "\\begin{pmatrix} -1 & 0 & 0 & -1 \\end{pmatrix}",
        ),
        ("\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}", "(-7, 16)"),
        // complex numbers
        ("-2 + 7i", "-2 - 7i"),
        ("1+2i", "2+i"),
        ("1 - 12i", "1 - 12"),
        // algebraic expressions
        ("2k+2", "2k+1"),
        ("2k", "2n"),
        ("(a+5)(b+2)", "ab + 10"),
        ("x^3+3x-6", "x^3+3x+6"),
        ("x^8 + x^7 + x^6 + x^5 + x^4 + x^3 + x^2 + x + 1", "\\frac{x^9+1}{x+1}"),
        ("\\frac{n(n+1)(2 n+1)}{6}", "\\frac{n(n+1)}{2}"),
        ("p - q", "q - p"),
        ("\\cot x", "\\tan x"),
        ("e^{t} / 3", "e^{3t}"),
        ("\\lfloor n / 2\\rfloor", "n/2"),
        ("\\binom{2n}{n}", "2^n"),
        ("\\sqrt{x^2}", "-x"),
        ("x_{0} \\cos (\\omega t)", "x_{1} \\cos (\\omega t)"),
        ("I(0) e^{-\\frac{t}{R C}}", "I(0) e^{-\\frac{t}{R}}"),
        ("R(1-\\cos\\theta)", "R - \\cos\\theta"),
        // more near misses, one per category
        ("100", "1000"),
        ("0.5", "5"),
        ("1.5", "15"),
        ("58,500", "58.5"),
        ("11,\\! 111,\\! 111,\\! 100", "11111111101"),
        ("\\frac{14}{3}", "\\frac{3}{14}"),
        ("\\frac{1}{2}", "\\frac{2}{4}x"),
        ("\\tfrac12", "12"),
        ("2\\frac{1}{2}", "1"),
        ("12.5\\%", "0.25"),
        ("1e-5", "1e5"),
        ("\\sqrt[3]{8}", "\\sqrt{8}"),
        ("\\sqrt{x}", "x^{1/3}"),
        ("18+2\\pi", "20\\pi"),
        ("2^{10}", "2 \\cdot 10"),
        ("e^{2}", "2e"),
        ("\\pi", "3.14"),
        ("864 \\mbox{ inches}^2", "864^2"),
        ("30^\\circ", "60^\\circ"),
        ("\\text{(C)}", "\\text{(E)}"),
        ("\\text{ellipse}", "\\text{parabola}"),
        ("k = 3", "k = 4"),
        ("y = 2x + 3", "x = 2y + 3"),
        ("f(x)=\\frac{1}{x}", "f(x)=x"),
        ("x = 5", "y = 6"),
        ("(8,-2)", "(-2,8)"),
        ("[0.5, 3)", "(0.5, 3]"),
        ("(2,\\infty)", "(2, 100)"),
        ("(0,9) \\cup (9,36)", "(0,9) \\cup (9,37)"),
        ("(1,2,3)", "\\{1,2,3\\}x"),
        ("1, 2", "1, 2, 3"),
        ("-2,1", "2, -1"),
        ("3 \\pm 2 \\sqrt{2}", "3 + 2\\sqrt{2}, 3 - \\sqrt{2}"),
        ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "\\begin{pmatrix} -18/5 \\\\ 1/5 \\end{pmatrix}"),
        (
            "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
            "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}",
        ),
        ("6 - 5i", "6 + 5i"),
        ("i", "-i"),
        ("\\frac{11+9a}{20}", "\\frac{11+9a}{2}"),
        ("a^2", "2a"),
        ("(x+1)^2", "x^2+1"),
        ("\\sin^2 x", "\\sin x^2"),
        ("\\ln 2", "\\log_2 2"),
        ("\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", "\\sinh(a t)"),
        ("2\\alpha + \\beta", "2\\beta + \\alpha"),
        ("n!", "n^n"),
        // separators, units, subscripts, scientific notation
        ("1600", "1{,}601"),
        ("1600", "16{,}00"),
        ("1600", "1\\,6"),
        ("5.4", "5.4 \\mathrm{~\\AA} + 1"),
        ("X_{d}=3", "X_{e}=3"),
        ("X_{d}=3", "X_{dd}=3"),
        ("1.24e-8", "1.24 \\times 10^{-9}"),
        ("1.24e-8", "1.24e8"),
        ("1.24e-8", "1.24 \\times 10^{8}"),
        ("1.24e-8", "1.2 \\times 10^{-8}"),
        // a decimal rounded short of six places is not an exact closed form
        ("\\frac{20000}{\\pi}", "6366.20"),
        ("5\\sqrt[3]{4}", "7.937"),
        ("\\frac{20000}{\\pi}", "6.3662 \\times 10^{3}"),
        ("\\frac{31}{25} \\times 10^{-8}", "1.240001e-8"),
        ("2^{100}", "1.26765e30"),
        ("\\frac{1}{3}", "33.333\\%"),
        ("\\frac{1}{30000}", "3.33333 \\times 10^{-5}"),
        // empty and garbage
        ("5", ""),
        ("5", "\\boxed{"),
        ("(2,4)", "(2,"),
    ];

    #[test]
    fn equal_pairs_are_equivalent_both_ways() {
        let failures: Vec<_> = EQUAL.iter().filter(|(g, p)| !equivalent(g, p) || !equivalent(p, g)).collect();
        assert!(failures.is_empty(), "judged different: {failures:#?}");
    }

    #[test]
    fn different_pairs_are_not_equivalent_both_ways() {
        let failures: Vec<_> =
            DIFFERENT.iter().filter(|(g, p)| equivalent(g, p) || equivalent(p, g)).collect();
        assert!(failures.is_empty(), "judged equal: {failures:#?}");
    }

    #[test]
    fn enough_cases() {
        assert!(EQUAL.len() + DIFFERENT.len() >= 150);
        assert!(EQUAL.len().abs_diff(DIFFERENT.len()) < 60);
    }

    #[test]
    fn decimal_scale_reads_the_written_exponent() {
        let cases: &[(&str, f64)] = &[
            ("6366.20", 1.0),
            ("-.5", 1.0),
            ("4005.", 1.0),
            ("12.5%", 1.0),
            ("1.24e-8", 1e-8),
            ("1E5", 1e5),
            ("1.24 \\times 10^{-8}", 1e-8),
            ("2.5 \\cdot 10^3", 1e3),
            ("2.5*10^{+3}", 1e3),
        ];
        for (s, want) in cases {
            let got = decimal_scale(s).unwrap_or_else(|| panic!("{s}: not a decimal"));
            assert!((got / want - 1.0).abs() < 1e-12, "{s}: {got} != {want}");
        }
        for exact in [
            "1600",
            "-7",
            "3 \\times 10^{5}",
            "\\frac{1}{2}",
            "2.5\\pi",
            "1.2 \\times 10^12",
            "1.2e",
            ".",
            "1.2.3",
        ] {
            assert_eq!(decimal_scale(exact), None, "{exact}");
        }
    }

    #[test]
    fn name_key_unbraces_one_token_subscripts() {
        assert_eq!(name_key("X_{d}"), "X_d");
        assert_eq!(name_key("\\omega_{n}"), "\\omega_n");
        assert_eq!(name_key("v_{\\max}"), "v_\\max");
        assert_eq!(name_key("R_{WD}"), "R_{WD}");
        assert_eq!(name_key("x_{1}+y_{2}"), "x_1+y_2");
        assert_eq!(name_key("a_{"), "a_{");
        assert_eq!(name_key("a_{}"), "a_{}");
    }

    #[test]
    fn structure_parsing() {
        assert!(matches!(Ans::parse("(a+5)(b+2)", 0), Ans::Expr(_)));
        assert!(matches!(Ans::parse("[0, 1)", 0), Ans::Tuple { open: '[', close: ')', .. }));
        assert!(matches!(Ans::parse("\\{1, 2\\}", 0), Ans::Set(ref v) if v.len() == 2));
        assert!(matches!(Ans::parse("1 \\pm 2", 0), Ans::Set(ref v) if v.len() == 2));
        assert!(matches!(Ans::parse("(1,2) \\cup [3,4]", 0), Ans::Union(ref v) if v.len() == 2));
        assert!(matches!(Ans::parse("x = 1", 0), Ans::Eq(..)));
        assert!(matches!(Ans::parse("Evelyn", 0), Ans::Text(_)));
        assert!(is_simple_lhs("f(x)") && is_simple_lhs("x_0") && !is_simple_lhs("2x+y"));
    }

    #[test]
    fn adversarial_answers_return() {
        let deep = format!("{}1{}", "{".repeat(10_000), "}".repeat(10_000));
        assert!(equivalent(&deep, &deep));
        assert!(!equivalent("1", &deep));
        let deep_parens = format!("{}1{}", "(".repeat(900), ")".repeat(900));
        assert!(!equivalent("2", &deep_parens));
        assert!(!equivalent("1", "2^{99999999}"));
        assert!(equivalent("2^{99999999}", "2^{99999999}"));
        assert!(!equivalent("2^{99999999}", "2^{99999998}"));
        assert!(!equivalent("x", "x^{10^{400}}"));
        let big = "9".repeat(100_000);
        assert!(!equivalent("9", &big));
        let list = vec!["1"; 500].join(",");
        assert!(!equivalent("1", &list));
        let commas = ",".repeat(1999);
        assert!(!equivalent("1", &commas));
        let pms = "1\\pm".repeat(400) + "1";
        assert!(!equivalent("1", &pms));
    }
}
