//! TensorBoard event files: every metric of a run as a scalar, readable by
//! TensorBoard (and by W&B, which imports TensorBoard logs) without any
//! TensorFlow or Python at run time.
//!
//! The format, written here by hand: a file of TFRecords, each
//! `u64 length | u32 masked_crc32c(length) | payload | u32 masked_crc32c(payload)`
//! (little-endian), whose payloads are serialized `tensorflow.Event` protobufs:
//! `wall_time` (double, field 1), `step` (int64, 2), `file_version` (string, 3,
//! first event only), `summary` (5) holding `Summary.Value { tag (1),
//! simple_value (float, 2) }`, and `source_metadata` (10) naming the writer.
//! Fields are encoded as proto3 does (a zero `step` is left out), so that a
//! scalar event is byte for byte what TensorBoard's own writer produces
//! (checked against a fixture written by it, `host/tests/fixtures/tensorboard/`).
//!
//! [`EventWriter`] is the file; [`Board`] turns the trainer's JSON rows
//! (`metrics.jsonl`, `eval.jsonl`) into scalars under `stapo/...`, plus verl's
//! metric names as aliases where stapo computes the same quantity.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::{Error, Result};

/// One open event file. Every record is written whole and flushed at once, so
/// a crash loses nothing already logged.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it, named as TensorFlow
    /// names them (`events.out.tfevents.<secs>.<host>`, TensorBoard reads every
    /// file with `tfevents` in its name), and writes the file-version event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let now = wall_time();
        let base = format!("events.out.tfevents.{:010}.{}", now as u64, hostname());
        // A second writer in the same second (a resumed run) gets its own file.
        for n in 0.. {
            let name = if n == 0 { base.clone() } else { format!("{base}.{n}") };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => {
                    let mut w = Self { file, path };
                    let mut ev = event_head(now, 0);
                    put_bytes(&mut ev, 3, b"brain.Event:2");
                    let mut source = Vec::new();
                    put_bytes(&mut source, 1, b"stapo");
                    put_bytes(&mut ev, 10, &source);
                    w.write_record(&ev)?;
                    return Ok(w);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        unreachable!("the loop above only ends by returning")
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Logs `value` as scalar `tag` at `step`.
    pub fn scalar(&mut self, tag: &str, step: i64, value: f32) -> Result<()> {
        self.write_record(&scalar_event(wall_time(), tag, step, value))
    }

    fn write_record(&mut self, payload: &[u8]) -> Result<()> {
        let rec = record(payload);
        self.file.write_all(&rec).and_then(|_| self.file.flush()).map_err(|e| Error::io(&self.path, e))
    }
}

/// The serialized `Event` of one scalar (public for the fixture test).
pub fn scalar_event(wall_time: f64, tag: &str, step: i64, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    put_bytes(&mut v, 1, tag.as_bytes());
    put_key(&mut v, 2, 5);
    v.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    put_bytes(&mut summary, 1, &v);
    let mut ev = event_head(wall_time, step);
    put_bytes(&mut ev, 5, &summary);
    ev
}

/// A TFRecord: the payload framed by its length and two masked CRC32Cs.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

/// TFRecord's checksum: CRC-32C rotated and offset, so that a CRC of data that
/// itself holds CRCs is not degenerate.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bytewise with a table.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// `wall_time` and `step` of an `Event`; proto3 leaves out a zero step.
fn event_head(wall_time: f64, step: i64) -> Vec<u8> {
    let mut ev = Vec::new();
    put_key(&mut ev, 1, 1);
    ev.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        put_key(&mut ev, 2, 0);
        put_varint(&mut ev, step as u64);
    }
    ev
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A field key: field number and wire type (0 varint, 1 64-bit, 2 bytes, 5 32-bit).
fn put_key(out: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(out, ((field << 3) | wire) as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The host name for the file name (kept to characters safe in a path).
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let name: String =
        raw.trim().chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')).collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// verl's names for the step metrics stapo computes the same way: (verl tag,
/// stapo field). `critic/score/mean` is the mean raw reward, which is
/// `accuracy` while rewards are 0/1 (the verifier's); `reward_mean` is after
/// the objective's scale and overlong shaping, verl's token-level rewards.
/// `actor/pg_clipfrac` (the sum of both clip sides) is added in [`Board::metrics`].
/// Not aliased: `loss` (verl's `actor/pg_loss` is the policy term alone) and
/// `approx_kl` (k3; verl's `actor/ppo_kl` is k1). Fields of nested objects are
/// named by their path (`rollout_corr/kl`); `rollout_corr/seq_outside_fraction` is
/// not aliased, being verl's `rollout_rs_seq_masked_fraction` only under seq-MIS.
const VERL_ALIASES: &[(&str, &str)] = &[
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("actor/lr", "lr"),
    ("critic/score/mean", "accuracy"),
    ("critic/rewards/mean", "reward_mean"),
    ("response_length/mean", "response_len_mean"),
    ("response_length/max", "response_len_max"),
    ("response_length/clip_ratio", "truncation_rate"),
    ("timing_s/gen", "rollout_secs"),
    ("timing_s/update_actor", "update_secs"),
    ("timing_s/wait_prev_gen", "async/wait_rollout_secs"),
    ("rollout_corr/kl", "rollout_corr/kl"),
    ("rollout_corr/k3_kl", "rollout_corr/k3_kl"),
    ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_mean"),
    ("rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/fraction_high"),
];

/// A run's TensorBoard log (`<run>/tb/`), opened at the first scalar so that a
/// rank that never logs creates no file. A resumed run writes a new file; the
/// steps it runs again replace those of the earlier files, as in metrics.jsonl
/// (see [`Board::metrics`]).
pub struct Board {
    dir: PathBuf,
    writer: Option<EventWriter>,
    /// Whether earlier files were already cleared of the steps this run logs again.
    replaced: bool,
}

impl Board {
    /// The log of the run in `run_dir` (nothing is written yet).
    pub fn new(run_dir: &Path) -> Self {
        Self { dir: run_dir.join("tb"), writer: None, replaced: false }
    }

    /// Logs `value` as scalar `tag` at `step`.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> Result<()> {
        let w = match &mut self.writer {
            Some(w) => w,
            None => self.writer.insert(EventWriter::create(&self.dir)?),
        };
        w.scalar(tag, step as i64, value as f32)
    }

    /// One `metrics.jsonl` row: every number in it as `stapo/<field>` at its
    /// `step`, and the verl aliases. The first row of a resumed run first drops
    /// the step rows from that step on from the earlier files (the steps logged
    /// after the checkpoint, run again now; evaluations stay, as in eval.jsonl).
    pub fn metrics(&mut self, row: &impl Serialize) -> Result<()> {
        let row = serde_json::to_value(row).map_err(|e| Error::invalid(e.to_string()))?;
        let step = row["step"].as_u64().unwrap_or(0);
        if !self.replaced {
            self.drop_rows_from(step)?;
            self.replaced = true;
        }
        let mut scalars = Vec::new();
        flatten("stapo", &row, &mut scalars);
        scalars.retain(|(tag, _)| tag != "stapo/step");
        for (verl, field) in VERL_ALIASES {
            if let Some(v) = row.pointer(&format!("/{field}")).and_then(|v| v.as_f64()) {
                scalars.push((verl.to_string(), v));
            }
        }
        if let (Some(lo), Some(hi)) = (row["clip_frac_low"].as_f64(), row["clip_frac_high"].as_f64()) {
            scalars.push(("actor/pg_clipfrac".into(), lo + hi));
        }
        scalars.into_iter().try_for_each(|(tag, v)| self.scalar(&tag, step, v))
    }

    /// One evaluation (an `EvalReport`: `overall` and `by_source` scores) at
    /// `step`: every number as `stapo/eval/...`, and verl's
    /// `val-core/<source>/reward/mean@<n>` for each source's avg@n.
    pub fn eval(&mut self, step: u64, report: &impl Serialize) -> Result<()> {
        let report = serde_json::to_value(report).map_err(|e| Error::invalid(e.to_string()))?;
        let mut scalars = Vec::new();
        flatten("stapo/eval", &report, &mut scalars);
        if let Some(sources) = report["by_source"].as_object() {
            for (src, s) in sources {
                if let (Some(avg), Some(n)) = (s["avg"].as_f64(), s["samples_per_problem"].as_u64()) {
                    scalars.push((format!("val-core/{src}/reward/mean@{n}"), avg));
                }
            }
        }
        scalars.into_iter().try_for_each(|(tag, v)| self.scalar(&tag, step, v))
    }
}

impl Board {
    /// Rewrites (atomically) each earlier event file in the folder without its
    /// step-row scalars at `step` or later. Complete records are kept as they
    /// are; a torn last record (a crash mid-write) is dropped.
    fn drop_rows_from(&self, step: u64) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Ok(()) };
        for entry in entries {
            let path = entry.map_err(|e| Error::io(&self.dir, e))?.path();
            let is_events = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains("tfevents"));
            if !is_events || self.writer.as_ref().is_some_and(|w| w.path() == path) {
                continue;
            }
            let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            let (records, whole) = split_records(&bytes);
            let kept: Vec<&[u8]> = records
                .iter()
                .copied()
                .filter(|p| !(scalar_of(p).is_some_and(|(tag, s)| s >= step && is_step_row(&tag))))
                .collect();
            if kept.len() < records.len() || !whole {
                crate::files::write_file_atomically(
                    &path,
                    &kept.iter().flat_map(|p| record(p)).collect::<Vec<_>>(),
                )?;
            }
        }
        Ok(())
    }
}

