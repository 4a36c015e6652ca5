//! Connections accepted within a bound: each holds one of its listener's places until it
//! closes, and past the bound new ones wait in the listen backlog. tonic serves every
//! connection it is handed for as long as it stays up (an idle HTTP/2 connection too), so a
//! public listener without a bound runs out of descriptors, and then accepts no one.
//!
//! A connection nothing is read from for its `quiet` time is closed: hyper pings a client
//! only once its HTTP/2 preface has come, so a client that connected and said nothing (or
//! finished its TLS handshake and said nothing) held its place for as long as it liked, and
//! 16,384 such sockets kept every new client out. A live client is never that quiet: the
//! servers ping it at least every 30 s, and it answers.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_stream::Stream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding a place of its listener until dropped, and failing its reads once
/// nothing has been read from it for its quiet time.
#[derive(Debug)]
pub struct Placed {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
    quiet: Quiet,
}

/// The connections `listener` accepts, at most `max` open at once, with `TCP_NODELAY` set;
/// each is closed once nothing has been read from it for `quiet`.
pub fn placed_incoming(
    listener: TcpListener,
    max: usize,
    quiet: Duration,
) -> impl Stream<Item = io::Result<Placed>> + Send + 'static {
    let places = Arc::new(Semaphore::new(max.max(1)));
    futures::stream::unfold((listener, places), move |(listener, places)| async move {
        let place = places.clone().acquire_owned().await.ok()?;
        let accepted = listener.accept().await.map(|(stream, _)| {
            // Best effort: a socket that refuses the option still works, only slower.
            let _ = stream.set_nodelay(true);
            Placed { stream, _place: place, quiet: Quiet::new(quiet) }
        });
        if accepted.is_err() {
            // Out of descriptors and the like pass; tonic asks again at once: don't spin.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Some((accepted, (listener, places)))
    })
}

/// When a connection was last heard from, and the timer that ends it once it has been quiet
/// too long. A read only notes the time; the timer is moved when it fires early.
#[derive(Debug)]
struct Quiet {
    limit: Duration,
    heard: Instant,
    timer: Pin<Box<Sleep>>,
}

impl Quiet {
    fn new(limit: Duration) -> Self {
        let heard = Instant::now();
        Quiet { limit, heard, timer: Box::pin(tokio::time::sleep_until(heard + limit)) }
    }

    /// Whether the connection has been quiet for its limit (else the timer wakes `cx` then).
    fn poll_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let by = self.heard + self.limit;
            if by <= Instant::now() {
                return true;
            }
            self.timer.as_mut().reset(by);
        }
    }
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
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.quiet.heard = Instant::now();
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.quiet.poll_too_long(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("nothing heard from the client for {:?}", self.quiet.limit),
            ))),
            other => other,
        }
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
        let mut incoming = std::pin::pin!(placed_incoming(listener, 2, Duration::from_secs(60)));
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

#[cfg(test)]
mod quiet_tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    use super::*;

    async fn accepted(quiet: Duration) -> (Placed, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let mut incoming = std::pin::pin!(placed_incoming(listener, 4, quiet));
        (incoming.next().await.unwrap().unwrap(), client)
    }

    /// A client that connected and said nothing is cut off at its quiet time.
    #[tokio::test]
    async fn a_client_that_says_nothing_is_cut_off() {
        let (mut conn, _client) = accepted(Duration::from_millis(200)).await;
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut buf)).await;
        let err = read.expect("the quiet connection stayed open").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    /// A client heard from more often than the quiet time stays, for several times it.
    #[tokio::test]
    async fn a_client_that_talks_stays() {
        let (mut conn, mut client) = accepted(Duration::from_secs(1)).await;
        let mut buf = [0u8; 16];
        for _ in 0..30 {
            client.write_all(b"ping").await.unwrap();
            let n = conn.read(&mut buf).await.expect("a talking client was cut off");
            assert!(n > 0);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
