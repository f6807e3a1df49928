//! Tokenizer for LaTeX-ish answers, and the command vocabulary the parser
//! consults (Greek letters, text commands, accents).

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
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

pub(super) fn tokenize(s: &str) -> Option<Vec<Tok>> {
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
pub(super) fn is_greek(name: &str) -> bool {
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
pub(super) fn is_text_cmd(name: &str) -> bool {
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
pub(super) fn is_accent(name: &str) -> bool {
    matches!(name, "dot" | "ddot" | "hat" | "bar" | "vec" | "tilde" | "overline" | "widehat" | "widetilde")
}

pub(super) fn tok_text(t: &Tok) -> String {
    match t {
        Tok::Num(s) => s.clone(),
        Tok::Letter(c) | Tok::Sym(c) => c.to_string(),
        Tok::Cmd(c) => format!("\\{c}"),
    }
}
