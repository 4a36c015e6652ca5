//! The tcp backend's same-host fast path: a write's bytes through shared memory instead of
//! the socket.
//!
//! Every tcp agent also listens on the abstract Unix socket named after its published
//! address ([`name`]). Abstract names live in a network namespace, so a sender finds one only
//! when its receiver runs on the same host (and namespace). Then, for writes and streamed
//! writes (handshakes stay on tcp):
//!
//! 1. The sender dials the name, and each end checks that the other runs as its own user
//!    (`SO_PEERCRED`): another local user who took the name first is not written to, and
//!    another user's process cannot write.
//! 2. Its hello (the cluster token, when there is one) carries the connection's
//!    [`window::Window`], a memfd of two halves sealed against shrinking, as `SCM_RIGHTS`.
//!    The receiver checks the token, the seal and the size, maps it and acks.
//! 3. A write's bytes are copied into a free half and named in a shared-write frame. The
//!    receiver lands them (copied into the region, hashed from the copy) and acks, which
//!    frees the half: the sender fills one half while the other is landed.
//! 4. Notices, acks, binding and verification are the tcp backend's own; handshakes over it
//!    are refused.
//!
//! A sender that cannot dial (another host, no listener, a stranger's listener) uses tcp, and
//! so does every agent with TLS: its bytes go over TLS.

mod conn;
mod fd;
mod window;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use handoff_core::Tasks;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, warn};

pub(crate) use conn::{ShmConn, ShmStream};
pub(crate) use window::SharedWindow;

use super::serve::{ConnCfg, Inbound, serve_conn};
use super::wire::{self, Frame};
use crate::idle::Idle;
use crate::listen::Places;
use crate::{AgentAddr, ConnId, Inbox};

/// The abstract socket name of the agent published at `addr`.
pub(crate) fn name(addr: &AgentAddr) -> String {
    format!("handoff-kv/{addr}")
}

/// Idle shm connections by peer, and how to make new ones.
#[derive(Debug)]
pub(crate) struct ShmPool {
    idle: Idle<ShmConn>,
    token: Option<String>,
    max_frame: usize,
    connect_timeout: Duration,
}

impl ShmPool {
    /// A pool keeping at most `max_idle` idle connections per peer, each for at most
    /// `idle_for`; frames up to `max_frame`; dials given `connect_timeout` (1 s at most).
    pub(crate) fn new(
        token: Option<String>,
        max_idle: usize,
        idle_for: Duration,
        max_frame: usize,
        connect_timeout: Duration,
    ) -> Self {
        ShmPool { idle: Idle::new(max_idle, idle_for), token, max_frame, connect_timeout }
    }

    /// A connection to `peer`'s shm listener, pooled or new; `None` when there is none to
    /// have (the peer is on another host, or refused us): tcp then.
    pub(crate) async fn open(&self, peer: &AgentAddr) -> Option<ShmConn> {
        if let Some(c) = self.idle.take(peer, ShmConn::looks_alive) {
            return Some(c);
        }
        // A listener that takes the connection but not the hello (its places all taken)
        // costs a write at most a second before it goes over tcp.
        let within = self.connect_timeout.min(Duration::from_secs(1));
        match tokio::time::timeout(within, self.dial(peer)).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => {
                debug!(%peer, error = %e, "no shared memory with this peer; tcp");
                None
            }
            Err(_) => None,
        }
    }

    /// Returns a connection after a completed exchange.
    pub(crate) fn checkin(&self, c: ShmConn) {
        self.idle.put(&c.peer.clone(), c);
    }

    async fn dial(&self, peer: &AgentAddr) -> std::io::Result<ShmConn> {
        // Non-blocking: with no listener (another host) the connect fails at once, and a
        // full backlog is a failure too rather than a wait.
        let fd = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        connect(fd.as_raw_fd(), &UnixAddr::new_abstract(name(peer).as_bytes())?)?;
        let mut stream = UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?;
        let cred = stream.peer_cred()?;
        if cred.uid() != nix::unistd::getuid().as_raw() {
            return Err(std::io::Error::other(format!(
                "its listener runs as uid {}, not ours",
                cred.uid()
            )));
        }
        let window = window::Window::create().map_err(std::io::Error::other)?;
        let hello = wire::hello(self.token.as_deref().unwrap_or_default());
        fd::send_with_fd(&mut stream, &hello, window.fd()).await?;
        match wire::read_frame(&mut stream, self.max_frame).await {
            Ok(Some(Frame::Ack(Ok(())))) => {}
            other => return Err(std::io::Error::other(format!("hello answered {other:?}"))),
        }
        Ok(ShmConn::new(peer, stream, window, self.max_frame))
    }
}

