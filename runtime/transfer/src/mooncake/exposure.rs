//! What a Mooncake target exposes, and what an initiator was told.
//!
//! - [`Exposed`] (target side): open receive regions at synthetic addresses. A region is
//!   mapped whole at a random base in [2^40, 2^62), or in pieces at addresses a protocol
//!   chose (SGLang's page pools); mappings never overlap. A write's address range must fall
//!   inside one mapping of a region that is still open (checked with overflow checks; the
//!   inbox checks again, under the region's lock, when the bytes land). Only hosts the target announced itself to (the senders it sent
//!   handshakes) may open data connections.
//! - [`Remotes`] (initiator side): the base of each region a receiver handed this agent
//!   (several of its senders may write one region); the oldest are forgotten first.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;

use tokio::time::Instant;

use crate::{Inbox, RegionId, TransferError};

/// Most ranges exposed at once (those of closed regions are swept when it fills).
const MAX_EXPOSED: usize = 1 << 16;
/// Most ranges retired at once (see [`Exposed::retire`]): a given-up SGLang request retires
/// twice its layers and its rows, about 160 for 80 layers, for 30 s; 40 bytes each.
const MAX_RETIRED: usize = 1 << 20;
/// Most peer hosts remembered (the oldest go first).
const MAX_PEERS: usize = 4096;
/// Most handshakes an initiator remembers (the oldest go first).
const MAX_REMOTES: usize = 1 << 16;

const LOWEST_BASE: u64 = 1 << 40;
const HIGHEST_BASE: u64 = 1 << 62;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One exposed address range: `len` bytes of `region` from `offset`.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    region: RegionId,
    len: u64,
    offset: u64,
}

#[derive(Default)]
struct Table {
    /// start address -> mapping; ranges never overlap.
    by_start: BTreeMap<u64, Mapping>,
    /// Each region's mapped start addresses.
    by_region: HashMap<RegionId, Vec<u64>>,
    /// Each region's whole-region base, when it has one.
    bases: HashMap<RegionId, u64>,
    /// Hosts allowed to write, oldest first.
    peers: VecDeque<IpAddr>,
    /// Ranges of regions given up before their writes came (see [`Exposed::retire`]): start
    /// -> (length, until when); at most [`MAX_RETIRED`].
    retired: BTreeMap<u64, (u64, Instant)>,
}

impl Table {
    /// Whether `[start, start + len)` overlaps no mapping.
    fn clear(&self, start: u64, len: u64) -> bool {
        let end = start.saturating_add(len.max(1));
        let below = self.by_start.range(..=start).next_back();
        let clear_below = below.is_none_or(|(&s, m)| s.saturating_add(m.len.max(1)) <= start);
        let above = self.by_start.range(start..).next();
        clear_below && above.is_none_or(|(&s, _)| end <= s)
    }

    fn insert(&mut self, start: u64, m: Mapping) {
        self.by_start.insert(start, m);
        self.by_region.entry(m.region).or_default().push(start);
    }

    fn forget(&mut self, id: RegionId) {
        for start in self.by_region.remove(&id).unwrap_or_default() {
            self.by_start.remove(&start);
        }
        self.bases.remove(&id);
    }

    /// Drops the mappings of regions that are no longer open.
    fn sweep(&mut self, inbox: &Inbox) {
        let stale: Vec<RegionId> =
            self.by_region.keys().filter(|r| inbox.open_len(**r).is_none()).copied().collect();
        for r in stale {
            self.forget(r);
        }
    }

    fn room_for(&mut self, inbox: &Inbox) -> Result<(), TransferError> {
        if self.by_start.len() >= MAX_EXPOSED {
            self.sweep(inbox);
        }
        if self.by_start.len() >= MAX_EXPOSED {
            return Err(TransferError::Full("mooncake exposed ranges"));
        }
        Ok(())
    }
}

/// Regions exposed at synthetic addresses (see the module docs).
#[derive(Default)]
pub struct Exposed {
    table: Mutex<Table>,
}

impl std::fmt::Debug for Exposed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = lock(&self.table);
        f.debug_struct("Exposed").field("ranges", &t.by_start.len()).finish()
    }
}

impl Exposed {
    /// The base address of open region `id`, mapped whole at a random address (assigned on
    /// first call).
    pub fn expose(&self, inbox: &Inbox, id: RegionId) -> Result<u64, TransferError> {
        let len = inbox.open_len(id).ok_or(TransferError::UnknownRegion(id))?;
        let mut t = lock(&self.table);
        if let Some(&base) = t.bases.get(&id) {
            return Ok(base);
        }
        t.room_for(inbox)?;
        let base = loop {
            // 4 KiB aligned, like real buffers; retried on the (unlikely) overlap.
            let base = rand::random_range(LOWEST_BASE..HIGHEST_BASE) & !0xfff;
            if t.clear(base, len) {
                break base;
            }
        };
        t.insert(base, Mapping { region: id, len, offset: 0 });
        t.bases.insert(id, base);
        Ok(base)
    }

