//! The one boundary between Rhai errors and the library's [`Error`].
//!
//! Rhai's `EvalAltResult` is neither `Send` nor `Sync`, so it never leaves this
//! module: [`from_eval`] and [`from_parse`] turn it into
//! [`Error::Script`]`{ pos: "file:line:col", msg }`, following the chain of
//! function calls and modules down to the innermost error (the line the user
//! has to fix). Every binding raises host failures through [`host`], which
//! throws an opaque [`HostError`] value (a registered type no script function
//! can construct), so a script error ("Variable not found", `throw "..."`) and
//! a host error ("models/x/config.json: No such file") stay distinguishable,
//! unforgeably, both to `try/catch` in scripts (`e.type_of() == "HostError"`)
//! and in the final report ([`Error::Script`] versus [`Error::Host`]).

use std::fmt::{self, Display};
use std::sync::Arc;

use rhai::{Dynamic, EvalAltResult, ParseError, Position};

use crate::Error;

/// Whether parsing `src` fails only because the input ends too early (the REPL then asks
/// for more): rhai's `UnexpectedEOF`, a missing closing token (`}`, `)`, `]`, ...) past the
/// last character of the input, or an unterminated backtick string (which may span lines;
/// a `"` string may not, so an open one is an error to report, not more input).
pub(crate) fn runs_past_end(engine: &rhai::Engine, src: &str) -> bool {
    use rhai::{LexError, ParseErrorType as P};
    let Err(ParseError(kind, pos)) = engine.compile(src) else { return false };
    let last = last_char_pos(src);
    // Past the last non-blank character (1-based line and column), or no position at all.
    let at_end = match (pos.line(), pos.position(), last) {
        (Some(l), Some(c), Some(last)) => (l, c) > last,
        (Some(l), None, Some(last)) => l > last.0,
        _ => true,
    };
    match *kind {
        P::UnexpectedEOF => true,
        P::MissingToken(..) => at_end,
        P::BadInput(LexError::UnterminatedString) => at_end || char_at(src, pos) == Some('`'),
        _ => false,
    }
}

/// (line, column) of the last non-whitespace character of `src`, 1-based as rhai counts.
fn last_char_pos(src: &str) -> Option<(usize, usize)> {
    src.lines()
        .enumerate()
        .filter_map(|(i, l)| l.trim_end().chars().count().checked_sub(1).map(|c| (i + 1, c + 1)))
        .last()
}

/// The character of `src` at rhai position `pos`.
fn char_at(src: &str, pos: Position) -> Option<char> {
    src.lines().nth(pos.line()?.checked_sub(1)?)?.chars().nth(pos.position()?.checked_sub(1)?)
}

/// The result type of native functions registered into the engine.
pub type RhaiResult<T> = Result<T, Box<EvalAltResult>>;

/// A host failure as a script sees it: `catch (e)` gets this value; it prints
/// as its message (`e.message`, `${e}`) and can be rethrown, but scripts have
/// no way to make one, so only the host raises host errors.
#[derive(Clone, Debug, PartialEq)]
pub struct HostError(Arc<str>);

