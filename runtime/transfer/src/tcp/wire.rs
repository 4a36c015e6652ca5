//! Frames of the tcp backend: `[u32 LE length][u8 kind][body]`, length counting kind and
//! body. Bodies are little-endian binary, except the rare handshake, which is JSON.

use bytes::{Buf, Bytes};
use handoff_core::Room;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::receive::SharedPiece;
use crate::{AgentAddr, ConnectRequest, Notice, RegionId, SenderId, TransferError};

const CONNECT: u8 = 1;
const WRITE: u8 = 2;
const NOTICE: u8 = 3;
const ACK: u8 = 4;
const HELLO: u8 = 5;
const SHARED_WRITE: u8 = 6;
/// Longest token a hello may carry.
pub(super) const MAX_TOKEN: usize = 4096;
const NOTICE_LEN: usize = 48;
/// A shared write's piece: pair offset, pair length, offset in the pair, length.
const PIECE_LEN: usize = 20;
/// Bytes of a frame reserved before they arrive (address space only: pages are touched as
/// bytes land). Larger frames grow as they come.
const READ_CHUNK: usize = 16 << 20;

/// The buffer either end of a connection keeps for frame heads and small writes. Bigger
/// reads and writes (a write's payloads, in pieces of up to [`crate::inbox::PIECE`]) go
/// straight between the socket and their own memory, not through the buffer: a 256 KiB
/// buffer copied every 192 KiB payload on both ends (a tenth of a transfer's CPU).
pub(super) const BUFFERED: usize = 64 << 10;

/// A decoded frame.
#[derive(Debug)]
pub(super) enum Frame {
    Connect(ConnectRequest),
    /// A write's head: each segment's (offset, length). Their bytes follow on the stream,
    /// in order, and must be read next ([`super::receive::land`]).
    Write {
        region: RegionId,
        sender: SenderId,
        segments: Vec<(u64, u32)>,
    },
    /// A write whose bytes are in a half of the connection's shared window ([`super::shm`]),
    /// each segment's after the one before; answered with an ack once landed.
    SharedWrite {
        region: RegionId,
        sender: SenderId,
        half: u32,
        pieces: Vec<SharedPiece>,
    },
    Notice {
        region: RegionId,
        notice: Notice,
    },
    Ack(Result<(), String>),
    /// The first frame of a connection to a listener with a token: the token.
    Hello(Bytes),
}

fn malformed(s: impl Into<String>) -> TransferError {
    TransferError::Malformed(s.into())
}

/// A frame's header (length, kind) for a body of `body` bytes, then `first` of the body,
/// in one buffer: each frame leaves in one write (two small writes would be two packets, the
/// second held back by the kernel until the first is sent).
fn framed(kind: u8, body: usize, first: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(5 + first.len());
    b.extend_from_slice(&((body + 1) as u32).to_le_bytes());
    b.push(kind);
    b.extend_from_slice(first);
    b
}

pub(super) async fn write_connect<W: AsyncWrite + Unpin>(
    w: &mut W,
    req: &ConnectRequest,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(req).map_err(std::io::Error::other)?;
    w.write_all(&framed(CONNECT, body.len(), &body)).await?;
    // Under TLS, written is not sent until flushed; the peer answers only what it has.
    w.flush().await
}

/// A write frame's length before its segments: the kind, the region, the sender and the
/// segment count.
const WRITE_HEAD: usize = 1 + 8 + 4 + 4;

/// Each segment's entry in a write frame's table: its offset and length.
const SEGMENT_ENTRY: usize = 8 + 4;

/// Refuses `pairs` when one would not fit a write frame of its own of at most `max_frame`
/// bytes (the receiver would refuse that frame, and the connection with it).
pub(super) fn check_fits(pairs: &[(Bytes, u64)], max_frame: usize) -> Result<(), TransferError> {
    match pairs.iter().find(|(b, _)| WRITE_HEAD + SEGMENT_ENTRY + b.len() > max_frame) {
        Some((b, _)) => Err(malformed(format!(
            "a pair of {} bytes does not fit a frame of {max_frame}",
            b.len()
        ))),
        None => Ok(()),
    }
}