    /// Maps `[start, start + len)` to `region` from `offset` (for protocols that choose the
    /// addresses themselves, as SGLang's page pools do). Refused if it overlaps a mapping or
    /// falls outside the region.
    pub fn map(
        &self,
        inbox: &Inbox,
        region: RegionId,
        start: u64,
        len: u64,
        offset: u64,
    ) -> Result<(), TransferError> {
        let region_len = inbox.open_len(region).ok_or(TransferError::UnknownRegion(region))?;
        let fits = offset.checked_add(len).is_some_and(|end| end <= region_len);
        if !fits || start.checked_add(len).is_none() || start == 0 {
            return Err(TransferError::Malformed(format!(
                "mapping [{start:#x}, +{len}) at offset {offset} of a {region_len}-byte region"
            )));
        }
        let mut t = lock(&self.table);
        t.room_for(inbox)?;
        if !t.clear(start, len) {
            return Err(TransferError::Malformed(format!(
                "mapping [{start:#x}, +{len}) overlaps another"
            )));
        }
        t.insert(start, Mapping { region, len, offset });
        Ok(())
    }

    /// Stops exposing `id` (every range mapped to it).
    pub fn withdraw(&self, id: RegionId) {
        lock(&self.table).forget(id);
    }

    /// Stops exposing `id`, whose writes may still come (its request was given up), but
    /// until `until` takes them and drops their bytes rather than refusing them: a Mooncake
    /// sender (SGLang's) marks a whole session failed on one refused write, and every later
    /// room over it with it. Its memory must stay unused as long (SGLang's page pool keeps
    /// it in quarantine), and a range mapped again meanwhile takes its writes first.
    pub fn retire(&self, id: RegionId, until: Instant) {
        let mut t = lock(&self.table);
        let ranges: Vec<(u64, u64)> = t
            .by_region
            .get(&id)
            .into_iter()
            .flatten()
            .filter_map(|s| t.by_start.get(s).map(|m| (*s, m.len)))
            .collect();
        t.forget(id);
        let now = Instant::now();
        t.retired.retain(|_, (_, end)| *end > now);
        for (start, len) in ranges {
            if t.retired.len() >= MAX_RETIRED {
                break;
            }
            t.retired.insert(start, (len, until));
        }
    }

    /// Whether `[addr, addr + size)` lies wholly inside a range retired until after `now`
    /// (see [`Exposed::retire`]).
    pub fn retired(&self, addr: u64, size: u64, now: Instant) -> bool {
        let Some(end) = addr.checked_add(size) else { return false };
        let t = lock(&self.table);
        t.retired.range(..=addr).next_back().is_some_and(|(&start, &(len, until))| {
            until > now && start.checked_add(len).is_some_and(|stop| end <= stop)
        })
    }

    /// The region and offset that `[addr, addr + size)` falls in, if it lies wholly inside
    /// one mapping of an open region.
    pub fn resolve(&self, inbox: &Inbox, addr: u64, size: u64) -> Option<(RegionId, u64)> {
        let end = addr.checked_add(size)?;
        let (start, m) = {
            let t = lock(&self.table);
            let (&start, &m) = t.by_start.range(..=addr).next_back()?;
            (start, m)
        };
        if end > start.checked_add(m.len)? {
            return None;
        }
        if inbox.open_len(m.region).is_none() {
            self.withdraw(m.region);
            return None;
        }
        Some((m.region, m.offset + (addr - start)))
    }

    /// Lets `ip` open data connections (a host this target sent a handshake to).
    pub fn allow(&self, ip: IpAddr) {
        let ip = ip.to_canonical();
        let mut t = lock(&self.table);
        if t.peers.contains(&ip) {
            return;
        }
        if t.peers.len() >= MAX_PEERS {
            t.peers.pop_front();
        }
        t.peers.push_back(ip);
    }

    /// Whether `ip` may open data connections.
    pub fn allowed(&self, ip: IpAddr) -> bool {
        lock(&self.table).peers.contains(&ip.to_canonical())
    }
}

/// Where a receiver's regions start in its address space (see the module docs).
#[derive(Default)]
pub struct Remotes {
    table: Mutex<(HashMap<RegionId, u64>, VecDeque<RegionId>)>,
}

impl std::fmt::Debug for Remotes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remotes").field("regions", &lock(&self.table).0.len()).finish()
    }
}

impl Remotes {
    /// Remembers that region `id` starts at `base`.
    pub fn insert(&self, id: RegionId, base: u64) {
        let mut t = lock(&self.table);
        let (map, order) = &mut *t;
        if map.insert(id, base).is_none() {
            order.push_back(id);
        }
        while map.len() > MAX_REMOTES {
            match order.pop_front() {
                Some(old) => {
                    map.remove(&old);
                }
                None => break,
            }
        }
    }

    /// Where region `id` starts.
    pub fn base(&self, id: RegionId) -> Option<u64> {
        lock(&self.table).0.get(&id).copied()
    }
}
