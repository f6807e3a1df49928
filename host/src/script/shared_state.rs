//! The host side of a script session: what the bindings share (output,
//! cancellation flag, options such as smoke mode and `--set` values, the run
//! folder, the current hook code, reload requests). One [`Host`] backs one
//! engine; `stapo run` makes one per script, the REPL one per session.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rhai::{Dynamic, Map};

use super::convert::parse_cli_value;
use super::hooks::HookSet;

/// Where `print` and the host's messages go.
#[derive(Clone)]
pub enum Console {
    /// The process's stdout (above the progress bar when one is drawn).
    Stdout,
    /// A shared buffer, drained by whoever owns it (the REPL driven by a test).
    Buffer(Arc<Mutex<String>>),
}

/// Wall-clock limits on script code, checked by the engine's `on_progress`
/// (between script operations: a long host call such as a training step
/// finishes first). A hook or script past its limit stops with an error naming
/// it and its file:line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeLimits {
    /// Each call of a training hook (`lr`, `on_step`, ...): 60 s by default;
    /// `stapo run --hook-timeout`, or `hook_timeout` (seconds) in a `train` config map.
    pub hook: Option<Duration>,
    /// The whole top-level script of `stapo run` ([`super::run_file`]),
    /// training included: none by default (a run may train for days; Ctrl-C
    /// stops it); `stapo run --script-timeout`. REPL inputs have no limit.
    pub script: Option<Duration>,
}

/// The default time limit of one hook call.
pub const DEFAULT_HOOK_TIMEOUT: Duration = Duration::from_secs(60);

impl TimeLimits {
    /// A limit of `secs` seconds; 0 means none. Negative or non-finite values are refused.
    pub fn seconds(secs: f64) -> Result<Option<Duration>, String> {
        if !(secs.is_finite() && secs >= 0.0) {
            return Err(format!("expected seconds >= 0, found {secs}"));
        }
        Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
    }
}

impl Default for TimeLimits {
    fn default() -> Self {
        TimeLimits { hook: Some(DEFAULT_HOOK_TIMEOUT), script: None }
    }
}

/// What a session is allowed and asked to do.
#[derive(Clone, Debug, Default)]
pub struct HostOptions {
    /// Smoke mode: scripts see `SMOKE == true`, and `train` clamps every run to
    /// a couple of tiny steps (see `train_loop`).
    pub smoke: bool,
    /// `--set key=value` pairs, visible to scripts as the constant map `ARGS`.
    pub args: BTreeMap<String, String>,
    /// The run folder of this script (`runs/<stem>-<time>/` or `--out`); `None`
    /// makes one under `runs/` on the first `train`.
    pub run_dir: Option<PathBuf>,
    /// Continue the run in `run_dir` instead of starting one.
    pub resume: bool,
    /// On resume, continue under the script's config (with `--set`) where it differs from
    /// the run's `run_config.json` (`stapo run --resume DIR --apply-changes`); without it a
    /// difference is an error listing the fields.
    pub apply_changes: bool,
    /// On resume, cut a damaged `metrics.jsonl` back to its last whole step
    /// (`--repair-metrics`); without it a damaged line is an error naming it.
    pub repair_metrics: bool,
    /// Draw a progress bar during `train` (only on a terminal).
    pub progress: bool,
    /// Watch the script and its imports and swap hooks when they change.
    pub watch: bool,
    /// Folders searched by `import` after the script's own folder.
    pub stdlib_dirs: Vec<PathBuf>,
    /// Wall-clock limits of hooks and of the whole script.
    pub time_limits: TimeLimits,
}

/// Nanoseconds since the first call (a process-wide origin for deadlines kept in atomics).
fn now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// A running deadline: the instant (0 = none) and what to say when it passes.
#[derive(Default)]
struct Deadline {
    at_ns: AtomicU64,
    what: Mutex<String>,
    fired: AtomicBool,
}

impl Deadline {
    fn set(&self, limit: Option<Duration>, what: String) -> u64 {
        if let Ok(mut w) = self.what.lock() {
            *w = what;
        }
        self.fired.store(false, Ordering::SeqCst);
        let at = limit.map_or(0, |l| now_ns().saturating_add(l.as_nanos() as u64));
        self.at_ns.swap(at, Ordering::SeqCst)
    }

