//! Separate processes on real etcd and NATS servers (started here on free loopback ports,
//! data in a temporary directory, stopped at the end). Needs `etcd` and `nats-server`
//! (scripts/test installs them); fails, never skips, without them.

mod cluster {
    pub(crate) mod bus;
    pub(crate) mod discovery;
    pub(crate) mod engines;
    pub(crate) mod fleet;
    pub(crate) mod frontends;
    pub(crate) mod links;
    pub(crate) mod misconfigured;
    pub(crate) mod netbed;
    pub(crate) mod nixl;
    pub(crate) mod operations;
    pub(crate) mod otlp;
    pub(crate) mod partitions;
    pub(crate) mod ports;
    pub(crate) mod processes;
    pub(crate) mod resync;
    pub(crate) mod servers;
    pub(crate) mod sglang;
    pub(crate) mod stopping;
    pub(crate) mod tls;
    pub(crate) mod trust;
    pub(crate) mod vllm;
}
