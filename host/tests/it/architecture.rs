//! docs/architecture.md against the code: its update-seam table (between the
//! `BEGIN update file names` / `END update file names` markers) names, per seam of an
//! update, the files of `host/src/train/update/` and the functions and types that hold
//! it. Each named file must exist, and each name must be defined in one of the row's
//! files: `f` as `fn f`, `Type` as a struct, enum or trait, `Type::f` as `fn f` beside
//! an `impl` of `Type` (a folder or a module path such as `dist::Comm` points elsewhere
//! and is not checked). A renamed file or function fails here until the table follows.

use std::path::{Path, PathBuf};

/// The names between backticks in `cell`, in order.
fn ticked(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// True when `code` defines `name` as described in the header.
fn defines(code: &str, name: &str) -> bool {
    let words = |w: &str| code.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|t| t == w);
    let fn_named = |f: &str| code.contains(&format!("fn {f}(")) || code.contains(&format!("fn {f}<"));
    match name.split_once("::") {
        Some((ty, f)) => {
            (code.contains(&format!("impl {ty} "))
                || code.contains(&format!("impl<'a> {ty}<"))
                || code.contains(&format!(" for {ty} "))
                || code.contains(&format!("impl {ty}<")))
                && fn_named(f)
        }
        None if name.starts_with(char::is_uppercase) => {
            ["struct", "enum", "trait", "type"]
                .iter()
                .any(|k| code.contains(&format!("{k} {name} ")) || code.contains(&format!("{k} {name}<")))
                && words(name)
        }
        None => fn_named(name),
    }
}

#[test]
fn the_update_seam_table_names_files_and_functions_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = root.join("../docs/architecture.md");
    let text = std::fs::read_to_string(&page).expect("docs/architecture.md");
    let begin = text.find("<!-- BEGIN update file names -->").expect("the table's BEGIN marker");
    let end = text.find("<!-- END update file names -->").expect("the table's END marker");
    let dir = root.join("src/train/update");
    let mut rows = 0;
    let mut missing = Vec::new();
    for line in text[begin..end].lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() != 3 || cells[0] == "seam" || cells[0].starts_with("---") {
            continue;
        }
        rows += 1;
        let files: Vec<PathBuf> = ticked(cells[1]).iter().map(|f| dir.join(f)).collect();
        assert!(!files.is_empty(), "architecture.md: the row `{}` names no file", cells[0]);
        let mut code = String::new();
        for f in &files {
            match std::fs::read_to_string(f) {
                Ok(t) => code.push_str(&t),
                Err(_) => missing.push(format!("`{}` (row `{}`): no such file", f.display(), cells[0])),
            }
        }
        // A folder (`train/optim/`) or a module path (`dist::Comm`) points elsewhere, not
        // to a definition of this row.
        let elsewhere = |n: &str| n.contains('/') || n.starts_with(char::is_lowercase) && n.contains("::");
        for name in ticked(cells[2]).iter().filter(|n| !elsewhere(n)) {
            if !defines(&code, name) {
                missing.push(format!("`{name}` (row `{}`): not defined in {:?}", cells[0], ticked(cells[1])));
            }
        }
    }
    assert!(rows >= 8, "architecture.md: the update-seam table has {rows} rows; expected one per seam");
    assert!(
        missing.is_empty(),
        "docs/architecture.md's update-seam table is out of date:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_seam_check_sees_a_missing_name() {
    // The check itself: a definition is found, a name absent from the code is not.
    let code = "pub fn score(x: u32) {}\nimpl Cut {\n    fn order(&self) {}\n}\npub struct CorrSums {}\n";
    assert!(defines(code, "score") && defines(code, "Cut::order") && defines(code, "CorrSums"));
    assert!(!defines(code, "scores") && !defines(code, "Span::order") && !defines(code, "Corr"));
}

/// Adding a scheduling policy is one file of `host/src/rollout/scheduler/` and one line
/// of its `policies!` registration, as docs/architecture.md shows: every file there
/// (beside `mod.rs` and the trait's `policy.rs`) is registered by exactly one line
/// `Variant => file::Type;` whose type the file implements `Scheduling` for, every
/// registered file exists, and no `mod file;` line besides the registration declares it.
#[test]
fn a_scheduling_policy_is_one_file_and_one_registration_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("src/rollout/scheduler");
    let registry = std::fs::read_to_string(dir.join("mod.rs")).expect("scheduler/mod.rs");
    let begin = registry.find("\npolicies! {").expect("the policies! registration");
    let end = begin + registry[begin..].find("\n}").expect("its end");
    let lines: Vec<(String, String)> = registry[begin..end]
        .lines()
        .filter_map(|l| {
            let (_, target) = l.trim().strip_suffix(';')?.split_once(" => ")?;
            let (file, ty) = target.split_once("::")?;
            Some((file.to_string(), ty.to_string()))
        })
        .collect();
    assert!(lines.len() >= 2, "continuous and static at least: {lines:?}");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("scheduler/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".rs").map(str::to_owned))
        .filter(|n| n != "mod" && n != "policy")
        .collect();
    files.sort();
    let mut registered: Vec<String> = lines.iter().map(|(f, _)| f.clone()).collect();
    registered.sort();
    assert_eq!(files, registered, "each policy file registered once, each registration a file");
    for (file, ty) in &lines {
        let code = std::fs::read_to_string(dir.join(format!("{file}.rs"))).expect("policy file");
        assert!(
            code.contains(&format!("impl Scheduling for {ty} ")),
            "{file}.rs implements Scheduling for {ty}"
        );
        assert!(
            !registry.contains(&format!("mod {file};")),
            "{file}: declared by its registration line only"
        );
    }
}
