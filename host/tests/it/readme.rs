//! The README's commands run as written: `.ci/readme-commands` runs them all in CI; this
//! test runs the one that used to fail on the bundled model, `stapo eval` with its default
//! response budget (1024 tokens, more than the model's 512 positions), which is now
//! clamped to what fits, with a note.

use std::path::Path;
use std::process::Command;

use crate::common::tempdir;

#[test]
fn readme_eval_command_runs_as_written_on_the_bundled_model() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let line = readme
        .lines()
        .find_map(|l| l.strip_prefix("    stapo eval "))
        .expect("README.md shows a `stapo eval` command");
    let args = line.split('#').next().unwrap().split_whitespace();
    // A scratch folder that sees the repository's models/ and data/ (eval writes
    // eval-samples.jsonl where it runs).
    let dir = tempdir();
    for d in ["models", "data"] {
        std::os::unix::fs::symlink(root.join(d), dir.path().join(d)).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_stapo"))
        .arg("eval")
        .args(args)
        .args(["--limit", "1"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "stapo eval {line}: {err}");
    assert!(err.contains("note: --max-tokens is") && err.contains("512 positions"), "{err}");
    assert!(dir.path().join("eval-samples.jsonl").is_file());
}
