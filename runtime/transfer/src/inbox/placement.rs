//! [`Placement`]: where one sender of a region may write, and what it has written. Its byte
//! ranges come from the shard plan; every write must land inside them, on bytes not written
//! before; the checksum covers each segment's offset and length as well as its bytes; at the
//! notice, every byte of the ranges must have been written, exactly once.
//!
//! The checksum is the wrapping sum of each segment's digest, so it does not depend on the
//! order segments arrive in (a sender may spread them over several connections). Summing is
//! safe here because every byte is written exactly once: a non-empty segment can neither
//! repeat nor overlap another. Empty segments count for nothing on either side.

use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Duration;

use tokio::time::Instant;

use xxhash_rust::xxh3::Xxh3;

/// Separate written intervals a sender may have at once beyond one per range and one per
/// [`BYTES_PER_PIECE`] of its ranges: each costs the written map about 40 bytes.
const MIN_PIECES: usize = 1024;

/// A sender's ranges allow one written interval apart from the others per this many bytes
/// (on top of one per range and [`MIN_PIECES`]), so the written map takes at most about
/// 40 / 64 of the bytes it tracks. Real senders write pages or head slices of hundreds of
/// bytes and more, or in order; a sender writing every other byte would cost 20 times.
const BYTES_PER_PIECE: u64 = 64;

/// The digest of one written segment: xxh3-64 over its offset, its length, its bytes. A
/// transfer's checksum is the wrapping sum of its segments' digests.
pub fn segment_digest(offset: u64, bytes: &[u8]) -> u64 {
    let mut h = segment_hasher(offset, bytes.len() as u64);
    h.update(bytes);
    h.digest()
}

/// [`segment_digest`] for a segment of `len` bytes at `offset` whose bytes arrive in pieces:
/// feed it every piece in order, then take its digest.
pub fn segment_hasher(offset: u64, len: u64) -> Xxh3 {
    let mut h = Xxh3::new();
    h.update(&offset.to_le_bytes());
    h.update(&len.to_le_bytes());
    h
}

/// One sender's ranges and progress (see the module docs).
pub(super) struct Placement {
    /// Sorted, disjoint, adjacent ones merged.
    ranges: Vec<Range<u64>>,
    /// Written intervals, start to end, disjoint; at most `max_pieces` of them.
    written: BTreeMap<u64, u64>,
    max_pieces: usize,
    /// Bodies landing now ([`super::Body`]), each under its hold's number: held against
    /// every other write, written only when whole. One per connection landing one, so few.
    landing: Vec<(u64, Range<u64>)>,
    /// The number of the next hold.
    holds: u64,
    pub(super) bytes: u64,
    pub(super) checksum: u64,
    /// How its bytes have been arriving (none yet: `None`).
    pub(super) arrival: Option<Arrival>,
}

/// How one sender's bytes have been arriving: when the first and the last came, and how many.
#[derive(Debug, Clone, Copy)]
pub(super) struct Arrival {
    first: Instant,
    last: Instant,
    bytes: u64,
}

/// The least rate, since its first byte, at which a sender's bytes count as arriving (see
/// [`Placement::arriving`]): a byte a second does not, any link worth the name does.
pub(super) const ARRIVING_RATE: u64 = 1 << 20;

/// Sorts and merges `ranges` (empty ones dropped); `None` if two overlap.
pub(super) fn normalize(mut ranges: Vec<Range<u64>>) -> Option<Vec<Range<u64>>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start < last.end => return None,
            Some(last) if r.start == last.end => last.end = r.end,
            _ => out.push(r),
        }
    }
    Some(out)
}

impl Placement {
    /// A sender allowed `ranges` (normalized).
    pub(super) fn new(ranges: Vec<Range<u64>>) -> Self {
        let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let per_bytes = usize::try_from(total / BYTES_PER_PIECE).unwrap_or(usize::MAX);
        Placement {
            max_pieces: MIN_PIECES.saturating_add(ranges.len()).saturating_add(per_bytes),
            ranges,
            written: BTreeMap::new(),
            landing: Vec::new(),
            holds: 0,
            bytes: 0,
            checksum: 0,
            arrival: None,
        }
    }

