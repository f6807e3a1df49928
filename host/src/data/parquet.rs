//! Parquet dataset files, as Hugging Face and verl ship them, read row by row
//! with the `parquet` crate's record API (no Arrow) and handed to the same
//! record parser as JSONL ([`super::record`]).
//!
//! Before any row is read the file's schema is checked against the fields the
//! options ask for, so a missing column or a column of the wrong type is one
//! error naming the file and the column (with the columns the file has),
//! rather than one warning per row. Only the top-level columns that some
//! field name refers to are decoded.

use std::path::Path;

use ::parquet::basic::{ConvertedType, LogicalType, Type as Physical};
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::Field;
use ::parquet::schema::types::{Type, TypePtr};
use serde_json::{Map, Number, Value};

use super::record::DatasetOptions;
use crate::{Error, Result};

/// What a field must hold, for the schema check.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    /// A problem: a string or a list (of chat messages).
    Problem,
    /// An answer or an id: a string or a number.
    TextOrNumber,
    /// A source label: a string.
    Text,
}

impl Want {
    fn describe(self) -> &'static str {
        match self {
            Want::Problem => "a string or a list of chat messages",
            Want::TextOrNumber => "a string or a number",
            Want::Text => "a string",
        }
    }
}

fn is_list(t: &Type) -> bool {
    let info = t.get_basic_info();
    info.converted_type() == ConvertedType::LIST || matches!(info.logical_type_ref(), Some(LogicalType::List))
}

fn is_string(t: &Type) -> bool {
    t.is_primitive() && t.get_physical_type() == Physical::BYTE_ARRAY
}

fn is_number(t: &Type) -> bool {
    t.is_primitive()
        && matches!(
            t.get_physical_type(),
            Physical::INT32 | Physical::INT64 | Physical::FLOAT | Physical::DOUBLE
        )
}

/// A schema type in words: `INT64`, `BYTE_ARRAY (STRING)`, `a list`, `a struct`.
fn describe(t: &Type) -> String {
    if t.is_primitive() {
        let info = t.get_basic_info();
        match (info.logical_type_ref(), info.converted_type()) {
            (Some(l), _) => format!("{} ({l:?})", t.get_physical_type()),
            (None, ConvertedType::NONE) => t.get_physical_type().to_string(),
            (None, c) => format!("{} ({c})", t.get_physical_type()),
        }
    } else if is_list(t) {
        "a list".into()
    } else {
        "a struct".into()
    }
}

/// The schema node at a dotted path below `root` (a top-level name with dots wins).
fn schema_at<'a>(root: &'a Type, path: &str) -> Option<&'a Type> {
    let child = |t: &'a Type, name: &str| -> Option<&'a Type> {
        if t.is_primitive() {
            return None;
        }
        t.get_fields().iter().find(|f| f.name() == name).map(|f| f.as_ref())
    };
    if let Some(t) = child(root, path) {
        return Some(t);
    }
    path.split('.').try_fold(root, child)
}

/// The top-level column a field name reads (`reward_model.ground_truth` → `reward_model`).
fn top_level<'a>(root: &Type, path: &'a str) -> &'a str {
    if schema_at(root, path).is_some() && root.get_fields().iter().any(|f| f.name() == path) {
        path
    } else {
        path.split('.').next().unwrap_or(path)
    }
}

/// Checks that the first candidate present in the schema has the wanted type.
/// `required`: no candidate present is an error. Returns the top-level columns used.
fn check_candidates<'a>(
    path: &Path,
    root: &Type,
    role: &str,
    names: &'a [String],
    want: Want,
    required: bool,
) -> Result<Vec<&'a str>> {
    let present: Vec<&String> = names.iter().filter(|n| schema_at(root, n).is_some()).collect();
    let Some(first) = present.first() else {
        if required {
            let cols: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
            return Err(Error::invalid(format!(
                "{}: no {role} column: looked for {names:?}, the file has columns {cols:?} \
                 (name the right one with data.options.{role}_fields in a run config, \
                 --{role}-field on the command line)",
                path.display()
            )));
        }
        return Ok(Vec::new());
    };
    let t = schema_at(root, first).ok_or_else(|| Error::invalid("unreachable: column vanished"))?;
    let ok = match want {
        Want::Problem => is_string(t) || is_list(t),
        Want::TextOrNumber => is_string(t) || is_number(t),
        Want::Text => is_string(t),
    };
    if !ok {
        return Err(Error::invalid(format!(
            "{}: column `{first}` ({role}): expected {}, found {}",
            path.display(),
            want.describe(),
            describe(t)
        )));
    }
    // Later candidates are read too: a row may have the first one null.
    Ok(present.into_iter().map(|n| top_level(root, n)).collect())
}

