//! Listener helpers.

use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt};

/// Accepted connections of `listener` with `TCP_NODELAY` set: request/response and
/// token-streaming protocols must not wait on Nagle's algorithm (40 ms with delayed ACKs).
pub fn nodelay_incoming(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            // Best effort: a socket that refuses the option still works, only slower.
            let _ = s.set_nodelay(true);
        }
        s
    })
}