/// Listens on `addr`'s name and serves what arrives into `inbox` on `tasks`. A name taken
/// already leaves this agent without a listener, and same-host senders write to whoever
/// holds the name (if it runs as our user: they check). Names vanish with their process and
/// follow the tcp port this agent owns, so only a process squatting on purpose holds one: a
/// loud warning.
pub(crate) fn serve(
    addr: &AgentAddr,
    inbox: Arc<Inbox>,
    cfg: Arc<ConnCfg>,
    places: Places,
    tasks: &Tasks,
) {
    let listener = match listen(addr) {
        Ok(l) => l,
        Err(e) => {
            warn!(
                %addr,
                name = %name(addr),
                error = %e,
                "shared-memory name taken: same-host senders will write to its holder, not to \
                 this agent; stop it or run with --no-shared-memory"
            );
            return;
        }
    };
    crate::listen::serve_accepts(
        listener,
        places,
        tasks,
        "shm transfer",
        move |s, _, id, place| {
            let (inbox, cfg) = (inbox.clone(), cfg.clone());
            async move {
                let Some((s, window)) = accept(s, &cfg).await else { return };
                place.proven();
                // Apart from the tcp listener's ids, which count from 1 as these do: a sender
                // bound to a tcp connection is not the same one over shared memory.
                let id = ConnId(id.0 | 1 << 63);
                let window = Some(window);
                let inbound = Inbound { peer: "shm", id, authed: true, window, place: None };
                serve_conn(s, inbound, inbox, &cfg).await;
            }
        },
    );
}

fn listen(addr: &AgentAddr) -> std::io::Result<UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let at = std::os::unix::net::SocketAddr::from_abstract_name(name(addr))?;
    let l = std::os::unix::net::UnixListener::bind_addr(&at)?;
    l.set_nonblocking(true)?;
    UnixListener::from_std(l)
}

/// A new connection's hello, within the hello time: the token checked, the window adopted,
/// and the answer sent. `None` (and the connection closed) on anything else.
async fn accept(mut s: UnixStream, cfg: &ConnCfg) -> Option<(UnixStream, SharedWindow)> {
    let hello = async {
        // Only our own user's processes: the same as ours is all a sender may be.
        let uid = s.peer_cred()?.uid();
        if uid != nix::unistd::getuid().as_raw() {
            return Err(std::io::Error::other(format!("a sender of uid {uid}, not ours")));
        }
        let (bytes, fd) = fd::recv_with_fd(&mut s, 5 + wire::MAX_TOKEN).await?;
        let token = match wire::read_frame(&mut bytes.as_slice(), 1 + wire::MAX_TOKEN).await {
            Ok(Some(Frame::Hello(t))) => t,
            other => return Err(std::io::Error::other(format!("not a hello: {other:?}"))),
        };
        let answer = match crate::token_accepted(cfg.token.as_deref(), Some(&token)) {
            false => Err(crate::error::WRONG_TOKEN.to_owned()),
            true => SharedWindow::adopt(fd).map_err(|e| e.to_string()),
        };
        wire::write_ack(&mut s, &answer.as_ref().map(|_| ()).map_err(Clone::clone)).await?;
        answer.map_err(std::io::Error::other)
    };
    match tokio::time::timeout(cfg.hello_timeout, hello).await {
        Ok(Ok(window)) => Some((s, window)),
        Ok(Err(e)) => {
            debug!(error = %e, "shm connection refused");
            None
        }
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests;
