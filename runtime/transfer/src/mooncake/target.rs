//! The target's two listeners: handshakes (metadata, probe, notify) and data (v2 writes).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use handoff_core::Tasks;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use super::wire::{
    self, FrameType, HEADER_LEN, Header, NotifyMsg, STATUS_OK, STATUS_REJECTED, SegmentDesc,
};
use super::{Control, SUCCESS, Shared, peer_conn};
use crate::TransferError;
use crate::inbox::PIECE;
use crate::listen::{Place, Places};

/// Starts both listeners on `tasks`.
pub(super) fn serve(rpc: TcpListener, data: TcpListener, shared: Arc<Shared>, tasks: &Tasks) {
    let max = Places { max: shared.cfg.max_inbound, grace: shared.cfg.unproven_grace };
    let s = shared.clone();
    crate::listen::serve_accepts(rpc, max, tasks, "mooncake handshake", move |st, peer, _, at| {
        let s = s.clone();
        async move { handshake(st, peer, &s, &at).await }
    });
    crate::listen::serve_accepts(data, max, tasks, "mooncake data", move |st, peer, _, at| {
        let s = shared.clone();
        async move { serve_data(st, peer, &s, &at).await }
    });
}

/// The descriptor of this segment. It lists no buffers: Mooncake's TCP initiators never
/// check a target's buffers (only the target validates), and listing live regions would hand
/// anyone who asks their addresses, in a reply that grows with the load.
pub(super) fn descriptor(s: &Shared) -> SegmentDesc {
    SegmentDesc {
        buffers: Vec::new(),
        name: s.session.clone(),
        protocol: "tcp".into(),
        rdma_server_name: String::new(),
        tcp_data_host: Some(s.data_host.clone()),
        tcp_data_port: s.data_port,
        tcp_proto_version: 2,
        timestamp: String::new(),
    }
}