/// Writes `pairs` as one or more write frames of at most `max_frame` bytes each. Callers
/// first pass them through [`check_fits`] (before taking a connection): a pair longer than a
/// frame would go in one the receiver refuses.
pub(super) async fn write_pairs<W: AsyncWrite + Unpin>(
    w: &mut W,
    region: RegionId,
    sender: SenderId,
    pairs: &[(Bytes, u64)],
    max_frame: usize,
) -> std::io::Result<()> {
    let mut rest = pairs;
    while !rest.is_empty() {
        // Take pairs while the frame stays under max_frame (always at least one).
        let mut n = 0;
        let mut size = WRITE_HEAD;
        while n < rest.len() && (n == 0 || size + SEGMENT_ENTRY + rest[n].0.len() <= max_frame) {
            size += SEGMENT_ENTRY + rest[n].0.len();
            n += 1;
        }
        let (now, later) = rest.split_at(n);
        let mut head = framed(WRITE, size - 1, &[]);
        head.reserve(WRITE_HEAD - 1 + SEGMENT_ENTRY * n);
        head.extend_from_slice(&region.0.to_le_bytes());
        head.extend_from_slice(&sender.0.to_le_bytes());
        head.extend_from_slice(&(n as u32).to_le_bytes());
        for (b, off) in now {
            head.extend_from_slice(&off.to_le_bytes());
            head.extend_from_slice(&(b.len() as u32).to_le_bytes());
        }
        w.write_all(&head).await?;
        for (b, _) in now {
            w.write_all(b).await?;
        }
        rest = later;
    }
    Ok(())
}

pub(super) async fn write_hello<W: AsyncWrite + Unpin>(
    w: &mut W,
    token: &str,
) -> std::io::Result<()> {
    w.write_all(&hello(token)).await?;
    w.flush().await
}

/// A hello frame carrying `token`.
pub(super) fn hello(token: &str) -> Vec<u8> {
    framed(HELLO, token.len(), token.as_bytes())
}

/// A shared write's frame: its bytes are already in `half` of the window.
pub(super) async fn write_shared<W: AsyncWrite + Unpin>(
    w: &mut W,
    region: RegionId,
    sender: SenderId,
    half: u32,
    pieces: &[SharedPiece],
) -> std::io::Result<()> {
    let mut b = framed(SHARED_WRITE, 20 + PIECE_LEN * pieces.len(), &[]);
    b.extend_from_slice(&region.0.to_le_bytes());
    b.extend_from_slice(&sender.0.to_le_bytes());
    b.extend_from_slice(&half.to_le_bytes());
    b.extend_from_slice(&(pieces.len() as u32).to_le_bytes());
    for p in pieces {
        b.extend_from_slice(&p.off.to_le_bytes());
        b.extend_from_slice(&p.len.to_le_bytes());
        b.extend_from_slice(&p.at.to_le_bytes());
        b.extend_from_slice(&p.n.to_le_bytes());
    }
    w.write_all(&b).await?;
    w.flush().await
}

pub(super) async fn write_notice<W: AsyncWrite + Unpin>(
    w: &mut W,
    region: RegionId,
    n: &Notice,
) -> std::io::Result<()> {
    let mut b = framed(NOTICE, NOTICE_LEN, &[]);
    b.extend_from_slice(&region.0.to_le_bytes());
    b.extend_from_slice(&n.room.get().to_le_bytes());
    b.extend_from_slice(&n.sender.0.to_le_bytes());
    b.extend_from_slice(&n.first_token.to_le_bytes());
    b.extend_from_slice(&n.tokens.to_le_bytes());
    b.extend_from_slice(&n.cached_tokens.to_le_bytes());
    b.extend_from_slice(&n.bytes.to_le_bytes());
    b.extend_from_slice(&n.checksum.to_le_bytes());
    debug_assert_eq!(b.len(), 5 + NOTICE_LEN);
    w.write_all(&b).await
}

pub(super) async fn write_ack<W: AsyncWrite + Unpin>(
    w: &mut W,
    res: &Result<(), String>,
) -> std::io::Result<()> {
    put_ack(w, res).await?;
    w.flush().await
}

/// Writes an ack into `w` without flushing it: a buffered writer holds it until flushed.
pub(super) async fn put_ack<W: AsyncWrite + Unpin>(
    w: &mut W,
    res: &Result<(), String>,
) -> std::io::Result<()> {
    let msg = res.as_ref().err().map(String::as_bytes).unwrap_or_default();
    let msg = &msg[..msg.len().min(4096)];
    let mut b = framed(ACK, 1 + msg.len(), &[u8::from(res.is_ok())]);
    b.extend_from_slice(msg);
    w.write_all(&b).await
}

/// The shortest ack: its length, its kind and the verdict byte.
const ACK_MIN: usize = 6;

