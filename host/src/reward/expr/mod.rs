//! A small LaTeX-ish expression parser and complex-valued evaluator.
//!
//! Answers are parsed by recursive descent into an [`Expr`] tree that can be
//! evaluated numerically with variables bound to values. Two answers are then
//! compared by evaluating both at the same random points (probabilistic
//! identity testing, as in the Schwartz–Zippel lemma), which stands in for the
//! symbolic simplification `sympy` does inside math-verify and the Hendrycks
//! MATH / Minerva graders.
//!
//! Grammar (loosest binding first):
//!
//! ```text
//! sum     := sign* term (('+' | '-') sign* term)*
//! term    := power (('*' | '\cdot' | '\times' | '/' | '\div') signed | power)*   -- juxtaposition multiplies
//! signed  := ('-' | '+')* power
//! power   := postfix ('^' exponent)?                                         -- right associative
//! postfix := primary ('!' | '%')*
//! primary := number | variable | constant | (sum) | [sum] | {sum} | |sum|
//!          | \frac A B | \sqrt[n]{A} | \binom A B | \lfloor sum \rfloor | \lceil sum \rceil
//!          | function argument
//! ```
//!
//! Every recursive step passes through a depth guard, sums and products are
//! n-ary (so `1+1+...+1` stays shallow), and the evaluator recurses only along
//! the tree the parser built, so adversarial input cannot overflow the stack.

mod complex;
mod lexer;
mod parser;

use std::collections::{BTreeSet, HashMap};
use std::f64::consts::PI;

pub(crate) use complex::C;

/// Longest input the parser accepts, in bytes.
pub(crate) const MAX_EXPR_LEN: usize = 4000;

/// Functions of one argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Func {
    Sin,
    Cos,
    Tan,
    Sec,
    Csc,
    Cot,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Exp,
    Ln,
    Log10,
    Sqrt,
    Abs,
    Floor,
    Ceil,
    Factorial,
}

impl Func {
    /// Function names as written after a backslash or bare (`sin`, `\sin`).
    pub(super) fn from_name(name: &str) -> Option<Func> {
        Some(match name {
            "sin" => Func::Sin,
            "cos" => Func::Cos,
            "tan" | "tg" => Func::Tan,
            "sec" => Func::Sec,
            "csc" | "cosec" => Func::Csc,
            "cot" | "ctg" => Func::Cot,
            "arcsin" | "asin" => Func::Asin,
            "arccos" | "acos" => Func::Acos,
            "arctan" | "atan" => Func::Atan,
            "sinh" => Func::Sinh,
            "cosh" => Func::Cosh,
            "tanh" => Func::Tanh,
            "exp" => Func::Exp,
            "ln" => Func::Ln,
            "lg" => Func::Log10,
            "sqrt" => Func::Sqrt,
            _ => return None,
        })
    }

    /// `\sin^{-1}` means `\arcsin`.
    pub(super) fn inverse(self) -> Option<Func> {
        match self {
            Func::Sin => Some(Func::Asin),
            Func::Cos => Some(Func::Acos),
            Func::Tan => Some(Func::Atan),
            _ => None,
        }
    }

    fn apply(self, z: C) -> C {
        let real = |f: fn(f64) -> f64| z.as_real().map_or(C::NAN, |x| C::real(f(x)));
        match self {
            Func::Sin => z.sin(),
            Func::Cos => z.cos(),
            Func::Tan => z.sin().div(z.cos()),
            Func::Sec => z.cos().recip(),
            Func::Csc => z.sin().recip(),
            Func::Cot => z.cos().div(z.sin()),
            Func::Asin => real(f64::asin),
            Func::Acos => real(f64::acos),
            Func::Atan => real(f64::atan),
            Func::Sinh => z.exp().sub(z.neg().exp()).mul(C::real(0.5)),
            Func::Cosh => z.exp().add(z.neg().exp()).mul(C::real(0.5)),
            Func::Tanh => {
                let (a, b) = (z.exp(), z.neg().exp());
                a.sub(b).div(a.add(b))
            }
            Func::Exp => z.exp(),
            Func::Ln => z.ln(),
            Func::Log10 => z.ln().div(C::real(10f64.ln())),
            Func::Sqrt => z.sqrt(),
            Func::Abs => C::real(z.norm()),
            Func::Floor => real(f64::floor),
            Func::Ceil => real(f64::ceil),
            Func::Factorial => real(|x| gamma(x + 1.0)),
        }
    }
}

