//! [`RegionBuf`]: a region's bytes, allocated without zeroing the ones its senders write.
//!
//! Every byte a sender may write is written exactly once before the region is handed on, so
//! zeroing them first was a whole pass over every byte received for nothing: 16 % of the CPU
//! of same-host transfers in the profile, about 60 % of the verification's hash. Only
//! the bytes no sender may write (the gaps between the senders' ranges) are zeroed, when the
//! region is registered. The rest is reached only as `MaybeUninit` (writes go through
//! [`ReadBuf`], which knows what it has initialized) until [`RegionBuf::into_written`], at
//! `Success`, when every sender's ranges have been written whole.
#![expect(
    unsafe_code,
    reason = "a region's bytes are allocated uninitialized and taken as initialized once \
              written whole"
)]

use std::mem::MaybeUninit;
use std::ops::Range;

use tokio::io::ReadBuf;

use super::region::Region;
use crate::KvPoll;

/// A region's bytes (see the module docs).
#[derive(Default)]
pub(super) struct RegionBuf(Box<[MaybeUninit<u8>]>);

impl RegionBuf {
    /// `len` bytes, those outside `ranges` (sorted, disjoint, within `len`) zeroed.
    pub(super) fn new(len: usize, ranges: &[Range<u64>]) -> Self {
        let mut bytes = Box::new_uninit_slice(len);
        populate(&mut bytes);
        zero_gaps(&mut bytes, ranges);
        RegionBuf(bytes)
    }

    /// How many bytes.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// The `n` bytes at `off`, for a write, or `None` past the end.
    pub(super) fn place(&mut self, off: u64, n: usize) -> Option<ReadBuf<'_>> {
        let start = usize::try_from(off).ok()?;
        self.0.get_mut(start..start.checked_add(n)?).map(ReadBuf::uninit)
    }

    /// The bytes, every one of them written.
    ///
    /// # Safety
    /// Every byte of the senders' ranges given to [`RegionBuf::new`] has been written through
    /// [`RegionBuf::place`] (as at `Success`: each sender's ranges written whole).
    unsafe fn into_written(self) -> Vec<u8> {
        // SAFETY: the gaps were zeroed in `new` and the caller vouches for the rest.
        unsafe { self.0.assume_init() }.into_vec()
    }
}

impl Region {
    /// The region's bytes once it has succeeded, `None` before.
    pub(super) fn take_written(&mut self) -> Option<Vec<u8>> {
        if *self.state.borrow() != KvPoll::Success {
            return None;
        }
        let buf = std::mem::take(&mut self.buf);
        // SAFETY: the ranges `new` left unzeroed are exactly the union of the senders' (each
        // sender named once, `Inbox::register_region`). At `Success` each of them has been
        // written whole (see `completion`: neither a notice nor a finish passes with a gap in
        // its sender's ranges, and a range counts as written only once its bytes landed
        // through `RegionBuf::place`); the rest was zeroed when the region was registered.
        // Nothing else writes a region's buffer.
        Some(unsafe { buf.into_written() })
    }
}

/// Regions up to this size are faulted in when registered (see [`populate`]); a larger one
/// is left to its writes, so one huge region does not hold a worker thread while it becomes
/// resident.
const POPULATE_MAX: usize = 64 << 20;

/// The page size this probing assumes. On a kernel with larger pages nothing is populated
/// (the writes fault the pages in): `mincore`'s answer would be a byte per larger page.
const PAGE: usize = 4096;

/// Pages asked about in one `mincore` call (its answer is a byte per page, on the stack).
const PROBE_PAGES: usize = 1024;

/// Faults in the pages of `bytes` that are not resident, where the writes would fault them
/// one by one later while holding the region's lock (and the other senders of the region
/// waiting on it); returns how many bytes it asked the kernel to populate.
///
/// Most regions reuse memory the allocator already has in place: populating that anyway
/// walks every page's table entry for nothing (8 % of a 12 MB tcp transfer's CPU). So each
/// stretch of [`PROBE_PAGES`] pages is asked with `mincore` first, and only the span from
/// its first page not resident to its last is populated; the whole stretch when `mincore`
/// fails. Resident is not quite "written": a page shared until written (the zero page, after
/// a fork) still faults once, as it did before. A kernel without `MADV_POPULATE_WRITE`
/// (before 5.14) refuses, and leaves the pages to the writes.
fn populate(bytes: &mut [MaybeUninit<u8>]) -> usize {
    if bytes.len() > POPULATE_MAX || !pages_are_4k() {
        return 0;
    }
    let start = bytes.as_mut_ptr() as usize;
    let (first, end) = (start.next_multiple_of(PAGE), (start + bytes.len()) / PAGE * PAGE);
    let mut asked = 0;
    let mut at = first;
    while at < end {
        let len = (end - at).min(PROBE_PAGES * PAGE);
        let stretch = bytes.as_mut_ptr().wrapping_byte_add(at - start).cast::<std::ffi::c_void>();
        let mut resident = [0u8; PROBE_PAGES];
        let missing = match ask_resident(stretch, len, &mut resident) {
            true => missing_span(&resident[..len / PAGE]),
            false => Some(0..len / PAGE),
        };
        if let Some(pages) = missing {
            let n = pages.len() * PAGE;
            populate_write(stretch.wrapping_byte_add(pages.start * PAGE), n);
            asked += n;
        }
        at += len;
    }
    asked
}

