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

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
