//! File helpers shared across modules: atomic file writes, appended log lines and
//! JSON-lines reading, each error naming the file. Depends on nothing of the crate but
//! [`crate::error`].

use std::io::Write;
use std::path::Path;

use crate::{Error, Result};

/// Writes `bytes` to `path` through a temporary sibling file and a rename, so
/// readers never see a half-written file and a crash leaves the old one.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
    f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Appends one line to `path` and flushes it to disk (metrics logs).
pub fn append_line(path: &Path, line: &str) -> Result<()> {
    let mut f =
        std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| Error::io(path, e))?;
    writeln!(f, "{line}").map_err(|e| Error::io(path, e))?;
    f.sync_data().map_err(|e| Error::io(path, e))
}

/// Reads a JSON-lines file, one `T` per non-blank line; a bad line is an
/// error naming the file and the line.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::Parse {
                path: path.into(),
                line: i + 1,
                msg: e.to_string(),
            })
        })
        .collect()
}