    /// The message once the deadline has passed.
    fn check(&self, now: u64) -> Option<String> {
        let at = self.at_ns.load(Ordering::Relaxed);
        if at == 0 || now < at {
            return None;
        }
        self.fired.store(true, Ordering::SeqCst);
        Some(self.what.lock().map(|w| w.clone()).unwrap_or_default())
    }
}

/// Clears a hook deadline when the hook returns.
pub struct HookDeadline<'a> {
    host: &'a Host,
    prev: u64,
}

impl HookDeadline<'_> {
    /// True when the hook was stopped by this deadline.
    pub fn fired(&self) -> bool {
        self.host.hook_deadline.fired.load(Ordering::SeqCst)
    }
}

impl Drop for HookDeadline<'_> {
    fn drop(&mut self) {
        self.host.hook_deadline.at_ns.store(self.prev, Ordering::SeqCst);
    }
}

/// Shared state of one script session; cheap to clone through `Arc`.
pub struct Host {
    /// The session's options (smoke mode, `--set` values, limits).
    pub opts: HostOptions,
    console: Console,
    cancel: &'static AtomicBool,
    /// The script file being run (hooks are recompiled from it on reload).
    script: RwLock<Option<PathBuf>>,
    /// The code hooks are called from; swapped by reloads.
    hooks: RwLock<Arc<HookSet>>,
    /// The hooks a reload replaced (what a hook that times out falls back to).
    previous_hooks: RwLock<Option<Arc<HookSet>>>,
    /// The running hook's deadline and the script's.
    hook_deadline: Deadline,
    script_deadline: Deadline,
    /// Set by the file watcher; consumed at the next step boundary.
    reload_requested: AtomicBool,
    /// Files read by `import` (watched for hot reload).
    imported: Mutex<Vec<PathBuf>>,
    /// `train` calls made so far (each after the first gets a sub-folder).
    trains: AtomicUsize,
    /// Summaries of finished `train` calls (for the batch table).
    results: Mutex<Vec<Map>>,
    /// Script-held runs checkpointed as the script let go of them after a stop.
    kept: Mutex<Vec<KeptRun>>,
    progress: Mutex<Option<ProgressBar>>,
}

/// A run a script held, saved when the script let go of it after a stop was requested
/// ([`super::handles::HeldRun`]).
#[derive(Debug, Clone)]
pub struct KeptRun {
    /// The run folder.
    pub run_dir: PathBuf,
    /// Steps completed.
    pub steps: u64,
    /// The checkpoint it resumes from (`None`: no step completed), or why none was written.
    pub checkpoint: std::result::Result<Option<String>, String>,
}

impl Host {
    /// A session with its own cancellation flag.
    pub fn new(opts: HostOptions, console: Console) -> Arc<Self> {
        Self::with_cancel(opts, console, Box::leak(Box::new(AtomicBool::new(false))))
    }

    /// A session whose cancellation flag is `cancel` (the process-wide Ctrl-C flag for the CLI).
    pub fn with_cancel(opts: HostOptions, console: Console, cancel: &'static AtomicBool) -> Arc<Self> {
        Arc::new(Host {
            opts,
            console,
            cancel,
            script: RwLock::new(None),
            hooks: RwLock::new(Arc::new(HookSet::empty())),
            previous_hooks: RwLock::new(None),
            hook_deadline: Deadline::default(),
            script_deadline: Deadline::default(),
            reload_requested: AtomicBool::new(false),
            imported: Mutex::new(Vec::new()),
            trains: AtomicUsize::new(0),
            results: Mutex::new(Vec::new()),
            kept: Mutex::new(Vec::new()),
            progress: Mutex::new(None),
        })
    }

