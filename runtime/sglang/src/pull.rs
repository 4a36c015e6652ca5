//! The decode's PULL socket, where SGLang's prefill ranks push each request's status and
//! `AUX_DATA` rows, spoken directly: ZMTP 3 with the NULL mechanism, as libzmq's PUSH
//! speaks it. Every frame's length is checked against [`MAX_FRAME_BYTES`] before a byte of
//! it is kept, and a frame's buffer grows only as its bytes arrive. (The `zeromq` crate
//! reserves a peer's declared frame length up front: one header declaring 2^63 bytes, from
//! anyone who could reach the port, aborted the process.) A peer that breaks a bound loses
//! its connection; nobody else notices.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::debug;

/// The longest frame taken: statuses are a few bytes, metadata rows a few KiB.
pub const MAX_FRAME_BYTES: u64 = 1 << 20;
/// The most frames in one message (SGLang's have at most 6).
pub const MAX_MESSAGE_FRAMES: usize = 16;
/// Connections served at once (one per prefill rank that pushes to this decode); beyond,
/// accepts wait in the backlog.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a new connection has to greet and say it is a PUSH socket.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Why a connection was dropped.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The socket failed or closed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak what a PUSH socket speaks.
    #[error("not a ZMTP 3 PUSH peer: {0}")]
    Handshake(&'static str),
    /// A frame longer than [`MAX_FRAME_BYTES`].
    #[error("a frame of {0} bytes (at most {MAX_FRAME_BYTES})")]
    Oversized(u64),
    /// A message of more than [`MAX_MESSAGE_FRAMES`] frames.
    #[error("a message of more than {MAX_MESSAGE_FRAMES} frames")]
    TooManyFrames,
}

/// Our greeting: signature, version 3.0, the NULL mechanism, not a server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A short command frame of `body`.
fn command(body: &[u8]) -> Vec<u8> {
    let mut f = vec![COMMAND, body.len() as u8];
    f.extend_from_slice(body);
    f
}

/// Our READY: the socket type is PULL.
fn ready() -> Vec<u8> {
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&4u32.to_be_bytes());
    body.extend_from_slice(b"PULL");
    command(&body)
}

/// The value of property `name` in a READY command's `props`, if it is there.
fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let [len, rest @ ..] = props {
        let (key, rest) = rest.split_at_checked(usize::from(*len))?;
        let (size, rest) = rest.split_at_checked(4)?;
        let size = u32::from_be_bytes(size.try_into().ok()?) as usize;
        let (value, rest) = rest.split_at_checked(size)?;
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
        props = rest;
    }
    None
}

/// Reads one frame: its flags and body, the body's length checked before it is read.
async fn read_frame(stream: &mut TcpStream) -> Result<(u8, Bytes), PullError> {
    let flags = stream.read_u8().await?;
    let len = match flags & LONG {
        0 => u64::from(stream.read_u8().await?),
        _ => stream.read_u64().await?,
    };
    if len > MAX_FRAME_BYTES {
        return Err(PullError::Oversized(len));
    }
    // Grown as bytes arrive: a peer declaring a long frame and sending nothing holds little.
    let mut body = Vec::with_capacity(len.min(4096) as usize);
    let got = (&mut *stream).take(len).read_to_end(&mut body).await?;
    if (got as u64) < len {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok((flags, body.into()))
}

/// Greets, and checks the peer's greeting and READY (a PUSH socket, NULL mechanism).
async fn handshake(stream: &mut TcpStream) -> Result<(), PullError> {
    stream.write_all(&greeting()).await?;
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer).await?;
    if peer[0] != 0xff || peer[9] & 1 != 1 {
        return Err(PullError::Handshake("no ZMTP signature"));
    }
    if peer[10] < 3 {
        return Err(PullError::Handshake("a version before 3.0"));
    }
    if &peer[12..16] != b"NULL" || peer[16..32].iter().any(|&b| b != 0) {
        return Err(PullError::Handshake("a mechanism other than NULL"));
    }
    stream.write_all(&ready()).await?;
    let (flags, body) = read_frame(stream).await?;
    let props = match body.strip_prefix(b"\x05READY") {
        Some(props) if flags & COMMAND != 0 => props,
        _ => return Err(PullError::Handshake("no READY")),
    };
    match property(props, b"Socket-Type") {
        Some(kind) if kind.eq_ignore_ascii_case(b"PUSH") => Ok(()),
        _ => Err(PullError::Handshake("a socket type other than PUSH")),
    }
}

/// Reads the next message, answering any PING (ZMTP 3.1 heartbeats) on the way.
async fn read_message(stream: &mut TcpStream) -> Result<Vec<Bytes>, PullError> {
    let mut frames = Vec::new();
    loop {
        let (flags, body) = read_frame(stream).await?;
        if flags & COMMAND != 0 {
            // PING: name, a 2-byte TTL, then a context echoed in the PONG.
            if let Some(rest) = body.strip_prefix(b"\x04PING") {
                let mut pong = b"\x04PONG".to_vec();
                pong.extend_from_slice(rest.get(2..).unwrap_or_default());
                stream.write_all(&command(&pong[..pong.len().min(255)])).await?;
            }
            continue;
        }
        frames.push(body);
        if frames.len() > MAX_MESSAGE_FRAMES {
            return Err(PullError::TooManyFrames);
        }
        if flags & MORE == 0 {
            return Ok(frames);
        }
    }
}

/// One peer's connection: the handshake in time, then each message to `on_message`.
async fn connection(
    mut stream: TcpStream,
    on_message: Arc<dyn Fn(&[Bytes]) + Send + Sync>,
) -> Result<(), PullError> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut stream))
        .await
        .map_err(|_| PullError::Handshake("no handshake in time"))??;
    loop {
        let message = read_message(&mut stream).await?;
        on_message(&message);
    }
}

/// Serves PUSH peers on `listener` until `shutdown`, handing each message's frames to
/// `on_message`.
pub async fn serve(
    listener: TcpListener,
    on_message: impl Fn(&[Bytes]) + Send + Sync + 'static,
    shutdown: impl Future<Output = ()>,
) {
    let on_message: Arc<dyn Fn(&[Bytes]) + Send + Sync> = Arc::new(on_message);
    let mut peers = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = peers.join_next(), if !peers.is_empty() => {}
            accepted = listener.accept(), if peers.len() < MAX_CONNECTIONS => match accepted {
                Ok((stream, from)) => {
                    let on_message = on_message.clone();
                    peers.spawn(async move {
                        if let Err(e) = connection(stream, on_message).await {
                            debug!(%from, error = %e, "SGLang PULL connection ended");
                        }
                    });
                }
                Err(e) => {
                    // Out of descriptors, say: a moment for some to close.
                    debug!(error = %e, "SGLang PULL accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests;
