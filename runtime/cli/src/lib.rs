//! The `handoff` binary's library: argument parsing and the assembly of processes.
//!
//! - [`alloc`] — the process's allocator (mimalloc), for every binary linking this library,
//!   and how long it keeps freed memory.
//! - [`args`] — the command line (clap); the one place configuration is read.
//! - [`cluster`] — [`Cluster`]: a scheduler, prefill instances and a frontend in one process
//!   (`handoff up`, tests, benchmarks).
//! - [`cmd`] — one module per subcommand.
//! - [`telemetry`] — logs (text or JSON) and OTLP span export.

pub mod alloc;
pub mod args;
pub mod cluster;
pub mod cmd;
pub mod fds;
pub mod stop;
pub mod telemetry;

pub use cluster::{Cluster, ClusterConfig};
