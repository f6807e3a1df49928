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

use std::collections::{BTreeSet, HashMap};
use std::f64::consts::{E, PI};

/// Deepest nesting of parser calls (about five per bracket level).
const MAX_DEPTH: usize = 400;
/// Longest input the parser accepts, in bytes.
pub(crate) const MAX_EXPR_LEN: usize = 4000;
/// Largest integer exponent evaluated by repeated squaring.
const MAX_INT_POW: f64 = 1024.0;

/// A complex number; answers such as `1 - 12i` and roots of negative values
/// at random points need the complex plane.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct C {
    pub re: f64,
    pub im: f64,
}

impl C {
    pub const fn real(re: f64) -> Self {
        C { re, im: 0.0 }
    }
    const I: C = C { re: 0.0, im: 1.0 };
    const NAN: C = C { re: f64::NAN, im: f64::NAN };

    pub fn is_finite(self) -> bool {
        self.re.is_finite() && self.im.is_finite()
    }
    pub fn norm(self) -> f64 {
        self.re.hypot(self.im)
    }
    fn is_real(self) -> bool {
        self.im == 0.0
    }
    /// The real part when the imaginary part is negligible, for real-only functions.
    fn as_real(self) -> Option<f64> {
        (self.im.abs() <= 1e-12 * self.re.abs().max(1.0)).then_some(self.re)
    }
    pub fn add(self, o: C) -> C {
        C { re: self.re + o.re, im: self.im + o.im }
    }
    pub fn sub(self, o: C) -> C {
        C { re: self.re - o.re, im: self.im - o.im }
    }
    fn neg(self) -> C {
        C { re: -self.re, im: -self.im }
    }
    pub fn mul(self, o: C) -> C {
        if self.is_real() && o.is_real() {
            return C::real(self.re * o.re);
        }
        C { re: self.re * o.re - self.im * o.im, im: self.re * o.im + self.im * o.re }
    }
    pub fn div(self, o: C) -> C {
        if self.is_real() && o.is_real() {
            return C::real(self.re / o.re);
        }
        let d = o.re * o.re + o.im * o.im;
        C { re: (self.re * o.re + self.im * o.im) / d, im: (self.im * o.re - self.re * o.im) / d }
    }
    fn exp(self) -> C {
        let m = self.re.exp();
        if self.im == 0.0 {
            return C::real(m);
        }
        C { re: m * self.im.cos(), im: m * self.im.sin() }
    }
    fn ln(self) -> C {
        if self.is_real() && self.re > 0.0 {
            return C::real(self.re.ln());
        }
        C { re: self.norm().ln(), im: self.im.atan2(self.re) }
    }
    fn sqrt(self) -> C {
        if self.is_real() && self.re >= 0.0 {
            return C::real(self.re.sqrt());
        }
        let r = self.norm().sqrt();
        let t = self.im.atan2(self.re) / 2.0;
        C { re: r * t.cos(), im: r * t.sin() }
    }
    fn sin(self) -> C {
        C { re: self.re.sin() * self.im.cosh(), im: self.re.cos() * self.im.sinh() }
    }
    fn cos(self) -> C {
        C { re: self.re.cos() * self.im.cosh(), im: -self.re.sin() * self.im.sinh() }
    }
    fn recip(self) -> C {
        C::real(1.0).div(self)
    }
    fn powi(self, mut n: u64) -> C {
        let (mut base, mut acc) = (self, C::real(1.0));
        while n > 0 {
            if n & 1 == 1 {
                acc = acc.mul(base);
            }
            base = base.mul(base);
            n >>= 1;
        }
        acc
    }
    /// Principal power; exact for integer exponents, real for real results.
    fn pow(self, w: C) -> C {
        if w.is_real() && w.re.fract() == 0.0 && w.re.abs() <= MAX_INT_POW {
            if self.is_real() {
                return C::real(self.re.powf(w.re));
            }
            // Exact integer powers keep `i^2 = -1` free of rounding noise.
            let p = self.powi(w.re.abs() as u64);
            return if w.re < 0.0 { p.recip() } else { p };
        }
        if self.is_real() && w.is_real() && self.re >= 0.0 {
            return C::real(self.re.powf(w.re));
        }
        if self.re == 0.0 && self.im == 0.0 {
            return if w.re > 0.0 { C::real(0.0) } else { C::NAN };
        }
        w.mul(self.ln()).exp()
    }
}

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
    fn from_name(name: &str) -> Option<Func> {
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
    fn inverse(self) -> Option<Func> {
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
        let toks = tokenize(s)?;
        if toks.is_empty() {
            return None;
        }
        let mut p = Parser {
            toks,
            pos: 0,
            depth: 0,
            abs_depth: 0,
            vars: BTreeSet::new(),
            discrete: false,
            infinite: false,
        };
        let root = p.sum()?;
        if p.pos != p.toks.len() {
            return None;
        }
        Some(Expr { root, vars: p.vars, discrete: p.discrete, infinite: p.infinite })
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

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// A numeric literal's text: digits, one dot, optional exponent.
    Num(String),
    Letter(char),
    /// `\name`, a bare function word such as `sin`, or `\` plus one symbol.
    Cmd(String),
    Sym(char),
}

/// Bare words read as commands, longest first so `sinh` beats `sin`.
const BARE_WORDS: &[&str] = &[
    "arcsin", "arccos", "arctan", "cosec", "sqrt", "sinh", "cosh", "tanh", "asin", "acos", "atan", "sin",
    "cos", "tan", "sec", "csc", "cot", "exp", "log", "ln", "pi",
];

fn tokenize(s: &str) -> Option<Vec<Tok>> {
    let cs: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() || (c == '.' && cs.get(i + 1).is_some_and(char::is_ascii_digit)) {
            let start = i;
            while i < cs.len() && cs[i].is_ascii_digit() {
                i += 1;
            }
            if i < cs.len() && cs[i] == '.' {
                i += 1;
                while i < cs.len() && cs[i].is_ascii_digit() {
                    i += 1;
                }
            }
            // Scientific notation only when digits follow: `2e5`, `1e-3`, but `2e^x` is 2·e^x.
            if i < cs.len() && (cs[i] == 'e' || cs[i] == 'E') {
                let j = if matches!(cs.get(i + 1), Some('+' | '-')) { i + 2 } else { i + 1 };
                if cs.get(j).is_some_and(char::is_ascii_digit) {
                    i = j;
                    while i < cs.len() && cs[i].is_ascii_digit() {
                        i += 1;
                    }
                }
            }
            out.push(Tok::Num(cs[start..i].iter().collect()));
        } else if c.is_ascii_alphabetic() {
            let start = i;
            while i < cs.len() && cs[i].is_ascii_alphabetic() {
                i += 1;
            }
            let word: String = cs[start..i].iter().collect();
            let mut rest = word.as_str();
            while !rest.is_empty() {
                if let Some(w) = BARE_WORDS.iter().find(|w| rest.starts_with(**w)) {
                    out.push(Tok::Cmd((*w).to_string()));
                    rest = &rest[w.len()..];
                } else {
                    let mut chars = rest.chars();
                    out.push(Tok::Letter(chars.next()?));
                    rest = chars.as_str();
                }
            }
        } else if c == '\\' {
            i += 1;
            let start = i;
            while i < cs.len() && cs[i].is_ascii_alphabetic() {
                i += 1;
            }
            if i == start {
                // `\{`, `\|`, `\,` ...; spacing commands are dropped.
                let sym = *cs.get(i)?;
                i += 1;
                match sym {
                    ',' | ';' | ':' | '!' | ' ' => {}
                    '{' => out.push(Tok::Sym('{')),
                    '}' => out.push(Tok::Sym('}')),
                    '|' => out.push(Tok::Sym('|')),
                    '%' => out.push(Tok::Sym('%')),
                    _ => out.push(Tok::Cmd(sym.to_string())),
                }
            } else {
                out.push(Tok::Cmd(cs[start..i].iter().collect()));
            }
        } else {
            let tok = match c {
                'π' => Tok::Cmd("pi".into()),
                '∞' => Tok::Cmd("infty".into()),
                '√' => Tok::Cmd("sqrt".into()),
                '·' | '×' | '⋅' => Tok::Sym('*'),
                '÷' => Tok::Sym('/'),
                '−' | '–' => Tok::Sym('-'),
                '*' if cs.get(i + 1) == Some(&'*') => {
                    i += 1;
                    Tok::Sym('^')
                }
                '+' | '-' | '*' | '/' | '^' | '_' | '(' | ')' | '[' | ']' | '{' | '}' | '|' | '!' | '%'
                | '\'' => Tok::Sym(c),
                _ => return None,
            };
            i += 1;
            out.push(tok);
        }
    }
    Some(out)
}

