//! A long-answer reasoning task: integer problems whose worked solutions write
//! out every digit step, so that a correct answer takes 150-600 tokens (digits
//! are one token each in every stapo tokenizer, as in Qwen3's).
//!
//! Four kinds, each checked by the existing `\boxed{}` verifier:
//!
//! - `mul`: long multiplication. One partial product per digit of the
//!   multiplier, each digit times digit written with its carry, then the
//!   shifted rows added column by column.
//! - `div`: long division by a one- or two-digit divisor, one line per digit
//!   brought down (quotient digit, product, remainder).
//! - `gcd`: Euclid's algorithm, each division written as its quotient, product
//!   and remainder, the subtraction worked column by column with borrows.
//! - `word`: a template story that needs a long multiplication and then a
//!   subtraction (column by column, with borrows) or an addition.
//!
//! ```text
//! problem:  Compute 47*36.
//! solution: 47*6:
//!           7*6=42, write 2, carry 4
//!           4*6+4=28, write 28
//!           47*6=282
//!           47*3:
//!           ...
//!           282+1410:
//!           2+0=2, write 2, carry 0
//!           ...
//!           \boxed{1692}
//! ```
//!
//! With `variety_percent` > 0 a solution is written in one of several
//! equivalent styles, each choice drawn independently with that chance: a
//! product with a carry in two steps (`7*6=42, 42+4=46`), factors and addends
//! in the other order (`6*7`, `0+2`), `put` for `write`, a zero carry left
//! unsaid, a borrow announced first (`borrow for 2-7: 12-7=5`). The arithmetic
//! is the same; a model trained on the mix keeps real choices in its wording
//! (sampling entropy on its own answers) after it has learned the arithmetic,
//! as a language model does. The choices are seeded by the problem's numbers, so
//! the problems themselves do not change with the setting.
//!
//! The difficulty of a problem is the number of digits of its operands, drawn
//! uniformly from the configured range, so that one set spans easy and hard
//! problems (and a starting model solves some, not all). Deterministic for a
//! seed and [`LongTaskConfig`] (`rand::rngs::StdRng`).

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::task::Problem;
use crate::seed::splitmix64;
use crate::{Error, Result};

/// The `source` field written for generated long-answer problems.
pub const LONG_SOURCE: &str = "long";

/// The problem kinds, in the order of [`LongTaskConfig::weights`].
pub const LONG_KINDS: [&str; 4] = ["mul", "div", "gcd", "word"];

/// Difficulty knobs of the long-answer generator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LongTaskConfig {
    /// Relative frequency of each kind, in the order `mul`, `div`, `gcd`, `word`.
    pub weights: [u32; 4],
    /// Digits of a multiplicand (and of a dividend's quotient part), uniform in `[min, max]`.
    pub min_digits: usize,
    /// See `min_digits`.
    pub max_digits: usize,
    /// Digits of a multiplier, uniform in `[2, max_multiplier_digits]`.
    pub max_multiplier_digits: usize,
    /// Largest number Euclid's algorithm starts from (the smaller one is below it).
    pub max_gcd: u64,
    /// Chance, in percent, that each step is written in its alternative style (see the
    /// module docs); 0 writes every solution in the one plain style.
    pub variety_percent: u32,
}

impl Default for LongTaskConfig {
    /// Multiplicands of 2-4 digits by 2-3 digit multipliers, dividends of 4-6
    /// digits, Euclid from numbers below 2000: worked solutions of ~150-550
    /// tokens (`data/long`).
    fn default() -> Self {
        Self {
            weights: [4, 2, 2, 2],
            min_digits: 2,
            max_digits: 4,
            max_multiplier_digits: 3,
            max_gcd: 2000,
            variety_percent: 0,
        }
    }
}

impl LongTaskConfig {
    /// Checks the knobs once, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| {
            Err(Error::Config { file: "long task config".into(), field: field.into(), msg })
        };
        if self.weights.iter().all(|&w| w == 0) {
            return bad("weights", "expected at least one kind with a non-zero weight".into());
        }
        if self.min_digits < 1 || self.max_digits < self.min_digits || self.max_digits > 9 {
            return bad(
                "max_digits",
                format!(
                    "expected 1 <= min_digits <= max_digits <= 9, found {}..={}",
                    self.min_digits, self.max_digits
                ),
            );
        }
        if !(2..=6).contains(&self.max_multiplier_digits) {
            return bad(
                "max_multiplier_digits",
                format!("expected 2..=6, found {}", self.max_multiplier_digits),
            );
        }
        if !(10..=1_000_000).contains(&self.max_gcd) {
            return bad("max_gcd", format!("expected 10..=1000000, found {}", self.max_gcd));
        }
        if self.variety_percent > 100 {
            return bad("variety_percent", format!("expected 0..=100, found {}", self.variety_percent));
        }
        Ok(())
    }
}

