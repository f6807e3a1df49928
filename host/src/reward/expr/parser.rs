//! Recursive-descent parser from tokens to an expression tree; the grammar is
//! in the module header of [`super`].

use std::collections::{BTreeSet, HashMap};
use std::f64::consts::{E, PI};

use super::lexer::{is_accent, is_greek, is_text_cmd, tok_text, tokenize, Tok};
use super::{eval, Expr, Func, Node, C};

/// Deepest nesting of parser calls (about five per bracket level).
const MAX_DEPTH: usize = 400;

/// Parses a whole input; `None` when any token is left over or unknown.
pub(super) fn parse(s: &str) -> Option<Expr> {
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
