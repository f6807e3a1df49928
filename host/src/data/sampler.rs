//! The seeded epoch sampler that feeds training: it walks a fresh
//! permutation of the dataset every epoch, seeded by `(seed, epoch)`, so a run
//! restored from its [`SamplerState`] continues with exactly the batches it
//! would have drawn (for the same `rand` version).
//!
//! Named `EpochSampler` to keep it apart from `rollout::Sampler`, which picks
//! tokens.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The serialisable state of an [`EpochSampler`]: enough to continue exactly where
/// it stopped. The permutation itself is recomputed from `(seed, epoch)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Base seed of the run.
    pub seed: u64,
    /// Dataset length the sampler was built for (checked on restore).
    pub len: usize,
    /// Whether epochs are shuffled (`false`: file order every epoch).
    pub shuffle: bool,
    /// Current epoch, from 0.
    pub epoch: u64,
    /// Next position inside the current epoch's order.
    pub pos: usize,
}

/// An endless stream of example indices: each epoch visits every index once,
/// in an order shuffled from `(seed, epoch)`. A batch that runs past the end
/// of an epoch continues into the next one, so every batch has the size asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SamplerState", into = "SamplerState")]
pub struct EpochSampler {
    state: SamplerState,
    order: Vec<usize>,
}

impl From<EpochSampler> for SamplerState {
    fn from(s: EpochSampler) -> Self {
        s.state
    }
}

impl TryFrom<SamplerState> for EpochSampler {
    type Error = Error;
    fn try_from(state: SamplerState) -> Result<Self> {
        if state.len == 0 {
            return Err(Error::invalid("sampler: dataset is empty"));
        }
        if state.pos > state.len {
            return Err(Error::invalid(format!(
                "sampler state: position {} is past the epoch length {}",
                state.pos, state.len
            )));
        }
        let order = epoch_order(state.seed, state.epoch, state.len, state.shuffle);
        Ok(EpochSampler { state, order })
    }
}

/// The index order of one epoch. The epoch is mixed into the seed with a
/// SplitMix64 step so neighbouring (seed, epoch) pairs give unrelated orders.
fn epoch_order(seed: u64, epoch: u64, len: usize, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let z =
            crate::seed::splitmix64(seed ^ epoch.wrapping_add(1).wrapping_mul(crate::seed::SPLITMIX64_GAMMA));
        order.shuffle(&mut StdRng::seed_from_u64(z));
    }
    order
}

impl EpochSampler {
    /// A shuffling sampler over `len` examples, at epoch 0, position 0.
    pub fn new(len: usize, seed: u64) -> Result<Self> {
        SamplerState { seed, len, shuffle: true, epoch: 0, pos: 0 }.try_into()
    }

    /// A sampler that yields file order every epoch (for evaluation).
    pub fn sequential(len: usize) -> Result<Self> {
        SamplerState { seed: 0, len, shuffle: false, epoch: 0, pos: 0 }.try_into()
    }

    /// Restores a saved state; `len` is the current dataset's length, which
    /// must equal the one the state was saved with.
    pub fn restore(state: SamplerState, len: usize) -> Result<Self> {
        if state.len != len {
            return Err(Error::invalid(format!(
                "sampler state was saved for {} examples, dataset has {len}",
                state.len
            )));
        }
        state.try_into()
    }

    /// The state to save in a checkpoint.
    pub fn state(&self) -> SamplerState {
        self.state
    }

    /// The current epoch (0-based). It advances when the last index of an epoch is handed out.
    pub fn epoch(&self) -> u64 {
        self.state.epoch
    }

    /// How many indices of the current epoch were handed out.
    pub fn position(&self) -> usize {
        self.state.pos
    }

    /// Dataset length.
    pub fn len(&self) -> usize {
        self.state.len
    }

