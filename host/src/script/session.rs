//! An interactive session: the REPL's state kept across inputs (one `Scope`
//! for variables, the functions of every input merged into one AST, the
//! imports typed so far replayed before each input), and what the REPL's
//! commands need (`:help` from the bindings' doc comments, `:vars`, `:load`,
//! `:reload`, completion candidates). The line editing lives in `crate::repl`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rhai::{Dynamic, Engine, Scope, AST};
use serde_json::Value;

use super::error::{from_eval, from_parse};
use super::hooks::{lint, top_level_imports, HookSet};
use super::shared_state::Host;
use super::{build_engine, new_scope};
use crate::{Error, Result};

/// One function's documentation, from the engine's metadata.
#[derive(Debug, Clone)]
pub struct FnDoc {
    /// The function's name.
    pub name: String,
    /// Its signature, as the first doc line gives it.
    pub signature: String,
    /// Its doc text.
    pub doc: String,
}

/// REPL state.
pub struct Session {
    host: Arc<Host>,
    engine: Engine,
    scope: Scope<'static>,
    /// Functions defined so far.
    fns: AST,
    /// Top-level imports typed so far (source text).
    imports: String,
    /// Files given to `:load`.
    loaded: Vec<PathBuf>,
    docs: Vec<FnDoc>,
}

impl Session {
    /// A fresh session on `host`.
    pub fn new(host: Arc<Host>) -> Self {
        let engine = build_engine(&host);
        let scope = new_scope(&host);
        let docs = collect_docs(&engine);
        Session { host, engine, scope, fns: AST::empty(), imports: String::new(), loaded: Vec::new(), docs }
    }

    /// The session's host.
    pub fn host(&self) -> &Arc<Host> {
        &self.host
    }

    /// Whether `src` is a complete input for [`Session::eval`], decided by rhai's own
    /// parser rather than by counting brackets: incomplete when parsing runs into the end
    /// of the input (a missing `}`, `)`, `]` or operand there, or an open backtick string).
    /// Any other parse error is complete input, whose error [`Session::eval`] reports.
    pub fn is_complete(&self, src: &str) -> bool {
        !super::error::runs_past_end(&self.engine, src)
    }

    /// Evaluates one input (`label` names it in errors); returns the value's
    /// printed form unless it is `()`.
    pub fn eval(&mut self, src: &str, label: &str) -> Result<Option<String>> {
        self.host.reset_cancel();
        let mut line = self.engine.compile_with_scope(&self.scope, src).map_err(|e| from_parse(label, e))?;
        line.set_source(label);
        self.warn_hook_like(label, src, &line);
        let prelude = self.engine.compile(&self.imports).map_err(|e| from_parse("<imports>", e))?;
        let new_imports = top_level_imports(src);
        // Functions first, so the input may call functions it defines itself.
        let ast = prelude.merge(&self.fns).merge(&line);
        let value = self
            .engine
            .eval_ast_with_scope::<Dynamic>(&mut self.scope, &ast)
            .map_err(|e| from_eval(label, e));
        // Keep the definitions even when the statements failed, as rhai-repl does.
        self.fns = self.fns.merge(&line.clone_functions_only());
        if value.is_ok() && new_imports.contains("import") {
            self.imports.push('\n');
            self.imports.push_str(new_imports.trim());
        }
        self.update_hooks()?;
        let value = value?;
        if value.is_unit() {
            return Ok(None);
        }
        Ok(Some(self.display(value)))
    }

    /// The printed form of a value, through the registered `to_string`.
    fn display(&self, v: Dynamic) -> String {
        let mut scope = Scope::new();
        scope.push_dynamic("__v", v.clone());
        self.engine.eval_with_scope::<String>(&mut scope, "to_string(__v)").unwrap_or_else(|_| v.to_string())
    }

    /// Warns about the functions of one input that look like hooks but would never be called.
    fn warn_hook_like(&self, label: &str, src: &str, ast: &AST) {
        for w in lint(label, src, ast) {
            self.host.notice(&format!("warning: {w}"));
        }
    }

    fn update_hooks(&self) -> Result<()> {
        let h = HookSet::from_parts(&self.engine, "<repl>", &self.imports, &self.fns, "")?;
        self.host.set_hooks(h);
        Ok(())
    }

