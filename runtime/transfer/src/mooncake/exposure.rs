//! What a Mooncake target exposes, and what an initiator was told.
//!
//! - [`Exposed`] (target side): open receive regions at synthetic addresses. Each region gets
//!   a random base in [2^40, 2^62), never overlapping another's range; a write's address
//!   range must fall inside one region that is still open, checked with overflow checks
//!   while the region is held. Only hosts the target announced itself to (the senders it
//!   sent handshakes) may open data connections.
//! - [`Remotes`] (initiator side): the base of each region a receiver handed this agent
//!   (several of its senders may write one region); the oldest are forgotten first.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;

use crate::{Inbox, RegionId, TransferError};

/// Most regions exposed at once (stale ones are swept when it fills).
const MAX_EXPOSED: usize = 1 << 16;
/// Most peer hosts remembered (the oldest go first).
const MAX_PEERS: usize = 4096;
/// Most handshakes an initiator remembers (the oldest go first).
const MAX_REMOTES: usize = 1 << 16;

const LOWEST_BASE: u64 = 1 << 40;
const HIGHEST_BASE: u64 = 1 << 62;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Table {
    /// base -> (region, length)
    by_base: BTreeMap<u64, (RegionId, u64)>,
    by_region: HashMap<RegionId, u64>,
    /// Hosts allowed to write, oldest first.
    peers: VecDeque<IpAddr>,
}

/// Regions exposed at synthetic addresses (see the module docs).
#[derive(Default)]
pub struct Exposed {
    table: Mutex<Table>,
}

impl std::fmt::Debug for Exposed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = lock(&self.table);
        f.debug_struct("Exposed").field("regions", &t.by_base.len()).finish()
    }
}

impl Exposed {
    /// The base address of open region `id` (assigned on first call).
    pub fn expose(&self, inbox: &Inbox, id: RegionId) -> Result<u64, TransferError> {
        let len = inbox.open_len(id).ok_or(TransferError::UnknownRegion(id))?;
        let mut t = lock(&self.table);
        if let Some(&base) = t.by_region.get(&id) {
            return Ok(base);
        }
        if t.by_base.len() >= MAX_EXPOSED {
            let stale: Vec<RegionId> =
                t.by_region.keys().filter(|r| inbox.open_len(**r).is_none()).copied().collect();
            for r in stale {
                Self::forget(&mut t, r);
            }
            if t.by_base.len() >= MAX_EXPOSED {
                return Err(TransferError::Full("mooncake exposed regions"));
            }
        }
        let span = len.max(1);
        let base = loop {
            // 4 KiB aligned, like real buffers; retried on the (unlikely) overlap.
            let base = rand::random_range(LOWEST_BASE..HIGHEST_BASE) & !0xfff;
            let below = t.by_base.range(..=base).next_back();
            let clear_below = below.is_none_or(|(&b, &(_, l))| b + l.max(1) <= base);
            let above = t.by_base.range(base..).next();
            let clear_above = above.is_none_or(|(&b, _)| base + span <= b);
            if clear_below && clear_above {
                break base;
            }
        };
        t.by_base.insert(base, (id, len));
        t.by_region.insert(id, base);
        Ok(base)
    }

    fn forget(t: &mut Table, id: RegionId) {
        if let Some(base) = t.by_region.remove(&id) {
            t.by_base.remove(&base);
        }
    }

    /// Stops exposing `id`.
    pub fn withdraw(&self, id: RegionId) {
        Self::forget(&mut lock(&self.table), id);
    }

    /// The region and offset that `[addr, addr + size)` falls in, if it lies wholly inside
    /// one open region.
    pub fn resolve(&self, inbox: &Inbox, addr: u64, size: u64) -> Option<(RegionId, u64)> {
        let end = addr.checked_add(size)?;
        let (id, base, len) = {
            let t = lock(&self.table);
            let (&base, &(id, len)) = t.by_base.range(..=addr).next_back()?;
            (id, base, len)
        };
        if end > base.checked_add(len)? {
            return None;
        }
        if inbox.open_len(id).is_none() {
            self.withdraw(id);
            return None;
        }
        Some((id, addr - base))
    }

    /// Lets `ip` open data connections (a host this target sent a handshake to).
    pub fn allow(&self, ip: IpAddr) {
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
        lock(&self.table).peers.contains(&ip)
    }

    /// Open regions exposed, as (base, length), for the segment descriptor.
    pub fn buffers(&self, inbox: &Inbox) -> Vec<(u64, u64)> {
        let t = lock(&self.table);
        let open = |id: &RegionId| inbox.open_len(*id).is_some();
        t.by_base
            .iter()
            .filter(|(_, (id, l))| *l > 0 && open(id))
            .map(|(&b, &(_, l))| (b, l))
            .collect()
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
