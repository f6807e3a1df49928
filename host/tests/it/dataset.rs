//! Dataset files as the ecosystem ships them: Parquet files written here with
//! the `parquet` crate's writer (verl's nested schema: `prompt` as a list of
//! chat-message structs, `reward_model` and `extra_info` structs; flat Hugging
//! Face shards in snappy, zstd and gzip), loaded through `Dataset::load`, and
//! the errors a user sees for a missing column, a wrong type and an empty file.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::{Compression, GzipLevel, ZstdLevel};
use parquet::column::writer::ColumnWriter;
use parquet::data_type::ByteArray;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;
use stapo::data::{BadLinePolicy, Dataset, DatasetOptions, Message, DAPO_PREFIX, DAPO_REMINDER};

use crate::common::tempdir;

/// One leaf column's data: values plus definition and repetition levels.
enum Values {
    Text(Vec<&'static str>),
    Owned(Vec<String>),
    Long(Vec<i64>),
}

struct Column {
    values: Values,
    def: Vec<i16>,
    rep: Option<Vec<i16>>,
}

fn text(values: Vec<&'static str>, def: Vec<i16>) -> Column {
    Column { values: Values::Text(values), def, rep: None }
}

/// Writes one row group with the leaf columns in schema order.
fn write_parquet(path: &Path, schema: &str, columns: Vec<Column>, compression: Compression) {
    let schema = Arc::new(parse_message_type(schema).expect("schema"));
    let props = Arc::new(WriterProperties::builder().set_compression(compression).build());
    let file = File::create(path).expect("create");
    let mut writer = SerializedFileWriter::new(file, schema, props).expect("writer");
    let mut rg = writer.next_row_group().expect("row group");
    let mut cols = columns.into_iter();
    while let Some(mut col) = rg.next_column().expect("column") {
        let c = cols.next().expect("data for every leaf column");
        let rep = c.rep.as_deref();
        match (col.untyped(), c.values) {
            (ColumnWriter::ByteArrayColumnWriter(w), Values::Text(v)) => {
                let v: Vec<ByteArray> = v.into_iter().map(ByteArray::from).collect();
                w.write_batch(&v, Some(&c.def), rep).expect("write");
            }
            (ColumnWriter::ByteArrayColumnWriter(w), Values::Owned(v)) => {
                let v: Vec<ByteArray> = v.into_iter().map(|s| ByteArray::from(s.into_bytes())).collect();
                w.write_batch(&v, Some(&c.def), rep).expect("write");
            }
            (ColumnWriter::Int64ColumnWriter(w), Values::Long(v)) => {
                w.write_batch(&v, Some(&c.def), rep).expect("write");
            }
            _ => panic!("column data does not match the schema"),
        }
        col.close().expect("close column");
    }
    rg.close().expect("close row group");
    writer.close().expect("close file");
}

/// verl's schema as pyarrow writes it (3-level list of structs).
const VERL_SCHEMA: &str = "message schema {
    optional binary data_source (STRING);
    optional group prompt (LIST) {
        repeated group list {
            optional group element {
                optional binary content (STRING);
                optional binary role (STRING);
            }
        }
    }
    optional binary ability (STRING);
    optional group reward_model {
        optional binary ground_truth (STRING);
        optional binary style (STRING);
    }
    optional group extra_info {
        optional binary index (STRING);
    }
}";

fn dapo(problem: &str) -> String {
    format!("{DAPO_PREFIX}\n\n{problem}\n\n{DAPO_REMINDER}")
}

/// Three DAPO-Math-style rows; the second has a system turn before the user
/// turn, the third repeats the first (DAPO-Math-17k's parquet repeats rows).
fn write_verl(path: &Path, compression: Compression) {
    let (p0, p1) = (dapo("Find $x$ if $2x = 6$."), dapo("What is $1+1$?"));
    // Leaves of `prompt`: def 4 = element present, rep 1 = next element of the same list.
    let contents = vec![p0.clone(), "Be brief.".into(), p1, p0];
    let columns = vec![
        text(vec!["math_dapo"; 3], vec![1; 3]),
        Column { values: Values::Owned(contents), def: vec![4; 4], rep: Some(vec![0, 0, 1, 0]) },
        Column {
            values: Values::Owned(vec!["user".into(), "system".into(), "user".into(), "user".into()]),
            def: vec![4; 4],
            rep: Some(vec![0, 0, 1, 0]),
        },
        text(vec!["MATH"; 3], vec![1; 3]),
        text(vec!["3", "2", "3"], vec![2; 3]),
        text(vec!["rule-lighteval/MATH_v2"; 3], vec![2; 3]),
        text(vec!["id-a", "id-b", "id-c"], vec![2; 3]),
    ];
    write_parquet(path, VERL_SCHEMA, columns, compression);
}