/// The decimal digits of `n`, least significant first.
fn digits(n: u64) -> Vec<u64> {
    let mut d = Vec::new();
    let mut n = n;
    loop {
        d.push(n % 10);
        n /= 10;
        if n == 0 {
            return d;
        }
    }
}

/// The choices between equivalent ways of writing a step (`variety_percent`).
struct Style {
    /// `None` when every step takes the plain style.
    rng: Option<StdRng>,
    chance: f64,
}

impl Style {
    /// Choices seeded by `key` (the problem's kind and numbers).
    fn new(cfg: &LongTaskConfig, key: &[u64]) -> Self {
        if cfg.variety_percent == 0 {
            return Self { rng: None, chance: 0.0 };
        }
        // A seed that depends on the problem alone: the key's words mixed in turn.
        let h = key.iter().fold(0u64, |h, &k| splitmix64(h ^ k));
        Self { rng: Some(StdRng::seed_from_u64(h)), chance: f64::from(cfg.variety_percent) / 100.0 }
    }

    /// Whether this step takes its alternative style.
    fn alt(&mut self) -> bool {
        let chance = self.chance;
        self.rng.as_mut().is_some_and(|r| r.random_bool(chance))
    }

    /// `x*y`, or `y*x` in the alternative style.
    fn product(&mut self, x: u64, y: u64) -> String {
        if self.alt() {
            format!("{y}*{x}")
        } else {
            format!("{x}*{y}")
        }
    }

    /// `write`, or `put` in the alternative style.
    fn write(&mut self) -> &'static str {
        if self.alt() {
            "put"
        } else {
            "write"
        }
    }

    /// The end of a column's line: the digit written and the carry (a zero carry may go
    /// unsaid in the alternative style).
    fn digit_and_carry(&mut self, v: u64, last: bool) -> String {
        let w = self.write();
        if last || (v / 10 == 0 && self.alt()) {
            format!(", {w} {v}\n")
        } else {
            format!(", {w} {}, carry {}\n", v % 10, v / 10)
        }
    }
}

/// A number of `k` digits, `k` uniform in `[lo_k, hi_k]`.
fn with_digits(rng: &mut impl Rng, lo_k: usize, hi_k: usize) -> u64 {
    let k = rng.random_range(lo_k..=hi_k);
    let lo = 10u64.pow(k as u32 - 1);
    rng.random_range(lo.max(1)..10 * lo)
}

/// `a * d` for one digit `d`, each column written with its carry; returns the product.
fn times_digit(out: &mut String, st: &mut Style, a: u64, d: u64) -> u64 {
    out.push_str(&format!("{a}*{d}:\n"));
    let ad = digits(a);
    let mut carry = 0;
    for (i, &x) in ad.iter().enumerate() {
        let v = x * d + carry;
        let xd = st.product(x, d);
        let expr = match carry {
            0 => format!("{xd}={v}"),
            // The product first, then the carry added: the same step in two.
            _ if st.alt() => format!("{xd}={}, {}+{carry}={v}", x * d, x * d),
            _ => format!("{xd}+{carry}={v}"),
        };
        out.push_str(&expr);
        out.push_str(&st.digit_and_carry(v, i + 1 == ad.len()));
        carry = v / 10;
    }
    let p = a * d;
    out.push_str(&format!("{a}*{d}={p}\n"));
    p
}

/// `a + b` column by column; returns the sum.
fn add_columns(out: &mut String, st: &mut Style, a: u64, b: u64) -> u64 {
    out.push_str(&format!("{a}+{b}:\n"));
    let (da, db) = (digits(a), digits(b));
    let n = da.len().max(db.len());
    let mut carry = 0;
    for i in 0..n {
        let (x, y) = (da.get(i).copied().unwrap_or(0), db.get(i).copied().unwrap_or(0));
        let v = x + y + carry;
        let (x, y) = if st.alt() { (y, x) } else { (x, y) };
        let expr = if carry > 0 { format!("{x}+{y}+{carry}={v}") } else { format!("{x}+{y}={v}") };
        out.push_str(&expr);
        out.push_str(&st.digit_and_carry(v, i + 1 == n));
        carry = v / 10;
    }
    let s = a + b;
    out.push_str(&format!("{a}+{b}={s}\n"));
    s
}

