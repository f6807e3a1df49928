//! Folders stapo writes into, and the rules that keep it from writing over what it
//! does not own:
//!
//! - a run folder carries a marker file ([`RUN_MARKER`]); `stapo run --out DIR` starts a
//!   run only in a new or empty folder ([`claim_new_run_folder`]), so user files are never
//!   overwritten or appended to;
//! - `stapo init --out` and `stapo update --out` refuse an existing non-empty folder
//!   unless `--force`, and `update` refuses `--out` equal to its `--model`
//!   ([`check_output_folder`]);
//! - a run folder is locked while a process trains in it ([`RunLock`]: an advisory
//!   `flock` on [`LOCK_FILE`], which the kernel releases on any exit, `kill -9`
//!   included), so a second process on the same folder fails with the holder's pid
//!   instead of logging steps twice and pruning checkpoints under the first;
//! - the temporary folders of a checkpoint that a killed process was writing
//!   (`checkpoints/.step-NNNNNN.tmp-PID/`, a full model and optimizer state each) are
//!   removed when a run starts or resumes, under the lock ([`remove_leftovers`]).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The marker file of a run folder (its content says which stapo made it).
pub const RUN_MARKER: &str = ".stapo-run";
/// The lock file of a run folder (holds the pid of the process that locked it).
pub const LOCK_FILE: &str = ".stapo-lock";

/// Whether `dir` is a stapo run folder: it has the marker, or (folders made before the
/// marker existed) a `run_config.json`.
pub fn is_run_folder(dir: &Path) -> bool {
    dir.join(RUN_MARKER).is_file() || dir.join("run_config.json").is_file()
}

/// Up to `n` entry names of `dir` (sorted), and how many entries it has.
fn entries(dir: &Path, n: usize) -> Result<(Vec<String>, usize)> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let total = names.len();
    names.truncate(n);
    Ok((names, total))
}

/// `a, b, c (and 4 more)`.
fn listing(dir: &Path) -> Result<String> {
    let (names, total) = entries(dir, 5)?;
    let more =
        if total > names.len() { format!(" (and {} more)", total - names.len()) } else { String::new() };
    Ok(format!("{}{more}", names.join(", ")))
}

