//! The folded multiply the block maps hash with, and [`FoldHasher`] on it for the
//! scheduler's other maps keyed by integers. Block
//! hashes are already xxh3 outputs, but callers (and benchmarks) may hand in structured
//! ones, so the key is still mixed: one 64x64->128-bit multiply folded to 64 bits, which
//! spreads low and high input bits over the whole word. Not keyed, so only for tables whose
//! keys no client picks: blocks that engines' KV events store, counters, slots. A table
//! taking keys from a caller (the scheduler's pending prompt starts, which a `/v1/select`
//! caller names) stays on std's keyed hasher, or crafted collisions would make one chain.

use std::hash::{BuildHasherDefault, Hasher};

const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// A folded-multiply hasher for integer keys.
#[derive(Debug, Default, Clone, Copy)]
pub struct FoldHasher(u64);

/// One folded multiply of `x` (the hasher's step, and the block maps' whole hash).
pub(crate) fn fold(x: u64) -> u64 {
    let p = u128::from(x ^ K) * u128::from(K.rotate_left(17) | 1);
    (p as u64) ^ ((p >> 64) as u64)
}

impl FoldHasher {
    fn mix(&mut self, x: u64) {
        self.0 = fold(self.0 ^ x);
    }
}

impl Hasher for FoldHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.mix(x);
    }

    fn write_u32(&mut self, x: u32) {
        self.mix(u64::from(x));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by integers (or what hashes as them) through [`FoldHasher`].
pub type FoldMap<K, V> = std::collections::HashMap<K, V, BuildHasherDefault<FoldHasher>>;