    /// Never true: a sampler cannot be built over an empty dataset.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// The next `n` indices (`n > len` repeats indices across epochs).
    pub fn next_batch(&mut self, n: usize) -> Result<Vec<usize>> {
        if n == 0 {
            return Err(Error::invalid("sampler: batch size must be at least 1"));
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.state.pos == self.state.len {
                self.state.epoch += 1;
                self.state.pos = 0;
                self.order =
                    epoch_order(self.state.seed, self.state.epoch, self.state.len, self.state.shuffle);
            }
            let take = (n - out.len()).min(self.state.len - self.state.pos);
            out.extend_from_slice(&self.order[self.state.pos..self.state.pos + take]);
            self.state.pos += take;
        }
        // Roll over eagerly so `epoch()` reports the epoch the next batch starts in.
        if self.state.pos == self.state.len {
            self.state.epoch += 1;
            self.state.pos = 0;
            self.order = epoch_order(self.state.seed, self.state.epoch, self.state.len, self.state.shuffle);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_covers_each_epoch_exactly_once_and_reshuffles() {
        let len = 10;
        let mut s = EpochSampler::new(len, 7).expect("sampler");
        let mut seen: Vec<usize> = Vec::new();
        for _ in 0..5 {
            seen.extend(s.next_batch(4).expect("batch"));
        }
        // 20 indices = exactly two epochs; the third batch straddles epochs 0 and 1.
        assert_eq!(s.epoch(), 2);
        assert_eq!(s.position(), 0);
        let (e0, e1) = seen.split_at(len);
        let sorted = |xs: &[usize]| {
            let mut v = xs.to_vec();
            v.sort_unstable();
            v
        };
        assert_eq!(sorted(e0), (0..len).collect::<Vec<_>>());
        assert_eq!(sorted(e1), (0..len).collect::<Vec<_>>());
        assert_ne!(e0, e1, "epochs should be shuffled differently");
        assert_ne!(e0, (0..len).collect::<Vec<_>>().as_slice(), "epoch 0 should be shuffled");

        let mut seq = EpochSampler::sequential(3).expect("sampler");
        assert_eq!(seq.next_batch(5).expect("batch"), vec![0, 1, 2, 0, 1]);
        assert_eq!((seq.epoch(), seq.position()), (1, 2));
        assert!(seq.next_batch(0).is_err());
        assert!(EpochSampler::new(0, 1).is_err());
    }

    #[test]
    fn sampler_is_deterministic_and_resumes_exactly() {
        let draw = |s: &mut EpochSampler, k: usize| -> Vec<Vec<usize>> {
            (0..k).map(|_| s.next_batch(3).expect("batch")).collect()
        };
        let mut a = EpochSampler::new(17, 42).expect("sampler");
        let mut b = EpochSampler::new(17, 42).expect("sampler");
        assert_eq!(draw(&mut a, 20), draw(&mut b, 20));
        let mut c = EpochSampler::new(17, 43).expect("sampler");
        let mut a2 = EpochSampler::new(17, 42).expect("sampler");
        assert_ne!(draw(&mut a2, 3), draw(&mut c, 3), "different seeds give different orders");

        // Save mid-epoch through JSON, restore, continue: same stream as uninterrupted.
        let mut full = EpochSampler::new(17, 5).expect("sampler");
        let reference = draw(&mut full, 15);
        let mut first = EpochSampler::new(17, 5).expect("sampler");
        let mut got = draw(&mut first, 7);
        let json = serde_json::to_string(&first).expect("serialize");
        assert!(!json.contains('['), "only the state is saved, not the permutation: {json}");
        let mut resumed: EpochSampler = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(resumed, first);
        got.extend(draw(&mut resumed, 8));
        assert_eq!(got, reference);

        let restored = EpochSampler::restore(first.state(), 17).expect("restore");
        assert_eq!(restored, first);
        assert!(EpochSampler::restore(first.state(), 18).is_err());
        let bad = SamplerState { pos: 99, ..first.state() };
        assert!(EpochSampler::try_from(bad).is_err());
    }
}
