//! ZMTP 3 with the NULL mechanism, as libzmq's sockets speak it to the engines we talk to
//! (SGLang's PUSH/PULL, vLLM's ROUTER), written here so that every length a peer declares is
//! checked before anything is kept for it. The `zeromq` crate reserves a peer's declared
//! frame length up front: one frame header declaring 2^63 bytes aborted the process.
//! [`Connection`] is one socket's connection to one peer, dialled or accepted (SGLang's
//! PULL, in `handoff_sglang::pull`, accepts).

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest frame taken by default: SGLang's statuses are a few bytes, its metadata rows
/// a few KiB, vLLM's handshake a few KiB ([`Limits`] for others).
pub const MAX_FRAME_BYTES: u64 = 1 << 20;
/// The most frames in one message (SGLang's have at most 20).
pub const MAX_MESSAGE_FRAMES: usize = 32;
/// The most bytes in one message's frames, by default.
pub const MAX_MESSAGE_BYTES: u64 = 2 << 20;

/// How long a message, once begun, may take to arrive whole, by default.
pub const MESSAGE_WITHIN: Duration = Duration::from_secs(10);

/// How long a frame and a message may be on one connection, and how long a message may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes in one frame.
    pub frame: u64,
    /// Bytes in one message's frames.
    pub message: u64,
    /// Time from a message's (or command's) first byte to its last, and to our answer to a
    /// PING: a peer that begins one and stalls, or sends PINGs and never reads our PONGs,
    /// loses the connection instead of holding it (and what it sent) forever. Between
    /// messages a connection may be idle for as long as it stays up.
    pub within: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { frame: MAX_FRAME_BYTES, message: MAX_MESSAGE_BYTES, within: MESSAGE_WITHIN }
    }
}
/// A connection idle this long is probed (TCP keepalive), so a peer that died without a word
/// (a crashed host, a partition) is noticed within a few minutes instead of never.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// How long a new connection has to greet and say what socket it is.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A frame flag: more frames of the message follow.
pub const MORE: u8 = 0x01;
/// A frame flag: the length takes 8 bytes.
pub const LONG: u8 = 0x02;
/// A frame flag: a command, not a message frame.
pub const COMMAND: u8 = 0x04;

/// Why a connection was dropped.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed or closed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak ZMTP 3 as the socket it should be.
    #[error("not a ZMTP 3 peer of the right kind: {0}")]
    Handshake(&'static str),
    /// A frame longer than its connection's [`Limits`].
    #[error("a frame of {0} bytes, past the connection's bound")]
    Oversized(u64),
    /// A message of more than [`MAX_MESSAGE_FRAMES`] frames, or bytes past its connection's
    /// [`Limits`].
    #[error("a message of more than {MAX_MESSAGE_FRAMES} frames, or bytes past the bound")]
    TooManyFrames,
    /// A message begun and not finished (or a PING not answered) within [`Limits::within`].
    #[error("a message begun and not finished within {0:?}")]
    Stalled(Duration),
}

/// Our greeting: signature, version 3.0, the NULL mechanism, not a server.
pub fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A short command frame of `body`.
pub fn command(body: &[u8]) -> Vec<u8> {
    let mut f = vec![COMMAND, body.len() as u8];
    f.extend_from_slice(body);
    f
}

/// A READY command saying the socket is of `kind` (`PUSH`, `PULL`).
pub fn ready(kind: &[u8]) -> Vec<u8> {
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    body.extend_from_slice(kind);
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
pub async fn read_frame(stream: &mut TcpStream, max: u64) -> Result<(u8, Bytes), ZmtpError> {
    let flags = stream.read_u8().await?;
    read_frame_after(stream, flags, max).await
}

/// [`read_frame`] once its flags byte was read.
async fn read_frame_after(
    stream: &mut TcpStream,
    flags: u8,
    max: u64,
) -> Result<(u8, Bytes), ZmtpError> {
    let len = match flags & LONG {
        0 => u64::from(stream.read_u8().await?),
        _ => stream.read_u64().await?,
    };
    if len > max {
        return Err(ZmtpError::Oversized(len));
    }
    // Grown as bytes arrive (a peer declaring a long frame and sending nothing holds little),
    // doubling but never past the frame's length.
    let len = len as usize;
    let mut body: Vec<u8> = Vec::new();
    while body.len() < len {
        if body.len() == body.capacity() {
            body.reserve_exact((len - body.len()).min(body.len().max(4096)));
        }
        let room = (body.capacity() - body.len()) as u64;
        if (&mut *stream).take(room).read_buf(&mut body).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    Ok((flags, body.into()))
}

/// Greets as a socket of kind `ours`, and checks the peer's greeting and READY (a socket of
/// kind `theirs`, the NULL mechanism).
pub async fn handshake(
    stream: &mut TcpStream,
    ours: &[u8],
    theirs: &[u8],
) -> Result<(), ZmtpError> {
    stream.write_all(&greeting()).await?;
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer).await?;
    if peer[0] != 0xff || peer[9] & 1 != 1 {
        return Err(ZmtpError::Handshake("no ZMTP signature"));
    }
    if peer[10] < 3 {
        return Err(ZmtpError::Handshake("a version before 3.0"));
    }
    if &peer[12..16] != b"NULL" || peer[16..32].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Handshake("a mechanism other than NULL"));
    }
    stream.write_all(&ready(ours)).await?;
    let (flags, body) = read_frame(stream, MAX_FRAME_BYTES).await?;
    let props = match body.strip_prefix(b"\x05READY") {
        Some(props) if flags & COMMAND != 0 => props,
        _ => return Err(ZmtpError::Handshake("no READY")),
    };
    match property(props, b"Socket-Type") {
        Some(kind) if kind.eq_ignore_ascii_case(theirs) => Ok(()),
        _ => Err(ZmtpError::Handshake("another socket type")),
    }
}

