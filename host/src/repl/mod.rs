//! `stapo repl`: the interactive shell, after rhai's own `rhai-repl`.
//!
//! Input is collected until rhai's parser finds it complete (multi-line functions, maps
//! and backtick strings; [`Session::is_complete`]; Ctrl-C drops an unfinished one), then
//! evaluated in one
//! [`crate::script::session::Session`] (variables and functions
//! persist). Commands start with `:` so they never clash with variables:
//!
//! | command | does |
//! |---|---|
//! | `:help` | lists the stapo functions and commands |
//! | `:help name` | the doc comments of `name` (every overload) |
//! | `:help hooks` | the hooks `train()` calls, their signatures and return values |
//! | `:load file` | runs a script file in the session |
//! | `:reload` | recompiles the loaded files' functions (hooks), top-level code not re-run |
//! | `:vars` | variables and their values |
//! | `:quit` | leaves (also Ctrl-D) |
//!
//! A rollout prints as a token table (token, p, H, advantage, silenced?).
//! Ctrl-C while a step runs cancels it and returns to the prompt.
//! [`run_repl`] drives the same loop from any `BufRead` (tests, pipes);
//! [`run_interactive`] adds rustyline (history file, tab completion).

use std::borrow::Cow;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustyline::completion::Completer;
use rustyline::error::ReadlineError;
use rustyline::highlight::Highlighter;
use rustyline::hint::Hinter;
use rustyline::history::DefaultHistory;
use rustyline::validate::Validator;
use rustyline::{Context, Editor, Helper};

use crate::script::session::Session;
use crate::script::{Console, Host, HostOptions};
use crate::Result;

/// The prompt, and the prompt of a continued line.
pub const PROMPT: &str = "stapo> ";
/// The prompt of a continued line.
pub const CONTINUE: &str = "  ...> ";

/// What feeding one line did.
#[derive(Debug, PartialEq)]
pub enum Feed {
    /// The input continues on the next line.
    More,
    /// The input was handled; print this (may be empty).
    Done(String),
    /// `:quit`.
    Quit,
}

/// The REPL's logic without any terminal.
pub struct Repl {
    session: Session,
    pending: String,
    buffer: Option<Arc<Mutex<String>>>,
}

impl Repl {
    /// A REPL on a new session with `opts`; `buffered` captures `print` output
    /// (drained into each [`Feed::Done`]) instead of writing to stdout.
    pub fn new(
        opts: HostOptions,
        buffered: bool,
        cancel: Option<&'static std::sync::atomic::AtomicBool>,
    ) -> Self {
        let buffer = buffered.then(|| Arc::new(Mutex::new(String::new())));
        let console = buffer.clone().map_or(Console::Stdout, Console::Buffer);
        let host = match cancel {
            Some(c) => Host::with_cancel(opts, console, c),
            None => Host::new(opts, console),
        };
        Repl { session: Session::new(host), pending: String::new(), buffer }
    }

    /// The session behind the REPL.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// True while a multi-line input is being collected.
    pub fn continuing(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Drops a partial multi-line input (Ctrl-C at the prompt).
    pub fn discard(&mut self) {
        self.pending.clear();
    }

    fn drain(&self) -> String {
        self.buffer
            .as_ref()
            .and_then(|b| b.lock().ok().map(|mut s| std::mem::take(&mut *s)))
            .unwrap_or_default()
    }

    /// Feeds one line of input.
    pub fn feed(&mut self, line: &str) -> Feed {
        if self.pending.is_empty() && line.trim_start().starts_with(':') {
            return self.command(line.trim());
        }
        self.pending.push_str(line);
        self.pending.push('\n');
        if !self.session.is_complete(&self.pending) {
            return Feed::More;
        }
        let src = std::mem::take(&mut self.pending);
        if src.trim().is_empty() {
            return Feed::Done(String::new());
        }
        let result = self.session.eval(&src, "<repl>");
        let mut out = self.drain();
        match result {
            Ok(Some(v)) => out.push_str(&format!("{v}\n")),
            Ok(None) => {}
            Err(e) => out.push_str(&format!("error: {e}\n")),
        }
        Feed::Done(out)
    }

    fn command(&mut self, cmd: &str) -> Feed {
        let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(a, b)| (a, b.trim()));
        let out = match name {
            ":quit" | ":q" | ":exit" => return Feed::Quit,
            ":help" | ":h" if arg.is_empty() => self.help_all(),
            ":help" | ":h" if arg == "hooks" => crate::script::hooks::hooks_help(),
            ":help" | ":h" => {
                let docs = self.session.help(arg);
                if docs.is_empty() {
                    format!("no function named `{arg}` (:help lists them)\n")
                } else {
                    docs.iter().map(|d| format!("{}\n", indent(&d.doc))).collect::<Vec<_>>().join("\n")
                }
            }
            ":load" if !arg.is_empty() => {
                let r = self.session.load(Path::new(arg));
                let mut out = self.drain();
                match r {
                    Ok(Some(v)) => out.push_str(&format!("{v}\n")),
                    Ok(None) => out.push_str(&format!("loaded {arg}\n")),
                    Err(e) => out.push_str(&format!("error: {e}\n")),
                }
                out
            }
            ":reload" => match self.session.reload() {
                Ok(files) if files.is_empty() => "nothing to reload (:load a file first)\n".into(),
                Ok(files) => format!(
                    "reloaded functions of {}\n",
                    files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
                ),
                Err(e) => format!("error: {e} (previous functions kept)\n"),
            },
            ":vars" => self.session.vars().iter().map(|(n, t, v)| format!("{n:<16} {t:<12} {v}\n")).collect(),
            _ => format!(
                "unknown command `{cmd}`: try :help, :help fn, :help hooks, :load file, :reload, :vars, :quit\n"
            ),
        };
        Feed::Done(out)
    }

