//! Memory a NIXL agent reads and writes behind Rust's back: the one module of this crate that
//! allows unsafe code.
//!
//! - [`Pinned`]: a heap buffer owned through a raw pointer, so no Rust reference to its bytes
//!   exists while the agent's progress thread may write them (a receive staging buffer) or
//!   read them (a send source).
//! - [`Registered`]: a [`Pinned`] registered with an agent. Its bytes cannot be reached from
//!   Rust; [`Registered::settle`] deregisters it first and only then hands out a [`Settled`],
//!   whose bytes can be read, and which gives the [`Pinned`] back for reuse.
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

    /// Deregisters and takes the memory, or leaks it if deregistration failed.
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

/// Memory no agent can reach any more: its bytes can be read.
#[derive(Debug)]
pub(crate) struct Settled {
    mem: Pinned,
}

impl Settled {
    /// The memory, for reuse.
    pub(crate) fn into_pinned(self) -> Pinned {
        self.mem
    }

    /// Its bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is live for `self`'s lifetime and initialized (it started
        // zeroed or as a `Vec`'s contents). It is deregistered, so the agent no longer writes
        // it: remote writes name it by its registration, which is gone. Should a write still
        // in flight land during this borrow, the bytes could be torn, never out of bounds;
        // the caller verifies them against the sender's checksum before anything uses them.
        unsafe { std::slice::from_raw_parts(self.mem.addr() as *const u8, self.mem.len()) }
    }
}
