//! Memory a NIXL agent reads and writes behind Rust's back: the one module of this crate that
//! allows unsafe code.
//!
//! - [`Pinned`]: a heap buffer owned through a raw pointer, so no Rust reference to its bytes
//!   exists while the agent's progress thread may write them (a receive staging buffer) or
//!   read them (a send source).
//! - [`Registered`]: a [`Pinned`] registered with an agent. Its bytes cannot be reached from
//!   Rust; [`Registered::settle`] deregisters it first and only then hands out a [`Settled`],
//!   whose bytes can be read, and which gives the [`Pinned`] back for reuse.
//! - [`Arena`]: one [`Registered`] buffer for the life of the agent, lent out in [`Slot`]s:
//!   receive staging. Registered once, so peers' views of this agent's memory never go stale
//!   (NIXL keeps every range a peer's metadata ever named; ranges registered and freed over
//!   and over come back overlapping old ones, and NIXL then refuses transfers into them).
#![expect(
    unsafe_code,
    reason = "nixl-sys's MemoryRegion::as_ptr is an unsafe method, and registered memory is \
              written by the agent outside Rust's view"
)]

use std::ptr::NonNull;

use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};

/// A heap buffer of at least one byte, owned through a raw pointer (see the module docs).
#[derive(Debug)]
pub(crate) struct Pinned {
    ptr: NonNull<[u8]>,
}

