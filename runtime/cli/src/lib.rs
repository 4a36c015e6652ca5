//! The `handoff` binary's library: argument parsing and the assembly of processes.
//!
//! - [`args`] — the command line (clap); the one place configuration is read.
//! - [`cluster`] — [`Cluster`]: a scheduler, prefill instances and a frontend in one process
//!   (`handoff up`, tests, benchmarks).
//! - [`cmd`] — one module per subcommand.

pub mod args;
pub mod cluster;
pub mod cmd;

pub use cluster::{Cluster, ClusterConfig};
