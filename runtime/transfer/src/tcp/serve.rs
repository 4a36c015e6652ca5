//! The tcp backend's receiving side: one inbound connection served until it closes or
//! breaks the protocol, over tcp (plain or TLS) or a same-host Unix socket with a shared
//! window ([`super::shm`]); and the same frame handling for the fuzzer.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tracing::debug;

use super::receive::{self, Writer};
use super::shm::SharedWindow;
use super::wire::{self, Frame};
use crate::listen::Place;
use crate::{ConnId, Inbox, RegionId, TransferError};

/// Decodes `bytes` as the frames of one inbound connection and hands each to `inbox` as a
/// served connection would, until the bytes end or a frame is malformed; returns how many
/// frames were decoded. For fuzzing the decoder and the inbox behind it: no input may panic.
pub async fn apply_frames(bytes: &[u8], inbox: &Inbox, max_frame: usize) -> usize {
    let mut r = bytes;
    let (mut n, mut piece) = (0, Vec::new());
    while let Ok(Some(frame)) = wire::read_frame(&mut r, max_frame).await {
        n += 1;
        let _ = match frame {
            Frame::Connect(req) => inbox.on_connect(req),
            Frame::Write { region, sender, segments } => {
                let w = Writer { region, sender, conn: ConnId(0) };
                let admitted = receive::admit(inbox, w, &mut HashSet::new());
                match receive::land(&mut r, &mut piece, inbox, w, &segments, admitted).await {
                    Ok(landed) => landed,
                    Err(_) => break,
                }
            }
            Frame::Notice { region, notice } => inbox.on_notice(region, ConnId(0), notice),
            // No window to find a shared write's bytes in: the connection would close.
            Frame::SharedWrite { .. } => break,
            Frame::Ack(_) | Frame::Hello(_) => Ok(()),
        };
    }
    n
}

/// What every inbound connection is served with.
#[derive(Debug)]
pub(super) struct ConnCfg {
    pub(super) max_frame: usize,
    pub(super) token: Option<String>,
    pub(super) max_unknown_writes: u32,
    pub(super) idle_timeout: Duration,
    pub(super) frame_timeout: Duration,
    pub(super) hello_timeout: Duration,
}

/// One inbound connection.
#[derive(Debug)]
pub(super) struct Inbound<'a> {
    /// Who it is, for logs.
    pub(super) peer: &'a str,
    pub(super) id: ConnId,
    /// Whether it said its hello already (a shm connection's comes with its window).
    pub(super) authed: bool,
    /// The window a shm connection's sender shares: its writes' bytes are there.
    pub(super) window: Option<SharedWindow>,
    /// Its place at the listener, proven at the hello.
    pub(super) place: Option<&'a Place>,
}