    /// Runs a script file in the session (its variables and functions stay).
    pub fn load(&mut self, path: &Path) -> Result<Option<String>> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        if !self.loaded.iter().any(|p| p == path) {
            self.loaded.push(path.to_path_buf());
        }
        if self.host.script().is_none() {
            self.host.set_script(Some(path.to_path_buf()));
        }
        self.eval(&text, &path.display().to_string())
    }

    /// Recompiles the `:load`ed files and replaces their functions and
    /// imports, without re-running their top-level code. Returns the files.
    pub fn reload(&mut self) -> Result<Vec<PathBuf>> {
        for p in self.loaded.clone() {
            let label = p.display().to_string();
            let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
            let mut ast = self.engine.compile(&text).map_err(|e| from_parse(&label, e))?;
            ast.set_source(label.as_str());
            self.warn_hook_like(&label, &text, &ast);
            self.fns = self.fns.merge(&ast.clone_functions_only());
            let imports = top_level_imports(&text);
            if imports.contains("import") {
                self.imports.push('\n');
                self.imports.push_str(imports.trim());
            }
        }
        self.update_hooks()?;
        Ok(self.loaded.clone())
    }

    /// `(name, type, value)` of every variable, the value shortened.
    pub fn vars(&self) -> Vec<(String, String, String)> {
        self.scope
            .iter_raw()
            .map(|(name, _constant, v)| {
                let mut s = self.display(v.clone()).lines().next().unwrap_or_default().to_string();
                if s.chars().count() > 60 {
                    s = format!("{}…", s.chars().take(59).collect::<String>());
                }
                (name.to_string(), self.engine.map_type_name(v.type_name()).to_string(), s)
            })
            .collect()
    }

    /// The documentation of every overload of `name` (script functions included).
    pub fn help(&self, name: &str) -> Vec<FnDoc> {
        let mut v: Vec<FnDoc> = self.docs.iter().filter(|d| d.name == name).cloned().collect();
        for f in self.fns.iter_functions().filter(|f| f.name == name) {
            v.push(FnDoc {
                name: f.name.to_string(),
                signature: format!("{}({})", f.name, f.params.join(", ")),
                doc: std::iter::once(format!("{}({}) (script function)", f.name, f.params.join(", ")))
                    .chain(f.comments.iter().map(|c| c.trim_start_matches("///").trim().to_string()))
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
        }
        v
    }

    /// Names of the documented host functions, sorted, without duplicates.
    pub fn function_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .docs
            .iter()
            .map(|d| d.name.clone())
            .filter(|n| !n.starts_with("get$") && !n.starts_with("set$"))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Completion candidates: functions (host and script), variables, properties.
    pub fn completions(&self) -> Vec<String> {
        let mut v = self.function_names();
        v.extend(self.docs.iter().filter_map(|d| d.name.strip_prefix("get$").map(str::to_string)));
        v.extend(self.fns.iter_functions().map(|f| f.name.to_string()));
        v.extend(self.scope.iter_raw().map(|(n, _, _)| n.to_string()));
        v.sort();
        v.dedup();
        v
    }
}

/// The stapo functions and their doc comments (`///` stripped).
fn collect_docs(engine: &Engine) -> Vec<FnDoc> {
    let Ok(json) = engine.gen_fn_metadata_to_json(false) else { return Vec::new() };
    let Ok(v) = serde_json::from_str::<Value>(&json) else { return Vec::new() };
    let mut out = Vec::new();
    for f in v["functions"].as_array().into_iter().flatten() {
        let comments: Vec<String> = f["docComments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str())
            .flat_map(|c| {
                c.lines()
                    .map(|l| {
                        l.trim_start()
                            .trim_start_matches("///")
                            .trim_start_matches("/**")
                            .trim_end_matches("*/")
                            .trim()
                            .to_string()
                    })
                    // Code fences are for rustdoc-style readers; the REPL shows the code as is.
                    .filter(|l| !l.starts_with("```"))
                    .collect::<Vec<_>>()
            })
            .collect();
        if comments.is_empty() {
            continue;
        }
        out.push(FnDoc {
            name: f["name"].as_str().unwrap_or_default().to_string(),
            signature: f["signature"].as_str().unwrap_or_default().to_string(),
            doc: comments.join("\n"),
        });
    }
    out
}