/// Whether the kernel's pages are [`PAGE`] bytes (asked once).
fn pages_are_4k() -> bool {
    static FOURK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: `sysconf` only reads a system setting.
    *FOURK.get_or_init(|| unsafe { nix::libc::sysconf(nix::libc::_SC_PAGESIZE) } == PAGE as i64)
}

/// Fills `resident` with `mincore`'s answer for the `len` bytes (page-aligned, at most
/// [`PROBE_PAGES`] pages) at `stretch`, a byte per page; false when it failed.
fn ask_resident(
    stretch: *mut std::ffi::c_void,
    len: usize,
    resident: &mut [u8; PROBE_PAGES],
) -> bool {
    debug_assert!(len <= PROBE_PAGES * PAGE && len.is_multiple_of(PAGE));
    debug_assert!((stretch as usize).is_multiple_of(PAGE));
    // SAFETY: the caller passes a page-aligned range of memory it owns, of at most
    // `PROBE_PAGES` pages, and `resident` has a byte for each; `mincore` only reads the page
    // tables.
    unsafe { nix::libc::mincore(stretch, len, resident.as_mut_ptr()) == 0 }
}

/// Faults in the `n` bytes at `from`, within a region's buffer, for writing.
fn populate_write(from: *mut std::ffi::c_void, n: usize) {
    let Some(addr) = std::ptr::NonNull::new(from) else { return };
    // SAFETY: the span lies within a region's buffer, memory the region owns and nothing else
    // can reach; populating it changes no byte anything may read (it is uninitialized). An
    // older kernel answers EINVAL: the writes fault the pages in then.
    let _ = unsafe {
        nix::sys::mman::madvise(addr, n, nix::sys::mman::MmapAdvise::MADV_POPULATE_WRITE)
    };
}

/// The pages from the first not resident to the last, by `mincore`'s answer (bit 0 of each
/// byte: resident), or `None` when all are.
fn missing_span(resident: &[u8]) -> Option<Range<usize>> {
    let gone = |b: &u8| b & 1 == 0;
    let first = resident.iter().position(gone)?;
    let last = resident.iter().rposition(gone)?;
    Some(first..last + 1)
}

