//! Servers and channels of handoff's gRPC services, plain or over TLS.
//!
//! The internal services (`Scheduler`, `Prefill`) use the cluster's mutual TLS when it is
//! configured: servers require a client certificate from the cluster's CA, and clients dial
//! `https://` with their own certificate, checking that the server's names the host dialed.
//! The public `Generate` service takes a certificate for clients that hold none. TLS is ours,
//! not tonic's ([`tls`]): a certificate reloaded from its files is taken at the next
//! handshake.

use std::time::Duration;

use handoff_core::tls::{ClusterTls, ListenerTls, ServerTls};
use handoff_core::traffic::{Protocol, TrafficLayer};
use tonic::transport::{Channel, Endpoint, Server};
use tower::layer::util::Stack;

mod bounded;
mod placed;
mod tls;
pub use bounded::{BoundBodies, Bounded};
pub use placed::{Placed, placed_incoming};
pub use tls::{Dialed, LazyTls, TlsDialer, with_tls};

/// How often an internal channel pings its server when it has heard nothing ...
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
/// ... and how long it waits for the answer before the connection counts as lost.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a public server pings a client connection it has heard nothing on.
pub const PUBLIC_KEEPALIVE_EVERY: Duration = Duration::from_secs(30);

/// Connections an internal service's listener holds open at once (one or a few per frontend,
/// replica or prefill of the cluster).
pub const CLUSTER_MAX_CONNECTIONS: usize = 4_096;

/// How long an internal service's connection may go without a byte read before it is
/// closed: both ends ping every 5 s, so only a dead peer, or a socket opened and left
/// silent, is that quiet.
pub const CLUSTER_QUIET: Duration = Duration::from_secs(90);

/// The connections an internal service's `listener` accepts: at most
/// [`CLUSTER_MAX_CONNECTIONS`] at once, each closed after [`CLUSTER_QUIET`] without a word
/// (before, an unbounded accept loop took whatever connections came, and once the process
/// was out of descriptors spun on its failing accepts). A server without TLS serves these as
/// they are: through one more layer, the `overhead` bench's open loop at half load measured a
/// p50 about 20 % higher (the mechanism not found: one match per read and write should not
/// cost that).
pub fn cluster_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<Placed>> + Send + 'static {
    placed_incoming(listener, CLUSTER_MAX_CONNECTIONS, CLUSTER_QUIET)
}

/// [`cluster_incoming`] over the cluster's mutual TLS.
pub fn cluster_incoming_tls(
    listener: tokio::net::TcpListener,
    tls: &ClusterTls,
) -> impl tokio_stream::Stream<Item = std::io::Result<LazyTls>> + Send + 'static {
    with_tls(cluster_incoming(listener), ListenerTls::Cluster(tls.clone()))
}

/// The connections a public service's `listener` accepts over its certificate: at most `max`
/// at once, each closed after `quiet` without a word (without TLS: [`placed_incoming`]).
pub fn public_incoming_tls(
    listener: tokio::net::TcpListener,
    tls: &ServerTls,
    max: usize,
    quiet: Duration,
) -> impl tokio_stream::Stream<Item = std::io::Result<LazyTls>> + Send + 'static {
    with_tls(placed_incoming(listener, max, quiet), ListenerTls::Public(tls.clone()))
}

/// How long a TLS handshake may take, on either side.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a server or channel could not be set up, or a server stopped.
#[derive(Debug)]
pub enum GrpcError {
    /// The address is not `host:port`.
    Address {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A server failed while serving.
    Serve(tonic::transport::Error),
}

impl std::fmt::Display for GrpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GrpcError::Address { addr, reason } => write!(f, "address {addr:?}: {reason}"),
            GrpcError::Serve(e) => write!(f, "gRPC server: {e}"),
        }
    }
}

impl std::error::Error for GrpcError {}

/// A server builder for an internal service (its TLS is [`cluster_incoming_tls`]'s). A caller
/// gone without a word (its host lost power, a partition) gives its connection back within
/// 15 s, and its calls are dropped with it (a prefill gives up their queued work, not
/// computing and sending KV for a decode that is gone).
pub fn cluster_server() -> Counted {
    counted(
        Server::builder()
            .http2_keepalive_interval(Some(KEEPALIVE_EVERY))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT)),
    )
}

/// A server builder whose calls are counted and timed ([`TrafficLayer`]).
pub type Counted = Server<Stack<TrafficLayer, tower::layer::util::Identity>>;

/// [`cluster_server`]'s router, with its services added.
pub type CountedRouter =
    tonic::transport::server::Router<Stack<TrafficLayer, tower::layer::util::Identity>>;

/// Serves `router` on `listener` until `shutdown`: over the cluster's mutual TLS when `tls` is
/// given ([`cluster_incoming_tls`]), else its plain connections as they are
/// ([`cluster_incoming`]).
pub async fn serve_cluster(
    router: CountedRouter,
    listener: tokio::net::TcpListener,
    tls: Option<&ClusterTls>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    match tls {
        None => router.serve_with_incoming_shutdown(cluster_incoming(listener), shutdown).await,
        Some(tls) => {
            let incoming = cluster_incoming_tls(listener, tls);
            router.serve_with_incoming_shutdown(incoming, shutdown).await
        }
    }
}

fn counted(s: Server) -> Counted {
    s.layer(TrafficLayer(Protocol::Grpc))
}

/// A server builder for a public service (its TLS is [`public_incoming_tls`]'s): at most
/// `max_streams` streams open at once on one client connection (tonic's default is no bound:
/// each stream holds its answer's messages until the client reads them, after the request's
/// own end too), and its request bodies within `bodies`.
pub fn public_server(max_streams: u32, bodies: BoundBodies) -> Public {
    // A client gone without a word (a crashed host, a partition) gives its connection back
    // within 40 s.
    let base = Server::builder()
        .http2_keepalive_interval(Some(PUBLIC_KEEPALIVE_EVERY))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(max_streams);
    counted(base).layer(bodies)
}

/// A public server builder: counted, its request bodies bounded.
pub type Public = Server<Stack<BoundBodies, Stack<TrafficLayer, tower::layer::util::Identity>>>;

/// A lazily connecting channel to an internal service at `addr` (`host:port`): `https://`
/// with the cluster's mutual TLS when given, else `http://`.
pub fn cluster_channel(
    addr: &str,
    tls: Option<&ClusterTls>,
    connect_timeout: Duration,
) -> Result<Channel, GrpcError> {
    let endpoint = |scheme: &str| {
        Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| GrpcError::Address { addr: addr.to_owned(), reason: e.to_string() })
    };
    // HTTP/2 pings find a connection the network lost within 15 s, so a call on it fails (and
    // is retried elsewhere) instead of waiting out its deadline.
    let ep = endpoint("http")?
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_EVERY)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    Ok(match tls {
        None => ep.connect_timeout(connect_timeout).connect_lazy(),
        // Our dialer does the TLS (the connector is handed the `http` URI); requests name
        // the `https` origin. Its own limits, as tonic's connector had them: `connect_timeout`
        // for TCP, shared by the host's addresses, and then the handshake's (an endpoint's
        // `connect_timeout` would bound both together).
        Some(tls) => {
            let dialer = TlsDialer::new(tls.clone(), connect_timeout);
            ep.origin(endpoint("https")?.uri().clone()).connect_with_connector_lazy(dialer)
        }
    })
}
