//! Which HTTP a connection speaks, told by its first bytes within a time: HTTP/2 with prior
//! knowledge opens with a fixed preface, anything else is HTTP/1. hyper-util's automatic
//! builder reads those bytes itself with no time limit, so a client that connected and said
//! nothing held its connection forever; here the wait is bounded, and the bytes read are
//! handed on in front of the rest ([`Prefixed`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// The HTTP/2 client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection's first bytes say.
pub(super) enum Spoken<I> {
    /// HTTP/2 with prior knowledge.
    Http2(Prefixed<I>),
    /// HTTP/1 (or something hyper will refuse).
    Http1(Prefixed<I>),
}

/// Reads `io`'s first bytes until they match the HTTP/2 preface or stop matching it, within
/// `within`; `None` when the client said too little in time, or closed.
pub(super) async fn sniff<I: AsyncRead + Unpin>(mut io: I, within: Duration) -> Option<Spoken<I>> {
    let mut seen = Vec::with_capacity(PREFACE.len());
    let read = async {
        let mut buf = [0u8; 24];
        while seen.len() < PREFACE.len() && PREFACE.starts_with(&seen) {
            let n = io.read(&mut buf[..PREFACE.len() - seen.len()]).await.ok()?;
            if n == 0 {
                return None;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        Some(())
    };
    tokio::time::timeout(within, read).await.ok()??;
    let h2 = seen == PREFACE;
    let io = Prefixed { prefix: seen, at: 0, io };
    Some(if h2 { Spoken::Http2(io) } else { Spoken::Http1(io) })
}

/// A connection whose first bytes were read already: they are read again first.
pub(super) struct Prefixed<I> {
    prefix: Vec<u8>,
    at: usize,
    io: I,
}

impl<I: AsyncRead + Unpin> AsyncRead for Prefixed<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Prefixed<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