/// `a - b` (with `a >= b`) column by column, borrowing; returns the difference.
fn sub_columns(out: &mut String, st: &mut Style, a: u64, b: u64) -> u64 {
    debug_assert!(a >= b);
    out.push_str(&format!("{a}-{b}:\n"));
    let (da, db) = (digits(a), digits(b));
    let mut borrow = 0;
    for (i, &x) in da.iter().enumerate() {
        let y = db.get(i).copied().unwrap_or(0) + borrow;
        if x >= y {
            out.push_str(&format!("{x}-{y}={}\n", x - y));
            borrow = 0;
        } else {
            if st.alt() {
                out.push_str(&format!("borrow for {x}-{y}: {}-{y}={}\n", x + 10, x + 10 - y));
            } else {
                out.push_str(&format!("{x}-{y}: borrow, {}-{y}={}\n", x + 10, x + 10 - y));
            }
            borrow = 1;
        }
    }
    let d = a - b;
    out.push_str(&format!("{a}-{b}={d}\n"));
    d
}

/// The long multiplication `a * b`, worked; returns the product.
fn long_mul(out: &mut String, st: &mut Style, a: u64, b: u64) -> u64 {
    let mut rows = Vec::new();
    for (shift, d) in digits(b).into_iter().enumerate() {
        let p = times_digit(out, st, a, d);
        let row = p * 10u64.pow(shift as u32);
        if shift > 0 {
            out.push_str(&format!("shift {shift}: {row}\n"));
        }
        rows.push(row);
    }
    let mut total = rows[0];
    for &r in &rows[1..] {
        total = add_columns(out, st, total, r);
    }
    total
}

/// `a // b` by long division (one line per digit brought down); returns the quotient.
fn long_div(out: &mut String, st: &mut Style, a: u64, b: u64) -> (u64, u64) {
    out.push_str(&format!("{a}//{b}:\n"));
    let mut rem = 0;
    let mut q = 0;
    for d in digits(a).into_iter().rev() {
        let cur = rem * 10 + d;
        let qd = cur / b;
        rem = cur - qd * b;
        let qb = st.product(qd, b);
        out.push_str(&format!("bring {d}: {cur}//{b}={qd}, {qb}={}, {cur}-{}={rem}\n", qd * b, qd * b));
        q = q * 10 + qd;
    }
    out.push_str(&format!("quotient {q}, remainder {rem}\n"));
    (q, rem)
}

/// `a mod b` the way a person checks it: the quotient by trial products, then
/// the subtraction worked; returns the remainder.
fn euclid_step(out: &mut String, st: &mut Style, a: u64, b: u64) -> u64 {
    let q = a / b;
    let p = q * b;
    let qb = st.product(q, b);
    out.push_str(&format!("{a}//{b}={q}, {qb}={p}\n"));
    let r = if p == a { 0 } else { sub_columns(out, st, a, p) };
    out.push_str(&format!("gcd({a},{b})=gcd({b},{r})\n"));
    r
}

fn draw_mul(rng: &mut impl Rng, cfg: &LongTaskConfig) -> (String, u64, String) {
    let a = with_digits(rng, cfg.min_digits.max(2), cfg.max_digits.max(2));
    let b = with_digits(rng, 2, cfg.max_multiplier_digits);
    let mut s = String::new();
    let v = long_mul(&mut s, &mut Style::new(cfg, &[0, a, b]), a, b);
    (format!("Compute {a}*{b}."), v, s)
}

fn draw_div(rng: &mut impl Rng, cfg: &LongTaskConfig) -> (String, u64, String) {
    let b = rng.random_range(3..=29u64);
    let q = with_digits(rng, cfg.min_digits + 1, cfg.max_digits + 2);
    let a = q * b + rng.random_range(0..b);
    let mut s = String::new();
    let (v, _) = long_div(&mut s, &mut Style::new(cfg, &[1, a, b]), a, b);
    (format!("Compute {a}//{b} (the quotient, rounded down)."), v, s)
}

