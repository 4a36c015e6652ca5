//! Ids as newtypes: never bare strings or integers as keys.

use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// An id that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidId {
    /// `bootstrap_room` must be in `1..=2^63-1`.
    #[error("bootstrap_room must be in 1..=2^63-1, got {0}")]
    Room(u64),
    /// Instance ids are 1-128 characters of `[A-Za-z0-9._-]`.
    #[error("instance id must be 1-128 characters of [A-Za-z0-9._-], got {0:?}")]
    Instance(String),
}

/// The `bootstrap_room` that binds one attempt of one request end to end: a u63, never 0
/// (SGLang's decode reads 0 as "metadata not yet written"), fresh for every attempt.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct Room(NonZeroU64);

impl Room {
    const MAX: u64 = (1 << 63) - 1;

    /// Mints a fresh room, uniform in `1..=2^63-1`.
    pub fn mint() -> Self {
        let v = rand::random_range(1..=Self::MAX);
        Room(NonZeroU64::new(v).expect("range excludes 0"))
    }

    /// Mints a fresh room that an SGLang prefill of `ranks` data-parallel ranks serves on
    /// rank `rank` (it serves room `r` on rank `r % ranks`): uniform among those rooms.
    /// Any room when `ranks` is 0 or 1, or `rank` is not one of them.
    pub fn mint_on(rank: u32, ranks: u32) -> Self {
        let (rank, ranks) = (u64::from(rank), u64::from(ranks));
        if ranks <= 1 || rank >= ranks {
            return Self::mint();
        }
        // Multiples of `ranks` from 0 to MAX - rank, plus `rank`, never 0 (rank 0 starts at
        // the first multiple past 0).
        let first = u64::from(rank == 0);
        let k = rand::random_range(first..=(Self::MAX - rank) / ranks);
        Room(NonZeroU64::new(k * ranks + rank).expect("k or rank is not 0"))
    }

    /// The room as the integer on the wire.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl TryFrom<u64> for Room {
    type Error = InvalidId;
    fn try_from(v: u64) -> Result<Self, InvalidId> {
        match NonZeroU64::new(v) {
            Some(n) if v <= Self::MAX => Ok(Room(n)),
            _ => Err(InvalidId::Room(v)),
        }
    }
}

impl From<Room> for u64 {
    fn from(r: Room) -> u64 {
        r.get()
    }
}

impl fmt::Display for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for Room {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Room({})", self.0)
    }
}

/// The id of one instance (a prefill instance, a frontend, a scheduler). Cheap to clone: the
/// scheduler copies ids on every selection.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InstanceId(Arc<str>);

impl InstanceId {
    /// A fresh random id with a readable prefix, e.g. `prefill-3f2a9c1d`.
    pub fn random(prefix: &str) -> Self {
        InstanceId(Arc::from(format!("{prefix}-{:08x}", rand::random::<u32>())))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for InstanceId {
    type Error = InvalidId;
    fn try_from(s: String) -> Result<Self, InvalidId> {
        let ok = !s.is_empty()
            && s.len() <= 128
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if ok { Ok(InstanceId(Arc::from(s))) } else { Err(InvalidId::Instance(s)) }
    }
}

impl std::str::FromStr for InstanceId {
    type Err = InvalidId;
    fn from_str(s: &str) -> Result<Self, InvalidId> {
        Self::try_from(s.to_owned())
    }
}

impl From<InstanceId> for String {
    fn from(id: InstanceId) -> String {
        id.0.to_string()
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceId({})", self.0)
    }
}

/// The chained hash of one full page of prompt tokens (see [`crate::hash`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

#[cfg(test)]
mod tests;