/// Serves one inbound connection until it closes or breaks the protocol.
pub(super) async fn serve_conn<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    inbound: Inbound<'_>,
    inbox: Arc<Inbox>,
    cfg: &ConnCfg,
) {
    let Inbound { peer, id: conn, authed, window, place } = inbound;
    let prove = || {
        if let Some(p) = place {
            p.proven();
        }
    };
    let (r, w) = tokio::io::split(stream);
    let mut r = BufReader::with_capacity(wire::BUFFERED, r);
    // Acks wait here while the frames they answer were read together, and go out together
    // before the connection reads from its socket again (see `flush_acks`).
    let mut w = BufWriter::with_capacity(ACKS_BUFFERED, w);
    let mut authed = authed || cfg.token.is_none();
    if authed {
        prove();
    }
    let mut unknown = 0u32;
    // Where a refused write's payload is drained (see `receive`).
    let mut piece = Vec::new();
    // A shared write's pair continued by the next one (see `receive::land_shared`).
    let mut open_pair = None;
    // Regions this connection wrote into and has not yet sent the notice for.
    let mut open: HashSet<RegionId> = HashSet::new();
    let reason = loop {
        // Before the hello, nothing bigger than a hello is read.
        let max_frame = if authed { cfg.max_frame } else { wire::MAX_TOKEN + 1 };
        // Idle until a frame begins, then the whole frame within its own time. Before its
        // hello a connection may idle only briefly: it holds a place it has not earned.
        let idle = if authed { cfg.idle_timeout } else { cfg.hello_timeout };
        if r.buffer().is_empty()
            && let Err(why) = flush_acks(&mut w, cfg.frame_timeout).await
        {
            break why.to_owned();
        }
        match tokio::time::timeout(idle, r.fill_buf()).await {
            Ok(Ok(b)) if !b.is_empty() => {}
            Ok(_) => break "sender connection closed mid-transfer".to_owned(),
            Err(_) => {
                debug!(%peer, "idle transfer connection closed");
                break "sender connection idle too long".to_owned();
            }
        }
        let frame_time = if authed { cfg.frame_timeout } else { cfg.hello_timeout };
        // The whole frame within its time, a write's payload landed as it arrives.
        let read = tokio::time::timeout(frame_time, async {
            let frame = wire::read_frame(&mut r, max_frame).await?;
            let landed = match &frame {
                Some(Frame::Write { region, sender, segments }) if authed => {
                    let w = Writer { region: *region, sender: *sender, conn };
                    // Once admitted the region is this connection's: if it breaks inside
                    // the payload, the region fails with it.
                    let admitted = receive::admit(&inbox, w, &mut open);
                    Some(receive::land(&mut r, &mut piece, &inbox, w, segments, admitted).await?)
                }
                Some(Frame::SharedWrite { region, sender, half, pieces }) if authed => {
                    let w = Writer { region: *region, sender: *sender, conn };
                    let half = window.as_ref().and_then(|win| win.half(*half));
                    let half = half.ok_or_else(|| {
                        TransferError::Malformed("a shared write with no such window".into())
                    })?;
                    let admitted = receive::admit(&inbox, w, &mut open);
                    Some(receive::land_shared(half, &inbox, w, pieces, &mut open_pair, admitted)?)
                }
                _ => None,
            };
            Ok::<_, TransferError>((frame, landed))
        });
        let Ok(read) = read.await else {
            debug!(%peer, "transfer frame too slow; closing");
            break "sender connection too slow mid-frame".to_owned();
        };
        let (frame, landed) = match read {
            Ok((Some(f), landed)) => (f, landed),
            Ok((None, _)) => break "sender connection closed mid-transfer".to_owned(),
            Err(e) => {
                debug!(%peer, error = %e, "bad transfer frame; closing");
                refuse(&mut w, &Err(e.to_string()), cfg.frame_timeout).await;
                break format!("sender connection broke mid-transfer: {e}");
            }
        };
        let reply = match frame {
            Frame::Hello(token) => {
                authed = crate::token_accepted(cfg.token.as_deref(), Some(&token));
                if !authed {
                    let wrong = Err(crate::error::WRONG_TOKEN.into());
                    refuse(&mut w, &wrong, cfg.frame_timeout).await;
                    debug!(%peer, "transfer connection with a wrong token; closing");
                    break "wrong token".to_owned();
                }
                prove();
                Some(Ok(()))
            }
            _ if !authed => {
                let e = "the first frame must be a hello with the cluster token";
                refuse(&mut w, &Err(e.into()), cfg.frame_timeout).await;
                debug!(%peer, "unauthenticated transfer connection; closing");
                break e.to_owned();
            }
            Frame::Connect(_) if window.is_some() => {
                let e = "handshakes go over tcp, not shared memory";
                refuse(&mut w, &Err(e.into()), cfg.frame_timeout).await;
                break e.to_owned();
            }
            Frame::Connect(req) => Some(inbox.on_connect(req)),
            Frame::Write { .. } | Frame::SharedWrite { .. } => {
                // A shared write is answered before the connection next waits (its half is
                // the sender's again); a rejected write fails its region, and the sender
                // learns it at the notice.
                let shared = matches!(frame, Frame::SharedWrite { .. });
                let verdict = match landed.unwrap_or(Ok(())) {
                    Ok(()) => {
                        // A sender in good standing: what it trailed into regions dropped by
                        // their decodes earlier does not add up against it across requests.
                        unknown = 0;
                        None
                    }
                    Err(e @ TransferError::Forbidden(_)) => Some(Err(e)),
                    Err(TransferError::UnknownRegion(_)) => {
                        unknown += 1;
                        (unknown > cfg.max_unknown_writes).then(|| {
                            Err(TransferError::Forbidden("writes to unknown regions".into()))
                        })
                    }
                    Err(_) => None,
                };
                verdict.or(shared.then_some(Ok(())))
            }
            Frame::Notice { .. } if open_pair.is_some() => {
                let e = "a notice with a shared pair unfinished";
                refuse(&mut w, &Err(e.into()), cfg.frame_timeout).await;
                break e.to_owned();
            }
            Frame::Notice { region, notice } => {
                open.remove(&region);
                Some(inbox.on_notice(region, conn, notice))
            }
            Frame::Ack(_) => {
                refuse(&mut w, &Err("unexpected ack".into()), cfg.frame_timeout).await;
                break "protocol violation: unexpected ack".to_owned();
            }
        };
        // Refused for what the connection is, not what it carried: the answer, then close.
        if let Some(Err(e @ TransferError::Forbidden(_))) = &reply {
            debug!(%peer, error = %e, "transfer connection closed");
            refuse(&mut w, &Err(e.to_string()), cfg.frame_timeout).await;
            break e.to_string();
        }
        if let Some(res) = reply
            && let Err(why) =
                answer(&mut w, &res.map_err(|e| e.to_string()), cfg.frame_timeout).await
        {
            break why.to_owned();
        }
    };
    // Acks still queued (of frames read before one that broke off) go if they can.
    let _ = flush_acks(&mut w, cfg.frame_timeout).await;
    for region in open {
        inbox.fail(region, reason.clone());
    }
}