const FLAT_SCHEMA: &str = "message schema {
    optional binary problem (STRING);
    optional binary answer (STRING);
    optional int64 id;
}";

/// A flat shard: problems `q{first}..`, answers, integer ids.
fn write_flat(path: &Path, first: i64, n: usize, compression: Compression) {
    let ids: Vec<i64> = (first..first + n as i64).collect();
    let problems: Vec<String> = ids.iter().map(|i| format!("q{i}")).collect();
    let answers: Vec<String> = ids.iter().map(|i| format!("{}", i * 10)).collect();
    let columns = vec![
        Column { values: Values::Owned(problems), def: vec![1; n], rep: None },
        Column { values: Values::Owned(answers), def: vec![1; n], rep: None },
        Column { values: Values::Long(ids), def: vec![1; n], rep: None },
    ];
    write_parquet(path, FLAT_SCHEMA, columns, compression);
}

fn err_text(path: impl AsRef<Path>, opts: &DatasetOptions) -> String {
    match Dataset::load(path, opts) {
        Ok((ds, _)) => panic!("expected an error, loaded {} examples", ds.len()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn verl_parquet_loads_with_chat_prompts_nested_answers_and_ids() {
    let dir = tempdir();
    let path = dir.path().join("dapo-math-17k.parquet");
    write_verl(&path, Compression::SNAPPY);

    let (ds, warnings) = Dataset::load(&path, &DatasetOptions::default()).expect("loads");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ds.len(), 3);
    let e = &ds.examples()[1];
    assert_eq!((e.id.as_str(), e.answer.as_str(), e.source.as_str()), ("id-b", "2", "math_dapo"));
    assert_eq!(
        e.messages.as_deref(),
        Some(&[Message::system("Be brief."), Message::user(dapo("What is $1+1$?"))][..])
    );
    // The problem is the last user message, as given (the DAPO instruction included).
    assert_eq!(e.problem, dapo("What is $1+1$?"));

    let opts = DatasetOptions { strip_instruction: true, dedupe: true, ..Default::default() };
    let (ds, _) = Dataset::load(&path, &opts).expect("loads");
    let got: Vec<(&str, &str, &str)> =
        ds.examples().iter().map(|e| (e.id.as_str(), e.problem.as_str(), e.answer.as_str())).collect();
    assert_eq!(got, [("id-a", "Find $x$ if $2x = 6$.", "3"), ("id-b", "What is $1+1$?", "2")]);
}

#[test]
fn hugging_face_shards_in_a_folder_load_as_one_dataset() {
    let dir = tempdir();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("mkdir");
    write_flat(&data.join("train-00000-of-00002.parquet"), 0, 3, Compression::ZSTD(ZstdLevel::default()));
    write_flat(&data.join("train-00001-of-00002.parquet"), 3, 2, Compression::GZIP(GzipLevel::default()));

    // The repository folder (shards under data/), the data folder and a pattern all agree.
    let want: Vec<(String, String, String)> =
        (0..5).map(|i| (i.to_string(), format!("q{i}"), (i * 10).to_string())).collect();
    for path in [dir.path().to_path_buf(), data.clone(), data.join("train-*.parquet")] {
        let (ds, warnings) = Dataset::load(&path, &DatasetOptions::default()).expect("loads");
        assert!(warnings.is_empty());
        let got: Vec<(String, String, String)> =
            ds.examples().iter().map(|e| (e.id.clone(), e.problem.clone(), e.answer.clone())).collect();
        assert_eq!(got, want, "{}", path.display());
        assert_eq!(ds.examples()[4].source, "train-00001-of-00002");
    }

    // A second split makes the folder ambiguous until one is chosen.
    write_flat(&data.join("test-00000-of-00001.parquet"), 100, 1, Compression::UNCOMPRESSED);
    let msg = err_text(dir.path(), &DatasetOptions::default());
    assert!(
        msg.contains("several splits [\"test\", \"train\"]") && msg.contains("data.options.split"),
        "{msg}"
    );
    let test = DatasetOptions { split: Some("test".into()), ..Default::default() };
    let (ds, _) = Dataset::load(dir.path(), &test).expect("test split");
    assert_eq!(ds.examples().iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["100"]);
    let msg =
        err_text(dir.path(), &DatasetOptions { split: Some("validation".into()), ..Default::default() });
    assert!(msg.contains("no files of split \"validation\""), "{msg}");
    let msg = err_text(data.join("dev-*.parquet"), &DatasetOptions::default());
    assert!(msg.contains("dev-*.parquet: no file matches"), "{msg}");
}

#[test]
fn other_layouts_load_through_a_field_mapping() {
    let dir = tempdir();
    let path = dir.path().join("custom.parquet");
    let schema = "message schema {
        optional binary question (STRING);
        optional group meta { optional binary gold (STRING); }
        optional int64 uid;
    }";
    let columns = vec![
        text(vec!["Q0", "Q2"], vec![1, 0, 1]),
        text(vec!["A0", "A1", "A2"], vec![2, 2, 2]),
        Column { values: Values::Long(vec![7, 8, 9]), def: vec![1; 3], rep: None },
    ];
    write_parquet(&path, schema, columns, Compression::SNAPPY);

    // The mapping as a config or `--set data.options.answer_fields=meta.gold` gives it.
    let opts: DatasetOptions = serde_json::from_str(
        r#"{"problem_fields": "question", "answer_fields": "meta.gold", "id_fields": "uid"}"#,
    )
    .expect("options");
    let (ds, warnings) = Dataset::load(&path, &opts).expect("loads");
    let got: Vec<(&str, &str, &str)> =
        ds.examples().iter().map(|e| (e.id.as_str(), e.problem.as_str(), e.answer.as_str())).collect();
    assert_eq!(got, [("7", "Q0", "A0"), ("9", "Q2", "A2")]);
    // The row with a null problem is skipped with a warning naming the file and row ...
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("custom.parquet: row 1: no problem field"), "{}", warnings[0]);
    // ... or stops the load under the reject policy.
    let reject = DatasetOptions { bad_lines: BadLinePolicy::Reject, ..opts.clone() };
    let msg = err_text(&path, &reject);
    assert!(msg.contains("custom.parquet: row 1: no problem field"), "{msg}");
}

