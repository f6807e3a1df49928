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
//! swaps code, never handles.
//!
//! Every script-visible function is one Rust function in a domain file's
//! `#[export_module] mod fns` (rhai's plugin macros): its `///` doc comment
//! (the usage line, what it does, `# Example` with a ```` ```rhai ```` block)
//! is the one rustdoc renders and, through rhai's `metadata` feature, the one
//! the REPL's `:help` shows. Each domain has one `register(engine)` of a few
//! lines; bindings that print, read `--set` values or claim the run folder
//! take a `NativeCallContext` and get the session's [`Host`] from
//! [`host_of`]. Tests check that every function has a doc comment with an
//! example, that every example compiles, and that no `fn register*` under
//! `script/` exceeds 80 lines.

use std::sync::Arc;

use rhai::{Dynamic, Engine, NativeCallContext};

use super::error::{HostError, RhaiResult};
pub use super::handles::{
    lock, DatasetHandle, HeldRun, ModelHandle, ModelSlot, RolloutHandle, RolloutState, RunHandle,
    TokenizerHandle,
};
use super::shared_state::Host;

pub mod algo;
pub mod data;
pub mod eval;
pub mod host_error;
pub mod model;
pub mod reward;
pub mod rollout;
pub mod runs;
pub mod train;

/// The [`Host`] of the engine a binding runs in: [`register_all`] keeps it as the
/// engine's default tag, so a binding that prints, reads `--set` values or claims the
/// run folder takes a `NativeCallContext` and asks for it here.
pub fn host_of(ctx: &NativeCallContext) -> RhaiResult<Arc<Host>> {
    ctx.engine().default_tag().clone().try_cast::<Arc<Host>>().ok_or_else(|| {
        super::error::host("this engine has no stapo host (build it with script::build_engine)")
    })
}

/// Registers every domain, and keeps `host` as the engine's default tag for [`host_of`].
pub fn register_all(engine: &mut Engine, host: &Arc<Host>) {
    engine.set_default_tag(Dynamic::from(host.clone()));
    engine
        .register_type_with_name::<HostError>("HostError")
        .register_type_with_name::<ModelHandle>("Model")
        .register_type_with_name::<TokenizerHandle>("Tokenizer")
        .register_type_with_name::<DatasetHandle>("Dataset")
        .register_type_with_name::<RolloutHandle>("Rollout")
        .register_type_with_name::<RunHandle>("Run");
    model::register(engine);
    data::register(engine);
    rollout::register(engine);
    reward::register(engine);
    algo::register(engine);
    train::register(engine);
    runs::register(engine);
    eval::register(engine);
    host_error::register(engine);
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

    /// The `fn register*` functions under `script/` (the domain files' `register`,
    /// `register_all`) stay registration only: none runs over 80 lines, so a
    /// binding's body and doc live in its own function, not in a long closure list.
    #[test]
    fn no_register_function_is_over_80_lines() {
        let mut files = Vec::new();
        let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/script")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        let (mut found, mut long) = (Vec::new(), Vec::new());
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                let t = l.trim_start();
                let Some(at) = t.find("fn register") else { continue };
                if !t[..at].split_whitespace().all(|w| w == "pub" || w.starts_with("pub("))
                    || t.starts_with("//")
                {
                    continue;
                }
                let indent = &l[..l.len() - t.len()];
                let close = format!("{indent}}}");
                let end = lines[i..].iter().position(|x| *x == close).unwrap_or_else(|| {
                    panic!("{}:{}: no closing brace at the indentation of `{t}`", f.display(), i + 1)
                });
                let name = t[at + 3..].split('(').next().unwrap_or_default().to_string();
                found.push(name.clone());
                if end + 1 > 80 {
                    long.push(format!("{}:{}: {name} is {} lines", f.display(), i + 1, end + 1));
                }
            }
        }
        assert!(
            found.iter().filter(|n| *n == "register").count() >= 9,
            "register functions found: {found:?}"
        );
        assert!(found.contains(&"register_all".to_string()), "{found:?}");
        assert!(long.is_empty(), "register functions over 80 lines:\n{}", long.join("\n"));
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
