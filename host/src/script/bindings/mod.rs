//! Script-visible types and functions, one registration file per domain.
//!
//! Bindings are thin: convert the arguments, call the library, convert back.
//! Option maps are read into typed structs (`#[serde(default,
//! deny_unknown_fields)]`) through the one converter
//! [`convert::options`](super::convert::options), so an unknown key or a bad
//! value is an error naming it; counts and seeds go through checked
//! conversions ([`convert::usize_arg`](super::convert::usize_arg)). Failures
//! are raised with [`error::host`](super::error::host) as opaque host errors.
//! Heavy state (model weights, optimizer moments, a trainer) lives in Rust
//! behind the [`handles`](super::handles) that scripts hold; a hot reload
//! swaps code, never handles. Every function is registered through `func!` /
//! `getter!` with `///`-style doc text (usage, description, `# Example`), which
//! the REPL's `:help` shows; a test checks that none lacks it.

use std::sync::Arc;

use rhai::Engine;

use super::error::HostError;
pub use super::handles::{
    lock, DatasetHandle, ModelHandle, ModelSlot, RolloutHandle, RolloutState, RunHandle, TokenizerHandle,
};
use super::shared_state::Host;

/// A binding's doc text as one Rhai doc comment. The text is written in the
/// source as indented `///` lines, as rhai's own packages document their
/// functions: the usage first, then what it does, then `# Example` with a
/// ```` ```rhai ```` block; the indentation is dropped here.
pub(crate) fn doc_comment(doc: &str) -> String {
    doc.trim()
        .lines()
        .map(|l| {
            let l = l.trim();
            if l.starts_with("///") {
                l.to_string()
            } else {
                format!("/// {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Registers a function `name` with its doc text (see [`doc_comment`]).
/// Invoked with braces (`func! { engine, "name", r#"/// ..."#, closure }`),
/// which rustfmt leaves as written: the doc block, then the closure.
/// Functions are marked volatile: they touch models and files, so the
/// optimizer must never fold them at compile time.
macro_rules! func {
    ($engine:expr, $name:expr, $doc:expr, $f:expr $(,)?) => {{
        rhai::FuncRegistration::new($name)
            .with_volatility(true)
            .with_comments([$crate::script::bindings::doc_comment($doc)])
            .register_into_engine($engine, $f);
    }};
}

/// Registers a property getter `obj.name` with a doc comment.
macro_rules! getter {
    ($engine:expr, $name:expr, $doc:expr, $f:expr $(,)?) => {{
        rhai::FuncRegistration::new_getter($name)
            .with_comments([$crate::script::bindings::doc_comment($doc)])
            .register_into_engine($engine, $f);
    }};
}

pub mod algo;
pub mod data;
pub mod eval;
pub mod model;
pub mod reward;
pub mod rollout;
pub mod train;

/// The opaque host-error type scripts catch ([`HostError`]): printable, with its message.
fn register_host_error(engine: &mut Engine) {
    engine.register_type_with_name::<HostError>("HostError");
    func! { engine, "to_string", r#"
        /// to_string(host_error) -> string
        ///
        /// The message of a host failure caught by `try/catch`. Host failures (a missing file,
        /// a bad option) are `HostError` values that only the host can raise; what a script
        /// throws stays its own value.
        ///
        /// # Example
        ///
        /// ```rhai
        /// try { load_model("nowhere") } catch (e) { if type_of(e) == "HostError" { print(e) } }
        /// ```
    "#,
        |e: &mut HostError| e.to_string()
    }
    func! { engine, "to_debug", r#"
        /// to_debug(host_error) -> string
        ///
        /// The message, marked as a host error.
        ///
        /// # Example
        ///
        /// ```rhai
        /// try { load_model("nowhere") } catch (e) { debug(e) }
        /// ```
    "#,
        |e: &mut HostError| format!("HostError({:?})", e.message())
    }
    getter! { engine, "message", r#"
        /// host_error.message -> string
        ///
        /// The message of a caught host failure.
        ///
        /// # Example
        ///
        /// ```rhai
        /// try { load_model("nowhere") } catch (e) { print(e.message) }
        /// ```
    "#,
        |e: &mut HostError| e.to_string()
    }
}

/// Registers every domain.
pub fn register_all(engine: &mut Engine, host: &Arc<Host>) {
    register_host_error(engine);
    engine
        .register_type_with_name::<ModelHandle>("Model")
        .register_type_with_name::<TokenizerHandle>("Tokenizer")
        .register_type_with_name::<DatasetHandle>("Dataset")
        .register_type_with_name::<RolloutHandle>("Rollout")
        .register_type_with_name::<RunHandle>("Run");
    model::register(engine, host);
    data::register(engine, host);
    rollout::register(engine, host);
    reward::register(engine, host);
    algo::register(engine, host);
    train::register(engine, host);
    eval::register(engine, host);
}

#[cfg(test)]
mod tests {
    use crate::script::{build_engine, Console, Host, HostOptions};

    /// The error of evaluating `src` in a fresh engine.
    fn error_of(src: &str) -> crate::Error {
        let host = Host::new(HostOptions::default(), Console::Buffer(Default::default()));
        let e = build_engine(&host).run(src).unwrap_err();
        crate::script::from_eval("t.rhai", e)
    }

    #[test]
    fn bad_arguments_are_host_errors_naming_the_argument() {
        for (src, what) in [
            ("arith_problems(-2, 0)", "n: expected a non-negative integer, found -2"),
            ("arith_problems(2, -1)", "seed: expected a non-negative integer, found -1"),
            ("format_number(1.0, -1)", "digits: expected a non-negative integer, found -1"),
            (
                "load_model(\"m\", #{ dtyp: \"float32\" })",
                "load_model: `dtyp`: unknown key `dtyp`; did you mean `dtype`? (valid: dtype, device)",
            ),
            ("init_model(#{}, #{ seed: -1 })", "init_model: `seed`: invalid value: integer `-1`"),
        ] {
            let e = error_of(src);
            assert!(crate::script::is_host_error(&e) && e.to_string().contains(what), "{src}: {e}");
        }
    }

    #[test]
    fn every_binding_has_docs_with_an_example() {
        let host = Host::new(HostOptions::default(), Console::Buffer(Default::default()));
        let engine = build_engine(&host);
        let json = engine.gen_fn_metadata_to_json(false).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let fns = v["functions"].as_array().unwrap();
        assert!(fns.len() > 60, "only {} functions registered", fns.len());
        let undocumented: Vec<String> = fns
            .iter()
            .filter(|f| {
                let doc: String = f["docComments"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c.as_str())
                    .collect::<Vec<_>>()
                    .join("\n");
                let lines: Vec<&str> = doc.lines().map(str::trim).collect();
                let usage = lines.first().is_some_and(|l| l.len() > "/// ".len());
                let example =
                    lines.windows(2).any(|w| w == ["/// # Example", "///"]) && lines.contains(&"/// ```rhai");
                !(usage && example && lines.iter().all(|l| l.starts_with("///")))
            })
            .map(|f| f["signature"].as_str().unwrap_or_default().to_string())
            .collect();
        assert!(
            undocumented.is_empty(),
            "functions without a doc comment with an example: {undocumented:#?}"
        );
    }

    /// The ```` ```rhai ```` blocks of a doc comment, `///` stripped.
    fn rhai_examples(doc: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut cur: Option<Vec<&str>> = None;
        for l in doc.lines() {
            let l = l.trim_start().strip_prefix("///").unwrap_or(l);
            let l = l.strip_prefix(' ').unwrap_or(l);
            match (&mut cur, l.trim()) {
                (None, "```rhai") => cur = Some(Vec::new()),
                (Some(_), "```") => out.push(cur.take().unwrap_or_default().join("\n")),
                (Some(v), _) => v.push(l),
                (None, _) => {}
            }
        }
        assert!(cur.is_none(), "an unclosed ```rhai block in:\n{doc}");
        out
    }

    /// Each ```` ```rhai ```` example of each binding's doc text compiles with
    /// the engine scripts run in (a syntax error fails, naming the function).
    #[test]
    fn every_doc_example_compiles_with_the_real_engine() {
        let host = Host::new(HostOptions::default(), Console::Buffer(Default::default()));
        let engine = build_engine(&host);
        let json = engine.gen_fn_metadata_to_json(false).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let mut compiled = 0;
        let mut broken = Vec::new();
        for f in v["functions"].as_array().unwrap() {
            let doc: String = f["docComments"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            for ex in rhai_examples(&doc) {
                match engine.compile(&ex) {
                    Ok(_) => compiled += 1,
                    Err(e) => {
                        broken.push(format!("{}: {e}\n{ex}", f["signature"].as_str().unwrap_or_default()))
                    }
                }
            }
        }
        assert!(compiled > 60, "only {compiled} examples found");
        assert!(broken.is_empty(), "doc examples that do not compile:\n{}", broken.join("\n\n"));
    }
}
