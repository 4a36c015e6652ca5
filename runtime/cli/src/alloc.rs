//! The process's memory allocator: mimalloc.
//!
//! Every request allocates and frees many short-lived buffers on several threads (gRPC
//! frames, KV pages cut for the prefix cache, transfer pieces); glibc's malloc spent about
//! 10 % of the path's CPU on them, trimming and growing its arenas with a syscall every few
//! allocations. With mimalloc the whole path costs about 30 % less CPU per request at
//! saturation (the overhead bench, same run, alternated). Declared here, in the library, so
//! every binary that assembles the path (the `handoff` binary, the cluster tests, the
//! benches) runs on the allocator it ships with, and what the benches measure is what runs.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