    fn help_all(&self) -> String {
        let names = self.session.function_names();
        let mut s = String::from(
            "Commands: :help [fn], :help hooks, :load file, :reload, :vars, :quit\n\
             Functions (:help name for details):\n",
        );
        for chunk in names.chunks(6) {
            s.push_str(&format!("  {}\n", chunk.join("  ")));
        }
        let hooks: Vec<String> = crate::script::hooks::HOOKS.iter().map(|h| h.signature()).collect();
        s.push_str(&format!("Hooks a script may define for train() (:help hooks): {}\n", hooks.join(", ")));
        s
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}

/// Runs the REPL over `input`, writing prompts' answers to `output` (no
/// prompts are echoed). Stops at end of input or `:quit`.
pub fn run_repl(input: impl BufRead, mut output: impl Write, opts: HostOptions) -> Result<()> {
    let mut repl = Repl::new(opts, true, None);
    let io = |e: std::io::Error| crate::Error::io("<repl output>", e);
    for line in input.lines() {
        let line = line.map_err(|e| crate::Error::io("<repl input>", e))?;
        match repl.feed(&line) {
            Feed::More => {}
            Feed::Done(s) => output.write_all(s.as_bytes()).map_err(io)?,
            Feed::Quit => break,
        }
    }
    output.flush().map_err(io)
}

/// Tab completion over the session's names.
struct ReplHelper {
    names: Arc<Mutex<Vec<String>>>,
}

impl Completer for ReplHelper {
    type Candidate = String;
    fn complete(
        &self,
        line: &str,
        pos: usize,
        _ctx: &Context<'_>,
    ) -> rustyline::Result<(usize, Vec<String>)> {
        let start =
            line[..pos].rfind(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).map_or(0, |i| i + 1);
        let word = &line[start..pos];
        if word.is_empty() {
            return Ok((pos, Vec::new()));
        }
        let commands = [":help", ":load", ":reload", ":vars", ":quit"];
        let names = self.names.lock().map(|n| n.clone()).unwrap_or_default();
        let v: Vec<String> =
            commands.iter().map(|c| c.to_string()).chain(names).filter(|n| n.starts_with(word)).collect();
        Ok((start, v))
    }
}
impl Hinter for ReplHelper {
    type Hint = String;
}
impl Highlighter for ReplHelper {
    fn highlight_prompt<'b, 's: 'b, 'p: 'b>(&'s self, prompt: &'p str, _default: bool) -> Cow<'b, str> {
        Cow::Borrowed(prompt)
    }
}
impl Validator for ReplHelper {}
impl Helper for ReplHelper {}

/// The history file: `$STAPO_HISTORY`, else `~/.stapo_history`, else `./.stapo_history`.
pub fn history_path() -> PathBuf {
    if let Ok(p) = std::env::var("STAPO_HISTORY") {
        return PathBuf::from(p);
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".stapo_history"))
        .unwrap_or_else(|| PathBuf::from(".stapo_history"))
}