fn draw_gcd(rng: &mut impl Rng, cfg: &LongTaskConfig) -> (String, u64, String) {
    // A common factor, so that the answer is rarely 1, and at least 3 steps.
    loop {
        let g = rng.random_range(2..=30u64);
        let top = (cfg.max_gcd / g).max(4);
        let a = g * rng.random_range(top / 3..=top);
        let b = g * rng.random_range(2..=top / 2);
        if a <= b {
            continue;
        }
        let mut s = String::new();
        let mut st = Style::new(cfg, &[2, a, b]);
        let (mut x, mut y, mut steps) = (a, b, 0);
        while y > 0 {
            let r = euclid_step(&mut s, &mut st, x, y);
            (x, y) = (y, r);
            steps += 1;
        }
        if steps >= 3 {
            s.push_str(&format!("gcd({x},0)={x}\n"));
            return (format!("Find the greatest common divisor of {a} and {b}."), x, s);
        }
    }
}

/// Word-problem templates: (story with `{a}`, `{b}`, `{c}`, question, whether `c` is taken away).
const STORIES: &[(&str, &str, bool)] = &[
    ("A farm packs {a} crates of {b} eggs each. Then {c} eggs break.", "How many eggs are left?", true),
    (
        "A library has {a} shelves with {b} books on each. It gives away {c} books.",
        "How many books remain?",
        true,
    ),
    (
        "A factory makes {a} boxes of {b} bolts. It then makes {c} loose bolts.",
        "How many bolts in all?",
        false,
    ),
    ("A train has {a} rows of {b} seats. {c} seats are taken.", "How many seats are free?", true),
    (
        "A school buys {a} packs of {b} pencils and already has {c} pencils.",
        "How many pencils does it have?",
        false,
    ),
];

fn draw_word(rng: &mut impl Rng, cfg: &LongTaskConfig) -> (String, u64, String) {
    let (story, question, take) = STORIES[rng.random_range(0..STORIES.len())];
    let a = with_digits(rng, cfg.min_digits.max(2), cfg.max_digits.max(2));
    let b = with_digits(rng, 2, 2);
    let total = a * b;
    let c = if take { rng.random_range(total / 10..total) } else { rng.random_range(10..=total) };
    let problem = format!(
        "{} {question}",
        story.replace("{a}", &a.to_string()).replace("{b}", &b.to_string()).replace("{c}", &c.to_string())
    );
    let mut s = String::new();
    let mut st = Style::new(cfg, &[3, a, b, c]);
    let m = long_mul(&mut s, &mut st, a, b);
    let v = if take { sub_columns(&mut s, &mut st, m, c) } else { add_columns(&mut s, &mut st, m, c) };
    (problem, v, s)
}

/// Draws one problem: (question, answer, worked solution ending in `\boxed{}`).
fn draw(rng: &mut impl Rng, cfg: &LongTaskConfig) -> (String, u64, String) {
    let total: u32 = cfg.weights.iter().sum();
    let mut pick = rng.random_range(0..total);
    let mut kind = 0;
    while pick >= cfg.weights[kind] {
        pick -= cfg.weights[kind];
        kind += 1;
    }
    let (q, v, mut s) = match kind {
        0 => draw_mul(rng, cfg),
        1 => draw_div(rng, cfg),
        2 => draw_gcd(rng, cfg),
        _ => draw_word(rng, cfg),
    };
    s.push_str(&format!("\\boxed{{{v}}}"));
    (q, v, s)
}

/// `n` problems drawn with `seed`, ids `"{prefix}-{i}"`, skipping any whose
/// text is in `exclude` (and repeats, when `unique`).
pub fn generate_long(
    n: usize,
    seed: u64,
    cfg: &LongTaskConfig,
    prefix: &str,
    exclude: &HashSet<String>,
    unique: bool,
) -> Result<Vec<Problem>> {
    cfg.validate()?;
    super::task::draw_problems(n, seed, prefix, exclude, unique, LONG_SOURCE, |rng| {
        let (problem, answer, solution) = draw(rng, cfg);
        (problem, answer.to_string(), solution)
    })
}

