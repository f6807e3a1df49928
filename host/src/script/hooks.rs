//! Hook code: the functions a script defines (`sampling`, `thresholds`, `lr`,
//! `on_step`, `should_stop`, ...) that the Rust training loop calls by name.
//!
//! A [`HookSet`] is the script's functions plus its top-level `import`
//! statements, and nothing else: calling a hook runs the imports (served from
//! the module cache) and then the function, never the script's other
//! top-level code (which would start training again). Swapping the `HookSet`
//! is all a hot reload does; the model, optimizer and step counter live in
//! Rust and are untouched.
//!
//! [`HOOKS`] is the one table of hook names, parameters and return values:
//! the training loop calls hooks through its entries, `:help hooks` lists it,
//! and [`lint`] warns about script functions that look like a hook but would
//! never be called (wrong number of parameters, a name one or two letters off).

use std::collections::HashMap;

use rhai::{CallFnOptions, Dynamic, Engine, FuncArgs, Scope, AST};

use super::error::{from_eval, from_parse};
use crate::{Error, Result};

/// One hook the training loop calls: its name, parameters and what it returns.
#[derive(Debug)]
pub struct HookSpec {
    /// The hook's function name in a script.
    pub name: &'static str,
    /// Its parameters' names.
    pub params: &'static [&'static str],
    /// What the hook returns (a type and its meaning).
    pub returns: &'static str,
    /// When it is called and what it does.
    pub doc: &'static str,
}

impl HookSpec {
    /// The number of parameters the host passes.
    pub fn arity(&self) -> usize {
        self.params.len()
    }

    /// `name(p1, p2)`.
    pub fn signature(&self) -> String {
        format!("{}({})", self.name, self.params.join(", "))
    }
}

/// `sampling(step)`.
pub const SAMPLING: HookSpec = HookSpec {
    name: "sampling",
    params: &["step"],
    returns: "a map merged into the step's sampling (n, temperature, top_p, top_k, max_tokens, ...)",
    doc: "called before each step's rollout",
};
/// `thresholds(step, stats)`.
pub const THRESHOLDS: HookSpec = HookSpec {
    name: "thresholds",
    params: &["step", "stats"],
    returns: "#{tau_p, tau_h (a number or #{q, over}), state}: the step's S2T thresholds",
    doc: "called before each step with an S2T objective; stats = the previous step's metrics, \
          run, the thresholds in force and prev (the map returned last time)",
};
/// `lr(step)`.
pub const LR: HookSpec = HookSpec {
    name: "lr",
    params: &["step"],
    returns: "a number: the step's learning rate",
    doc: "called before each step",
};
/// `on_step(step, metrics)`.
pub const ON_STEP: HookSpec = HookSpec {
    name: "on_step",
    params: &["step", "metrics"],
    returns: "anything (ignored)",
    doc: "called after each step with its metrics map",
};
/// `should_stop(step, metrics)`.
pub const SHOULD_STOP: HookSpec = HookSpec {
    name: "should_stop",
    params: &["step", "metrics"],
    returns: "a bool: true ends the run after this step",
    doc: "called after each step, after on_step",
};

/// Every hook, in the order the training loop calls them.
pub const HOOKS: [&HookSpec; 5] = [&SAMPLING, &THRESHOLDS, &LR, &ON_STEP, &SHOULD_STOP];

/// The hooks as help text: one line per hook, signature, returns, when called.
pub fn hooks_help() -> String {
    let mut s = String::from("Hooks a script may define; train() calls them by name at every step:\n");
    for h in HOOKS {
        s.push_str(&format!("  {}\n      -> {}\n      {}\n", h.signature(), h.returns, h.doc));
    }
    s
}

/// The callable part of a script.
pub struct HookSet {
    /// Imports + function definitions.
    ast: AST,
    /// The file the code came from (for error positions).
    file: String,
    /// The source text it was compiled from (to detect unchanged reloads).
    text: String,
    /// (name, arity) -> line of the definition in `text` (for messages).
    lines: HashMap<(String, usize), usize>,
}

