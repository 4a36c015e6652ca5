//! End-to-end tests: whole clusters in one process on port 0, real sockets.

mod e2e {
    pub(crate) mod faults;
    pub(crate) mod handshakes;
    pub(crate) mod hostile;
    pub(crate) mod load;
    pub(crate) mod memory;
    pub(crate) mod model;
    pub(crate) mod overload;
    pub(crate) mod path;
    pub(crate) mod reassembly;
    pub(crate) mod replicas;
    pub(crate) mod resync;
    pub(crate) mod stalls;
    pub(crate) mod streams;
    pub(crate) mod support;
    pub(crate) mod tls;
    pub(crate) mod trace_ids;
}
