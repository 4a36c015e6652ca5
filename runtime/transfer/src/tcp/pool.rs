//! The tcp backend's dialed connections ([`ClientIo`]) and the ack every exchange on one ends
//! with. (The idle pool they return to is [`crate::idle::Idle`].)

use handoff_core::tls::Rechecked;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::wire;
use crate::{AgentAddr, TransferError};

/// A connection this agent dialed: plain, or TLS over the socket.
pub(super) trait ClientIo:
    AsyncRead + AsyncWrite + Unpin + Send + Sync + std::fmt::Debug
{
    /// The socket under it.
    fn socket(&self) -> &TcpStream;

    /// Whether its peer is still trusted (see [`Rechecked::still_trusted`]).
    fn trusted(&self) -> bool {
        true
    }
}

impl ClientIo for TcpStream {
    fn socket(&self) -> &TcpStream {
        self
    }
}

impl ClientIo for Rechecked<tokio_rustls::client::TlsStream<TcpStream>> {
    fn socket(&self) -> &TcpStream {
        self.get_ref().get_ref().0
    }

    fn trusted(&self) -> bool {
        self.still_trusted().is_ok()
    }
}

/// Whether the connection an exchange ended on can serve another: the exchange completed.
/// Not after a refusal: the receiver may be closing it (a forbidden frame, a wrong token),
/// and another request taking it before the close arrives would fail with it.
pub(super) fn reusable(res: &Result<(), TransferError>) -> bool {
    res.is_ok()
}

/// A stream whose connection failed an exchange before.
pub(super) fn broke_earlier(peer: &AgentAddr) -> TransferError {
    io_err(peer, "the stream's connection broke earlier")
}

/// An I/O failure with `peer`.
pub(super) fn io_err(peer: &AgentAddr, e: impl std::fmt::Display) -> TransferError {
    TransferError::Io { peer: peer.clone(), reason: e.to_string() }
}

