//! Hot reload: watch the script and the files it imports, debounce, and ask
//! the training loop to reload at its next step boundary.
//!
//! As alacritty's config monitor does, the *parent folders* are watched
//! (editors save by writing a new file and renaming it over the old one,
//! which a watch on the file itself would lose), events are filtered by file
//! name, and bursts are debounced (~200 ms) into one request. The watcher
//! never touches the engine: it only sets a flag the loop reads.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use notify::{EventKind, RecursiveMode, Watcher as _};

use super::shared_state::Host;
use crate::{Error, Result};

/// Quiet time after the last change before a reload is requested.
pub const DEBOUNCE: Duration = Duration::from_millis(200);

/// A running watcher; stops when dropped.
pub struct Watcher {
    _inner: notify::RecommendedWatcher,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `parent (canonical) / file name`, which stays stable while an editor
/// replaces the file.
fn norm(p: &Path) -> Option<PathBuf> {
    let name = p.file_name()?;
    let parent = p.parent().filter(|x| !x.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Some(parent.canonicalize().unwrap_or_else(|_| parent.to_path_buf()).join(name))
}

/// True when `p` is the script or one of the files it imported.
fn relevant(host: &Host, p: &Path) -> bool {
    let Some(p) = norm(p) else { return false };
    host.script().iter().chain(host.imported().iter()).filter_map(|f| norm(f)).any(|f| f == p)
}

/// Watches the folders of the script and of its possible imports (`dirs`);
/// changes to the script or to an imported file request a reload on `host`.
pub fn start(host: Arc<Host>, dirs: &[PathBuf]) -> Result<Watcher> {
    let (tx, rx) = mpsc::channel::<notify::Result<notify::Event>>();
    let mut w = notify::recommended_watcher(move |res| {
        let _ = tx.send(res);
    })
    .map_err(|e| Error::invalid(format!("cannot start the file watcher: {e}")))?;
    let mut watched = Vec::new();
    for d in dirs {
        let d = if d.as_os_str().is_empty() { PathBuf::from(".") } else { d.clone() };
        let c = d.canonicalize().unwrap_or(d);
        if c.is_dir() && !watched.contains(&c) {
            w.watch(&c, RecursiveMode::NonRecursive)
                .map_err(|e| Error::invalid(format!("cannot watch {}: {e}", c.display())))?;
            watched.push(c);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name("stapo-watch".into())
        .spawn(move || {
            let mut pending: Option<Instant> = None;
            while !stop2.load(Ordering::SeqCst) {
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(Ok(ev)) => {
                        if !matches!(ev.kind, EventKind::Access(_))
                            && ev.paths.iter().any(|p| relevant(&host, p))
                        {
                            pending = Some(Instant::now());
                        }
                    }
                    Ok(Err(e)) => host.notice(&format!("watch error: {e}")),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
                if pending.is_some_and(|t| t.elapsed() >= DEBOUNCE) {
                    pending = None;
                    host.request_reload();
                }
            }
        })
        .map_err(|e| Error::invalid(format!("cannot start the watcher thread: {e}")))?;
    Ok(Watcher { _inner: w, stop, thread: Some(thread) })
}