#[test]
fn missing_columns_wrong_types_and_empty_files_are_named() {
    let dir = tempdir();
    let p = |name: &str| -> PathBuf { dir.path().join(name) };

    // No answer column under any default name: the error lists the file's columns.
    let no_answer = "message schema { optional binary problem (STRING); optional binary notes (STRING); }";
    write_parquet(
        &p("no_answer.parquet"),
        no_answer,
        vec![text(vec!["q"], vec![1]), text(vec!["n"], vec![1])],
        Compression::SNAPPY,
    );
    let msg = err_text(p("no_answer.parquet"), &DatasetOptions::default());
    assert!(msg.contains("no_answer.parquet: no answer column"), "{msg}");
    assert!(msg.contains("[\"problem\", \"notes\"]") && msg.contains("answer_fields"), "{msg}");
    // The hint names the field's path in the config tree and the flag, not the old flat key.
    assert!(msg.contains("data.options.answer_fields") && msg.contains("--answer-field"), "{msg}");
    assert!(!msg.contains("data_options"), "{msg}");

    // A problem column of numbers.
    let int_problem = "message schema { optional int64 problem; optional binary answer (STRING); }";
    let columns =
        vec![Column { values: Values::Long(vec![5]), def: vec![1], rep: None }, text(vec!["5"], vec![1])];
    write_parquet(&p("int_problem.parquet"), int_problem, columns, Compression::SNAPPY);
    let msg = err_text(p("int_problem.parquet"), &DatasetOptions::default());
    assert!(
        msg.contains("int_problem.parquet: column `problem` (problem): expected a string or a list of chat messages, found INT64"),
        "{msg}"
    );

    // An answer that is a struct, not a value.
    let struct_answer = "message schema { optional binary problem (STRING); optional group answer { optional binary text (STRING); } }";
    write_parquet(
        &p("struct_answer.parquet"),
        struct_answer,
        vec![text(vec!["q"], vec![1]), text(vec!["a"], vec![2])],
        Compression::SNAPPY,
    );
    let msg = err_text(p("struct_answer.parquet"), &DatasetOptions::default());
    assert!(msg.contains("column `answer` (answer): expected a string or a number, found a struct"), "{msg}");

    // Zero bytes, a schema with no rows, and text that is not Parquet.
    File::create(p("empty.parquet")).expect("create");
    let msg = err_text(p("empty.parquet"), &DatasetOptions::default());
    assert!(msg.contains("empty.parquet: empty file"), "{msg}");
    let empty = || Column { values: Values::Owned(Vec::new()), def: Vec::new(), rep: None };
    let columns =
        vec![empty(), empty(), Column { values: Values::Long(Vec::new()), def: Vec::new(), rep: None }];
    write_parquet(&p("no_rows.parquet"), FLAT_SCHEMA, columns, Compression::SNAPPY);
    let msg = err_text(p("no_rows.parquet"), &DatasetOptions::default());
    assert!(msg.contains("no_rows.parquet: the file has no rows"), "{msg}");
    std::fs::write(p("text.parquet"), "{\"problem\": \"q\"}\n").expect("write");
    let msg = err_text(p("text.parquet"), &DatasetOptions::default());
    assert!(msg.contains("text.parquet: not a readable Parquet file"), "{msg}");
    let msg = err_text(dir.path().join("missing.parquet"), &DatasetOptions::default());
    assert!(msg.contains("missing.parquet"), "{msg}");
}