/// Reads the peer's ack of an exchange.
pub(super) async fn read_ack<S: AsyncRead + Unpin>(
    peer: &AgentAddr,
    s: &mut S,
    max_frame: usize,
) -> Result<(), TransferError> {
    match wire::read_ack(s, peer, max_frame).await? {
        Some(Ok(())) => Ok(()),
        Some(Err(reason)) => Err(TransferError::refused(reason)),
        None => Err(io_err(peer, "connection closed before the ack")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn peer(port: u16) -> AgentAddr {
        AgentAddr { ip: "10.0.0.1".into(), port }
    }

    /// A socket that counts its reads: each is a syscall on an unbuffered stream.
    struct Counted<'a> {
        data: &'a [u8],
        reads: usize,
    }

    impl tokio::io::AsyncRead for Counted<'_> {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let n = buf.remaining().min(self.data.len());
            buf.put_slice(&self.data[..n]);
            self.data = &self.data[n..];
            self.reads += 1;
            std::task::Poll::Ready(Ok(()))
        }
    }

    async fn ack(verdict: Result<(), &str>) -> Vec<u8> {
        let mut b = Vec::new();
        wire::write_ack(&mut b, &verdict.map_err(str::to_owned)).await.unwrap();
        b
    }

    /// A plain ack takes one read and nothing past it; a refusal comes with its reason and
    /// leaves the next frame whole; what is not an ack, or too short to be one, is malformed.
    #[tokio::test]
    async fn an_ack_is_read_in_one_read_and_no_further() {
        let at = peer(1);
        let (yes, no) = (ack(Ok(())).await, ack(Err("region expired")).await);
        let both: Vec<u8> = [yes.clone(), no.clone(), yes.clone()].concat();
        let mut s = Counted { data: &both, reads: 0 };
        assert!(read_ack(&at, &mut s, 1 << 20).await.is_ok());
        assert_eq!((s.reads, s.data.len()), (1, no.len() + yes.len()), "one read, no further");
        let refused = read_ack(&at, &mut s, 1 << 20).await;
        assert!(matches!(refused, Err(TransferError::Rejected(r)) if r == "region expired"));
        assert_eq!(s.data, &yes[..], "the next ack is left whole");
        assert!(read_ack(&at, &mut s, 1 << 20).await.is_ok());
        let closed = read_ack(&at, &mut s, 1 << 20).await;
        assert!(matches!(closed, Err(TransferError::Io { .. })), "{closed:?}");

        let mut notice = Vec::new();
        let n = crate::Notice {
            room: handoff_core::Room::mint(),
            sender: crate::SenderId::new(0, 0),
            first_token: 1,
            tokens: 2,
            cached_tokens: 0,
            bytes: 3,
            checksum: 4,
        };
        wire::write_notice(&mut notice, crate::RegionId(1), &n).await.unwrap();
        let short = [2u8, 0, 0, 0, 4]; // an ack's head, then the stream ends
        let empty = [1u8, 0, 0, 0, 4, 9]; // an ack of no verdict
        let long = [0u8, 0, 0, 2, 4, 1]; // longer than a frame may be
        for bad in [&notice[..], &short[..], &empty[..], &long[..]] {
            let got = read_ack(&at, &mut Counted { data: bad, reads: 0 }, 1 << 20).await;
            assert!(matches!(got, Err(TransferError::Malformed(_))), "{bad:?}: {got:?}");
        }
    }

    /// Acks that came together are read together, the n-th and nothing past it; a refusal
    /// among them keeps its reason, and a stream that ends between two gives fewer.
    #[tokio::test]
    async fn acks_that_came_together_are_read_together() {
        let (yes, no) = (ack(Ok(())).await, ack(Err("region expired")).await);
        let next = b"next frame";
        let plain: Vec<u8> = [yes.clone(), yes.clone(), yes.clone(), next.to_vec()].concat();
        let mut s = Counted { data: &plain, reads: 0 };
        let got = wire::read_acks(&mut s, &peer(1), 3, 1 << 20).await.unwrap();
        assert_eq!(got, vec![Ok(()), Ok(()), Ok(())]);
        assert_eq!((s.reads, s.data), (1, &next[..]), "one read, no further");

        let mixed: Vec<u8> = [yes.clone(), no.clone(), yes.clone(), next.to_vec()].concat();
        let mut s = Counted { data: &mixed, reads: 0 };
        let got = wire::read_acks(&mut s, &peer(1), 3, 1 << 20).await.unwrap();
        assert_eq!(got, vec![Ok(()), Err("region expired".to_owned()), Ok(())]);
        assert_eq!(s.data, &next[..], "nothing past the third");

        let cut: Vec<u8> = [yes.clone(), yes.clone()].concat();
        let got =
            wire::read_acks(&mut Counted { data: &cut, reads: 0 }, &peer(1), 3, 1 << 20).await;
        assert_eq!(got.unwrap().len(), 2, "the stream ended after two");
        let torn = &cut[..9];
        let got =
            wire::read_acks(&mut Counted { data: torn, reads: 0 }, &peer(1), 2, 1 << 20).await;
        assert!(matches!(got, Err(TransferError::Malformed(_))), "{got:?}");
    }

    /// A frame's bound is its kind's, checked before its body is read: a peer declaring a
    /// 64 MiB notice or a 1 MiB ack (and sending nothing more) is refused at once, not
    /// waited on and buffered.
    #[tokio::test]
    async fn frames_longer_than_their_kind_are_refused_before_their_body() {
        use tokio::io::AsyncWriteExt;
        let within = Duration::from_secs(5);
        let (mut peer_end, mut ours) = tokio::io::duplex(1 << 10);
        peer_end.write_all(&[0, 0, 0, 4, 3]).await.unwrap(); // a notice of 64 MiB
        let got = tokio::time::timeout(within, wire::read_frame(&mut ours, 128 << 20)).await;
        let got = got.expect("refused without waiting for the body");
        assert!(matches!(got, Err(TransferError::Malformed(_))), "{got:?}");
        let (mut peer_end, mut ours) = tokio::io::duplex(1 << 10);
        peer_end.write_all(&[0, 0, 16, 0, 4, 1]).await.unwrap(); // an ack of 1 MiB
        let got =
            tokio::time::timeout(within, wire::read_acks(&mut ours, &peer(1), 1, 128 << 20)).await;
        let got = got.expect("refused without waiting for the rest");
        assert!(matches!(got, Err(TransferError::Malformed(_))), "{got:?}");
    }

    /// A connection reset (or a TLS stream cut without its close) while an ack is awaited is
    /// the peer's loss (`Io`, which a handshake retries on a fresh connection), not a
    /// malformed frame.
    #[tokio::test]
    async fn a_reset_while_an_ack_is_awaited_is_an_io_error() {
        struct Reset;
        impl AsyncRead for Reset {
            fn poll_read(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
                _: &mut tokio::io::ReadBuf<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()))
            }
        }
        let got = read_ack(&peer(1), &mut Reset, 1 << 20).await;
        assert!(matches!(got, Err(TransferError::Io { .. })), "{got:?}");
    }
}