/// What a connection's acks are buffered in: a few dozen plain ones.
const ACKS_BUFFERED: usize = 256;

/// Queues an ack, sent by the next [`flush_acks`] (or at once, when the buffer is full),
/// within `within`: a sender that stops reading its answers cannot hold the connection (and
/// its place) forever. `Err` names why the connection must close.
async fn answer<W: AsyncWrite + Unpin>(
    w: &mut BufWriter<W>,
    res: &Result<(), String>,
    within: Duration,
) -> Result<(), &'static str> {
    written(tokio::time::timeout(within, wire::put_ack(w, res)).await)
}

/// Sends the queued acks, within `within`. Called whenever the read buffer is empty, before
/// the connection reads from its socket again (and waits, if nothing has come), so an ack is
/// never held while its sender waits for it: the plain acks of frames read together (a
/// shared write and the notice right behind it) go in one write (a refusal's reason may take
/// its own). A frame already begun is read to its end first, which never needs an ack: a
/// sender writes each frame whole, and flushes it, before it waits for any answer.
async fn flush_acks<W: AsyncWrite + Unpin>(
    w: &mut BufWriter<W>,
    within: Duration,
) -> Result<(), &'static str> {
    written(tokio::time::timeout(within, w.flush()).await)
}

fn written(
    r: Result<std::io::Result<()>, tokio::time::error::Elapsed>,
) -> Result<(), &'static str> {
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("sender connection lost"),
        Err(_) => Err("sender not reading its acks"),
    }
}

/// The last answer before closing a connection, after the acks queued before it: written if
/// it can be, within `within`.
async fn refuse<W: AsyncWrite + Unpin>(
    w: &mut BufWriter<W>,
    res: &Result<(), String>,
    within: Duration,
) {
    if answer(w, res, within).await.is_ok() {
        let _ = flush_acks(w, within).await;
    }
}

#[cfg(test)]
mod tests;