impl HostError {
    /// The message.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A host-side failure (I/O, bad config, tensor error) raised into the script
/// as a catchable runtime error. The position is filled in by Rhai at the call.
pub fn host(e: impl Display) -> Box<EvalAltResult> {
    host_at(e, Position::NONE)
}

/// A host failure at a known position (module resolution).
pub fn host_at(e: impl Display, pos: Position) -> Box<EvalAltResult> {
    EvalAltResult::ErrorRuntime(Dynamic::from(HostError(e.to_string().into())), pos).into()
}

/// A bad argument to a binding (wrong key, wrong type): also a host error, but
/// phrased as what was expected and found.
pub fn bad_arg(func: &str, msg: impl Display) -> Box<EvalAltResult> {
    host(format!("{func}: {msg}"))
}

/// `file:line:col`, or just `file` when the position is unknown.
pub fn format_pos(file: &str, pos: Position) -> String {
    match (pos.line(), pos.position()) {
        (Some(l), Some(c)) => format!("{file}:{l}:{c}"),
        (Some(l), None) => format!("{file}:{l}"),
        _ => file.to_string(),
    }
}

/// Converts a compile error of `file`.
pub fn from_parse(file: &str, e: ParseError) -> Error {
    let pos = e.position();
    Error::Script { pos: format_pos(file, pos), msg: format!("syntax error: {}", e.err_type()) }
}

/// Converts a runtime error raised while running code of `file`: the position
/// is the innermost one (inside the called function or imported module), the
/// message the innermost error plus the call chain.
#[allow(clippy::boxed_local)] // rhai hands its errors over boxed; callers pass them on as they come
pub fn from_eval(file: &str, e: Box<EvalAltResult>) -> Error {
    let mut cur_file = file.to_string();
    let mut best: Option<String> = None;
    let mut chain: Vec<String> = Vec::new();
    let mut err = *e;
    loop {
        match err {
            EvalAltResult::ErrorInFunctionCall(name, src, inner, pos) => {
                if !pos.is_none() {
                    best = Some(format_pos(&cur_file, pos));
                }
                if !src.is_empty() {
                    cur_file = src;
                }
                if !name.starts_with("anon$") {
                    chain.push(format!("in call to `{name}`"));
                } else {
                    chain.push("in closure call".into());
                }
                err = *inner;
            }
            EvalAltResult::ErrorInModule(name, inner, pos) => {
                if !pos.is_none() {
                    best = Some(format_pos(&cur_file, pos));
                }
                chain.push(format!("in module `{name}`"));
                cur_file = name;
                err = *inner;
            }
            mut leaf => {
                let pos = leaf.take_position();
                let here = if pos.is_none() {
                    best.unwrap_or_else(|| cur_file.clone())
                } else {
                    format_pos(&cur_file, pos)
                };
                let mut msg = leaf_message(&leaf);
                for c in chain.iter().rev() {
                    msg.push_str(&format!("\n  {c}"));
                }
                return if is_host(&leaf) {
                    Error::Host { pos: here, msg }
                } else {
                    Error::Script { pos: here, msg }
                };
            }
        }
    }
}

/// The message of a Rhai error without its position: a host error's own text
/// (Rhai itself would print a custom type's name), a thrown value as thrown.
pub fn message(e: &EvalAltResult) -> String {
    leaf_message(e)
}

/// A binding's error as a library error, for host code that calls a binding
/// helper outside any script position (the training loop).
pub fn into_error(e: Box<EvalAltResult>) -> Error {
    Error::invalid(message(&e))
}

/// True when `e` is a host failure (a [`HostError`] thrown by a binding).
fn is_host(e: &EvalAltResult) -> bool {
    matches!(e, EvalAltResult::ErrorRuntime(d, _) if d.is::<HostError>())
}

/// The message of an error without Rhai's position suffix; thrown values are
/// shown as thrown.
fn leaf_message(e: &EvalAltResult) -> String {
    match e {
        EvalAltResult::ErrorRuntime(d, _) if d.is::<HostError>() => {
            d.clone().try_cast::<HostError>().map(|h| h.to_string()).unwrap_or_default()
        }
        EvalAltResult::ErrorRuntime(d, _) if d.is_string() => {
            format!("runtime error: {}", d.clone().into_string().unwrap_or_default())
        }
        EvalAltResult::ErrorTerminated(d, _) => {
            let s = d.to_string();
            if s.is_empty() {
                "terminated".into()
            } else {
                format!("terminated: {s}")
            }
        }
        EvalAltResult::ErrorTooManyOperations(_) => {
            "too many operations (an endless loop?); the engine's operation limit stopped it".into()
        }
        other => other.to_string(),
    }
}

/// True when a converted error came from the host rather than the script.
pub fn is_host_error(e: &Error) -> bool {
    matches!(e, Error::Host { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_error_has_file_line_col() {
        let engine = rhai::Engine::new();
        let e = engine.compile("let x = 1;\nlet y = ;").unwrap_err();
        let err = from_parse("a.rhai", e);
        match err {
            Error::Script { pos, .. } => assert!(pos.starts_with("a.rhai:2:"), "{pos}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn runtime_error_inside_function_points_inside_it() {
        let engine = rhai::Engine::new();
        let mut ast = engine.compile("fn f(x) {\n  x + y\n}\nf(1)").unwrap();
        ast.set_source("b.rhai");
        let e = engine.run_ast(&ast).unwrap_err();
        let err = from_eval("b.rhai", e);
        match err {
            Error::Script { pos, msg } => {
                assert!(pos.starts_with("b.rhai:2:"), "{pos}");
                assert!(msg.contains("y") && msg.contains("`f`"), "{msg}");
            }
            other => panic!("{other:?}"),
        }
    }

    fn engine_with_boom() -> rhai::Engine {
        let mut e = rhai::Engine::new();
        e.register_type_with_name::<HostError>("HostError")
            .register_fn("to_string", |e: &mut HostError| e.to_string())
            .register_get("message", |e: &mut HostError| e.to_string());
        e.register_fn("boom", || -> RhaiResult<()> { Err(host("disk on fire")) });
        e
    }

    #[test]
    fn host_errors_are_host_errors_with_positions() {
        let engine = engine_with_boom();
        let e = engine.run("let a = 1;\nboom();").unwrap_err();
        let err = from_eval("c.rhai", e);
        assert!(is_host_error(&err), "{err}");
        assert_eq!(err.to_string(), "host error at c.rhai:2:1: disk on fire");
        // Inside a function, rethrown after a catch: still the host's, at the innermost call.
        let e = engine.run("fn f() {\n  try { boom() } catch (e) { throw e; }\n}\nf();").unwrap_err();
        let err = from_eval("d.rhai", e);
        assert!(is_host_error(&err), "{err}");
        assert!(err.to_string().starts_with("host error at d.rhai:2:"), "{err}");
    }

    #[test]
    fn scripts_cannot_forge_host_errors() {
        let engine = engine_with_boom();
        for src in ["throw \"[host] disk on fire\";", "throw \"disk on fire\";", "throw #{ message: \"x\" };"]
        {
            let err = from_eval("e.rhai", engine.run(src).unwrap_err());
            assert!(!is_host_error(&err) && matches!(err, Error::Script { .. }), "{src}: {err}");
        }
        // What a script catches: the opaque type, printable, with its message.
        let (ty, msg, text): (String, String, String) = {
            let v: rhai::Array = engine
                .eval("let v = []; try { boom(); } catch (e) { v = [type_of(e), e.message, `${e}`]; } v")
                .unwrap();
            let s: Vec<String> = v.into_iter().map(|d| d.into_string().unwrap()).collect();
            (s[0].clone(), s[1].clone(), s[2].clone())
        };
        assert_eq!((ty.as_str(), msg.as_str(), text.as_str()), ("HostError", "disk on fire", "disk on fire"));
        let thrown: String =
            engine.eval("let t = (); try { throw \"[host] x\"; } catch (e) { t = type_of(e); } t").unwrap();
        assert_eq!(thrown, "string");
    }
}