/// The longest ack's length field: its kind, the verdict byte and a reason of 4 KiB.
const ACK_LEN_MAX: usize = 2 + 4096;

/// The longest handshake (JSON of a few fields and a token of at most [`MAX_TOKEN`]).
const CONNECT_MAX: usize = 64 << 10;

/// The most one read of acks asks for: a refusal's reason is at most 4 KiB.
const ACK_READ: usize = 64 << 10;

/// Reads one frame that must be an ack (a sender's read of its receiver's answer), in one
/// read when it is a plain yes (see [`read_acks`]). `Ok(None)` at a clean end of stream
/// before the ack.
pub(super) async fn read_ack<R: AsyncRead + Unpin>(
    r: &mut R,
    peer: &AgentAddr,
    max_frame: usize,
) -> Result<Option<Result<(), String>>, TransferError> {
    Ok(read_acks(r, peer, 1, max_frame).await?.pop())
}

/// Reads the next `n` frames, which must be acks, oldest first: fewer when the stream ends
/// cleanly between two. Unbuffered, yet never past the `n`-th: each read asks for at most
/// what the acks still due take at their shortest ([`ACK_MIN`] each). Plain yeses that came
/// together take one read; a refusal's reason takes another after its head. A frame that is
/// not an ack, or too short to be one, is malformed, and its connection is not used again.
pub(super) async fn read_acks<R: AsyncRead + Unpin>(
    r: &mut R,
    peer: &AgentAddr,
    n: usize,
    max_frame: usize,
) -> Result<Vec<Result<(), String>>, TransferError> {
    let mut verdicts = Vec::with_capacity(n);
    // Read and not yet taken: the head of the next ack, or more.
    let mut buf: Vec<u8> = Vec::new();
    while verdicts.len() < n {
        if let Some(&kind) = buf.get(4)
            && kind != ACK
        {
            return Err(malformed(format!("expected an ack, got a frame of kind {kind}")));
        }
        let len = match buf.get(..4) {
            Some(l) => {
                let len = u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize;
                let most = max_frame.min(ACK_LEN_MAX);
                if len < ACK_MIN - 4 || len > most {
                    return Err(malformed(format!(
                        "ack length {len} outside {}..={most}",
                        ACK_MIN - 4
                    )));
                }
                Some(len)
            }
            None => None,
        };
        if let Some(len) = len
            && buf.len() >= 4 + len
        {
            match decode(ACK, Bytes::copy_from_slice(&buf[5..4 + len]))? {
                Frame::Ack(verdict) => verdicts.push(verdict),
                other => return Err(malformed(format!("expected an ack, got {other:?}"))),
            }
            buf.drain(..4 + len);
            continue;
        }
        let after = (n - verdicts.len() - 1) * ACK_MIN;
        let want = (len.map_or(ACK_MIN, |l| 4 + l) + after - buf.len()).min(ACK_READ);
        let at = buf.len();
        buf.resize(at + want, 0);
        // A connection reset or a TLS stream cut without its close: the peer is gone.
        let got = r
            .read(&mut buf[at..])
            .await
            .map_err(|e| TransferError::io(peer, "reading an ack", &e))?;
        buf.truncate(at + got);
        if got == 0 {
            if buf.is_empty() {
                return Ok(verdicts);
            }
            return Err(malformed(format!("truncated ack: {} bytes", buf.len())));
        }
    }
    Ok(verdicts)
}

/// Reads one frame; `Ok(None)` at a clean end of stream between frames.
pub(super) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: usize,
) -> Result<Option<Frame>, TransferError> {
    let len = match r.read_u32_le().await {
        Ok(l) => l as usize,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(malformed(format!("reading frame length: {e}"))),
    };
    if len == 0 || len > max_frame {
        return Err(malformed(format!("frame length {len} outside 1..={max_frame}")));
    }
    let kind = r.read_u8().await.map_err(|e| malformed(format!("reading frame kind: {e}")))?;
    if kind == WRITE {
        return read_write_head(r, len - 1).await.map(Some);
    }
    // Read whole before it is decoded: bounded by what its kind can hold first.
    let most = match kind {
        CONNECT => CONNECT_MAX,
        NOTICE => NOTICE_LEN,
        ACK => ACK_LEN_MAX - 1,
        HELLO => MAX_TOKEN,
        SHARED_WRITE => max_frame,
        k => return Err(malformed(format!("unknown frame kind {k}"))),
    };
    if len - 1 > most {
        return Err(malformed(format!(
            "frame of kind {kind} and {} bytes, at most {most}",
            len - 1
        )));
    }
    let body = read_up_to(r, len - 1).await?;
    decode(kind, Bytes::from(body)).map(Some)
}

