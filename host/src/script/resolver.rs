//! `import "name" as x;` for scripts: looks for `name.rhai` next to the
//! importing file, then in the running script's folder, then in the stdlib
//! folders (`STAPO_STDLIB` as passed by the CLI, `stdlib/` above the script,
//! `<crate>/../stdlib`).
//!
//! Only relative names without `..` are accepted, so `import` cannot read
//! arbitrary files. Modules are cached by path and modification time: an
//! edited stdlib file is recompiled on its next import (what hot reload
//! needs), an unchanged one is served from the cache.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use rhai::{Engine, EvalAltResult, Module, ModuleResolver, Position, Scope};

/// A compiled module, shared (`rhai::SharedModule` under the `sync` feature).
type SharedModule = Arc<Module>;

use super::error::host_at;
use super::shared_state::Host;

/// A cached module: the file's modification time when compiled, the module, and the
/// newest modification time of what it imports.
type Cached = (SystemTime, SharedModule, Option<SystemTime>);

/// The module resolver of [`super::build_engine`].
pub struct Resolver {
    host: Weak<Host>,
    /// path → (mtime of the loaded version, module, mtime of a version that failed).
    cache: Mutex<HashMap<PathBuf, Cached>>,
}

impl Resolver {
    /// A resolver that reports the files it reads to `host` (for watching).
    pub fn new(host: &Arc<Host>) -> Self {
        Resolver { host: Arc::downgrade(host), cache: Mutex::new(HashMap::new()) }
    }

    /// The folders searched, in order, for an import from `source` (a file path).
    fn search_dirs(&self, source: Option<&str>) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(src) = source {
            if let Some(p) = Path::new(src).parent() {
                dirs.push(p.to_path_buf());
            }
        }
        if let Some(h) = self.host.upgrade() {
            if let Some(s) = h.script() {
                if let Some(p) = s.parent() {
                    dirs.push(p.to_path_buf());
                }
            }
            dirs.extend(h.opts.stdlib_dirs.iter().cloned());
        }
        dirs
    }
}

fn not_found(path: &str, pos: Position) -> Box<EvalAltResult> {
    EvalAltResult::ErrorModuleNotFound(path.to_string(), pos).into()
}

impl ModuleResolver for Resolver {
    fn resolve(
        &self,
        engine: &Engine,
        source: Option<&str>,
        path: &str,
        pos: Position,
    ) -> Result<SharedModule, Box<EvalAltResult>> {
        let rel = Path::new(path);
        if rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(EvalAltResult::ErrorInModule(
                path.to_string(),
                host_at(format!("import \"{path}\": expected a relative name without `..`"), pos),
                pos,
            )
            .into());
        }
        let file_name =
            if rel.extension().is_some() { rel.to_path_buf() } else { rel.with_extension("rhai") };
        let file = self
            .search_dirs(source)
            .into_iter()
            .map(|d| d.join(&file_name))
            .find(|p| p.is_file())
            .ok_or_else(|| not_found(path, pos))?;
        let mtime = std::fs::metadata(&file).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
        if let Some(h) = self.host.upgrade() {
            h.note_import(&file);
        }
        if let Ok(c) = self.cache.lock() {
            if let Some((t, m, failed)) = c.get(&file) {
                if *t == mtime || *failed == Some(mtime) {
                    return Ok(m.clone());
                }
            }
        }
        // Not holding the cache lock here: the module may import others.
        let label = file.display().to_string();
        let text = std::fs::read_to_string(&file).map_err(|_| not_found(path, pos))?;
        let built = engine
            .compile(&text)
            .map_err(|e| {
                Box::new(EvalAltResult::ErrorInModule(
                    label.clone(),
                    EvalAltResult::ErrorParsing(*e.0, e.1).into(),
                    pos,
                ))
            })
            .and_then(|mut ast| {
                ast.set_source(label.as_str());
                Module::eval_ast_as_new(Scope::new(), &ast, engine)
                    .map_err(|e| Box::new(EvalAltResult::ErrorInModule(label.clone(), e, pos)))
            });
        let module: SharedModule = match built {
            Ok(m) => m.into(),
            Err(e) => {
                // A broken edit of a module that loaded before keeps the old
                // version (hot reload must not kill a run); said once per edit.
                let old = self.cache.lock().ok().and_then(|mut c| {
                    let entry = c.get_mut(&file)?;
                    let first = entry.2 != Some(mtime);
                    entry.2 = Some(mtime);
                    Some((entry.1.clone(), first))
                });
                match old {
                    Some((m, first)) => {
                        if first {
                            if let Some(h) = self.host.upgrade() {
                                let err = super::error::from_eval(&label, e);
                                h.notice(&format!(
                                    "{label} no longer compiles, keeping its previous version: {err}"
                                ));
                            }
                        }
                        return Ok(m);
                    }
                    None => return Err(e),
                }
            }
        };
        if let Ok(mut c) = self.cache.lock() {
            c.insert(file, (mtime, module.clone(), None));
        }
        Ok(module)
    }
}

/// The stdlib folders for a script at `script`: `env_dir` (`$STAPO_STDLIB`,
/// which the CLI reads once and passes here, so a test sets it without the
/// environment), the first `stdlib/` found in the script's folder or above
/// it, and `<crate>/../stdlib` (the repository's, when run from a checkout).
pub fn stdlib_dirs(env_dir: Option<&Path>, script: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(p) = env_dir.filter(|p| !p.as_os_str().is_empty()) {
        dirs.push(p.to_path_buf());
    }
    let start =
        script.and_then(|s| s.parent()).map(Path::to_path_buf).or_else(|| std::env::current_dir().ok());
    if let Some(start) = start {
        let start = if start.as_os_str().is_empty() { PathBuf::from(".") } else { start };
        let abs = start.canonicalize().unwrap_or(start);
        for anc in abs.ancestors() {
            let d = anc.join("stdlib");
            if d.is_dir() {
                dirs.push(d);
                break;
            }
        }
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../stdlib");
    if repo.is_dir() {
        dirs.push(repo);
    }
    dirs.dedup();
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_given_stdlib_folder_comes_first() {
        let d = tempfile::tempdir().unwrap();
        let dirs = stdlib_dirs(Some(d.path()), None);
        assert_eq!(dirs.first().map(PathBuf::as_path), Some(d.path()));
        assert!(!stdlib_dirs(Some(Path::new("")), None).contains(&PathBuf::new()));
        assert!(!stdlib_dirs(None, None).iter().any(|p| p == d.path()));
    }
}
