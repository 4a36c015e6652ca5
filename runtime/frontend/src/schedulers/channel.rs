//! [`ReplicaChannel`]: how a frontend reaches one scheduler replica. Either a gRPC channel
//! over the network, or the replica's service in this process: the call is then the
//! service's own future, run on the caller's task (the messages are still encoded and
//! decoded, with no socket, no h2 framing and no wakeup of another task in between).

use std::convert::Infallible;

use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{Body as HttpBody, Bytes, StdError};
use tonic::transport::Channel;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

/// One replica's transport (see the module docs).
pub type ReplicaChannel = BoxCloneSyncService<Request<Body>, Response<Body>, TransportError>;

/// A call's failure below gRPC: the network's (an in-process scheduler's service has none).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct TransportError(StdError);

/// A replica over the network.
pub(crate) fn remote(channel: Channel) -> ReplicaChannel {
    BoxCloneSyncService::new(channel.map_err(|e| TransportError(e.into())))
}

/// A replica's gRPC service in this process (a `SchedulerServer`, as a scheduler serves it).
pub fn in_process<S, B>(service: S) -> ReplicaChannel
where
    S: tower::Service<Request<Body>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError>,
{
    let service = service.map_response(|r| r.map(Body::new));
    BoxCloneSyncService::new(service.map_err(|e: Infallible| match e {}))
}
