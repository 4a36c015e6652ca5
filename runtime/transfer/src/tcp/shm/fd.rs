//! A window's file handed from sender to receiver with the connection's first frame (its
//! hello), as `SCM_RIGHTS` over the Unix socket. The other module of the shm path that allows
//! unsafe code: a received descriptor number is taken into ownership.
#![expect(
    unsafe_code,
    reason = "a descriptor received with SCM_RIGHTS is a fresh one the kernel installed for \
              this process; taking it into an OwnedFd is what makes it closed exactly once"
)]

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

/// Sends `hello` (a whole frame) with `fd` attached to its first byte.
pub(crate) async fn send_with_fd(
    s: &mut UnixStream,
    hello: &[u8],
    fd: BorrowedFd<'_>,
) -> io::Result<()> {
    let raw = s.as_raw_fd();
    let fds = [fd.as_raw_fd()];
    let sent = loop {
        s.writable().await?;
        let sent = s.try_io(Interest::WRITABLE, || {
            let cmsg = [ControlMessage::ScmRights(&fds)];
            sendmsg::<()>(raw, &[IoSlice::new(hello)], &cmsg, MsgFlags::MSG_NOSIGNAL, None)
                .map_err(io::Error::from)
        });
        match sent {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    s.write_all(&hello[sent..]).await
}

/// Receives a frame of at most `max` bytes sent by [`send_with_fd`]: its bytes, and the one
/// descriptor that came with them. Anything else attached is refused (and closed).
pub(crate) async fn recv_with_fd(s: &mut UnixStream, max: usize) -> io::Result<(Vec<u8>, OwnedFd)> {
    let raw = s.as_raw_fd();
    let mut buf = vec![0u8; max];
    let (n, fds) = loop {
        s.readable().await?;
        let got = s.try_io(Interest::READABLE, || {
            // Room for the most descriptors one message can carry (SCM_MAX_FD), so none is
            // ever cut off uncounted: every one the kernel installs is owned, and closed.
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 253]);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let m = recvmsg::<()>(raw, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
                .map_err(io::Error::from)?;
            let mut fds = Vec::new();
            for c in m.cmsgs().map_err(io::Error::from)? {
                if let ControlMessageOwned::ScmRights(rights) = c {
                    // SAFETY: each is a descriptor the kernel just installed for us and
                    // nothing else refers to (see the module docs).
                    fds.extend(rights.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            Ok((m.bytes, fds))
        });
        match got {
            Ok(g) => break g,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    let [fd] = <[OwnedFd; 1]>::try_from(fds).map_err(|fds| {
        io::Error::other(format!("{} descriptors with the hello, want 1", fds.len()))
    })?;
    if n < 4 {
        return Err(io::Error::other("hello shorter than its length"));
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let whole = len
        .checked_add(4)
        .filter(|w| *w <= max && *w >= n)
        .ok_or_else(|| io::Error::other(format!("hello frame of {len} bytes")))?;
    s.read_exact(&mut buf[n..whole]).await?;
    buf.truncate(whole);
    Ok((buf, fd))
}
