use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use handoff_core::Room;
use tokio::io::{AsyncWriteExt, DuplexStream, ReadBuf};

use super::*;
use crate::{AgentAddr, ConnectRequest, InboxConfig};

/// A server end that counts the writes its acks take.
struct CountedWrites {
    inner: DuplexStream,
    writes: Arc<AtomicUsize>,
}

impl AsyncRead for CountedWrites {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CountedWrites {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let done = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(done, Poll::Ready(Ok(_))) {
            self.writes.fetch_add(1, Ordering::SeqCst);
        }
        done
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn cfg() -> ConnCfg {
    ConnCfg {
        max_frame: 1 << 20,
        token: None,
        max_unknown_writes: 4,
        idle_timeout: Duration::from_secs(30),
        frame_timeout: Duration::from_secs(30),
        hello_timeout: Duration::from_secs(30),
    }
}

fn peer() -> AgentAddr {
    AgentAddr { ip: "127.0.0.1".into(), port: 1 }
}

fn connect(region: u64) -> ConnectRequest {
    ConnectRequest {
        room: Room::mint(),
        receiver: AgentAddr { ip: "127.0.0.1".into(), port: 1 },
        region: RegionId(region),
        region_len: 16,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: None,
    }
}

/// The acks of frames that arrive together go out in one write; a frame that arrives alone
/// is answered before the connection waits for the next.
#[tokio::test]
async fn acks_of_frames_read_together_go_out_together() {
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let writes = Arc::new(AtomicUsize::new(0));
    let server = CountedWrites { inner: server, writes: writes.clone() };
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let inbound = Inbound { peer: "test", id: ConnId(1), authed: true, window: None, place: None };
    let cfg = cfg();
    let serving = serve_conn(server, inbound, inbox, &cfg);
    let talking = async {
        let mut three = Vec::new();
        for region in 1..=3 {
            wire::write_connect(&mut three, &connect(region)).await.unwrap();
        }
        client.write_all(&three).await.unwrap();
        // Three plain yeses (a handshake is kept until the prefill it names takes it).
        for _ in 0..3 {
            assert_eq!(wire::read_ack(&mut client, &peer(), 1 << 20).await.unwrap(), Some(Ok(())));
        }
        assert_eq!(writes.load(Ordering::SeqCst), 1, "three acks, one write");
        // One frame alone: its ack comes while the connection waits for the next.
        let mut one = Vec::new();
        wire::write_connect(&mut one, &connect(4)).await.unwrap();
        client.write_all(&one).await.unwrap();
        assert_eq!(wire::read_ack(&mut client, &peer(), 1 << 20).await.unwrap(), Some(Ok(())));
        assert_eq!(writes.load(Ordering::SeqCst), 2);
        drop(client);
    };
    let guard = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(serving, talking);
    });
    guard.await.expect("an ack was held while its sender waited for it");
}

/// A connection that ends inside the frame after an answered one still gets that answer.
#[tokio::test]
async fn the_acks_queued_before_a_connection_breaks_off_still_go() {
    let (mut client, server) = tokio::io::duplex(1 << 16);
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let inbound = Inbound { peer: "test", id: ConnId(1), authed: true, window: None, place: None };
    let cfg = cfg();
    let serving = serve_conn(server, inbound, inbox, &cfg);
    let talking = async {
        let mut sent = Vec::new();
        wire::write_connect(&mut sent, &connect(1)).await.unwrap();
        sent.extend_from_slice(&[9, 0]); // half of the next frame's length, then the end
        client.write_all(&sent).await.unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(wire::read_ack(&mut client, &peer(), 1 << 20).await.unwrap(), Some(Ok(())));
    };
    let guard = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(serving, talking);
    });
    guard.await.expect("the connection was served to its end");
}