/// Greek letters and other commands that name a variable.
fn is_greek(name: &str) -> bool {
    const GREEK: &[&str] = &[
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "varepsilon",
        "zeta",
        "eta",
        "theta",
        "vartheta",
        "iota",
        "kappa",
        "lambda",
        "mu",
        "nu",
        "xi",
        "rho",
        "varrho",
        "sigma",
        "tau",
        "upsilon",
        "phi",
        "varphi",
        "chi",
        "psi",
        "omega",
        "Gamma",
        "Delta",
        "Theta",
        "Lambda",
        "Xi",
        "Pi",
        "Sigma",
        "Phi",
        "Psi",
        "Omega",
        "ell",
        "hbar",
    ];
    GREEK.contains(&name)
}

/// Commands whose braced argument is plain text.
fn is_text_cmd(name: &str) -> bool {
    matches!(
        name,
        "text"
            | "mathrm"
            | "operatorname"
            | "mathbf"
            | "mathit"
            | "textrm"
            | "textit"
            | "textbf"
            | "mbox"
            | "mathsf"
    )
}

/// Accents that decorate a variable name (`\dot{x}` is a different variable from `x`).
fn is_accent(name: &str) -> bool {
    matches!(name, "dot" | "ddot" | "hat" | "bar" | "vec" | "tilde" | "overline" | "widehat" | "widetilde")
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    depth: usize,
    /// Inside `|...|` a bar closes rather than opens.
    abs_depth: usize,
    vars: BTreeSet<String>,
    discrete: bool,
    infinite: bool,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn eat_sym(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Sym(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn eat_cmd(&mut self, name: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Cmd(n)) if n == name) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect_sym(&mut self, c: char) -> Option<()> {
        self.eat_sym(c).then_some(())
    }

    /// Runs `f` one level deeper, failing beyond [`MAX_DEPTH`].
    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Option<T>) -> Option<T> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return None;
        }
        let r = f(self);
        self.depth -= 1;
        r
    }

    fn sum(&mut self) -> Option<Node> {
        self.nested(|p| {
            let mut terms = Vec::new();
            let mut neg = p.signs(false);
            loop {
                terms.push((neg, p.term()?));
                if p.eat_sym('+') {
                    neg = p.signs(false);
                } else if p.eat_sym('-') {
                    neg = p.signs(true);
                } else {
                    break;
                }
            }
            Some(match terms.pop() {
                Some((false, t)) if terms.is_empty() => t,
                Some(last) => {
                    terms.push(last);
                    Node::Sum(terms)
                }
                None => return None,
            })
        })
    }

    /// Consumes a run of `+`/`-` and returns whether the net sign is negative.
    fn signs(&mut self, mut neg: bool) -> bool {
        loop {
            if self.eat_sym('-') {
                neg = !neg;
            } else if !self.eat_sym('+') {
                return neg;
            }
        }
    }

    fn term(&mut self) -> Option<Node> {
        self.nested(|p| {
            let mut factors = vec![(false, p.power()?)];
            loop {
                match p.peek() {
                    Some(Tok::Sym('*')) => {
                        p.pos += 1;
                        factors.push((false, p.signed()?));
                    }
                    Some(Tok::Sym('/')) => {
                        p.pos += 1;
                        factors.push((true, p.signed()?));
                    }
                    Some(Tok::Cmd(c)) if matches!(c.as_str(), "cdot" | "times" | "ast" | "div") => {
                        let div = c == "div";
                        p.pos += 1;
                        factors.push((div, p.signed()?));
                    }
                    Some(t) if p.starts_factor(t, false) => {
                        let frac_next = matches!(t, Tok::Cmd(c) if c == "frac");
                        let f = p.power()?;
                        // `1\frac{4}{5}` is the mixed number 9/5, not 1·4/5.
                        let whole = match factors.as_slice() {
                            [(false, Node::Num(w))] if frac_next && w.fract() == 0.0 => Some(*w),
                            _ => None,
                        };
                        if let (Some(whole), Some(frac)) = (whole, int_fraction(&f)) {
                            factors[0].1 = Node::Num(whole + frac);
                            continue;
                        }
                        factors.push((false, f));
                    }
                    _ => break,
                }
            }
            Some(if factors.len() == 1 && !factors[0].0 {
                factors.swap_remove(0).1
            } else {
                Node::Prod(factors)
            })
        })
    }

    fn signed(&mut self) -> Option<Node> {
        self.nested(|p| {
            if p.eat_sym('-') {
                Some(Node::Neg(Box::new(p.signed()?)))
            } else if p.eat_sym('+') {
                p.signed()
            } else {
                p.power()
            }
        })
    }

    /// Whether `t` can begin a factor multiplied by juxtaposition. Function
    /// arguments written without parentheses stop at the next function.
    fn starts_factor(&self, t: &Tok, stop_at_function: bool) -> bool {
        match t {
            Tok::Num(_) | Tok::Letter(_) => true,
            Tok::Sym('(' | '[' | '{') => true,
            Tok::Sym('|') => self.abs_depth == 0,
            Tok::Cmd(c) => {
                let is_fn = Func::from_name(c).is_some() || c == "log";
                if is_fn {
                    return !stop_at_function;
                }
                is_greek(c)
                    || is_text_cmd(c)
                    || is_accent(c)
                    || matches!(
                        c.as_str(),
                        "frac" | "sqrt" | "binom" | "pi" | "infty" | "lfloor" | "lceil" | "lvert"
                    )
            }
            _ => false,
        }
    }

    fn power(&mut self) -> Option<Node> {
        self.nested(|p| {
            let base = p.postfix()?;
            if p.eat_sym('^') {
                let exp = p.exponent()?;
                return Some(Node::Pow(Box::new(base), Box::new(exp)));
            }
            Some(base)
        })
    }

    /// The exponent after `^`: a braced group, a signed atom, or a power (right associative).
    fn exponent(&mut self) -> Option<Node> {
        self.nested(|p| {
            if p.eat_sym('-') {
                return Some(Node::Neg(Box::new(p.exponent()?)));
            }
            if p.eat_sym('+') {
                return p.exponent();
            }
            p.power()
        })
    }

    fn postfix(&mut self) -> Option<Node> {
        let mut node = self.primary()?;
        let mut wraps = 0;
        loop {
            if self.eat_sym('!') {
                self.discrete = true;
                node = Node::Call(Func::Factorial, Box::new(node));
            } else if self.eat_sym('%') {
                node = Node::Prod(vec![(false, node), (true, Node::Num(100.0))]);
            } else {
                return Some(node);
            }
            wraps += 1;
            if self.depth + wraps > MAX_DEPTH {
                return None;
            }
        }
    }

    /// A TeX macro argument: a braced group or a single token (`\frac12`, `\sqrt2`, `\frac\pi2`).
    fn tex_arg(&mut self) -> Option<Node> {
        self.nested(|p| match p.peek()? {
            Tok::Sym('{') => {
                p.pos += 1;
                let e = p.sum()?;
                p.expect_sym('}')?;
                Some(e)
            }
            Tok::Num(text) => {
                let text = text.clone();
                if text.len() > 1 && text.chars().all(|c| c.is_ascii_digit()) {
                    // `\frac12`: only the first digit is the argument; the rest stays.
                    p.toks[p.pos] = Tok::Num(text[1..].to_string());
                    return number(&text[..1]);
                }
                p.pos += 1;
                number(&text)
            }
            _ => p.primary(),
        })
    }

    /// Raw text of a braced group or single token, for names and subscripts.
    fn raw_arg(&mut self) -> Option<String> {
        if !self.eat_sym('{') {
            return self.next().map(|t| tok_text(&t));
        }
        let mut depth = 1usize;
        let mut out = String::new();
        loop {
            let t = self.next()?;
            match t {
                Tok::Sym('{') => depth += 1,
                Tok::Sym('}') => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(out);
                    }
                }
                _ => {}
            }
            out.push_str(&tok_text(&t));
        }
    }

    /// A variable named `base`, with an optional subscript and primes.
    fn variable(&mut self, base: String) -> Option<Node> {
        let mut name = base;
        if self.eat_sym('_') {
            let sub = self.raw_arg()?;
            name = format!("{name}_{sub}");
        }
        while self.eat_sym('\'') {
            name.push('\'');
        }
        // f(x), g(x+1), N(n), I(0): application of an unknown function. An
        // uppercase letter before a compound group, `R(1-\cos t)`, multiplies.
        let first = name.chars().next()?;
        let simple_arg = matches!(self.toks.get(self.pos + 1), Some(Tok::Num(_) | Tok::Letter(_)))
            && self.toks.get(self.pos + 2) == Some(&Tok::Sym(')'));
        let is_fn_name = name.len() == 1
            && (matches!(first, 'f' | 'g' | 'h') || (first.is_ascii_uppercase() && simple_arg));
        if is_fn_name && self.peek() == Some(&Tok::Sym('(')) {
            self.pos += 1;
            let arg = self.sum()?;
            self.expect_sym(')')?;
            return Some(Node::Apply(name, Box::new(arg)));
        }
        Some(match name.as_str() {
            "e" => Node::Num(E),
            "i" => Node::Imag,
            _ => {
                self.vars.insert(name.clone());
                Node::Var(name)
            }
        })
    }

    fn primary(&mut self) -> Option<Node> {
        self.nested(|p| match p.next()? {
            Tok::Num(text) => number(&text),
            Tok::Letter(c) => p.variable(c.to_string()),
            Tok::Sym('(') => p.group(')'),
            Tok::Sym('[') => p.group(']'),
            Tok::Sym('{') => p.group('}'),
            Tok::Sym('|') => p.abs_group(),
            Tok::Cmd(name) => p.command(&name),
            _ => None,
        })
    }

    fn group(&mut self, close: char) -> Option<Node> {
        let saved = self.abs_depth;
        self.abs_depth = 0;
        let e = self.sum()?;
        self.abs_depth = saved;
        self.expect_sym(close)?;
        Some(e)
    }

    fn abs_group(&mut self) -> Option<Node> {
        self.abs_depth += 1;
        let e = self.sum()?;
        self.abs_depth -= 1;
        self.expect_sym('|')?;
        Some(Node::Call(Func::Abs, Box::new(e)))
    }

    fn command(&mut self, name: &str) -> Option<Node> {
        match name {
            "frac" | "dfrac" | "tfrac" | "cfrac" => {
                let (a, b) = (self.tex_arg()?, self.tex_arg()?);
                Some(Node::Prod(vec![(false, a), (true, b)]))
            }
            "sqrt" => {
                if self.eat_sym('[') {
                    let n = self.sum()?;
                    self.expect_sym(']')?;
                    return Some(Node::Root(Box::new(n), Box::new(self.tex_arg()?)));
                }
                Some(Node::Call(Func::Sqrt, Box::new(self.tex_arg()?)))
            }
            "binom" | "dbinom" | "tbinom" => {
                self.discrete = true;
                let (a, b) = (self.tex_arg()?, self.tex_arg()?);
                Some(Node::Binom(Box::new(a), Box::new(b)))
            }
            "pi" => Some(Node::Num(PI)),
            "infty" | "infin" => {
                self.infinite = true;
                Some(Node::Num(f64::INFINITY))
            }
            "lfloor" | "lceil" => {
                self.discrete = true;
                let (close, f) =
                    if name == "lfloor" { ("rfloor", Func::Floor) } else { ("rceil", Func::Ceil) };
                let e = self.sum()?;
                self.eat_cmd(close).then(|| Node::Call(f, Box::new(e)))
            }
            "lvert" => {
                let e = self.sum()?;
                self.eat_cmd("rvert").then(|| Node::Call(Func::Abs, Box::new(e)))
            }
            "log" => self.log(),
            _ if is_greek(name) => self.variable(format!("\\{name}")),
            _ if is_text_cmd(name) => {
                let text: String = self.raw_arg()?.chars().filter(|c| !c.is_whitespace()).collect();
                if let Some(f) = Func::from_name(&text) {
                    return self.function(f);
                }
                match text.as_str() {
                    "e" => Some(Node::Num(E)),
                    "i" => Some(Node::Imag),
                    "log" => self.log(),
                    _ if text.is_empty() => None,
                    _ => self.variable(text),
                }
            }
            _ if is_accent(name) => {
                let inner = self.raw_arg()?;
                self.variable(format!("\\{name}{{{inner}}}"))
            }
            _ => self.function(Func::from_name(name)?),
        }
    }

    /// `\sin x`, `\sin(x)`, `\sin^2 x`, `\sin^{-1} x`.
    fn function(&mut self, f: Func) -> Option<Node> {
        let mut f = f;
        let mut power = None;
        if self.eat_sym('^') {
            let e = self.exponent()?;
            match f.inverse() {
                Some(inv) if eval(&e, &HashMap::new()) == C::real(-1.0) => f = inv,
                _ => power = Some(e),
            }
        }
        let arg = self.func_arg()?;
        let call = Node::Call(f, Box::new(arg));
        Some(match power {
            Some(e) => Node::Pow(Box::new(call), Box::new(e)),
            None => call,
        })
    }

    /// `\log_2 x`, `\log_{b}(x)`, `\log x` (natural, as in sympy and math-verify).
    fn log(&mut self) -> Option<Node> {
        let base = if self.eat_sym('_') { Some(self.tex_arg()?) } else { None };
        let arg = self.func_arg()?;
        Some(match base {
            Some(b) => Node::Log(Box::new(b), Box::new(arg)),
            None => Node::Call(Func::Ln, Box::new(arg)),
        })
    }

    /// A function argument: a bracketed group, or a juxtaposed product that
    /// stops at the next function (`\sin 2x \cos x`).
    fn func_arg(&mut self) -> Option<Node> {
        self.nested(|p| {
            if matches!(p.peek(), Some(Tok::Sym('(' | '{' | '['))) {
                return p.postfix();
            }
            let mut factors = vec![(false, p.power()?)];
            while let Some(t) = p.peek() {
                if !p.starts_factor(t, true) {
                    break;
                }
                factors.push((false, p.power()?));
            }
            Some(if factors.len() == 1 { factors.swap_remove(0).1 } else { Node::Prod(factors) })
        })
    }
}

fn number(text: &str) -> Option<Node> {
    text.parse::<f64>().ok().map(Node::Num)
}

/// The value of `\frac{a}{b}` when both are integer literals.
fn int_fraction(node: &Node) -> Option<f64> {
    match node {
        Node::Prod(f) => match f.as_slice() {
            [(false, Node::Num(a)), (true, Node::Num(b))]
                if a.fract() == 0.0 && b.fract() == 0.0 && *b != 0.0 =>
            {
                Some(a / b)
            }
            _ => None,
        },
        _ => None,
    }
}

fn tok_text(t: &Tok) -> String {
    match t {
        Tok::Num(s) => s.clone(),
        Tok::Letter(c) | Tok::Sym(c) => c.to_string(),
        Tok::Cmd(c) => format!("\\{c}"),
    }
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