/// Reads exactly `len` bytes, grown as they arrive rather than allocated at the declared
/// length: a peer that declares a large frame and sends little holds little.
async fn read_up_to<R: AsyncRead + Unpin>(r: &mut R, len: usize) -> Result<Vec<u8>, TransferError> {
    let mut buf = Vec::with_capacity(len.min(READ_CHUNK));
    let got = (&mut *r)
        .take(len as u64)
        .read_to_end(&mut buf)
        .await
        .map_err(|e| malformed(format!("reading a frame of {len} bytes: {e}")))?;
    if got != len {
        return Err(malformed(format!("truncated frame: {got} of {len} bytes")));
    }
    Ok(buf)
}

/// A write frame's head (its `body` bytes counted from after the kind), leaving the payload
/// on the stream; the segments' lengths must add up to the payload.
async fn read_write_head<R: AsyncRead + Unpin>(
    r: &mut R,
    body: usize,
) -> Result<Frame, TransferError> {
    if body < 16 {
        return Err(malformed("write frame shorter than its header"));
    }
    let mut b = Bytes::from(read_up_to(r, 16).await?);
    let region = RegionId(b.get_u64_le());
    let sender = SenderId(b.get_u32_le());
    let n = b.get_u32_le() as usize;
    let table = n.checked_mul(12).filter(|t| *t <= body - 16);
    let Some(table) = table else {
        return Err(malformed(format!("write frame claims {n} segments")));
    };
    let mut t = Bytes::from(read_up_to(r, table).await?);
    let segments: Vec<(u64, u32)> = (0..n).map(|_| (t.get_u64_le(), t.get_u32_le())).collect();
    let want: u64 = segments.iter().map(|s| u64::from(s.1)).sum();
    let payload = body - 16 - table;
    if want != payload as u64 {
        return Err(malformed(format!(
            "write frame payload is {payload} bytes, its segments say {want}"
        )));
    }
    Ok(Frame::Write { region, sender, segments })
}

fn decode(kind: u8, mut b: Bytes) -> Result<Frame, TransferError> {
    match kind {
        CONNECT => serde_json::from_slice(&b)
            .map(Frame::Connect)
            .map_err(|e| malformed(format!("handshake: {e}"))),
        SHARED_WRITE => {
            if b.len() < 20 {
                return Err(malformed("shared write frame shorter than its header"));
            }
            let region = RegionId(b.get_u64_le());
            let sender = SenderId(b.get_u32_le());
            let half = b.get_u32_le();
            let n = b.get_u32_le() as usize;
            if n.checked_mul(PIECE_LEN) != Some(b.len()) {
                return Err(malformed(format!("shared write frame claims {n} pieces")));
            }
            let pieces = (0..n)
                .map(|_| SharedPiece {
                    off: b.get_u64_le(),
                    len: b.get_u32_le(),
                    at: b.get_u32_le(),
                    n: b.get_u32_le(),
                })
                .collect();
            Ok(Frame::SharedWrite { region, sender, half, pieces })
        }
        NOTICE => {
            if b.len() != NOTICE_LEN {
                return Err(malformed(format!("notice of {} bytes, want {NOTICE_LEN}", b.len())));
            }
            let region = RegionId(b.get_u64_le());
            let room = b.get_u64_le();
            let room = Room::try_from(room).map_err(|e| malformed(e.to_string()))?;
            let notice = Notice {
                room,
                sender: SenderId(b.get_u32_le()),
                first_token: b.get_u32_le(),
                tokens: b.get_u32_le(),
                cached_tokens: b.get_u32_le(),
                bytes: b.get_u64_le(),
                checksum: b.get_u64_le(),
            };
            Ok(Frame::Notice { region, notice })
        }
        ACK => {
            if b.is_empty() {
                return Err(malformed("empty ack"));
            }
            let ok = b.get_u8() == 1;
            Ok(Frame::Ack(if ok { Ok(()) } else { Err(String::from_utf8_lossy(&b).into_owned()) }))
        }
        HELLO if b.len() <= MAX_TOKEN => Ok(Frame::Hello(b)),
        HELLO => Err(malformed(format!("hello of {} bytes", b.len()))),
        k => Err(malformed(format!("unknown frame kind {k}"))),
    }
}