/// The interactive REPL on a terminal.
pub fn run_interactive(opts: HostOptions, cancel: &'static std::sync::atomic::AtomicBool) -> Result<()> {
    let mut repl = Repl::new(opts, false, Some(cancel));
    let names = Arc::new(Mutex::new(repl.session().completions()));
    let mut ed: Editor<ReplHelper, DefaultHistory> =
        Editor::new().map_err(|e| crate::Error::invalid(format!("cannot start the line editor: {e}")))?;
    ed.set_helper(Some(ReplHelper { names: names.clone() }));
    let hist = history_path();
    let _ = ed.load_history(&hist);
    println!("stapo repl — :help for functions and commands, :quit to leave");
    loop {
        let prompt = if repl.continuing() { CONTINUE } else { PROMPT };
        match ed.readline(prompt) {
            Ok(line) => {
                if !line.trim().is_empty() {
                    let _ = ed.add_history_entry(line.as_str());
                }
                match repl.feed(&line) {
                    Feed::More => {}
                    Feed::Done(s) => {
                        print!("{s}");
                        let _ = std::io::stdout().flush();
                        crate::guard::signal::clear();
                        if let Ok(mut n) = names.lock() {
                            *n = repl.session().completions();
                        }
                    }
                    Feed::Quit => break,
                }
            }
            Err(ReadlineError::Interrupted) => {
                repl.discard();
                println!("(Ctrl-C: input discarded; :quit or Ctrl-D to leave)");
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(crate::Error::invalid(format!("line editor: {e}"))),
        }
    }
    let _ = ed.save_history(&hist);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parser, not bracket counting, decides when input is complete.
    #[test]
    fn nothing_silent_repl_completeness_from_the_parser() {
        let r = Repl::new(HostOptions::default(), true, None);
        let s = r.session();
        // Complete, though brackets inside literals and comments do not balance.
        for src in ["let c = '{';\n", "let s = \"}\"; // {\n", "#{ a: [1,\n 2] }\n", "1 +\n 2\n", "let x = 1"]
        {
            assert!(s.is_complete(src), "{src:?}");
        }
        // Incomplete: open constructs at the end, a `}` inside a string of an open function,
        // a multi-line backtick string.
        for src in
            ["fn f(x) {\n", "fn f() {\n  let s = \"}\";\n", "let t = `line one\n", "foo(1,\n", "let y =\n"]
        {
            assert!(!s.is_complete(src), "{src:?}");
        }
        // A real error in the middle is complete input (reported, not waited on).
        assert!(s.is_complete("let x = (1 2);\nlet y = 3;\n"));
        assert!(s.is_complete("let s = \"open\nlet y = 3;\n"), "an open \" string cannot span lines");
        // Fed line by line: `let c = '{';` no longer swallows what follows, and a `}` in a
        // string inside a function or a backtick string does not cut it early.
        let mut r = Repl::new(HostOptions::default(), true, None);
        assert_eq!(r.feed("let c = '{';"), Feed::Done(String::new()));
        assert_eq!(r.feed("fn g() {"), Feed::More);
        assert_eq!(r.feed("  let s = \"}\";"), Feed::More);
        assert_eq!(r.feed("  s + `a"), Feed::More);
        assert_eq!(r.feed("}`"), Feed::More);
        assert_eq!(r.feed("}"), Feed::Done(String::new()));
        assert_eq!(r.feed("g()"), Feed::Done("}a\n}\n".into()));
        assert_eq!(r.feed("c"), Feed::Done("{\n".into()));
    }

    #[test]
    fn state_persists_and_commands_work() {
        let input = "let x = 40;\nfn add(a,\n b) {\n a + b\n}\nadd(x, 2)\n:vars\n:help verify\n:bogus\nprint(\"hi\");\n\
                     :help hooks\nfn on_steps(step, m) { }\n:quit\nnot reached\n";
        let mut out = Vec::new();
        run_repl(input.as_bytes(), &mut out, HostOptions::default()).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(out.contains("42\n"), "{out}");
        assert!(out.contains("x ") && out.contains("verify(answer, response)"), "{out}");
        assert!(out.contains("unknown command") && out.contains("hi\n"), "{out}");
        assert!(!out.contains("not reached"));
        // `:help hooks` lists the one table, and a near-miss hook name is warned about.
        for h in crate::script::hooks::HOOKS {
            assert!(out.contains(&format!("  {}\n      -> {}", h.signature(), h.returns)), "{out}");
        }
        assert!(
            out.contains(
                "warning: <repl>:1: fn on_steps(step, m) is never called: did you mean the hook \
                 on_step(step, metrics)?"
            ),
            "{out}"
        );
    }
}