    /// Writes one line of output (script `print`, host notices).
    pub fn println(&self, s: &str) {
        match &self.console {
            Console::Stdout => {
                let pb = self.progress.lock().ok().and_then(|p| p.clone());
                match pb {
                    Some(pb) => pb.suspend(|| println!("{s}")),
                    None => {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "{s}");
                    }
                }
            }
            Console::Buffer(b) => {
                if let Ok(mut b) = b.lock() {
                    b.push_str(s);
                    b.push('\n');
                }
            }
        }
    }

    /// A notice for stderr (reloads, warnings); buffered consoles get it too.
    pub fn notice(&self, s: &str) {
        match &self.console {
            Console::Stdout => {
                let pb = self.progress.lock().ok().and_then(|p| p.clone());
                match pb {
                    Some(pb) => pb.suspend(|| eprintln!("{s}")),
                    None => eprintln!("{s}"),
                }
            }
            Console::Buffer(_) => self.println(s),
        }
    }

    /// The cancellation flag (Ctrl-C), checked by the engine and by long host calls.
    pub fn cancel_flag(&self) -> &'static AtomicBool {
        self.cancel
    }

    /// True once cancellation was requested.
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// Clears the cancellation flag (before each REPL line).
    pub fn reset_cancel(&self) {
        self.cancel.store(false, Ordering::Relaxed);
    }

    /// Records the session's script file.
    pub fn set_script(&self, path: Option<PathBuf>) {
        if let Ok(mut s) = self.script.write() {
            *s = path;
        }
    }

    /// The session's script file.
    pub fn script(&self) -> Option<PathBuf> {
        self.script.read().ok().and_then(|s| s.clone())
    }

    /// The current hooks.
    pub fn hooks(&self) -> Arc<HookSet> {
        self.hooks.read().map(|h| h.clone()).unwrap_or_else(|_| Arc::new(HookSet::empty()))
    }

    /// Replaces the hooks (a new script, a REPL input); no previous hooks to fall back to.
    pub fn set_hooks(&self, h: HookSet) {
        if let Ok(mut slot) = self.hooks.write() {
            *slot = Arc::new(h);
        }
        if let Ok(mut p) = self.previous_hooks.write() {
            *p = None;
        }
    }

    /// Replaces the hooks on a hot reload, keeping the replaced ones to fall back to.
    pub fn reload_hooks(&self, h: HookSet) {
        let old = self.hooks();
        if let Ok(mut slot) = self.hooks.write() {
            *slot = Arc::new(h);
        }
        if let Ok(mut p) = self.previous_hooks.write() {
            *p = Some(old);
        }
    }

    /// Goes back to the hooks the last reload replaced; false when there are none.
    pub fn revert_hooks(&self) -> bool {
        let Some(prev) = self.previous_hooks.write().ok().and_then(|mut p| p.take()) else { return false };
        if let Ok(mut slot) = self.hooks.write() {
            *slot = prev;
        }
        true
    }

    /// Starts the deadline of one hook call (`limit`; `what` is the message
    /// when it passes); it ends when the returned guard is dropped.
    pub fn hook_deadline(&self, limit: Option<Duration>, what: String) -> HookDeadline<'_> {
        let prev = self.hook_deadline.set(limit, what);
        HookDeadline { host: self, prev }
    }

    /// Starts the deadline of the whole script (`what` is the message when it passes).
    pub fn start_script_deadline(&self, limit: Option<Duration>, what: String) {
        self.script_deadline.set(limit, what);
    }

    /// The message of a passed deadline (the hook's first), checked by `on_progress`.
    pub fn deadline_passed(&self) -> Option<String> {
        // Without a deadline (the common case) the clock is not read.
        if self.hook_deadline.at_ns.load(Ordering::Relaxed) == 0
            && self.script_deadline.at_ns.load(Ordering::Relaxed) == 0
        {
            return None;
        }
        let now = now_ns();
        self.hook_deadline.check(now).or_else(|| self.script_deadline.check(now))
    }

    /// Asks for a reload at the next step boundary (called by the watcher).
    pub fn request_reload(&self) {
        self.reload_requested.store(true, Ordering::SeqCst);
    }

    /// Takes a pending reload request.
    pub fn take_reload_request(&self) -> bool {
        self.reload_requested.swap(false, Ordering::SeqCst)
    }

    /// Notes a file read by `import`.
    pub fn note_import(&self, p: &Path) {
        if let Ok(mut v) = self.imported.lock() {
            if !v.iter().any(|x| x == p) {
                v.push(p.to_path_buf());
            }
        }
    }

    /// Files read by `import` so far.
    pub fn imported(&self) -> Vec<PathBuf> {
        self.imported.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The folder of the next `train` call: the session's run folder for the
    /// first call (or when `name` is given, `<run folder>/<name>`), then
    /// `<run folder>/run-<k>`; and whether it resumes a run there.
    pub fn next_run_dir(&self, name: Option<&str>) -> (PathBuf, bool) {
        let k = self.trains.fetch_add(1, Ordering::SeqCst);
        let base = self
            .opts
            .run_dir
            .clone()
            .unwrap_or_else(|| default_run_dir(self.script().as_deref(), Path::new("runs")));
        let resume_here = self.opts.resume;
        match name {
            Some(n) => {
                let d = base.join(sanitize(n));
                let resume = resume_here && d.join("run_config.json").exists();
                (d, resume)
            }
            None if k == 0 => {
                let resume = resume_here && base.join("run_config.json").exists();
                (base, resume)
            }
            None => {
                let d = base.join(format!("run-{}", k + 1));
                let resume = resume_here && d.join("run_config.json").exists();
                (d, resume)
            }
        }
    }

    /// The session's base run folder, when known.
    pub fn run_dir(&self) -> Option<PathBuf> {
        self.opts.run_dir.clone()
    }

    /// [`Host::run_dir`] for a script to write into: created with the run marker first
    /// ([`crate::guard::folder::claim_run_folder`]), so that stapo never writes into a
    /// folder it did not create, and files written there before `train` do not make the
    /// run's own folder look foreign.
    pub fn claimed_run_dir(&self) -> crate::Result<Option<PathBuf>> {
        let Some(d) = self.run_dir() else { return Ok(None) };
        crate::guard::folder::claim_run_folder(&d)?;
        Ok(Some(d))
    }

    /// Records the summary of a finished `train`.
    pub fn push_result(&self, m: Map) {
        if let Ok(mut r) = self.results.lock() {
            r.push(m);
        }
    }

    /// Summaries of the finished `train` calls.
    pub fn results(&self) -> Vec<Map> {
        self.results.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Records a script-held run saved after a stop.
    pub fn record_kept(&self, k: KeptRun) {
        if let Ok(mut v) = self.kept.lock() {
            v.push(k);
        }
    }

    /// The script-held runs saved after a stop, in the order the script let go of them.
    pub fn kept_runs(&self) -> Vec<KeptRun> {
        self.kept.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Installs (or removes) the progress bar that `println` prints above.
    pub fn set_progress(&self, pb: Option<ProgressBar>) {
        if let Ok(mut p) = self.progress.lock() {
            *p = pb;
        }
    }

    /// `ARGS` as a Rhai map (values parsed as int, float, bool or string).
    pub fn args_map(&self) -> Map {
        self.opts.args.iter().map(|(k, v)| (k.as_str().into(), parse_cli_value(v))).collect()
    }

    /// `SMOKE` as a Rhai value.
    pub fn smoke_value(&self) -> Dynamic {
        self.opts.smoke.into()
    }
}

/// Keeps folder names to letters, digits, `-`, `_` and `.`.
fn sanitize(s: &str) -> String {
    let t: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if t.is_empty() || t == "." || t == ".." {
        "run".into()
    } else {
        t
    }
}

/// `<parent>/<script stem>-<YYYYmmdd-HHMMSS>` (UTC), with `-2`, `-3` ... when taken.
pub fn default_run_dir(script: Option<&Path>, parent: &Path) -> PathBuf {
    let stem = script
        .and_then(|p| p.file_stem())
        .map(|s| sanitize(&s.to_string_lossy()))
        .unwrap_or_else(|| "repl".into());
    let base = format!("{stem}-{}", timestamp());
    let mut d = parent.join(&base);
    let mut k = 2;
    while d.exists() {
        d = parent.join(format!("{base}-{k}"));
        k += 1;
    }
    d
}

/// The current UTC time as `YYYYmmdd-HHMMSS`.
pub fn timestamp() -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, (rem % 3600) / 60, rem % 60)
}

/// Days since 1970-01-01 to (year, month, day) (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn run_dirs_follow_the_calls() {
        let h = Host::new(
            HostOptions { run_dir: Some("/tmp/x".into()), ..Default::default() },
            Console::Buffer(Default::default()),
        );
        assert_eq!(h.next_run_dir(None).0, PathBuf::from("/tmp/x"));
        assert_eq!(h.next_run_dir(None).0, PathBuf::from("/tmp/x/run-2"));
        assert_eq!(h.next_run_dir(Some("grpo a")).0, PathBuf::from("/tmp/x/grpo_a"));
    }
}