    /// `n` of its bytes (at least one) arrived at `now`.
    pub(super) fn arrive(&mut self, n: u64, now: Instant) {
        let a = self.arrival.get_or_insert(Arrival { first: now, last: now, bytes: 0 });
        a.last = now;
        a.bytes = a.bytes.saturating_add(n);
    }

    /// Whether its bytes were still arriving at `at`: its last within `window` before it,
    /// at [`ARRIVING_RATE`] at least since its first.
    pub(super) fn arriving(&self, window: Duration, at: Instant) -> bool {
        self.arrival.is_some_and(|a| {
            let over = at.saturating_duration_since(a.first).max(Duration::from_millis(1));
            at.saturating_duration_since(a.last) <= window
                && a.bytes as f64 / over.as_secs_f64() >= ARRIVING_RATE as f64
        })
    }

    /// Whether every byte of its ranges is written.
    pub(super) fn complete(&self) -> bool {
        self.bytes >= self.total()
    }

    /// Whether `offset` lies in one of its ranges.
    pub(super) fn holds(&self, offset: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.end <= offset);
        self.ranges.get(i).is_some_and(|r| r.start <= offset)
    }

    /// Bytes the sender must write.
    pub(super) fn total(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Where its ranges are, for messages.
    fn span(&self) -> String {
        match (self.ranges.first(), self.ranges.last()) {
            (Some(a), Some(b)) => {
                format!("{} range(s) within [{}, {})", self.ranges.len(), a.start, b.end)
            }
            _ => "no range".into(),
        }
    }

    /// Checks that `len` bytes at `offset` lie inside one range and on nothing written yet.
    pub(super) fn check(&self, offset: u64, len: u64) -> Result<(), String> {
        let Some(end) = offset.checked_add(len) else {
            return Err(format!("write of {len} bytes at {offset} overflows"));
        };
        if len == 0 {
            return Ok(());
        }
        let i = self.ranges.partition_point(|r| r.end <= offset);
        if !self.ranges.get(i).is_some_and(|r| r.start <= offset && end <= r.end) {
            return Err(format!("write of [{offset}, {end}) outside its {}", self.span()));
        }
        // The written interval starting at or before `end` with the largest start.
        if let Some((&s, &e)) = self.written.range(..end).next_back()
            && e > offset
        {
            return Err(format!(
                "write of [{offset}, {end}) over bytes [{}, {}) already written",
                s.max(offset),
                e.min(end)
            ));
        }
        if let Some((_, r)) = self.landing.iter().find(|(_, r)| r.start < end && offset < r.end) {
            return Err(format!(
                "write of [{offset}, {end}) over bytes [{}, {}) another write is landing",
                r.start.max(offset),
                r.end.min(end)
            ));
        }
        if self.written.len() >= self.max_pieces && !self.touches_written(offset, end) {
            return Err(format!(
                "write of [{offset}, {end}) would be a written piece apart from {} others \
                 (at most {} for its {} bytes)",
                self.written.len(),
                self.max_pieces,
                self.total()
            ));
        }
        Ok(())
    }

    /// Whether `[offset, end)` adjoins an interval already written (and would extend it).
    fn touches_written(&self, offset: u64, end: u64) -> bool {
        let before = self.written.range(..=offset).next_back().is_some_and(|(_, &e)| e == offset);
        before || self.written.contains_key(&end)
    }

    /// Lets go of a body landing at exactly `[offset, offset + len)`, if one is: the same
    /// write sent again (its sender's earlier try was cut off before its receiver noticed)
    /// takes its place, and the earlier body lands nothing more.
    pub(super) fn take_over(&mut self, offset: u64, len: u64) {
        let same = offset..offset.saturating_add(len);
        self.landing.retain(|(_, r)| *r != same);
    }

    /// Holds `len` checked bytes at `offset` for a body landing in pieces: the hold's number.
    pub(super) fn hold(&mut self, offset: u64, len: u64) -> u64 {
        self.holds += 1;
        self.landing.push((self.holds, offset..offset + len));
        self.holds
    }

    /// Whether a body is held under `hold`.
    pub(super) fn is_held(&self, hold: u64) -> bool {
        self.landing.iter().any(|(h, _)| *h == hold)
    }

    /// Whether `[offset, offset + len)` lies inside the body held under `hold`.
    pub(super) fn held(&self, hold: u64, offset: u64, len: u64) -> bool {
        let inside = |r: &Range<u64>| offset >= r.start && offset.saturating_add(len) <= r.end;
        self.landing.iter().any(|(h, r)| *h == hold && inside(r))
    }

    /// Bodies landing now.
    #[cfg(test)]
    pub(super) fn landing(&self) -> usize {
        self.landing.len()
    }

    /// Lets go of the body held under `hold`: written, with its whole digest, when it landed
    /// whole; otherwise its bytes count for nothing and may be written again. An empty body
    /// counts for nothing either way, as an empty segment does.
    pub(super) fn settle(&mut self, hold: u64, whole: Option<u64>) {
        let Some(i) = self.landing.iter().position(|(h, _)| *h == hold) else {
            return;
        };
        let (_, body) = self.landing.swap_remove(i);
        if let Some(digest) = whole
            && body.start < body.end
        {
            self.add_digest(digest);
            self.record_range(body.start, body.end - body.start);
        }
    }

    /// Records a checked segment.
    pub(super) fn record(&mut self, offset: u64, bytes: &[u8]) {
        // An empty segment lands nowhere and counts for nothing (backends may drop it).
        if !bytes.is_empty() {
            self.add_digest(segment_digest(offset, bytes));
            self.record_range(offset, bytes.len() as u64);
        }
    }

    /// Adds a whole segment's digest (see [`segment_hasher`]) to the checksum.
    pub(super) fn add_digest(&mut self, digest: u64) {
        self.checksum = self.checksum.wrapping_add(digest);
    }

    /// Records `len` checked bytes at `offset` as written, without their digest: a piece of
    /// a segment arriving in pieces, whose digest comes at its end.
    pub(super) fn record_range(&mut self, offset: u64, len: u64) {
        let (mut start, mut end) = (offset, offset + len);
        if start == end {
            return;
        }
        self.bytes += len;
        // Merge with the neighbours it touches.
        if let Some((&s, &e)) = self.written.range(..=start).next_back()
            && e == start
        {
            self.written.remove(&s);
            start = s;
        }
        if let Some(e) = self.written.remove(&end) {
            end = e;
        }
        self.written.insert(start, end);
    }

    /// The first bytes of its ranges not written, if any.
    pub(super) fn first_gap(&self) -> Option<Range<u64>> {
        for r in &self.ranges {
            let mut at = r.start;
            for (&s, &e) in self.written.range(r.start..r.end) {
                if s > at {
                    return Some(at..s);
                }
                at = at.max(e);
            }
            if at < r.end {
                return Some(at..r.end);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is xxh3-64 of (offset, length, bytes) taken at once, at every size class
    /// xxh3 treats apart (the 16-byte prefix included: up to 16, 128 and 240 bytes, then
    /// stripes and blocks with a tail), however the bytes are cut into pieces.
    #[test]
    fn the_digest_is_xxh3_of_offset_length_and_bytes_whatever_the_pieces() {
        let bytes: Vec<u8> =
            (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0usize, 1, 100, 112, 113, 200, 224, 225, 1024, 1025, 65_536, 299_999] {
            let off = 4096 * len as u64;
            let b = &bytes[..len];
            let whole = [&off.to_le_bytes()[..], &(len as u64).to_le_bytes(), b].concat();
            let reference = xxhash_rust::xxh3::xxh3_64(&whole);
            assert_eq!(segment_digest(off, b), reference, "{len} bytes");
            for piece in [1usize, 7, 64, 1000, 100_000] {
                let mut h = segment_hasher(off, len as u64);
                b.chunks(piece).for_each(|c| h.update(c));
                assert_eq!(h.digest(), reference, "{len} bytes in pieces of {piece}");
            }
        }
    }
}