/// Expression tree. Sums and products are n-ary so long chains stay shallow.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Node {
    Num(f64),
    Imag,
    Var(String),
    /// Terms with a "subtract" flag.
    Sum(Vec<(bool, Node)>),
    /// Factors with a "divide" flag.
    Prod(Vec<(bool, Node)>),
    Neg(Box<Node>),
    Pow(Box<Node>, Box<Node>),
    Call(Func, Box<Node>),
    /// `\log_b x` as (base, argument).
    Log(Box<Node>, Box<Node>),
    /// `\sqrt[n]{x}` as (index, radicand).
    Root(Box<Node>, Box<Node>),
    Binom(Box<Node>, Box<Node>),
    /// An undefined function such as `f(x)`, `N(n)`: evaluated as a fixed
    /// nonlinear function of its name so that `f(2x)` and `f(x)` differ.
    Apply(String, Box<Node>),
}

/// A parsed expression with the variables it mentions.
#[derive(Clone, Debug)]
pub(crate) struct Expr {
    root: Node,
    /// Variable names, sorted.
    pub vars: BTreeSet<String>,
    /// True when floor, ceiling, factorial or binomials appear: such answers
    /// are tested at integer points.
    pub discrete: bool,
    /// True when `\infty` is written: only then is an infinite value an
    /// answer (an interval end) rather than an overflow.
    pub infinite: bool,
}

impl Expr {
    /// Parses LaTeX-ish text; `None` when it is not an expression we understand.
    pub fn parse(s: &str) -> Option<Expr> {
        if s.len() > MAX_EXPR_LEN {
            return None;
        }
        parser::parse(s)
    }

    /// `self - other`, used to compare equations `l = r` as `l - r = 0`.
    pub fn minus(&self, other: &Expr) -> Expr {
        Expr {
            root: Node::Sum(vec![(false, self.root.clone()), (true, other.root.clone())]),
            vars: self.vars.union(&other.vars).cloned().collect(),
            discrete: self.discrete || other.discrete,
            infinite: self.infinite || other.infinite,
        }
    }

    /// Evaluates with the variables bound by `env`; unbound variables are NaN.
    pub fn eval(&self, env: &HashMap<String, C>) -> C {
        eval(&self.root, env)
    }
}

fn eval(node: &Node, env: &HashMap<String, C>) -> C {
    match node {
        Node::Num(v) => C::real(*v),
        Node::Imag => C::I,
        Node::Var(name) => env.get(name).copied().unwrap_or(C::NAN),
        Node::Sum(terms) => terms.iter().fold(C::real(0.0), |acc, (neg, t)| {
            let v = eval(t, env);
            if *neg {
                acc.sub(v)
            } else {
                acc.add(v)
            }
        }),
        Node::Prod(factors) => factors.iter().fold(C::real(1.0), |acc, (div, f)| {
            let v = eval(f, env);
            if *div {
                acc.div(v)
            } else {
                acc.mul(v)
            }
        }),
        Node::Neg(a) => eval(a, env).neg(),
        Node::Pow(a, b) => eval(a, env).pow(eval(b, env)),
        Node::Call(f, a) => f.apply(eval(a, env)),
        Node::Log(b, a) => eval(a, env).ln().div(eval(b, env).ln()),
        Node::Root(n, a) => {
            let (n, a) = (eval(n, env), eval(a, env));
            // Odd roots of negative reals are real: \sqrt[3]{-8} = -2.
            match (n.as_real(), a.as_real()) {
                (Some(k), Some(x)) if x < 0.0 && k.fract() == 0.0 && k.rem_euclid(2.0) == 1.0 => {
                    C::real(-(-x).powf(1.0 / k))
                }
                _ => a.pow(n.recip()),
            }
        }
        Node::Binom(n, k) => match (eval(n, env).as_real(), eval(k, env).as_real()) {
            (Some(n), Some(k)) => C::real(binomial(n, k)),
            _ => C::NAN,
        },
        Node::Apply(name, a) => {
            let h = name.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
            let k1 = 0.3 + f64::from(h % 7) * 0.1;
            let k2 = 1.0 + f64::from(h % 5) * 0.25;
            let z = eval(a, env);
            z.mul(C::real(k1)).exp().mul(C::real(k2)).add(z.mul(z))
        }
    }
}

