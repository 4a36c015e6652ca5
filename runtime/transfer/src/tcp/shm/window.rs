//! [`Window`]: the memory a sender shares with its receiver, a memfd of two halves mapped by
//! both. The one module of the shm path that allows unsafe code (mapping a file).
//!
//! The sender makes it ([`Window::create`]) and seals it against shrinking, so the receiver,
//! which checks the seal before mapping ([`Window::adopt`]), can never fault on pages the
//! sender took away. A half belongs to the sender until it names it in a frame, then to the
//! receiver until its ack: the receiver reads a half only between the two, and copies what it
//! reads into its own memory before hashing it.
#![expect(
    unsafe_code,
    reason = "mapping a file is unsafe: the bytes can change behind Rust's view if another \
              process writes them, which the protocol above rules out for a half while it is \
              read, and which can then only garble the sender's own bytes"
)]

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use memmap2::{Mmap, MmapMut, MmapOptions};
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::statfs::{TMPFS_MAGIC, fstatfs};

use crate::TransferError;

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
    map: MmapMut,
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
        // SAFETY: the file is ours and sealed against shrinking, so the mapping stays
        // backed; only the receiver maps it besides, and it never writes.
        let map = unsafe { MmapOptions::new().len(2 * HALF).map_mut(&file) }
            .map_err(|e| failed("mapping", e))?;
        Ok(Window { file, map })
    }

    /// The file, to pass to the receiver.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Half `h` (0 or 1), to write a frame's bytes into.
    pub(crate) fn half_mut(&mut self, h: u32) -> &mut [u8] {
        let at = (h as usize & 1) * HALF;
        &mut self.map[at..at + HALF]
    }
}

/// The receiver's side: both halves readable.
#[derive(Debug)]
pub(crate) struct SharedWindow {
    map: Mmap,
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
        // SAFETY: sealed against shrinking (checked above), so every mapped page stays
        // backed; the sender writes a half only while we do not read it (module docs).
        let map = unsafe { MmapOptions::new().len(2 * HALF).map(&file) }
            .map_err(|e| failed("mapping", e))?;
        Ok(SharedWindow { map })
    }

    /// Half `h`, or `None` past the second.
    pub(crate) fn half(&self, h: u32) -> Option<&[u8]> {
        let at = usize::try_from(h).ok().filter(|h| *h < 2)? * HALF;
        Some(&self.map[at..at + HALF])
    }
}
