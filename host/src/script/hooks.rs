//! Hook code: the functions a script defines (`sampling`, `thresholds`, `lr`,
//! `on_step`, `should_stop`, ...) that the Rust training loop calls by name.
//!
//! A [`HookSet`] is the script's functions plus its top-level `import`
//! statements, and nothing else: calling a hook runs the imports (served from
//! the module cache) and then the function, never the script's other
//! top-level code (which would start training again). Swapping the `HookSet`
//! is all a hot reload does; the model, optimizer and step counter live in
//! Rust and are untouched.

use rhai::{CallFnOptions, Dynamic, Engine, FuncArgs, Scope, AST};

use super::error::{from_eval, from_parse};
use crate::{Error, Result};

/// The callable part of a script.
pub struct HookSet {
    /// Imports + function definitions.
    ast: AST,
    /// The file the code came from (for error positions).
    file: String,
    /// The source text it was compiled from (to detect unchanged reloads).
    text: String,
}

impl HookSet {
    /// No hooks.
    pub fn empty() -> Self {
        HookSet { ast: AST::empty(), file: "<none>".into(), text: String::new() }
    }

    /// Compiles `text` (the whole script, labelled `file`) into its hooks.
    /// A syntax error anywhere in the script is reported with its position.
    pub fn compile(engine: &Engine, file: &str, text: &str) -> Result<Self> {
        let mut full = engine.compile(text).map_err(|e| from_parse(file, e))?;
        full.set_source(file);
        Self::from_parts(engine, file, &top_level_imports(text), &full, text)
    }

    /// Hooks from an import prelude (source text) and an AST whose functions are kept.
    pub fn from_parts(
        engine: &Engine,
        file: &str,
        imports: &str,
        functions: &AST,
        text: &str,
    ) -> Result<Self> {
        let mut prelude = engine.compile(imports).map_err(|e| from_parse(file, e))?;
        prelude.set_source(file);
        let mut ast = prelude.merge(&functions.clone_functions_only());
        ast.set_source(file);
        Ok(HookSet { ast, file: file.to_string(), text: text.to_string() })
    }

    /// The source text these hooks were compiled from.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The file these hooks came from.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// True when a function `name` taking `arity` parameters is defined.
    pub fn has(&self, name: &str, arity: usize) -> bool {
        self.ast.iter_functions().any(|f| f.name == name && f.params.len() == arity)
    }

    /// Names of the defined functions.
    pub fn names(&self) -> Vec<String> {
        self.ast.iter_functions().map(|f| f.name.to_string()).collect()
    }

    /// Calls hook `name` with `args`; errors carry the hook's file:line:col.
    pub fn call(
        &self,
        engine: &Engine,
        scope: &mut Scope,
        name: &str,
        args: impl FuncArgs,
    ) -> Result<Dynamic> {
        let opts = CallFnOptions::new().eval_ast(true).rewind_scope(true);
        engine
            .call_fn_with_options::<Dynamic>(opts, scope, &self.ast, name, args)
            .map_err(|e| from_eval(&self.file, e))
    }
}

/// The script's top-level `import ... ;` statements, every other character
/// blanked (newlines kept), so that positions in the result match the script.
pub fn top_level_imports(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut keep = vec![false; chars.len()];
    let mut depth: i64 = 0;
    let mut i = 0;
    // True when the previous significant character ends a statement (or at start).
    let mut at_stmt_start = true;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '/' if next == Some('*') => {
                let mut nest = 0;
                while i < chars.len() {
                    if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                        nest += 1;
                        i += 2;
                    } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                        nest -= 1;
                        i += 2;
                        if nest == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                continue;
            }
            '"' | '`' | '\'' => {
                i = skip_string(&chars, i);
                at_stmt_start = false;
                continue;
            }
            '{' | '(' | '[' => depth += 1,
            '}' | ')' | ']' => depth -= 1,
            _ => {}
        }
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if depth == 0 && at_stmt_start && starts_with_word(&chars, i, "import") {
            // Keep up to and including the terminating `;` (outside strings).
            let start = i;
            let mut j = i;
            while j < chars.len() && chars[j] != ';' {
                if matches!(chars[j], '"' | '`') {
                    j = skip_string(&chars, j);
                } else {
                    j += 1;
                }
            }
            let end = (j + 1).min(chars.len());
            for k in keep.iter_mut().take(end).skip(start) {
                *k = true;
            }
            i = end;
            at_stmt_start = true;
            continue;
        }
        at_stmt_start = (c == ';' || c == '}') && depth == 0;
        i += 1;
    }
    chars.iter().zip(&keep).map(|(&c, &k)| if k || c == '\n' { c } else { ' ' }).collect()
}

/// Index just past the string literal starting at `i`.
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        if chars[j] == '\\' && quote != '`' {
            j += 2;
            continue;
        }
        if chars[j] == quote {
            return j + 1;
        }
        j += 1;
    }
    j
}

fn starts_with_word(chars: &[char], i: usize, word: &str) -> bool {
    let w: Vec<char> = word.chars().collect();
    chars.len() >= i + w.len()
        && chars[i..i + w.len()] == w[..]
        && chars.get(i + w.len()).is_none_or(|c| !(c.is_alphanumeric() || *c == '_'))
        && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_'))
}

/// The error raised when a hook returns the wrong type.
pub fn hook_type_error(hooks: &HookSet, name: &str, expected: &str, found: &Dynamic) -> Error {
    Error::Script {
        pos: hooks.file().to_string(),
        msg: format!("hook `{name}` must return {expected}, found {}", found.type_name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imports_are_kept_in_place() {
        let src = "import \"a\" as a;\nlet x = #{ y: \"import z\" };\nfn f() { import \"b\" as b; }\n  import \"c\" as c; // import \"d\" as d;\n";
        let out = top_level_imports(src);
        assert_eq!(out.lines().count(), src.lines().count());
        assert!(out.contains("import \"a\" as a;"));
        assert!(out.contains("import \"c\" as c;"));
        assert!(!out.contains("\"b\"") && !out.contains("\"d\"") && !out.contains("z"), "{out}");
        assert_eq!(out.find("import \"c\""), src.find("import \"c\""));
    }

    #[test]
    fn hooks_skip_top_level_code() {
        let engine = Engine::new();
        let h = HookSet::compile(
            &engine,
            "t.rhai",
            "let n = 0;\nthrow \"top-level ran\";\nfn lr(step) { step * 2 }",
        )
        .unwrap();
        assert!(h.has("lr", 1) && !h.has("lr", 2) && !h.has("sampling", 1));
        let v = h.call(&engine, &mut Scope::new(), "lr", (3_i64,)).unwrap();
        assert_eq!(v.as_int().unwrap(), 6);
    }
}
