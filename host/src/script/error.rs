//! The one boundary between Rhai errors and the library's [`Error`].
//!
//! Rhai's `EvalAltResult` is neither `Send` nor `Sync`, so it never leaves this
//! module: [`from_eval`] and [`from_parse`] turn it into
//! [`Error::Script`]`{ pos: "file:line:col", msg }`, following the chain of
//! function calls and modules down to the innermost error (the line the user
//! has to fix). Every binding raises host failures through [`host`], which
//! tags the message with `[host]`, so a script error ("Variable not found")
//! and a host error ("[host] models/x/config.json: No such file") stay
//! distinguishable both to `try/catch` in scripts and in the final report.

use std::fmt::Display;

use rhai::{EvalAltResult, ParseError, Position};

use crate::Error;

/// The result type of native functions registered into the engine.
pub type RhaiResult<T> = Result<T, Box<EvalAltResult>>;

/// The prefix of every host error raised inside a script.
pub const HOST_TAG: &str = "[host] ";

/// A host-side failure (I/O, bad config, tensor error) raised into the script
/// as a catchable runtime error. The position is filled in by Rhai at the call.
pub fn host(e: impl Display) -> Box<EvalAltResult> {
    EvalAltResult::ErrorRuntime(format!("{HOST_TAG}{e}").into(), Position::NONE).into()
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
                return Error::Script { pos: here, msg };
            }
        }
    }
}

/// The message of an error without Rhai's position suffix; host errors keep
/// their `[host]` tag, thrown values are shown as thrown.
fn leaf_message(e: &EvalAltResult) -> String {
    match e {
        EvalAltResult::ErrorRuntime(d, _) if d.is_string() => {
            let s = d.clone().into_string().unwrap_or_default();
            if s.starts_with(HOST_TAG) {
                s
            } else {
                format!("runtime error: {s}")
            }
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
    matches!(e, Error::Script { msg, .. } if msg.starts_with(HOST_TAG))
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

    #[test]
    fn host_errors_are_tagged() {
        let engine = {
            let mut e = rhai::Engine::new();
            e.register_fn("boom", || -> RhaiResult<()> { Err(host("disk on fire")) });
            e
        };
        let e = engine.run("let a = 1;\nboom();").unwrap_err();
        let err = from_eval("c.rhai", e);
        assert!(is_host_error(&err), "{err}");
        assert!(err.to_string().contains("c.rhai:2:"), "{err}");
    }
}