/// A Parquet value as JSON: groups become objects, lists arrays, binary UTF-8
/// text a string; non-finite floats become null.
fn to_json(f: &Field) -> Value {
    match f {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(x) => Value::from(*x),
        Field::Short(x) => Value::from(*x),
        Field::Int(x) => Value::from(*x),
        Field::Long(x) => Value::from(*x),
        Field::UByte(x) => Value::from(*x),
        Field::UShort(x) => Value::from(*x),
        Field::UInt(x) => Value::from(*x),
        Field::ULong(x) => Value::from(*x),
        Field::Float16(x) => Number::from_f64(f64::from(*x)).map_or(Value::Null, Value::Number),
        Field::Float(x) => Number::from_f64(f64::from(*x)).map_or(Value::Null, Value::Number),
        Field::Double(x) => Number::from_f64(*x).map_or(Value::Null, Value::Number),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match b.as_utf8() {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => Value::Array(b.data().iter().map(|&x| Value::from(x)).collect()),
        },
        Field::Group(row) => {
            Value::Object(row.get_column_iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
        }
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(to_json).collect()),
        Field::MapInternal(map) => Value::Object(
            map.entries()
                .iter()
                .map(|(k, v)| {
                    let key = match to_json(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        // Dates, times and decimals never hold a problem or an answer; keep their text.
        other => Value::String(other.to_string()),
    }
}

/// Streams the rows of a Parquet file to `each(row index, row)` as JSON
/// objects holding the columns the options refer to. Errors name the file
/// (and the column, for schema errors); `each`'s errors pass through.
pub(crate) fn for_each_row(
    path: &Path,
    opts: &DatasetOptions,
    each: &mut dyn FnMut(usize, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    if file.metadata().map(|m| m.len()).unwrap_or(0) == 0 {
        return Err(Error::invalid(format!("{}: empty file (0 bytes)", path.display())));
    }
    let reader = SerializedFileReader::new(file)
        .map_err(|e| Error::invalid(format!("{}: not a readable Parquet file: {e}", path.display())))?;
    let meta = reader.metadata().file_metadata();
    if meta.num_rows() == 0 {
        return Err(Error::invalid(format!("{}: the file has no rows", path.display())));
    }
    let root = meta.schema();
    let mut used: Vec<&str> = Vec::new();
    used.extend(check_candidates(path, root, "problem", &opts.problem_fields, Want::Problem, true)?);
    used.extend(check_candidates(path, root, "answer", &opts.answer_fields, Want::TextOrNumber, true)?);
    used.extend(check_candidates(path, root, "id", &opts.id_fields, Want::TextOrNumber, false)?);
    used.extend(check_candidates(path, root, "source", &opts.source_fields, Want::Text, false)?);
    let fields: Vec<TypePtr> =
        root.get_fields().iter().filter(|f| used.contains(&f.name())).cloned().collect();
    let projection = Type::group_type_builder(root.name())
        .with_fields(fields)
        .build()
        .map_err(|e| Error::invalid(format!("{}: schema projection: {e}", path.display())))?;
    let iter = reader
        .get_row_iter(Some(projection))
        .map_err(|e| Error::invalid(format!("{}: cannot read rows: {e}", path.display())))?;
    for (i, row) in iter.enumerate() {
        let row = row.map_err(|e| Error::invalid(format!("{}: row {i}: {e}", path.display())))?;
        each(i, row.get_column_iter().map(|(k, v)| (k.clone(), to_json(v))).collect())?;
    }
    Ok(())
}
