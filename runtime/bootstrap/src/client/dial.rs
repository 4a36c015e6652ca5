//! How the directory client reaches a directory: TCP (`TCP_NODELAY`), then for `https://`
//! the cluster's mutual TLS, proving the host dialed, within [`HANDSHAKE_TIMEOUT`]. A
//! directory's certificate is checked again after a reload changed the cluster's CA file
//! ([`Rechecked`]): a kept connection to a directory of a CA taken out of the bundle is cut
//! at its next call.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use handoff_core::tls::{Alpn, ClusterTls, Rechecked};
use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How long a TLS handshake with a directory may take (a call's own timeout is shorter; a
/// connection hyper goes on making for its pool after the call gave up has this).
pub(crate) const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The connector of a directory client's pools.
#[derive(Clone, Debug)]
pub(crate) struct DirectoryDialer {
    tcp: HttpConnector,
    tls: Option<ClusterTls>,
}

impl DirectoryDialer {
    /// Plain `http://`, and `https://` with `tls` when given.
    pub(crate) fn new(tls: Option<&ClusterTls>) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        DirectoryDialer { tcp, tls: tls.cloned() }
    }
}

/// A connection to a directory.
#[derive(Debug)]
pub(crate) enum DirectoryStream {
    /// `http://`.
    Plain(TcpStream),
    /// `https://`, its server checked again after each reload.
    Tls(Box<Rechecked<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl tower::Service<Uri> for DirectoryDialer {
    type Response = TokioIo<DirectoryStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tcp.poll_ready(cx).map_err(io::Error::other)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = match uri.scheme_str() {
            Some("https") => match &self.tls {
                Some(tls) => Some(tls.clone()),
                None => return Box::pin(async { Err(refused("https:// without TLS settings")) }),
            },
            _ => None,
        };
        let host = uri.host().map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned());
        let shown = uri.to_string();
        let tcp = self.tcp.call(uri);
        Box::pin(async move {
            let tcp = tcp.await.map_err(io::Error::other)?.into_inner();
            let Some(tls) = tls else { return Ok(TokioIo::new(DirectoryStream::Plain(tcp))) };
            let host = host.ok_or_else(|| refused("no host"))?;
            let name = handoff_core::tls::server_name(&host).map_err(io::Error::other)?;
            let s = tls.connect(name, &shown, tcp, Alpn::Unused, HANDSHAKE_TIMEOUT).await?;
            Ok(TokioIo::new(DirectoryStream::Tls(Box::new(s))))
        })
    }
}

fn refused(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_owned())
}

impl Connection for DirectoryStream {
    fn connected(&self) -> Connected {
        match self {
            DirectoryStream::Plain(s) => s.connected(),
            DirectoryStream::Tls(s) => s.get_ref().get_ref().0.connected(),
        }
    }
}

impl AsyncRead for DirectoryStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            DirectoryStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            DirectoryStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DirectoryStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            DirectoryStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            DirectoryStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            DirectoryStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            DirectoryStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            DirectoryStream::Plain(s) => s.is_write_vectored(),
            DirectoryStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            DirectoryStream::Plain(s) => Pin::new(s).poll_flush(cx),
            DirectoryStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            DirectoryStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            DirectoryStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
