//! [`Window`]: the memory a sender shares with its receiver, a memfd of two halves mapped by
//! both. The one module of the shm path that allows unsafe code (mapping a file, and copying
//! into and out of the mapping).
//!
//! The sender makes it ([`Window::create`]) and seals it against shrinking, so the receiver,
//! which checks the seal before mapping ([`Window::adopt`]), can never fault on pages the
//! sender took away. A half belongs to the sender until it names it in a frame, then to the
//! receiver until its ack: the receiver reads a half only between the two, and copies what it
//! reads into its own memory before hashing it.
//!
//! Neither side ever holds a Rust reference into the mapping: the other process could write
//! it at any time (a hostile peer of our own user may map the memfd writable and ignore the
//! protocol), and a `&[u8]` promises the bytes stay put while it lives. The mapping is raw
//! ([`MmapRaw`]) and bytes cross it only in one `copy_nonoverlapping` each way
//! ([`Window::fill`], [`PieceBytes::copy_to`]). That narrows the gap without closing it: a
//! peer writing while a copy reads is still a data race in Rust's memory model (volatile or
//! atomic copies would close it). What such a peer gets is its own bytes garbled, which the
//! receiver's hash of its own copy then refuses.
#![expect(
    unsafe_code,
    reason = "mapping a file, and copying through raw pointers into and out of memory another \
              process maps too"
)]

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use std::marker::PhantomData;

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::statfs::{TMPFS_MAGIC, fstatfs};

use crate::TransferError;
use crate::inbox::PieceBytes;

/// Bytes in each half: a write of more goes in several frames.
pub(crate) const HALF: usize = 2 << 20;

/// The seals a window must carry before a receiver maps it.
fn required() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL
}

fn failed(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Malformed(format!("shared window: {what}: {e}"))
}

/// The sender's side: both halves writable.
#[derive(Debug)]
pub(crate) struct Window {
    file: File,
    map: MmapRaw,
}

impl Window {
    /// A fresh window, sealed against shrinking (and, where the kernel knows how, against
    /// ever being made executable: hosts with `vm.memfd_noexec=2` refuse any other memfd).
    pub(crate) fn create() -> Result<Self, TransferError> {
        let flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
        let fd = memfd_create(
            "handoff-kv",
            flags | MFdFlags::from_bits_retain(nix::libc::MFD_NOEXEC_SEAL),
        )
        .or_else(|e| match e {
            // A kernel before 6.3 does not know the flag.
            nix::errno::Errno::EINVAL => memfd_create("handoff-kv", flags),
            e => Err(e),
        })
        .map_err(|e| failed("memfd_create", e))?;
        let file = File::from(fd);
        file.set_len(2 * HALF as u64).map_err(|e| failed("sizing", e))?;
        fcntl(file.as_fd(), FcntlArg::F_ADD_SEALS(required())).map_err(|e| failed("sealing", e))?;
        // A raw mapping: no reference into it is ever made (module docs). The file is ours
        // and sealed against shrinking, so every mapped page stays backed.
        let map =
            MmapOptions::new().len(2 * HALF).map_raw(&file).map_err(|e| failed("mapping", e))?;
        Ok(Window { file, map })
    }

    /// The file, to pass to the receiver.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Copies `src` into half `h` (0 or 1) from byte `at`. `Err` (nothing copied) if it would
    /// run past the half.
    pub(crate) fn fill(&mut self, h: u32, at: usize, src: &[u8]) -> Result<(), TransferError> {
        let fits = at.checked_add(src.len()).is_some_and(|end| end <= HALF);
        if !fits || self.map.len() < 2 * HALF {
            return Err(failed("filling", format!("{} bytes at {at} of a half", src.len())));
        }
        let start = (h as usize & 1) * HALF + at;
        // SAFETY: `start + src.len()` is within the mapping (checked above), which stays
        // mapped while `self` lives; `src` is our own memory, so the two cannot overlap. The
        // receiver may read (or a hostile one write) these bytes meanwhile: that garbles only
        // what it takes, and no reference into the mapping exists to be broken.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(start),
                src.len(),
            );
        }
        Ok(())
    }
}

/// The receiver's side: both halves readable.
#[derive(Debug)]
pub(crate) struct SharedWindow {
    map: MmapRaw,
}

impl SharedWindow {
    /// Maps a window a sender passed, after checking it is one: a memfd sealed against
    /// shrinking and large enough for both halves.
    pub(crate) fn adopt(fd: OwnedFd) -> Result<Self, TransferError> {
        // A memfd lives on tmpfs; one backed by huge pages could lose its pages to a hole
        // its sender punches, and the receiver would fault on them.
        let fs = fstatfs(fd.as_fd()).map_err(|e| failed("statfs", e))?;
        if fs.filesystem_type() != TMPFS_MAGIC {
            return Err(failed("kind", "not a memfd on tmpfs"));
        }
        let seals = fcntl(fd.as_fd(), FcntlArg::F_GET_SEALS)
            .map_err(|e| failed("not a sealable memfd", e))?;
        if !SealFlag::from_bits_truncate(seals).contains(required()) {
            return Err(failed("seals", "not sealed against shrinking"));
        }
        let file = File::from(fd);
        let len = file.metadata().map_err(|e| failed("size", e))?.len();
        if len < 2 * HALF as u64 {
            return Err(failed("size", format!("{len} bytes, want {}", 2 * HALF)));
        }
        // Raw and read-only: no reference into it is ever made (module docs). Sealed against
        // shrinking (checked above), so every mapped page stays backed.
        let map = MmapOptions::new()
            .len(2 * HALF)
            .map_raw_read_only(&file)
            .map_err(|e| failed("mapping", e))?;
        Ok(SharedWindow { map })
    }

    /// Half `h`, or `None` past the second.
    pub(crate) fn half(&self, h: u32) -> Option<SharedBytes<'_>> {
        let at = usize::try_from(h).ok().filter(|h| *h < 2)? * HALF;
        if self.map.len() < at + HALF {
            return None;
        }
        // SAFETY: `at + HALF` is within the mapping (checked above).
        let ptr = unsafe { self.map.as_ptr().add(at) };
        Some(SharedBytes { ptr, len: HALF, window: PhantomData })
    }
}

/// Bytes of a window the sender maps too: never seen through a reference, only copied out
/// ([`PieceBytes::copy_to`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedBytes<'a> {
    ptr: *const u8,
    len: usize,
    window: PhantomData<&'a SharedWindow>,
}

impl PieceBytes for SharedBytes<'_> {
    fn byte_len(self) -> usize {
        self.len
    }

    fn range(self, from: usize, n: usize) -> Option<Self> {
        let fits = from.checked_add(n).is_some_and(|end| end <= self.len);
        // SAFETY: `from` is within these bytes (checked), so within the mapping.
        fits.then(|| SharedBytes { ptr: unsafe { self.ptr.add(from) }, len: n, ..self })
    }

    fn copy_to(self, dst: &mut tokio::io::ReadBuf<'_>) -> bool {
        if dst.remaining() != self.len {
            return false;
        }
        // SAFETY: `ptr..ptr + len` lies within a mapping that outlives `'_` (it borrows the
        // window); `dst` is our own memory, so they cannot overlap. The sender may write
        // these bytes meanwhile only against the protocol, and then garbles only its own.
        // The `len` bytes of `dst`'s room copied into are then initialized, as marked.
        unsafe {
            let room = dst.unfilled_mut();
            std::ptr::copy_nonoverlapping(self.ptr, room.as_mut_ptr().cast::<u8>(), self.len);
            dst.assume_init(self.len);
        }
        dst.advance(self.len);
        true
    }
}