/// Gamma function: exact products for small integers, Lanczos (g = 7) otherwise.
fn gamma(x: f64) -> f64 {
    if x.fract() == 0.0 {
        if x <= 0.0 {
            return f64::NAN;
        }
        if x <= 171.0 {
            return (2..x as u32).fold(1.0, |acc, k| acc * f64::from(k));
        }
        return f64::INFINITY;
    }
    if x < 0.5 {
        return PI / ((PI * x).sin() * gamma(1.0 - x));
    }
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let t = x + 7.5;
    let s = G[1..].iter().enumerate().fold(G[0], |s, (i, g)| s + g / (x + i as f64 + 1.0));
    (2.0 * PI).sqrt() * t.powf(x + 0.5) * (-t).exp() * s
}

fn binomial(n: f64, k: f64) -> f64 {
    if n.fract() == 0.0 && k.fract() == 0.0 {
        if k < 0.0 || (n >= 0.0 && k > n) {
            return 0.0;
        }
        let k = if n >= 0.0 { k.min(n - k) } else { k };
        if k <= 1000.0 {
            return (0..k as u32).fold(1.0, |acc, j| acc * (n - f64::from(j)) / f64::from(j + 1));
        }
    }
    gamma(n + 1.0) / (gamma(k + 1.0) * gamma(n - k + 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(s: &str) -> C {
        Expr::parse(s).unwrap_or_else(|| panic!("parse failed: {s}")).eval(&HashMap::new())
    }

    fn at(s: &str, vars: &[(&str, f64)]) -> f64 {
        let env = vars.iter().map(|(k, v)| ((*k).to_string(), C::real(*v))).collect();
        let c = Expr::parse(s).unwrap_or_else(|| panic!("parse failed: {s}")).eval(&env);
        assert!(c.im.abs() < 1e-9, "{s} is not real: {c:?}");
        c.re
    }

    #[test]
    fn constant_values() {
        let cases: &[(&str, f64)] = &[
            ("1+2*3", 7.0),
            ("2^10", 1024.0),
            ("2^3^2", 512.0),
            ("-2^2", -4.0),
            ("(-2)^2", 4.0),
            ("\\frac{1}{2}", 0.5),
            ("\\frac12", 0.5),
            ("\\frac 34", 0.75),
            ("\\frac9{19}", 9.0 / 19.0),
            ("\\frac{\\pi}{2}", PI / 2.0),
            ("\\frac\\pi2", PI / 2.0),
            ("1\\frac{4}{5}", 1.8),
            ("137 \\frac{1}{2}", 137.5),
            ("-1\\frac12", -1.5),
            ("2\\cdot\\frac{1}{2}", 1.0),
            ("\\sqrt{16}", 4.0),
            ("\\sqrt2^2", 2.0),
            ("\\sqrt[3]{-8}", -2.0),
            ("2\\pi", 2.0 * PI),
            ("3.83e35", 3.83e35),
            ("1e-3", 1e-3),
            ("3 \\times 10^{5}", 3e5),
            ("6 \\div 4", 1.5),
            (".5", 0.5),
            ("-1./3", -1.0 / 3.0),
            ("5!", 120.0),
            ("\\binom{5}{2}", 10.0),
            ("\\lfloor 2.7 \\rfloor", 2.0),
            ("\\lceil 2.1 \\rceil", 3.0),
            ("|-3|", 3.0),
            ("\\ln e", 1.0),
            ("\\log_2 8", 3.0),
            ("\\log_{10}(1000)", 3.0),
            ("\\sin^2 x + \\cos^2 x", 1.0),
            ("e^{0}", 1.0),
            ("\\exp{0}", 1.0),
            ("50%", 0.5),
            ("2 \\cdot -3", -6.0),
            ("--3", 3.0),
            ("\\sin^{-1} 1", PI / 2.0),
            ("arcsin(1)", PI / 2.0),
        ];
        for (s, want) in cases {
            let env = HashMap::from([("x".to_string(), C::real(0.7))]);
            let got = Expr::parse(s).unwrap_or_else(|| panic!("parse failed: {s}")).eval(&env);
            assert!(
                (got.re - want).abs() <= 1e-9 * want.abs().max(1.0) && got.im.abs() < 1e-9,
                "{s}: {got:?} != {want}"
            );
        }
    }

    #[test]
    fn complex_values() {
        assert_eq!(val("i^2"), C::real(-1.0));
        let z = val("-2 + 7i");
        assert_eq!((z.re, z.im), (-2.0, 7.0));
        let z = val("\\sqrt{-4}");
        assert!(z.re.abs() < 1e-12 && (z.im - 2.0).abs() < 1e-12);
        let z = val("\\frac{1+2i}{1-2i}");
        assert!((z.re + 0.6).abs() < 1e-12 && (z.im - 0.8).abs() < 1e-12);
    }

    #[test]
    fn variables_and_implicit_multiplication() {
        assert_eq!(at("2x", &[("x", 3.0)]), 6.0);
        assert_eq!(at("x(x+1)", &[("x", 3.0)]), 12.0);
        assert_eq!(at("(a+5)(b+2)", &[("a", 1.0), ("b", 2.0)]), 24.0);
        assert_eq!(at("x_{0} + x_1", &[("x_0", 1.0), ("x_1", 2.0)]), 3.0);
        assert_eq!(at("3R^2", &[("R", 2.0)]), 12.0);
        assert_eq!(at("\\sin 2x", &[("x", 0.25)]), (0.5f64).sin());
        assert_eq!(at("\\sin x \\cos x", &[("x", 0.25)]), 0.25f64.sin() * 0.25f64.cos());
        assert_eq!(at("2\\alpha", &[("\\alpha", 1.5)]), 3.0);
        let e = Expr::parse("\\frac{n(n+1)}{2} + k").unwrap_or_else(|| panic!("parse"));
        assert_eq!(e.vars.iter().cloned().collect::<Vec<_>>(), vec!["k".to_string(), "n".to_string()]);
        assert!(!e.discrete);
        assert!(Expr::parse("\\lfloor n/2 \\rfloor").is_some_and(|e| e.discrete));
    }

    #[test]
    fn rejects_malformed() {
        for s in
            ["", "(1+2", "1+", "\\frac{1}", "x \\cup y", "a & b", "\\unknowncmd{3}", "1 = 2", "\\lfloor x"]
        {
            assert!(Expr::parse(s).is_none(), "{s:?} should not parse");
        }
    }

    #[test]
    fn adversarial_inputs_are_bounded() {
        let deep = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
        assert!(Expr::parse(&deep[..MAX_EXPR_LEN - 2]).is_none());
        let deep = format!("{}1{}", "{".repeat(1500), "}".repeat(1500));
        assert!(Expr::parse(&deep).is_none());
        let powers = "2^".repeat(1500) + "2";
        assert!(Expr::parse(&powers).is_none());
        let chain = "1+".repeat(1900) + "1";
        assert_eq!(val(&chain), C::real(1901.0));
        let facts = format!("3{}", "!".repeat(3000));
        assert!(Expr::parse(&facts).is_none());
        assert!(!val("2^{99999999}").is_finite());
        assert!(!val("10^{10^{10}}").is_finite());
        assert!(!val("(1+i)^{10^{12}}").is_finite());
    }
}
