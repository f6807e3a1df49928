//! Small helpers shared across modules: atomic file writes, appended log
//! lines, JSON-lines reading, and the SplitMix64 mix that derives every seed in the crate.

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

/// The SplitMix64 increment (2^64 / golden ratio, odd).
pub const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014; Vigna's `splitmix64.c`): the output of the
/// generator whose state is `x` before the step, i.e. the finaliser applied
/// to `x + GAMMA`. The `k`-th output of the stream seeded with `s` is
/// `splitmix64(s + k * GAMMA)`. A bijection of `u64`, used to derive
/// unrelated seeds from (seed, index) pairs.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(SPLITMIX64_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_published_stream() {
        // Rosetta Code "Pseudo-random numbers/Splitmix64": the first outputs for seed 1234567.
        let expected: [u64; 5] = [
            6457827717110365317,
            3203168211198807973,
            9817491932198370423,
            4593380528125082431,
            16408922859458223821,
        ];
        let got: Vec<u64> = (0..5u64)
            .map(|k| splitmix64(1234567u64.wrapping_add(k.wrapping_mul(SPLITMIX64_GAMMA))))
            .collect();
        assert_eq!(got, expected);
        // Vigna's splitmix64.c from state 0: first output 0xE220A8397B1DCDAF.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }
}
