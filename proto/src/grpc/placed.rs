//! Connections accepted within a bound: each holds one of its listener's places until it
//! closes, and past the bound new ones wait in the listen backlog. tonic serves every
//! connection it is handed for as long as it stays up (an idle HTTP/2 connection too), so a
//! public listener without a bound runs out of descriptors, and then accepts no one.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding a place of its listener until dropped.
#[derive(Debug)]
pub struct Placed {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
}

/// The connections `listener` accepts, at most `max` open at once, with `TCP_NODELAY` set.
pub fn placed_incoming(
    listener: TcpListener,
    max: usize,
) -> impl Stream<Item = io::Result<Placed>> + Send + 'static {
    let places = Arc::new(Semaphore::new(max.max(1)));
    futures::stream::unfold((listener, places), |(listener, places)| async move {
        let place = places.clone().acquire_owned().await.ok()?;
        let accepted = listener.accept().await.map(|(stream, _)| {
            // Best effort: a socket that refuses the option still works, only slower.
            let _ = stream.set_nodelay(true);
            Placed { stream, _place: place }
        });
        if accepted.is_err() {
            // Out of descriptors and the like pass; tonic asks again at once: don't spin.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Some((accepted, (listener, places)))
    })
}

impl Connected for Placed {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Placed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Placed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_stream::StreamExt;

    use super::*;

    /// Past the bound, a connection is accepted only once an earlier one closes.
    #[tokio::test]
    async fn a_connection_past_the_bound_waits_for_one_to_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = std::pin::pin!(placed_incoming(listener, 2));
        let _clients: Vec<TcpStream> = {
            let mut c = Vec::new();
            for _ in 0..3 {
                c.push(TcpStream::connect(addr).await.unwrap());
            }
            c
        };
        let within = Duration::from_secs(10);
        let first = tokio::time::timeout(within, incoming.next()).await.unwrap().unwrap().unwrap();
        let second = tokio::time::timeout(within, incoming.next()).await.unwrap().unwrap();
        let early = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(early.is_err(), "a third accepted past the bound of 2");
        drop(first);
        let third = tokio::time::timeout(within, incoming.next()).await;
        assert!(matches!(third, Ok(Some(Ok(_)))), "accepted once a place freed");
        drop(second);
    }
}