/// A training set of `n_train` problems (seed `seed`) and a held-out test set
/// of `n_test` distinct problems (seed `seed + 1`), none of them in the
/// training set. Ids are `train-{i}` and `test-{i}`.
pub fn generate_long_split(
    n_train: usize,
    n_test: usize,
    seed: u64,
    cfg: &LongTaskConfig,
) -> Result<(Vec<Problem>, Vec<Problem>)> {
    let train = generate_long(n_train, seed, cfg, "train", &HashSet::new(), false)?;
    let seen: HashSet<String> = train.iter().map(|p| p.problem.clone()).collect();
    let test = generate_long(n_test, seed.wrapping_add(1), cfg, "test", &seen, true)?;
    Ok((train, test))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::{verify, ExtractMode};

    /// Re-does every written step with integers parsed from the text: each
    /// `x*d(+c)=v`, `x+y(+c)=v`, `x-y=v`, `cur//b=q` line is true arithmetic, so a
    /// model trained on these solutions learns only correct steps.
    fn check_steps(solution: &str) {
        let mut checked = 0;
        for line in solution.lines() {
            // Every `lhs=rhs` segment of a line (`7*6=42, 42+4=46, write 6, carry 4`;
            // `bring 5: 25//7=3, 3*7=21, 25-21=4`; `borrow for 2-7: 12-7=5`).
            for seg in line.split([',', ':']) {
                let Some((lhs, rhs)) = seg.rsplit_once('=') else { continue };
                let Ok(rhs) = rhs.trim().parse::<i64>() else { continue };
                let lhs = lhs.trim();
                let lhs = lhs.rsplit(' ').next().unwrap();
                // `gcd(147,0)=147` is split by its comma: not a step of arithmetic.
                if !lhs.chars().all(|c| c.is_ascii_digit() || "+-*/".contains(c)) {
                    continue;
                }
                let value = if let Some((a, b)) = lhs.split_once("//") {
                    a.parse::<i64>().unwrap() / b.parse::<i64>().unwrap()
                } else {
                    // Left to right over + - *, as the lines are written (a*d+c).
                    let mut acc: Option<i64> = None;
                    let mut op = '+';
                    let mut num = String::new();
                    for ch in lhs.chars().chain(std::iter::once('$')) {
                        if ch.is_ascii_digit() {
                            num.push(ch);
                            continue;
                        }
                        let n: i64 = num.parse().unwrap_or_else(|_| panic!("bad step {line:?}"));
                        num.clear();
                        acc = Some(match (acc, op) {
                            (None, _) => n,
                            (Some(a), '+') => a + n,
                            (Some(a), '-') => a - n,
                            (Some(a), _) => a * n,
                        });
                        op = ch;
                    }
                    acc.unwrap()
                };
                assert_eq!(value, rhs, "a wrong step {line:?} in\n{solution}");
                checked += 1;
            }
        }
        assert!(checked >= 5, "only {checked} steps checked in\n{solution}");
    }

    #[test]
    fn every_kind_is_right_and_verifiable() {
        for ((k, kind), variety_percent) in LONG_KINDS.iter().enumerate().flat_map(|k| [(k, 0), (k, 50)]) {
            let mut weights = [0; 4];
            weights[k] = 1;
            let cfg = LongTaskConfig { weights, variety_percent, ..Default::default() };
            for p in generate_long(200, 7 + k as u64, &cfg, "t", &HashSet::new(), false).unwrap() {
                check_steps(&p.solution);
                let v = verify(&p.answer, &p.solution, ExtractMode::Strict);
                assert!(v.correct, "{kind}: the checker rejects the worked solution of {:?}", p.problem);
                let want: u64 = match *kind {
                    "mul" => {
                        let (a, b) =
                            p.problem["Compute ".len()..p.problem.len() - 1].split_once('*').unwrap();
                        a.parse::<u64>().unwrap() * b.parse::<u64>().unwrap()
                    }
                    "div" => {
                        let e = p.problem["Compute ".len()..].split(' ').next().unwrap();
                        let (a, b) = e.split_once("//").unwrap();
                        a.parse::<u64>().unwrap() / b.parse::<u64>().unwrap()
                    }
                    "gcd" => {
                        let nums: Vec<u64> = p
                            .problem
                            .trim_end_matches('.')
                            .split(' ')
                            .filter_map(|w| w.parse().ok())
                            .collect();
                        let (mut a, mut b) = (nums[0], nums[1]);
                        while b > 0 {
                            (a, b) = (b, a % b);
                        }
                        a
                    }
                    _ => {
                        let nums: Vec<u64> = p
                            .problem
                            .split(|c: char| !c.is_ascii_digit())
                            .filter_map(|w| w.parse().ok())
                            .collect();
                        let m = nums[0] * nums[1];
                        if p.problem.contains("left")
                            || p.problem.contains("remain")
                            || p.problem.contains("free")
                        {
                            m - nums[2]
                        } else {
                            m + nums[2]
                        }
                    }
                };
                assert_eq!(p.answer, want.to_string(), "{kind}: {:?}", p.problem);
            }
        }
    }

    #[test]
    fn generation_is_deterministic_and_the_split_is_disjoint() {
        let cfg = LongTaskConfig::default();
        let a = generate_long(50, 3, &cfg, "x", &HashSet::new(), false).unwrap();
        let b = generate_long(50, 3, &cfg, "x", &HashSet::new(), false).unwrap();
        assert_eq!(a, b);
        let (train, test) = generate_long_split(300, 100, 11, &cfg).unwrap();
        let seen: HashSet<_> = train.iter().map(|p| &p.problem).collect();
        assert!(test.iter().all(|p| !seen.contains(&p.problem)));
        let distinct: HashSet<_> = test.iter().map(|p| &p.problem).collect();
        assert_eq!(distinct.len(), test.len());
    }

    /// The plain style is the one `data/long` was written in, byte for byte; with
    /// variety the problems and answers stay, and the wording of most solutions changes
    /// in each of its forms.
    #[test]
    fn variety_changes_the_wording_only() {
        let root = crate::data::test_support::repo_root();
        let shipped = crate::data::task::read_jsonl(&root.join("data/long/train.jsonl")).unwrap();
        let plain =
            generate_long(200, 2024, &LongTaskConfig::default(), "train", &HashSet::new(), false).unwrap();
        assert_eq!(plain[..], shipped[..200]);
        let varied = LongTaskConfig { variety_percent: 50, ..Default::default() };
        let mixed = generate_long(200, 2024, &varied, "train", &HashSet::new(), false).unwrap();
        let mut changed = 0;
        for (p, m) in plain.iter().zip(&mixed) {
            assert_eq!((&p.problem, &p.answer), (&m.problem, &m.answer));
            changed += usize::from(p.solution != m.solution);
        }
        assert!(changed >= 190, "{changed} of 200 solutions changed");
        let all: String = mixed.iter().map(|m| m.solution.as_str()).collect();
        for form in [", put ", "borrow for ", ", write "] {
            assert!(all.contains(form), "no {form:?} in the varied solutions");
        }
        // The two-step product (`7*6=42, 42+4=46`) and a zero carry left unsaid.
        assert!(all.lines().any(|l| l.matches('=').count() == 2 && l.contains('*') && !l.contains("//")));
        let unsaid = all.lines().filter(|l| l.contains('+') && !l.contains("carry") && !l.contains(':'));
        assert!(unsaid.count() > 0);
        // Same choices for the same problem: deterministic.
        assert_eq!(mixed, generate_long(200, 2024, &varied, "train", &HashSet::new(), false).unwrap());
    }

    #[test]
    fn bad_knobs_name_their_field() {
        let cfg = LongTaskConfig { weights: [0; 4], ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("weights"));
        let cfg = LongTaskConfig { min_digits: 5, max_digits: 3, ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("max_digits"));
        let cfg = LongTaskConfig { max_multiplier_digits: 1, ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("max_multiplier_digits"));
        let cfg = LongTaskConfig { variety_percent: 101, ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("variety_percent"));
    }
    /// Worked solutions are long answers: in Qwen3's own tokenizer (digits one
    /// token each) the default mix spans about 150 to 600 tokens.
    #[test]
    fn default_solutions_take_150_to_600_tokens() {
        let root = crate::data::test_support::repo_root();
        let tok =
            crate::data::Tokenizer::from_file(root.join("models/qwen3-tokenizer/tokenizer.json")).unwrap();
        let probs = generate_long(400, 5, &LongTaskConfig::default(), "t", &HashSet::new(), false).unwrap();
        let mut lens: Vec<usize> =
            probs.iter().map(|p| tok.encode(&p.solution, false).unwrap().len()).collect();
        lens.sort_unstable();
        let (p5, p50, p95) = (lens[lens.len() / 20], lens[lens.len() / 2], lens[lens.len() * 19 / 20]);
        eprintln!(
            "long task solution tokens: p5 {p5}, median {p50}, p95 {p95}, max {}",
            lens[lens.len() - 1]
        );
        assert!(p5 >= 120 && p50 >= 150 && p95 <= 600, "p5 {p5}, median {p50}, p95 {p95}");
    }
}
