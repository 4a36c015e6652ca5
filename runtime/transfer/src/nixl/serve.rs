//! The control listener's side of the nixl backend: a receiver's handshake at the sender, a
//! sender's notice at the receiver.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use super::control::{self, Control, Reply};
use super::memory::Slot;
use super::{Remote, Shared};
use crate::inbox::lock;
use crate::listen::Place;
use crate::{ConnectRequest, RegionId, TransferError};

/// One control connection: a message, its answer, then close. The message's token, checked
/// first (the metadata is parsed by NIXL only for a peer that has it), proves its place.
pub(super) async fn serve_control(
    mut st: TcpStream,
    peer: SocketAddr,
    s: Arc<Shared>,
    place: &Place,
) {
    let deadline = s.cfg.control_timeout;
    let served = async {
        let msg = control::read_message::<_, Control>(&mut st).await.and_then(|m| {
            let token = m.token().map(str::as_bytes);
            if !crate::token_accepted(s.cfg.token.as_deref(), token) {
                return Err(TransferError::Unauthorized);
            }
            place.proven();
            Ok(m)
        });
        let reply: Reply = match msg {
            Ok(Control::Connect { req, introduction, metadata, addr, ticket }) => {
                on_connect(&s, req, &introduction, &metadata, (addr, ticket)).into()
            }
            Ok(Control::Notice { region, ticket, notice, segments, .. }) => {
                let conn = crate::mooncake::peer_conn(peer.ip());
                // Copying and hashing a region's bytes (up to its whole size) is off the
                // async workers.
                let s = s.clone();
                let copied = tokio::task::spawn_blocking(move || {
                    on_notice(&s, region, ticket, conn, notice, &segments)
                });
                let done = copied.await.unwrap_or_else(|e| {
                    Err(TransferError::Failed(format!("notice not applied: {e}")))
                });
                done.into()
            }
            Err(e) => Err(e).into(),
        };
        control::write_message(&mut st, &reply).await
    };
    match tokio::time::timeout(deadline, served).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!(%peer, error = %e, "nixl control answer not sent"),
        Err(_) => debug!(%peer, "nixl control exchange too slow"),
    }
}

/// A receiver's handshake, at the sender (its token checked): the introduction and the
/// buffer's metadata (one agent's both), then the inbox's table.
fn on_connect(
    s: &Shared,
    req: ConnectRequest,
    introduction: &str,
    metadata: &str,
    (addr, ticket): (u64, u64),
) -> Result<(), TransferError> {
    let region = req.region;
    let len = req.region_len;
    // Its request ended already: nothing will write for it (see `Inbox::close_room`).
    if s.inbox.room_closed(req.room) {
        return Ok(());
    }
    {
        let mut remotes = lock(&s.remotes);
        if remotes.len() >= s.cfg.max_open && !remotes.contains_key(&region) {
            let ttl = s.cfg.handshake_ttl;
            remotes.retain(|_, r| r.since.elapsed() < ttl && !s.inbox.room_closed(r.room));
            if remotes.len() >= s.cfg.max_open {
                return Err(TransferError::Full("nixl handshake"));
            }
        }
    }
    let (introduction, metadata) = (control::unhex(introduction)?, control::unhex(metadata)?);
    let agent = s.load(&introduction, &metadata)?;
    // Recorded before the inbox's table wakes the prefill, whose first write looks it up.
    let room = req.room;
    let remote =
        Remote { room, agent, addr, len, ticket, since: Instant::now(), written: Vec::new() };
    lock(&s.remotes).insert(region, remote);
    let accepted = s.inbox.on_connect(req);
    if accepted.is_err() {
        lock(&s.remotes).remove(&region);
    }
    accepted
}

/// A sender's notice, at the receiver: its ticket redeemed, the segments it lists copied
/// from the region's staging slot into the region, the notice verified (see the module docs),
/// the slot given back once the region is done with it.
fn on_notice(
    s: &Shared,
    region: RegionId,
    ticket: u64,
    conn: crate::ConnId,
    notice: crate::Notice,
    segments: &[(u64, u64)],
) -> Result<(), TransferError> {
    let slot = s.staging.redeem(region, ticket)?;
    let verified = apply(s, region, &slot, conn, notice.sender, segments)
        .and_then(|()| s.inbox.on_notice(region, conn, notice));
    drop(slot);
    let closed = s.inbox.open_len(region).is_none();
    s.staging.settle(region, closed, Instant::now());
    verified
}

/// Copies the listed segments of `slot` into the region, through the inbox's checks.
fn apply(
    s: &Shared,
    region: RegionId,
    slot: &Slot,
    conn: crate::ConnId,
    sender: crate::SenderId,
    segments: &[(u64, u64)],
) -> Result<(), TransferError> {
    let arena = s.staging.arena();
    let mut parts = Vec::with_capacity(segments.len());
    for &(off, len) in segments {
        // (A slot may be longer than its region, by page rounding; the inbox bounds it.)
        let bytes = usize::try_from(off)
            .ok()
            .zip(usize::try_from(len).ok())
            .and_then(|(o, l)| arena.segment(slot, o, l));
        let Some(bytes) = bytes else {
            let reason = format!("segment [{off}, +{len}) outside the region");
            s.inbox.fail(region, reason.clone());
            return Err(TransferError::Malformed(reason));
        };
        parts.push((off, bytes));
    }
    s.inbox.on_write(region, sender, conn, &parts)
}

/// Peers' metadata kept before idle ones are forgotten.
const MAX_PEERS: usize = 256;

impl Shared {
    /// Loads a receiver's introduction and arena metadata (one agent's both), unless the
    /// same were loaded before (a receiver sends the same with every handshake: NIXL parses
    /// them once), and notes the use; past [`MAX_PEERS`], forgets the peers no handshake
    /// waits on that have been idle past the handshake's lifetime (a restarted receiver comes
    /// back under a new name, and NIXL would keep the old one forever). All under one lock,
    /// so a peer is never forgotten between its loading and its use being noted.
    fn load(&self, introduction: &[u8], metadata: &[u8]) -> Result<String, TransferError> {
        let now = Instant::now();
        let key = xxhash_rust::xxh3::xxh3_64(&[introduction, metadata].concat());
        let mut loaded = lock(&self.loaded);
        if let Some((agent, used)) = loaded.get_mut(&key) {
            *used = now;
            return Ok(agent.clone());
        }
        let agent = self.engine.load(introduction)?;
        if self.engine.load(metadata)? != agent {
            return Err(TransferError::Malformed("nixl metadata of two agents".into()));
        }
        loaded.insert(key, (agent.clone(), now));
        if loaded.len() > MAX_PEERS {
            let waited_on: std::collections::HashSet<String> =
                lock(&self.remotes).values().map(|r| r.agent.clone()).collect();
            let ttl = self.cfg.handshake_ttl;
            let idle =
                loaded.extract_if(|_, (name, at)| !waited_on.contains(name) && now - *at > ttl);
            idle.for_each(|(_, (name, _))| self.engine.forget(&name));
        }
        Ok(agent)
    }
}