/// Zeroes the bytes of `bytes` outside `ranges` (sorted, disjoint, within it).
fn zero_gaps(bytes: &mut [MaybeUninit<u8>], ranges: &[Range<u64>]) {
    let len = bytes.len();
    let mut at = 0;
    for (start, end) in ranges.iter().map(|r| (r.start as usize, r.end as usize)) {
        bytes[at..start].fill(MaybeUninit::new(0));
        at = end;
    }
    bytes[at..len].fill(MaybeUninit::new(0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gaps_are_zeroed_and_the_ranges_hold_what_was_written() {
        let ranges = [2..4u64, 6..7, 9..10];
        // Memory as a reused allocation would hand it over: someone else's bytes.
        let mut reused = [MaybeUninit::new(0xAA_u8); 12];
        zero_gaps(&mut reused, &ranges);
        // SAFETY: every byte was initialized above.
        let seen = reused.map(|b| unsafe { b.assume_init() });
        assert_eq!(seen, [0, 0, 0xAA, 0xAA, 0, 0, 0xAA, 0, 0, 0xAA, 0, 0], "the gaps, to the end");

        let mut buf = RegionBuf::new(12, &ranges);
        for r in &ranges {
            let n = (r.end - r.start) as usize;
            buf.place(r.start, n).unwrap().put_slice(&vec![7; n]);
        }
        assert!(buf.place(11, 2).is_none(), "past the end");
        // SAFETY: every range was written just above.
        let bytes = unsafe { buf.into_written() };
        assert_eq!(bytes, [0, 0, 7, 7, 0, 0, 7, 0, 0, 7, 0, 0]);
        assert!(RegionBuf::new(0, &[]).place(0, 0).is_some(), "an empty region");
    }

    #[test]
    fn gaps_at_either_end_none_or_all() {
        let zeroed = |len: usize, ranges: &[Range<u64>]| {
            let mut bytes = vec![MaybeUninit::new(0xAA_u8); len];
            zero_gaps(&mut bytes, ranges);
            // SAFETY: every byte was initialized above.
            bytes.iter().map(|b| unsafe { b.assume_init() }).collect::<Vec<u8>>()
        };
        assert_eq!(zeroed(4, std::slice::from_ref(&(0..2))), [0xAA, 0xAA, 0, 0]);
        assert_eq!(zeroed(4, std::slice::from_ref(&(2..4))), [0, 0, 0xAA, 0xAA]);
        assert_eq!(zeroed(4, std::slice::from_ref(&(0..4))), [0xAA; 4]);
        assert_eq!(zeroed(4, &[]), [0; 4]);
    }

    #[test]
    fn the_missing_span_runs_from_the_first_page_not_resident_to_the_last() {
        assert_eq!(missing_span(&[1, 1, 1]), None);
        assert_eq!(missing_span(&[]), None);
        assert_eq!(missing_span(&[0, 0]), Some(0..2));
        // Bits other than bit 0 say nothing about residence.
        assert_eq!(missing_span(&[1, 2, 3, 0, 1, 4, 1]), Some(1..6));
    }

    /// Fresh memory is populated whole; then, resident, not again; a stretch given back is
    /// populated alone, across a probe's boundary; a slice not aligned to pages, its whole
    /// pages. Needs `MADV_POPULATE_WRITE` (Linux 5.14) and 4 KiB pages, as every machine of this
    /// project has.
    #[test]
    fn only_pages_not_resident_are_populated() {
        let pages = PROBE_PAGES + 8;
        let len = std::num::NonZeroUsize::new(pages * PAGE).unwrap();
        let prot = nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE;
        let private = nix::sys::mman::MapFlags::MAP_PRIVATE;
        // SAFETY: a fresh anonymous mapping, only reached through `bytes` below and unmapped
        // at the end.
        let map = unsafe { nix::sys::mman::mmap_anonymous(None, len, prot, private) }.unwrap();
        // SAFETY: the mapping is `len` bytes, writable, and nothing else refers to it.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(map.as_ptr().cast::<MaybeUninit<u8>>(), len.get())
        };
        assert_eq!(populate(bytes), len.get(), "nothing of a fresh mapping is resident");
        assert_eq!(populate(bytes), 0, "every page is resident now");
        let back = PROBE_PAGES - 2;
        let given = bytes.as_mut_ptr().wrapping_byte_add(back * PAGE).cast();
        // SAFETY: four pages within the mapping, whose bytes nothing reads.
        let dropped = unsafe {
            nix::sys::mman::madvise(
                std::ptr::NonNull::new(given).unwrap(),
                4 * PAGE,
                nix::sys::mman::MmapAdvise::MADV_DONTNEED,
            )
        };
        dropped.unwrap();
        assert_eq!(populate(bytes), 4 * PAGE, "the four pages given back, in two probes");
        // SAFETY: all of the mapping's pages, whose bytes nothing reads.
        let dropped = unsafe {
            nix::sys::mman::madvise(map, len.get(), nix::sys::mman::MmapAdvise::MADV_DONTNEED)
        };
        dropped.unwrap();
        let inner = &mut bytes[100..len.get() - 100];
        assert_eq!(populate(inner), (pages - 2) * PAGE, "the whole pages within a slice");
        // SAFETY: the mapping made above, no longer referred to.
        unsafe { nix::sys::mman::munmap(map, len.get()) }.unwrap();
    }

    /// Pages enough to be populated, written in two ranges around a gap that spans pages.
    #[test]
    fn a_region_of_many_pages_holds_its_writes_and_zeroes() {
        let len = 5 * 4096 + 123;
        let ranges = [0..4096u64, 3 * 4096..len as u64];
        let mut buf = RegionBuf::new(len, &ranges);
        for r in &ranges {
            let n = (r.end - r.start) as usize;
            buf.place(r.start, n).unwrap().put_slice(&vec![9; n]);
        }
        // SAFETY: both ranges were written just above.
        let bytes = unsafe { buf.into_written() };
        assert!(bytes[..4096].iter().all(|&b| b == 9));
        assert!(bytes[4096..3 * 4096].iter().all(|&b| b == 0));
        assert!(bytes[3 * 4096..].iter().all(|&b| b == 9));
    }
}