/// Makes `dir` the folder of a new run: creates it with the marker. Refuses a folder that
/// already holds a run (resume it instead) and a non-empty folder that is not a stapo
/// run (its files are the user's).
pub fn claim_new_run_folder(dir: &Path) -> Result<()> {
    if dir.join("run_config.json").exists() {
        if holds_unsaved_run(dir) {
            // A run that ended before its first checkpoint: nothing to resume, it starts again.
            return Ok(());
        }
        return Err(Error::invalid(format!(
            "{} already holds a run; resume it (stapo run --resume {}) or pick another folder",
            dir.display(),
            dir.display()
        )));
    }
    if dir.exists() && !dir.is_dir() {
        return Err(Error::invalid(format!(
            "{}: exists and is not a folder; pick another run folder",
            dir.display()
        )));
    }
    if dir.is_dir() && !is_run_folder(dir) && entries(dir, 0)?.1 > 0 {
        return Err(Error::invalid(format!(
            "{} is not empty and is not a stapo run folder (no {RUN_MARKER}); it holds {}. \
             stapo does not write into folders it did not create: pick a new or empty folder",
            dir.display(),
            listing(dir)?
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let text = format!("{{\"made_by\": \"stapo {}\"}}\n", env!("CARGO_PKG_VERSION"));
    crate::files::write_file_atomically(&dir.join(RUN_MARKER), text.as_bytes())
}

/// Whether `dir` holds a run that ended before its first checkpoint (a `run_config.json`
/// and no `checkpoints/latest`): such a run can be started again in its folder, or resumed
/// from step 0.
pub fn holds_unsaved_run(dir: &Path) -> bool {
    dir.join("run_config.json").is_file() && !dir.join("checkpoints/latest").exists()
}

/// Makes `dir` a stapo run folder unless it is one already (a script writing into its run
/// folder before `train` creates the run there): new or empty folders get the marker, a
/// non-empty folder that is not a stapo run is refused as [`claim_new_run_folder`] does.
pub fn claim_run_folder(dir: &Path) -> Result<()> {
    if is_run_folder(dir) {
        return Ok(());
    }
    claim_new_run_folder(dir)
}

/// Checks that `stapo <command>` may write the model folder `out`: never one of its
/// `inputs` (`(flag, path)`, e.g. `("--model", dir)`), and an existing non-empty folder
/// only with `force` (it is then replaced as a whole).
pub fn check_output_folder(out: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<()> {
    for (flag, input) in inputs {
        if same_path(out, input) {
            return Err(Error::invalid(format!(
                "--out {} is the {flag} folder: writing there would replace the input; pick another folder",
                out.display()
            )));
        }
    }
    if out.exists() && !out.is_dir() {
        return Err(Error::invalid(format!("--out {}: exists and is not a folder", out.display())));
    }
    if out.is_dir() && !force && entries(out, 0)?.1 > 0 {
        return Err(Error::invalid(format!(
            "--out {} already exists and holds {}; it would be replaced as a whole. \
             Pick a new folder, or pass --force to replace it",
            out.display(),
            listing(out)?
        )));
    }
    Ok(())
}

/// Whether `a` and `b` name the same existing folder (symlinks and `..` resolved), or the
/// same path when either does not exist.
fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// Removes what a killed process left half-written in run folder `dir`: temporary
/// checkpoint folders (`checkpoints/.step-NNNNNN.tmp-PID/`) and temporary files of the
/// atomic writes (`.NAME.tmp-PID`), in the folder and in `checkpoints/`. Call it holding
/// the run's [`RunLock`] (no live process is writing them). Returns what was removed.
pub fn remove_leftovers(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for d in [dir.to_path_buf(), dir.join("checkpoints")] {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !is_temporary(&name) {
                continue;
            }
            let p = e.path();
            let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            r.map_err(|err| Error::io(&p, err))?;
            removed.push(p);
        }
    }
    removed.sort();
    Ok(removed)
}

/// Cleans up after a process killed while it replaced folder `dir` as a whole (`stapo
/// update --out DIR --force`, `stapo init`, `stapo merge`: the new folder is written as
/// `.DIR.tmp-PID` beside it, the old one moved to `.DIR.old-PID`, then the new one renamed
/// into place). For each such sibling whose process is gone: when `dir` itself is missing
/// (killed between the two renames) the `.old` folder is moved back; every other one is
/// removed. Returns one line per action, for the caller to report.
pub fn recover_folder_leftovers(dir: &Path) -> Result<Vec<String>> {
    let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else { return Ok(Vec::new()) };
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Ok(rd) = std::fs::read_dir(parent) else { return Ok(Vec::new()) };
    let mut found: Vec<(PathBuf, bool)> = rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let rest = n.strip_prefix('.')?.strip_prefix(name.as_str())?;
            let (old, pid) = match (rest.strip_prefix(".old-"), rest.strip_prefix(".tmp-")) {
                (Some(pid), _) => (true, pid),
                (_, Some(pid)) => (false, pid),
                _ => return None,
            };
            let pid: u32 = pid.parse().ok()?;
            (pid != std::process::id() && !process_alive(pid)).then(|| (e.path(), old))
        })
        .collect();
    found.sort();
    let mut done = Vec::new();
    for (p, old) in found {
        if old && !dir.exists() {
            std::fs::rename(&p, dir).map_err(|e| Error::io(&p, e))?;
            done.push(format!(
                "restored {} from {}, left by a process killed while it replaced the folder",
                dir.display(),
                p.display()
            ));
            continue;
        }
        let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        r.map_err(|e| Error::io(&p, e))?;
        done.push(format!("removed {}, left half-written by a killed process", p.display()));
    }
    Ok(done)
}

/// Whether process `pid` exists (on other than Unix: assumed alive, nothing is removed).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        extern "C" {
            fn kill(pid: i32, sig: i32) -> i32;
        }
        let Ok(pid) = i32::try_from(pid) else { return false };
        // SAFETY: signal 0 only checks that the process exists; nothing is sent.
        if unsafe { kill(pid, 0) } == 0 {
            return true;
        }
        // EPERM: it exists, owned by someone else.
        std::io::Error::last_os_error().raw_os_error() == Some(1)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// `.NAME.tmp-PID`: what `write_atomically` and `write_file_atomically` write into
/// before their rename.
fn is_temporary(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else { return false };
    match rest.rsplit_once(".tmp-") {
        Some((stem, pid)) => !stem.is_empty() && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// An advisory lock on a run folder, held while a process trains in it; released when
/// dropped or when the process exits in any way (the kernel drops `flock` locks with the
/// file descriptor).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Locks run folder `dir` (which must exist), writing this process's pid into the lock
    /// file; an error naming the holder's pid when another process holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another process".to_string()
                } else {
                    format!("process {holder}")
                };
                return Err(Error::invalid(format!(
                    "{} is in use: {who} is training in it (it holds the lock {}); wait for it to end \
                     or stop it before running or resuming this folder again",
                    dir.display(),
                    path.display()
                )));
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        let pid = std::process::id().to_string();
        let written = file.set_len(0).and_then(|_| file.seek(SeekFrom::Start(0))).and_then(|_| {
            file.write_all(pid.as_bytes())?;
            file.flush()
        });
        written.map_err(|e| Error::io(&path, e))?;
        Ok(Self { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_a_killed_folder_write_are_restored_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        // A pid that cannot be alive (above the kernel's pid_max).
        let dead = 99_999_999u32;
        std::fs::create_dir_all(dir.path().join(format!(".out.old-{dead}"))).unwrap();
        std::fs::write(dir.path().join(format!(".out.old-{dead}/config.json")), "{}").unwrap();
        std::fs::create_dir_all(dir.path().join(format!(".out.tmp-{dead}"))).unwrap();
        // This process's own are never touched, nor another folder's.
        std::fs::create_dir_all(dir.path().join(format!(".out.tmp-{}", std::process::id()))).unwrap();
        std::fs::create_dir_all(dir.path().join(format!(".outer.tmp-{dead}"))).unwrap();
        let done = recover_folder_leftovers(&out).unwrap();
        assert_eq!(done.len(), 2, "{done:?}");
        assert!(done[0].starts_with("restored") && out.join("config.json").is_file(), "{done:?}");
        assert!(done[1].starts_with("removed") && done[1].contains(".out.tmp-"), "{done:?}");
        assert!(dir.path().join(format!(".out.tmp-{}", std::process::id())).exists());
        assert!(dir.path().join(format!(".outer.tmp-{dead}")).exists());
        // With the folder in place an old copy is removed, not restored.
        std::fs::create_dir_all(dir.path().join(format!(".out.old-{dead}"))).unwrap();
        let done = recover_folder_leftovers(&out).unwrap();
        assert!(done.len() == 1 && done[0].starts_with("removed"), "{done:?}");
    }

    #[test]
    fn temporary_names() {
        assert!(is_temporary(".step-000004.tmp-1234"));
        assert!(is_temporary(".latest.tmp-7"));
        assert!(!is_temporary("step-000004"));
        assert!(!is_temporary(".step-000004.tmp-"));
        assert!(!is_temporary(".step-000004.tmp-12a"));
        assert!(!is_temporary(".tmp-12"));
        assert!(!is_temporary("notes.tmp-12"));
    }
}
