//! The process's memory allocator: mimalloc.
//!
//! Every request allocates and frees many short-lived buffers on several threads (gRPC
//! frames, transfer pieces, and when this was measured the KV pages the prefix cache cut);
//! glibc's malloc spent about 10 % of the path's CPU on them, trimming and growing its
//! arenas with a syscall every few allocations. With mimalloc the whole path costs about
//! 30 % less CPU per request at saturation (the overhead bench, same code, alternated with
//! glibc's).
//!
//! mimalloc is built without its transparent-huge-page advice (`no_thp`): with it, memory
//! the prefix cache's churn gave back came back as fresh 2 MiB pages, each zeroed whole on
//! its first touch (22 % of the path's CPU in the profile). That only removes mimalloc's own
//! `madvise`; a host whose THP setting is `always` still faults huge pages.
//!
//! Declared here, in the library, so every binary that uses it runs on the allocator the
//! `handoff` binary ships with: the cluster and end-to-end tests, the benches of the whole
//! path (overhead, model, kv_stream, loadgen, goodput, ops_overhead), and prefix_cache, which
//! names this library for it. Benches of one part that never touch this library (vs_dynamo,
//! transfer, churn, engine_events, the index bench) run on the system allocator, their peers
//! in the same process alike; fuzz counts allocations through an allocator of its own, which
//! is why it must not use this library.
//!
//! Processes that call [`keep_freed_memory`] (the binary's roles, every [`crate::Cluster`])
//! have mimalloc hand memory back to the OS once it has lain freed for [`PURGE_DELAY_MS`] (a
//! minute), not after its default of one second. A decode's receive region is allocated for
//! each request and freed once its KV is taken; a request that came more than a second after
//! the last found the region's pages given back, and registering the region faulted them in
//! again, zeroed by the kernel, before its transfer could start. At 256 SmolLM2 tokens (11.8
//! MB a region) that was 0.1-3.6 ms on the request's path in 8 of 10 requests that each
//! followed a run of the engine alone (1.8 s on a busy machine), and in none of 10 with the
//! delay longer; in `kv_stream`'s rows of requests after 2 s idle, the streamed tail at 1024
//! tokens was 7.4-10.3 ms over tcp and 7.2-7.9 over Mooncake with the second, 3.2-3.3 and
//! 3.5-4.1 with the minute. Memory not needed
//! for longer than the delay still goes back (mimalloc purges as it allocates and frees, so
//! at the next allocation after that).

use std::ffi::c_long;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long, in milliseconds, freed memory stays with the process before it goes back to the
/// OS, unless `MIMALLOC_PURGE_DELAY` (milliseconds; mimalloc reads it as the process starts)
/// sets another delay.
pub const PURGE_DELAY_MS: c_long = 60_000;

/// `mi_option_purge_delay` in mimalloc 3's `mi_option_t` (the bindings name no constant for
/// it); the tests check it against mimalloc's default.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Makes mimalloc keep freed memory [`PURGE_DELAY_MS`] before handing it back to the OS, unless
/// the environment set the delay (see the module docs). Call it as early as the process can:
/// the binary's `main` does before its runtime starts, [`crate::Cluster::start_with`] for
/// tests and benches. Calling it again changes nothing.
#[expect(unsafe_code, reason = "mimalloc's options are set through its C API")]
pub fn keep_freed_memory() {
    // SAFETY: `mi_option_set_default` stores the option's value unless the environment set
    // it (valid option, any value valid for a delay). Called with other threads running, the
    // store races only with mimalloc's reads of this one aligned word, which see the old
    // delay or the new one.
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
}

/// The purge delay mimalloc uses now, in milliseconds.
#[cfg(test)]
#[expect(unsafe_code, reason = "mimalloc's options are read through its C API")]
fn purge_delay_now_ms() -> c_long {
    // SAFETY: `mi_option_get` only reads an option's value.
    unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) }
}

#[cfg(test)]
mod tests;