impl HookSet {
    /// No hooks.
    pub fn empty() -> Self {
        HookSet { ast: AST::empty(), file: "<none>".into(), text: String::new(), lines: HashMap::new() }
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
        let lines = fn_lines(text).into_iter().map(|(n, a, l)| ((n, a), l)).collect();
        Ok(HookSet { ast, file: file.to_string(), text: text.to_string(), lines })
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

    /// True when the script defines `hook` with the parameters the host passes.
    pub fn has_hook(&self, hook: &HookSpec) -> bool {
        self.has(hook.name, hook.arity())
    }

    /// `file:line` of the definition of `hook`, or the file when the line is unknown.
    pub fn hook_pos(&self, hook: &HookSpec) -> String {
        match self.lines.get(&(hook.name.to_string(), hook.arity())) {
            Some(l) => format!("{}:{l}", self.file),
            None => self.file.clone(),
        }
    }

    /// Warnings about functions that look like hooks but are never called (see [`lint`]).
    pub fn lint(&self) -> Vec<String> {
        lint(&self.file, &self.text, &self.ast)
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
                i = skip_block_comment(&chars, i);
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

/// `(name, number of parameters, line)` of every `fn name(...)` in `src`
/// outside comments and strings (lines from 1). The AST keeps no positions
/// for function definitions, so the text is scanned.
pub fn fn_lines(src: &str) -> Vec<(String, usize, usize)> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '\n' => line += 1,
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
                continue;
            }
            '/' if next == Some('*') => {
                let start = i;
                i = skip_block_comment(&chars, i);
                line += chars[start..i].iter().filter(|&&c| c == '\n').count();
                continue;
            }
            '"' | '`' | '\'' => {
                let start = i;
                i = skip_string(&chars, i);
                line += chars[start..i.min(chars.len())].iter().filter(|&&c| c == '\n').count();
                continue;
            }
            _ if starts_with_word(&chars, i, "fn") => {
                let def_line = line;
                let mut j = i + 2;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let name_start = j;
                while j < chars.len() && ident(chars[j]) {
                    j += 1;
                }
                let name: String = chars[name_start..j].iter().collect();
                while j < chars.len() && chars[j].is_whitespace() && chars[j] != '\n' {
                    j += 1;
                }
                if !name.is_empty() && chars.get(j) == Some(&'(') {
                    let close = chars[j..].iter().position(|&c| c == ')').map_or(chars.len(), |p| j + p);
                    let params: String = chars[j + 1..close].iter().collect();
                    let arity = params.split(',').filter(|p| !p.trim().is_empty()).count();
                    out.push((name, arity, def_line));
                }
                i += 2;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

fn skip_block_comment(chars: &[char], mut i: usize) -> usize {
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
    i
}

/// Levenshtein distance (names are short).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The hook a function name misses by a letter or two: distance 1 for hook
/// names under 5 letters (`lr` would otherwise match most two-letter names),
/// 2 for longer ones; never an exact name.
fn near_miss(name: &str) -> Option<&'static HookSpec> {
    HOOKS.into_iter().find(|h| {
        let d = edit_distance(name, h.name);
        let max = if h.name.len() < 5 { 1 } else { 2 };
        d > 0 && d <= max && name.len() >= 2
    })
}

/// Warnings for the functions of `ast` (compiled from `text`, labelled `file`)
/// that the training loop would never call although they look like hooks: a
/// hook's name with another number of parameters, or a name one or two
/// letters off a hook's, e.g. `x.rhai:12: fn thresholds(step) is never called:
/// the hook is thresholds(step, stats)`. A function is not reported when the
/// script also defines the hook it resembles (then it is a helper).
pub fn lint(file: &str, text: &str, ast: &AST) -> Vec<String> {
    let defined =
        |h: &HookSpec| ast.iter_functions().any(|f| f.name == h.name && f.params.len() == h.arity());
    let lines: HashMap<(String, usize), usize> =
        fn_lines(text).into_iter().map(|(n, a, l)| ((n, a), l)).collect();
    let mut out = Vec::new();
    for f in ast.iter_functions() {
        let what = if let Some(h) = HOOKS.into_iter().find(|h| h.name == f.name) {
            if f.params.len() == h.arity() || defined(h) {
                continue;
            }
            format!("the hook is {}", h.signature())
        } else if let Some(h) = near_miss(f.name) {
            if defined(h) {
                continue;
            }
            format!("did you mean the hook {}?", h.signature())
        } else {
            continue;
        };
        let at = match lines.get(&(f.name.to_string(), f.params.len())) {
            Some(l) => format!("{file}:{l}"),
            None => file.to_string(),
        };
        out.push(format!("{at}: fn {}({}) is never called: {what}", f.name, f.params.join(", ")));
    }
    out.sort();
    out
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

    #[test]
    fn definitions_are_found_with_their_lines() {
        let src = "// fn hidden(a)\nlet s = \"fn nope(x)\";\n/* fn no(\n) */\nfn lr(step) { step }\n\nfn  on_step ( step, m ) {}\nfn f() {}\n";
        assert_eq!(fn_lines(src), vec![("lr".into(), 1, 5), ("on_step".into(), 2, 7), ("f".into(), 0, 8)]);
    }

    #[test]
    fn hook_like_functions_that_are_never_called_are_reported() {
        let engine = Engine::new();
        let text = "fn thresholds(step) { 1 }\n\nfn on_steps(step, m) {}\nfn sampling(step) { #{} }\n\
                    fn lrs(step) { 1 }\nfn pm(a, b) {}\nfn should_stopp(s, m) {}\nfn should_stop(s, m) {}\n";
        let h = HookSet::compile(&engine, "scripts/x.rhai", text).unwrap();
        assert_eq!(
            h.lint(),
            vec![
                "scripts/x.rhai:1: fn thresholds(step) is never called: the hook is thresholds(step, stats)",
                "scripts/x.rhai:3: fn on_steps(step, m) is never called: did you mean the hook \
                 on_step(step, metrics)?",
                "scripts/x.rhai:5: fn lrs(step) is never called: did you mean the hook lr(step)?",
            ]
        );
        assert_eq!(h.hook_pos(&SAMPLING), "scripts/x.rhai:4");
        // A helper beside the real hook is not reported.
        let ok =
            HookSet::compile(&engine, "y.rhai", "fn lr(step) { 1 }\nfn lr(step, base) { base }\n").unwrap();
        assert!(ok.lint().is_empty(), "{:?}", ok.lint());
    }

    #[test]
    fn distances() {
        assert_eq!(edit_distance("on_steps", "on_step"), 1);
        assert_eq!(edit_distance("thresold", "thresholds"), 2);
        assert_eq!(edit_distance("", "lr"), 2);
        assert!(near_miss("thresold").is_some_and(|h| h.name == "thresholds"));
        assert!(near_miss("pm").is_none() && near_miss("lr").is_none());
    }
}