/// One handshake connection: a request frame, a reply of the same type, then close. Only a
/// notify with the token proves its place: a metadata request or a probe carries none.
async fn handshake(mut st: TcpStream, peer: SocketAddr, s: &Shared, place: &Place) {
    let deadline = s.cfg.handshake_timeout;
    let frame = match tokio::time::timeout(deadline, wire::read_frame(&mut st)).await {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => return debug!(%peer, error = %e, "mooncake handshake refused"),
        Err(_) => return debug!(%peer, "mooncake handshake too slow"),
    };
    let reply = match frame {
        (FrameType::Metadata, _) => s.descriptor.clone(),
        (FrameType::Probe, _) => wire::json_line(&json!({ "status": "success" })),
        (FrameType::Notify, body) => {
            let answer = match on_notify(&body, peer, s) {
                Ok(()) => {
                    place.proven();
                    SUCCESS.to_owned()
                }
                Err(e) => format!("error: {e}"),
            };
            wire::json_line(&NotifyMsg { name: String::new(), notify_msg: answer })
        }
        // RDMA queue pairs are not served over TCP.
        (FrameType::Connection, _) => return,
    };
    let answered = async {
        wire::write_frame(&mut st, frame.0, &reply).await?;
        st.shutdown().await?;
        // As the wheel does: hold on until the client has read and closed.
        let mut sink = [0u8; 64];
        while st.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    if tokio::time::timeout(deadline, answered).await.is_err() {
        debug!(%peer, "mooncake handshake reply not taken in time");
    }
}

/// A `Notify` from another handoff agent: a handshake for this sender, or a notice for this
/// receiver.
fn on_notify(body: &[u8], peer: SocketAddr, s: &Shared) -> Result<(), TransferError> {
    let msg: NotifyMsg = serde_json::from_slice(body)
        .map_err(|e| TransferError::Malformed(format!("mooncake notify: {e}")))?;
    let control: Control = serde_json::from_str(&msg.notify_msg)
        .map_err(|e| TransferError::Malformed(format!("mooncake notify message: {e}")))?;
    match control {
        Control::Connect { req, base } => {
            // The token first: a stranger's handshake leaves nothing behind. Then the base,
            // known before the inbox wakes the prefill that writes to it.
            let token = req.token.as_deref().map(str::as_bytes);
            if !crate::token_accepted(s.cfg.token.as_deref(), token) {
                return Err(TransferError::Unauthorized);
            }
            s.remotes.insert(req.region, base);
            s.inbox.on_connect(req)
        }
        Control::Notice { region, notice, token } => {
            if !crate::token_accepted(s.cfg.token.as_deref(), token.as_deref().map(str::as_bytes)) {
                return Err(TransferError::Unauthorized);
            }
            s.inbox.on_notice(region, peer_conn(peer.ip()), notice)
        }
    }
}

/// One data connection: headers, bodies into regions, a status after each (v2). Its host is
/// its proof: one a token holder's handshake named.
async fn serve_data(mut st: TcpStream, peer: SocketAddr, s: &Shared, place: &Place) {
    if !s.exposed.allowed(peer.ip()) {
        return debug!(%peer, "mooncake data connection from a host no handshake named");
    }
    place.proven();
    loop {
        let mut h = [0u8; HEADER_LEN];
        match tokio::time::timeout(s.cfg.idle_timeout, st.read_exact(&mut h)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return,
            Err(_) => return debug!(%peer, "mooncake data connection idle"),
        }
        let h = Header::decode(&h);
        let applied = tokio::time::timeout(s.cfg.io_timeout, apply(&mut st, peer, &h, s)).await;
        let result = applied.unwrap_or_else(|_| Err("write body too slow".into()));
        match result {
            Ok(()) if h.v2() => {
                if st.write_all(&STATUS_OK.to_le_bytes()).await.is_err() {
                    return;
                }
            }
            Ok(()) => {}
            Err(reason) => {
                debug!(%peer, addr = h.addr, size = h.size, %reason, "mooncake write refused");
                if h.v2() {
                    let _ = st.write_all(&STATUS_REJECTED.to_le_bytes()).await;
                }
                // As the wheel does: a refused request ends the connection.
                return;
            }
        }
    }
}

/// Validates one request and lands its body, read straight into its region: the shard plan
/// names the sender, and the body's range is held before a byte is read, and counts as
/// written only when all of it is in ([`Inbox::begin_body`](crate::Inbox::begin_body)).
/// Only writes into open regions are served.
async fn apply(st: &mut TcpStream, peer: SocketAddr, h: &Header, s: &Shared) -> Result<(), String> {
    if !h.is_write() {
        return Err("READ is not served".into());
    }
    if h.size == 0 {
        return Err("empty request".into());
    }
    let Some((region, offset)) = s.exposed.resolve(&s.inbox, h.addr, h.size) else {
        if s.exposed.retired(h.addr, h.size, tokio::time::Instant::now()) {
            // A given-up region's late write: taken and dropped (see `Exposed::retire`).
            let mut gone = tokio::io::sink();
            let copied = tokio::io::copy(&mut (&mut *st).take(h.size), &mut gone).await;
            return match copied {
                Ok(n) if n == h.size => Ok(()),
                _ => Err("body: the connection ended".into()),
            };
        }
        return Err(format!("[{:#x}, +{}) is not inside an open region", h.addr, h.size));
    };
    let conn = peer_conn(peer.ip());
    let mut body = s.inbox.begin_body(region, conn, offset, h.size).map_err(|e| e.to_string())?;
    while body.remaining() > 0 {
        std::future::poll_fn(|cx| {
            let fill = |place: &mut ReadBuf<'_>| Pin::new(&mut *st).poll_read(cx, place);
            match body.recv(PIECE, fill) {
                Ok(Poll::Ready(Ok(0))) => Poll::Ready(Err("body: the connection ended".into())),
                Ok(Poll::Ready(read)) => {
                    Poll::Ready(read.map(drop).map_err(|e| format!("body: {e}")))
                }
                Ok(Poll::Pending) => Poll::Pending,
                Err(e) => Poll::Ready(Err(e.to_string())),
            }
        })
        .await?;
    }
    body.finish().map_err(|e| e.to_string())
}
