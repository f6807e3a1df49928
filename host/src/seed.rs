//! The SplitMix64 mix that derives every seed in the crate from (seed, index) pairs.
//! Depends on nothing of the crate.

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