/// Writes one message: its frames, each but the last flagged MORE.
pub async fn write_message(stream: &mut TcpStream, frames: &[Bytes]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        match u8::try_from(f.len()) {
            Ok(len) => out.extend_from_slice(&[more, len]),
            Err(_) => {
                out.push(more | LONG);
                out.extend_from_slice(&(f.len() as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(f);
    }
    stream.write_all(&out).await
}

/// Has the kernel probe `stream` once idle for [`KEEPALIVE_IDLE`].
pub fn keep_alive(stream: &TcpStream) -> std::io::Result<()> {
    let probes = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(Duration::from_secs(10));
    socket2::SockRef::from(stream).set_tcp_keepalive(&probes)
}

/// Reads the next message, answering any PING (ZMTP 3.1 heartbeats) on the way. It waits
/// for a message to begin as long as the connection lasts; once begun, the message (or a
/// command, and our PONG) must be done within [`Limits::within`].
pub async fn read_message(stream: &mut TcpStream, limits: Limits) -> Result<Vec<Bytes>, ZmtpError> {
    loop {
        let flags = stream.read_u8().await?;
        let rest = read_message_after(stream, flags, limits);
        match tokio::time::timeout(limits.within, rest).await {
            Ok(Ok(Some(frames))) => return Ok(frames),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(ZmtpError::Stalled(limits.within)),
        }
    }
}

/// The rest of a message whose first frame's flags were `flags`; `None` for a command
/// (a PING is answered).
async fn read_message_after(
    stream: &mut TcpStream,
    mut flags: u8,
    limits: Limits,
) -> Result<Option<Vec<Bytes>>, ZmtpError> {
    let (mut frames, mut bytes) = (Vec::new(), 0u64);
    loop {
        // What is left of the message's bytes bounds this frame too.
        let room = limits.frame.min(limits.message.saturating_sub(bytes));
        let (flags_read, body) = read_frame_after(stream, flags, room).await?;
        if flags_read & COMMAND != 0 {
            // PING: name, a 2-byte TTL, then a context echoed in the PONG.
            if let Some(rest) = body.strip_prefix(b"\x04PING") {
                let mut pong = b"\x04PONG".to_vec();
                pong.extend_from_slice(rest.get(2..).unwrap_or_default());
                stream.write_all(&command(&pong[..pong.len().min(255)])).await?;
            }
            if frames.is_empty() {
                return Ok(None);
            }
        } else {
            bytes += body.len() as u64;
            frames.push(body);
            if frames.len() > MAX_MESSAGE_FRAMES || bytes > limits.message {
                return Err(ZmtpError::TooManyFrames);
            }
            if flags_read & MORE == 0 {
                return Ok(Some(frames));
            }
        }
        flags = stream.read_u8().await?;
    }
}

/// One socket's connection to one peer (a PUSH to a PULL, a REQ to a ROUTER, ...). Nothing
/// is read but what [`Connection::recv`] asks for, so a PUSH, which never asks, keeps
/// nothing its peer sends after the handshake.
pub struct Connection {
    stream: TcpStream,
    limits: Limits,
}

impl Connection {
    /// Connects to the socket of kind `theirs` at `addr` (`host:port`) as one of kind `ours`,
    /// shaking hands within [`HANDSHAKE_TIMEOUT`].
    pub async fn connect(addr: &str, ours: &[u8], theirs: &[u8]) -> Result<Self, ZmtpError> {
        let go = async { Self::shake(TcpStream::connect(addr).await?, ours, theirs).await };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, go)
            .await
            .map_err(|_| ZmtpError::Io(std::io::ErrorKind::TimedOut.into()))?
    }

    /// A connection a listener accepted, once its peer (of kind `theirs`) has shaken hands
    /// with us (of kind `ours`) within [`HANDSHAKE_TIMEOUT`].
    pub async fn accept(stream: TcpStream, ours: &[u8], theirs: &[u8]) -> Result<Self, ZmtpError> {
        tokio::time::timeout(HANDSHAKE_TIMEOUT, Self::shake(stream, ours, theirs))
            .await
            .map_err(|_| ZmtpError::Handshake("no handshake in time"))?
    }

    async fn shake(mut stream: TcpStream, ours: &[u8], theirs: &[u8]) -> Result<Self, ZmtpError> {
        stream.set_nodelay(true)?;
        keep_alive(&stream)?;
        handshake(&mut stream, ours, theirs).await?;
        Ok(Connection { stream, limits: Limits::default() })
    }

    /// Whether the peer has closed the connection (or it broke), for a socket that never
    /// reads (a PUSH): whatever the peer sent meanwhile is read and dropped. A write into a
    /// connection the peer has closed would still succeed, into the kernel's buffer, and be
    /// lost.
    pub fn peer_closed(&self) -> bool {
        // Straight to the socket (non-blocking already): tokio's cached readiness could say
        // "nothing yet" for a close that has arrived.
        let sock = socket2::SockRef::from(&self.stream);
        let mut scratch = [std::mem::MaybeUninit::<u8>::uninit(); 512];
        for _ in 0..64 {
            match sock.recv(&mut scratch) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }

    /// The same connection, receiving within `limits`.
    pub fn with_limits(self, limits: Limits) -> Self {
        Connection { limits, ..self }
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[Bytes]) -> std::io::Result<()> {
        write_message(&mut self.stream, frames).await
    }

    /// Receives one message, within the bounds.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        read_message(&mut self.stream, self.limits).await
    }
}

#[cfg(test)]
mod tests;
