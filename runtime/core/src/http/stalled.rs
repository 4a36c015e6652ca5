//! A connection whose writes fail once they have made no progress for a time: a client that
//! stops reading a response (an SSE stream whose reader went away without closing, its
//! kernel still acknowledging with a zero window) would otherwise hold the connection, its
//! place among the listener's and the response's buffers for as long as it stays so, past
//! the request's own end. hyper closes a connection whose write fails. A connection whose
//! writes go on, however slowly, is left alone; so is an HTTP/2 connection one of whose
//! streams a client does not read (flow control holds that stream, not the socket).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io`, its writes failing after `within` without progress.
pub(super) struct StallBounded<I> {
    io: I,
    within: Duration,
    /// Armed while a write waits: when it fails.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<I> StallBounded<I> {
    pub(super) fn new(io: I, within: Duration) -> Self {
        StallBounded { io, within, stalled: None }
    }

    /// What a write attempt gave: progress disarms the timer, waiting arms it (once) and
    /// fails when it fires.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let within = self.within;
        let timer = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(within)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no write went through for {within:?}: the client does not read"),
        )))
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for StallBounded<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for StallBounded<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Closing may write too (TLS's close_notify).
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}