/// Whether `tag` comes from a metrics.jsonl row (not from an evaluation).
fn is_step_row(tag: &str) -> bool {
    !(tag.starts_with("stapo/eval/") || tag.starts_with("val-core/"))
}

/// The payloads of the complete, checksum-valid records at the start of
/// `bytes`, and whether that was all of it.
fn split_records(bytes: &[u8]) -> (Vec<&[u8]>, bool) {
    let (mut i, mut out) = (0, Vec::new());
    while bytes.len() - i >= 12 {
        let len_bytes = &bytes[i..i + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default()) as usize;
        let crc =
            |at: usize| bytes.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()));
        if crc(i + 8) != Some(masked_crc32c(len_bytes)) || len > bytes.len() - i - 12 {
            break;
        }
        let payload = &bytes[i + 12..i + 12 + len];
        if crc(i + 12 + len) != Some(masked_crc32c(payload)) {
            break;
        }
        out.push(payload);
        i += 16 + len;
    }
    (out, i == bytes.len())
}

/// The `(tag, step)` of an event holding one scalar, as [`scalar_event`] writes them.
fn scalar_of(payload: &[u8]) -> Option<(String, u64)> {
    let (mut step, mut tag) = (0, None);
    for (field, value) in Fields(payload) {
        match (field, value) {
            (2, Field::Varint(s)) => step = s,
            (5, Field::Bytes(summary)) => {
                for (f, v) in Fields(summary) {
                    if let (1, Field::Bytes(value)) = (f, v) {
                        for (vf, x) in Fields(value) {
                            if let (1, Field::Bytes(t)) = (vf, x) {
                                tag = Some(String::from_utf8_lossy(t).into_owned());
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    tag.map(|t| (t, step))
}

/// A protobuf field's value by wire type (fixed-size values are not needed here).
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a protobuf message; stops at the first malformed one.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = (u64, Field<'a>);

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.0;
        let mut i = 0;
        let mut varint = || {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let x = *b.get(i)?;
                i += 1;
                v |= ((x & 0x7f) as u64).checked_shl(shift)?;
                if x & 0x80 == 0 {
                    return Some(v);
                }
                shift += 7;
            }
        };
        let key = varint()?;
        let value = match key & 7 {
            0 => Field::Varint(varint()?),
            2 => {
                let n = varint()? as usize;
                let bytes = b.get(i..i.checked_add(n)?)?;
                i += n;
                Field::Bytes(bytes)
            }
            1 => {
                i += 8;
                Field::Fixed
            }
            5 => {
                i += 4;
                Field::Fixed
            }
            _ => return None,
        };
        self.0 = b.get(i..)?;
        Some((key >> 3, value))
    }
}

/// Every number in `v` with its path under `prefix` (`a/b/c`); other values
/// (strings, lists, null) are not scalars and are skipped.
fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Number(n) => out.extend(n.as_f64().map(|x| (prefix.to_string(), x))),
        Value::Bool(b) => out.push((prefix.to_string(), f64::from(u8::from(*b)))),
        Value::Object(m) => m.iter().for_each(|(k, x)| flatten(&format!("{prefix}/{k}"), x, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal TFRecord + `Event` reader written from the format's
    /// description, independent of the writer above: it checks both CRCs of
    /// every record and decodes the fields by wire type.
    #[derive(Debug, Default, PartialEq)]
    struct Ev {
        wall_time: f64,
        step: i64,
        file_version: Option<String>,
        writer: Option<String>,
        values: Vec<(String, f32)>,
    }

    /// Bitwise CRC-32C straight from the definition (no table).
    fn crc32c_slow(data: &[u8]) -> u32 {
        let mut c = 0xffff_ffffu32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 == 1 { (c >> 1) ^ 0x82f6_3b78 } else { c >> 1 };
            }
        }
        !c
    }

    fn masked(data: &[u8]) -> u32 {
        let c = crc32c_slow(data);
        c.rotate_right(15).wrapping_add(0xa282_ead8)
    }

    fn varint(b: &[u8], i: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let x = b[*i];
            *i += 1;
            v |= ((x & 0x7f) as u64) << shift;
            if x & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }

    /// (field, wire type, raw bytes or value as u64) of every field of a message.
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let (mut i, mut out) = (0, Vec::new());
        while i < b.len() {
            let key = varint(b, &mut i);
            let (field, wire) = (key >> 3, key & 7);
            let raw = match wire {
                0 => varint(b, &mut i).to_le_bytes().to_vec(),
                1 => {
                    i += 8;
                    b[i - 8..i].to_vec()
                }
                2 => {
                    let n = varint(b, &mut i) as usize;
                    i += n;
                    b[i - n..i].to_vec()
                }
                5 => {
                    i += 4;
                    b[i - 4..i].to_vec()
                }
                w => panic!("unexpected wire type {w}"),
            };
            out.push((field, wire, raw));
        }
        out
    }

    pub(crate) fn read_records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let (mut i, mut out) = (0, Vec::new());
        while i < bytes.len() {
            let len_bytes = &bytes[i..i + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap());
            assert_eq!(len_crc, masked(len_bytes), "length crc of the record at byte {i}");
            let payload = &bytes[i + 12..i + 12 + len];
            let crc = u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked(payload), "payload crc of the record at byte {i}");
            out.push(payload.to_vec());
            i += 16 + len;
        }
        out
    }

    fn decode(payload: &[u8]) -> Ev {
        let mut ev = Ev::default();
        for (field, wire, raw) in fields(payload) {
            match (field, wire) {
                (1, 1) => ev.wall_time = f64::from_le_bytes(raw.try_into().unwrap()),
                (2, 0) => ev.step = u64::from_le_bytes(raw.try_into().unwrap()) as i64,
                (3, 2) => ev.file_version = Some(String::from_utf8(raw).unwrap()),
                (10, 2) => ev.writer = Some(String::from_utf8(fields(&raw)[0].2.clone()).unwrap()),
                (5, 2) => {
                    for (f, _, value) in fields(&raw) {
                        assert_eq!(f, 1, "Summary holds only values");
                        let (mut tag, mut x) = (String::new(), f32::NAN);
                        for (vf, vw, vr) in fields(&value) {
                            match (vf, vw) {
                                (1, 2) => tag = String::from_utf8(vr).unwrap(),
                                (2, 5) => x = f32::from_le_bytes(vr.try_into().unwrap()),
                                other => panic!("unexpected Summary.Value field {other:?}"),
                            }
                        }
                        ev.values.push((tag, x));
                    }
                }
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        ev
    }

    fn events(path: &Path) -> Vec<Ev> {
        read_records(&std::fs::read(path).unwrap()).iter().map(|p| decode(p)).collect()
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720, iSCSI).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c_slow(b"123456789"), 0xe306_9283);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(crc32c(&data), crc32c_slow(&data));
        assert_eq!(masked_crc32c(&data), masked(&data));
    }

    #[test]
    fn writes_events_an_independent_reader_decodes() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalar("loss", 0, 0.5).unwrap();
        w.scalar("actor/entropy", 3, -1.25).unwrap();
        w.scalar("big", 1 << 40, 3.0e7).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents.") && name.contains(&hostname()), "{name}");
        // Written and flushed already: read without dropping the writer.
        let evs = events(w.path());
        assert_eq!(evs.len(), 4);
        assert_eq!(evs[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(evs[0].writer.as_deref(), Some("stapo"));
        assert!(evs[0].values.is_empty() && evs[0].step == 0);
        let got: Vec<(i64, String, f32)> =
            evs[1..].iter().map(|e| (e.step, e.values[0].0.clone(), e.values[0].1)).collect();
        assert_eq!(
            got,
            [(0, "loss".into(), 0.5), (3, "actor/entropy".into(), -1.25), (1 << 40, "big".into(), 3.0e7)]
        );
        let now = wall_time();
        assert!(evs.iter().all(|e| e.wall_time > now - 60.0 && e.wall_time <= now && e.values.len() <= 1));
        // A second writer in the same folder gets its own file.
        let w2 = EventWriter::create(dir.path()).unwrap();
        assert_ne!(w2.path(), w.path());
    }

    /// Without its `wall_time` (field 1), which differs between any two writers.
    fn without_wall_time(payload: &[u8]) -> Vec<u8> {
        assert_eq!(payload[0], 0x09, "wall_time comes first");
        payload[9..].to_vec()
    }

    #[test]
    fn scalars_equal_tensorboards_own_writer_byte_for_byte() {
        // Written by tensorboard 2.21.0's EventFileWriter (fixtures/README.md).
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard/reference.tfevents");
        let bytes = std::fs::read(&path).unwrap();
        let records = read_records(&bytes);
        let evs: Vec<Ev> = records.iter().map(|p| decode(p)).collect();
        assert_eq!(evs[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(evs[0].writer.as_deref(), Some("tensorboard.summary.writer.event_file_writer"));
        let scalars: [(&str, i64, f32); 5] = [
            ("stapo/loss", 0, 0.5),
            ("actor/entropy", 1, 1.25),
            ("critic/score/mean", 7, 0.0),
            ("response_length/mean", 1_000_000, -3.5e-8),
            ("val-core/gsm8k/reward/mean@4", 1 << 40, 123_456.79),
        ];
        assert_eq!(records.len(), 1 + scalars.len());
        for (i, ((tag, step, value), theirs)) in scalars.iter().zip(&records[1..]).enumerate() {
            assert_eq!(evs[i + 1].wall_time, 1.7e9 + i as f64);
            let ours = scalar_event(1.7e9 + i as f64, tag, *step, *value);
            // Same wall time given: the whole payload and record are equal too.
            assert_eq!(&ours, theirs, "{tag}");
            assert_eq!(
                without_wall_time(&scalar_event(wall_time(), tag, *step, *value)),
                without_wall_time(theirs)
            );
        }
        // The file-version events differ only in wall_time and the writer's name.
        let dir = tempfile::tempdir().unwrap();
        let w = EventWriter::create(dir.path()).unwrap();
        let ours = read_records(&std::fs::read(w.path()).unwrap()).remove(0);
        let swap = |p: &[u8], name: &str| {
            let mut d = decode(p);
            d.wall_time = 0.0;
            d.writer = Some(name.into());
            d
        };
        assert_eq!(swap(&ours, "w"), swap(&records[0], "w"));
    }

    #[test]
    fn a_resumed_run_replaces_the_steps_it_runs_again() {
        let dir = tempfile::tempdir().unwrap();
        let row = |step: u64, loss: f64| serde_json::json!({"step": step, "loss": loss});
        let eval = serde_json::json!({"overall": {"avg": 0.5}, "by_source": {}});
        let mut first = Board::new(dir.path());
        for s in 0..3 {
            first.metrics(&row(s, s as f64)).unwrap();
        }
        first.eval(2, &eval).unwrap();
        first.metrics(&row(3, 3.0)).unwrap();
        let old = first.writer.as_ref().unwrap().path().to_path_buf();
        drop(first);
        // A crash tore the last record.
        let mut f = OpenOptions::new().append(true).open(&old).unwrap();
        f.write_all(&record(&scalar_event(9.0, "stapo/loss", 4, 4.0))[..20]).unwrap();
        drop(f);
        // Resumed from the checkpoint at step 2: step 2 runs again, with another loss.
        let mut resumed = Board::new(dir.path());
        resumed.metrics(&row(2, 20.0)).unwrap();
        let new = resumed.writer.as_ref().unwrap().path().to_path_buf();
        assert_ne!(new, old);
        let summary = |p: &Path| -> Vec<(i64, String, f32)> {
            events(p)[1..].iter().map(|e| (e.step, e.values[0].0.clone(), e.values[0].1)).collect()
        };
        let t = |s: i64, tag: &str, v: f32| (s, tag.to_string(), v);
        assert_eq!(
            summary(&old),
            [t(0, "stapo/loss", 0.0), t(1, "stapo/loss", 1.0), t(2, "stapo/eval/overall/avg", 0.5)]
        );
        assert_eq!(summary(&new), [t(2, "stapo/loss", 20.0)]);
        assert_eq!(events(&old)[0].file_version.as_deref(), Some("brain.Event:2"));
    }

    #[test]
    fn a_corrupted_byte_fails_the_reader_crc() {
        let mut rec = record(&scalar_event(1.0, "x", 1, 2.0));
        assert_eq!(read_records(&rec).len(), 1);
        let n = rec.len();
        rec[n - 6] ^= 1;
        assert!(std::panic::catch_unwind(|| read_records(&rec)).is_err());
    }

    #[test]
    fn board_logs_metric_rows_with_verl_aliases_and_evals() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Board::new(dir.path());
        let row = serde_json::json!({"step": 2, "lr": 1e-6, "loss": 0.25, "entropy": 1.5, "accuracy": 0.75,
            "reward_mean": 0.5, "clip_frac_low": 0.125, "clip_frac_high": 0.25, "response_len_max": 40,
            "tau_h": null, "warnings": ["w"], "silenced_tokens_text": [["a", 1]],
            "rollout_corr": {"kl": 0.5, "fraction_high": 0.25}});
        b.metrics(&row).unwrap();
        let report = serde_json::json!({"overall": {"avg": 0.5, "pass": 0.75, "samples_per_problem": 4},
            "by_source": {"gsm8k": {"avg": 0.25, "pass": 0.5, "samples_per_problem": 4}}});
        b.eval(5, &report).unwrap();
        let files: Vec<_> =
            std::fs::read_dir(dir.path().join("tb")).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1);
        let got: Vec<(i64, String, f32)> =
            events(&files[0])[1..].iter().map(|e| (e.step, e.values[0].0.clone(), e.values[0].1)).collect();
        let want: Vec<(i64, String, f32)> = [
            (2, "stapo/lr", 1e-6),
            (2, "stapo/loss", 0.25),
            (2, "stapo/entropy", 1.5),
            (2, "stapo/accuracy", 0.75),
            (2, "stapo/reward_mean", 0.5),
            (2, "stapo/clip_frac_low", 0.125),
            (2, "stapo/clip_frac_high", 0.25),
            (2, "stapo/response_len_max", 40.0),
            (2, "actor/entropy", 1.5),
            (2, "actor/lr", 1e-6),
            (2, "critic/score/mean", 0.75),
            (2, "critic/rewards/mean", 0.5),
            (2, "response_length/max", 40.0),
            (2, "actor/pg_clipfrac", 0.375),
            (2, "stapo/rollout_corr/kl", 0.5),
            (2, "stapo/rollout_corr/fraction_high", 0.25),
            (2, "rollout_corr/kl", 0.5),
            (2, "rollout_corr/rollout_is_ratio_fraction_high", 0.25),
            (5, "stapo/eval/overall/avg", 0.5),
            (5, "stapo/eval/overall/pass", 0.75),
            (5, "stapo/eval/overall/samples_per_problem", 4.0),
            (5, "stapo/eval/by_source/gsm8k/avg", 0.25),
            (5, "stapo/eval/by_source/gsm8k/pass", 0.5),
            (5, "stapo/eval/by_source/gsm8k/samples_per_problem", 4.0),
            (5, "val-core/gsm8k/reward/mean@4", 0.25),
        ]
        .into_iter()
        .map(|(s, t, v)| (s, t.to_string(), v as f32))
        .collect();
        let (mut got_sorted, mut want_sorted) = (got.clone(), want.clone());
        let key = |a: &(i64, String, f32), b: &(i64, String, f32)| (a.0, &a.1).cmp(&(b.0, &b.1));
        got_sorted.sort_by(key);
        want_sorted.sort_by(key);
        assert_eq!(got_sorted, want_sorted);
    }
}