// SAFETY: `Pinned` owns its allocation exclusively, like a `Box<[u8]>`; nothing in it is tied
// to a thread.
unsafe impl Send for Pinned {}
// SAFETY: `&Pinned` only exposes the address and length, never the bytes.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `len` zero bytes (pages are touched only where written).
    pub(crate) fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0; len.max(1)])
    }

    /// Takes `bytes` (at least one) as the buffer's contents.
    pub(crate) fn from_vec(mut bytes: Vec<u8>) -> Self {
        if bytes.is_empty() {
            bytes.push(0);
        }
        let raw = Box::into_raw(bytes.into_boxed_slice());
        // `Box::into_raw` never returns null.
        let ptr = NonNull::new(raw).unwrap_or_else(|| unreachable!("Box::into_raw is non-null"));
        Pinned { ptr }
    }

    /// The buffer's address, as NIXL descriptors name it.
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr().cast::<u8>() as usize
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.ptr.len()
    }

    /// The buffer as a `Vec`, without a copy.
    pub(crate) fn into_vec(self) -> Vec<u8> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `ptr` came from `Box::into_raw` in `from_vec`; `ManuallyDrop` keeps `Drop`
        // from freeing it too, so ownership passes to the `Box` exactly once.
        unsafe { Box::from_raw(this.ptr.as_ptr()) }.into_vec()
    }

    /// Its bytes, to fill. A `Pinned` outside a [`Registered`] is reachable by no agent.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live, initialized allocation owned by `self` (see `from_vec`);
        // `&mut self` makes this the only access: no agent holds it (registration moves it
        // into a `Registered`, which gives it back only after deregistering).
        unsafe { &mut *self.ptr.as_ptr() }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` in `from_vec` and is freed only here, once.
        // Registered memory drops only after it is deregistered (`Registered::release`).
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

impl MemoryRegion for Pinned {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr().cast::<u8>()
    }

    fn size(&self) -> usize {
        self.len()
    }
}

impl NixlDescriptor for Pinned {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// A [`Pinned`] registered with an agent: peers holding the agent's metadata may read and
/// write it until it is settled or dropped.
#[derive(Debug)]
pub(crate) struct Registered {
    handle: RegistrationHandle,
    /// `None` once settled.
    mem: Option<Pinned>,
}

impl Registered {
    /// Registers `mem` with `agent`.
    pub(crate) fn new(agent: &Agent, mem: Pinned) -> Result<Self, nixl_sys::NixlError> {
        let handle = agent.register_memory(&mem, None)?;
        Ok(Registered { handle, mem: Some(mem) })
    }

    /// Its address.
    pub(crate) fn addr(&self) -> usize {
        self.mem.as_ref().map_or(0, Pinned::addr)
    }

    /// Its length.
    pub(crate) fn len(&self) -> usize {
        self.mem.as_ref().map_or(0, Pinned::len)
    }

    /// Deregisters it, so no peer can reach it any more, and returns the memory readable;
    /// `None` if the agent refused to deregister it (the memory is then never freed: a peer
    /// could still write it).
    pub(crate) fn settle(mut self) -> Option<Settled> {
        self.release().map(|mem| Settled { mem })
    }

    /// Deregisters and takes the memory, or leaks it if deregistration failed. (nixl-sys
    /// 1.5.2 does not pass on the C call's status, so a refusal is not seen; the callers
    /// release only memory no transfer of theirs still uses.)
    fn release(&mut self) -> Option<Pinned> {
        let mem = self.mem.take()?;
        match self.handle.deregister() {
            Ok(()) => Some(mem),
            Err(e) => {
                tracing::warn!(error = ?e, len = mem.len(), "nixl deregistration failed: memory kept");
                std::mem::forget(mem);
                None
            }
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        drop(self.release());
    }
}

/// A range of an [`Arena`], lent out. Not `Clone`: given back once, to the arena it came
/// from (checked).
#[derive(Debug)]
pub(crate) struct Slot {
    arena: u64,
    off: usize,
    len: usize,
}

impl Slot {
    /// Its offset in the arena.
    pub(crate) fn offset(&self) -> usize {
        self.off
    }
}

/// One registered buffer, lent out in slots (see the module docs). First fit over a sorted
/// list of free ranges, coalesced on return; slots are whole pages of the arena.
#[derive(Debug)]
pub(crate) struct Arena {
    /// Tells this arena's slots from another's.
    id: u64,
    mem: Registered,
    free: std::sync::Mutex<Vec<std::ops::Range<usize>>>,
}

const PAGE: usize = 4096;

impl Arena {
    /// `len` bytes (rounded up to a page), registered with `agent`. Pages are touched only as
    /// slots are used.
    pub(crate) fn new(agent: &Agent, len: usize) -> Result<Self, nixl_sys::NixlError> {
        let len = len.max(PAGE).next_multiple_of(PAGE);
        let mem = Registered::new(agent, Pinned::zeroed(len))?;
        let free = std::sync::Mutex::new(std::iter::once(0..len).collect());
        Ok(Arena { id: rand::random(), mem, free })
    }

    /// The registered buffer (for its metadata).
    pub(crate) fn registered(&self) -> &Registered {
        &self.mem
    }

    /// A zeroed slot of `len` bytes, or `None` if no free range is long enough.
    pub(crate) fn take(&self, len: usize) -> Option<Slot> {
        let want = len.max(1).checked_next_multiple_of(PAGE)?;
        let off = {
            let mut free = self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let i = free.iter().position(|r| r.len() >= want)?;
            let off = free[i].start;
            free[i].start += want;
            if free[i].is_empty() {
                free.remove(i);
            }
            off
        };
        // SAFETY: `[off, off + want)` lies inside the arena's live allocation (it came from
        // the free list, which only holds ranges of it) and was just taken out of the free
        // list, so no other slot covers it; no honest peer has been told its address yet.
        unsafe { std::ptr::write_bytes((self.mem.addr() + off) as *mut u8, 0, want) };
        Some(Slot { arena: self.id, off, len: want })
    }

    /// Whether `slot` is one of this arena's, inside it.
    fn owns(&self, slot: &Slot) -> bool {
        slot.arena == self.id && slot.off.checked_add(slot.len).is_some_and(|e| e <= self.mem.len())
    }

    /// `len` bytes at `off` in `slot`, for as long as both are borrowed (a slot cannot be given
    /// back, and so lent again and zeroed, while read); `None` outside the slot or for another
    /// arena's slot.
    pub(crate) fn segment<'a>(
        &'a self,
        slot: &'a Slot,
        off: usize,
        len: usize,
    ) -> Option<&'a [u8]> {
        let inside = off.checked_add(len).is_some_and(|end| end <= slot.len);
        if !self.owns(slot) || !inside {
            return None;
        }
        // SAFETY: the range lies inside the slot (`inside`), so inside the arena's live,
        // initialized allocation (`owns`); the slot is not free (a slot leaves the free list
        // only as one `Slot`, which `give` consumes, and `'a` keeps it borrowed as long as the
        // slice lives). The caller reads a sender's own segments after its notice, and NIXL
        // reports a WRITE complete only once its bytes are here, so no honest peer writes them
        // any more (other senders of the region write other ranges). A hostile UCX peer can
        // write any address of this process over UCX's TCP transport (docs/security.md); that
        // is outside what Rust can contain, and a torn copy fails the notice's checksum.
        Some(unsafe {
            std::slice::from_raw_parts((self.mem.addr() + slot.off + off) as *const u8, len)
        })
    }

    /// Gives `slot` back (another arena's slot is refused, and leaked: never lent twice).
    pub(crate) fn give(&self, slot: Slot) {
        if !self.owns(&slot) {
            tracing::warn!(off = slot.off, len = slot.len, "slot of another arena not taken back");
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let at = free.partition_point(|r| r.start < slot.off);
        free.insert(at, slot.off..slot.off + slot.len);
        // Coalesce with the neighbours.
        if at + 1 < free.len() && free[at].end == free[at + 1].start {
            free[at].end = free[at + 1].end;
            free.remove(at + 1);
        }
        if at > 0 && free[at - 1].end == free[at].start {
            free[at - 1].end = free[at].end;
            free.remove(at);
        }
    }

    /// Bytes not lent out.
    #[cfg(test)]
    pub(crate) fn free_bytes(&self) -> usize {
        let free = self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        free.iter().map(|r| r.len()).sum()
    }
}

/// Memory no agent can reach any more, for reuse.
#[derive(Debug)]
pub(crate) struct Settled {
    mem: Pinned,
}

impl Settled {
    /// The memory, for reuse.
    pub(crate) fn into_pinned(self) -> Pinned {
        self.mem
    }
}
