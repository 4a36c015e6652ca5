//! [`SglangReceiver`]: an SGLang decode for requests whose KV an SGLang prefill computed.
//!
//! Per request: read the prefill's directory (page size and topology must fit), find the
//! rank's ZMQ address, lease pages and a metadata row in the virtual pool and map them onto a
//! fresh receive region, register with the rank (once per rank, on one PUSH socket, so ZMQ
//! keeps registration before metadata), send the transfer info, and wait on the PULL socket
//! for the rank's status. Pages land through the Mooncake target; a metadata row may instead
//! come as `AUX_DATA` over ZMQ. On success every byte of the region must have been written
//! exactly once, and the row's `bootstrap_room` must be the room minted for the request.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use handoff_bootstrap::DirectoryClient;
use handoff_core::{Room, Tasks};
use handoff_engine::{Kv, KvShape};
use handoff_transfer::mooncake::{MooncakeConfig, MooncakeTransfer, peer_conn, resolve};
use handoff_transfer::{Inbox, InboxConfig, RegionId, SenderId};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::debug;
use zeromq::{Endpoint, PullSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::SglangError;
use crate::layout::{self, RequestLayout, SglangLayout};
use crate::pool::{Lease, POOL_PAGES, POOL_ROWS, PagePool};
use crate::wire::{Inbound, Registration, STATUS_FAILED, STATUS_SUCCESS, TransferInfo};

/// The senders of an SGLang region, both the prefill rank (equal tp on both sides): its
/// pages come over its Mooncake connections, its metadata rows over Mooncake or over ZMQ.
const PAGES: SenderId = SenderId(0);
const ROWS: SenderId = SenderId(1);
/// How long connecting to a rank and sending it a message may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn zmq(e: impl std::fmt::Display) -> SglangError {
    SglangError::Zmq(e.to_string())
}

/// What an SGLang prefill delivered for one request.
#[derive(Debug)]
pub struct SglangKv {
    /// The prompt's KV in the engine's layout.
    pub kv: Kv,
    /// The first generated token.
    pub first_token: u32,
    /// The region as it arrived (pages, then metadata rows), for checks.
    pub raw: Vec<u8>,
    /// Where things sit in `raw`.
    pub layout: RequestLayout,
}

type Waiters = Arc<Mutex<HashMap<u64, mpsc::Sender<Inbound>>>>;

/// One prefill rank's PUSH socket (registered once), behind its own lock: a slow rank holds
/// up only its own requests.
type Push = Arc<tokio::sync::Mutex<Option<PushSocket>>>;

/// An SGLang decode (see the module docs).
pub struct SglangReceiver {
    layout: SglangLayout,
    mooncake: MooncakeTransfer,
    directory: DirectoryClient,
    pool: PagePool,
    kv_bases: Vec<u64>,
    aux_bases: Vec<u64>,
    pull_ip: String,
    pull_port: u16,
    pushes: Mutex<HashMap<String, Push>>,
    waiters: Waiters,
}

impl std::fmt::Debug for SglangReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SglangReceiver")
            .field("session", &self.mooncake.session())
            .field("pull", &format!("{}:{}", self.pull_ip, self.pull_port))
            .finish_non_exhaustive()
    }
}

/// The virtual pool's base addresses: K/V buffers, then metadata buffers.
fn pool_bases(layout: &SglangLayout) -> (Vec<u64>, Vec<u64>) {
    let base = rand::random_range(1u64 << 40..1 << 44) & !0xfffff;
    let buffer = POOL_PAGES * layout.item_len() as u64;
    let kv: Vec<u64> = (0..2 * layout.layers as u64).map(|i| base + i * buffer).collect();
    let mut at = base + 2 * layout.layers as u64 * buffer;
    let aux = layout
        .aux_row_bytes
        .iter()
        .map(|&row| {
            let here = at;
            at += u64::from(POOL_ROWS) * row as u64;
            here
        })
        .collect();
    (kv, aux)
}

impl SglangReceiver {
    /// Listens on `bind_ip` (Mooncake handshake and data ports, a ZMQ PULL port) for a model
    /// of `layout`, telling prefills to reach it at `advertise_ip` (default `bind_ip`), its
    /// tasks on `tasks`.
    pub async fn start(
        layout: SglangLayout,
        bind_ip: IpAddr,
        advertise_ip: Option<String>,
        inbox: InboxConfig,
        tasks: &Tasks,
    ) -> Result<Self, SglangError> {
        layout.request(1)?;
        let io = |e: std::io::Error| SglangError::Zmq(format!("listening: {e}"));
        let rpc = TcpListener::bind((bind_ip, 0)).await.map_err(io)?;
        let data = TcpListener::bind((bind_ip, 0)).await.map_err(io)?;
        let inbox = Arc::new(Inbox::new(inbox));
        let mooncake = MooncakeTransfer::serve(
            rpc,
            data,
            advertise_ip.clone(),
            inbox,
            MooncakeConfig::default(),
            tasks,
        )
        .map_err(io)?;
        let mut pull = PullSocket::new();
        let endpoint = pull.bind(&format!("tcp://{bind_ip}:0")).await.map_err(zmq)?;
        let Endpoint::Tcp(_, pull_port) = endpoint else {
            return Err(SglangError::Zmq(format!("PULL bound to {endpoint}")));
        };
        let waiters: Waiters = Arc::default();
        let (w, t) = (waiters.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    m = pull.recv() => m,
                };
                match msg {
                    Ok(m) => route(&w, &m.into_vec()),
                    Err(e) => debug!(error = %e, "SGLang PULL socket"),
                }
            }
        });
        let (kv_bases, aux_bases) = pool_bases(&layout);
        Ok(SglangReceiver {
            layout,
            mooncake,
            directory: DirectoryClient::default(),
            pool: PagePool::default(),
            kv_bases,
            aux_bases,
            pull_ip: advertise_ip.unwrap_or_else(|| bind_ip.to_string()),
            pull_port,
            pushes: Mutex::default(),
            waiters,
        })
    }

    /// The Mooncake segment name prefills write to.
    pub fn session(&self) -> &str {
        self.mooncake.session()
    }

    /// Receives room `room`'s KV (`tokens` prompt tokens) from the SGLang prefill whose
    /// bootstrap directory is at `bootstrap`, as the engine's KV of `shape`.
    pub async fn receive(
        &self,
        bootstrap: &str,
        room: Room,
        tokens: usize,
        shape: KvShape,
        deadline: Instant,
    ) -> Result<SglangKv, SglangError> {
        let info = self.directory.server_info(bootstrap).await?;
        if info.page_size as usize != self.layout.page_size {
            return Err(SglangError::Unsupported(format!(
                "the prefill's page size is {}, ours {}",
                info.page_size, self.layout.page_size
            )));
        }
        if (info.attn_tp_size, info.attn_cp_size, info.pp_size) != (1, 1, 1) {
            return Err(SglangError::Unsupported(format!(
                "prefill attn tp {} / cp {} / pp {}: only 1/1/1 is served yet",
                info.attn_tp_size, info.attn_cp_size, info.pp_size
            )));
        }
        let dp = if info.follow_bootstrap_room {
            (room.get() % info.dp_size.max(1) as u64) as u32
        } else if info.dp_size == 1 {
            0
        } else {
            return Err(SglangError::Unsupported("dp ranks not following the room".into()));
        };
        let rank = self.directory.rank(bootstrap, dp, 0, 0, 0).await?;
        let rank_ips = resolve(&rank.rank_ip).await;
        if rank_ips.is_empty() {
            return Err(SglangError::Unsupported(format!(
                "the rank's address {:?} does not resolve",
                rank.rank_ip
            )));
        }
        let req = self.layout.request(tokens)?;
        let (tx, rx) = mpsc::channel(64);
        {
            let mut waiters = lock(&self.waiters);
            if waiters.contains_key(&room.get()) {
                return Err(SglangError::Unsupported(format!("room {room} is already receiving")));
            }
            waiters.insert(room.get(), tx.clone());
        }
        let lease = match self.pool.lease_at(req.pages as u64, Instant::now()) {
            Ok(l) => l,
            Err(e) => {
                lock(&self.waiters).remove(&room.get());
                return Err(e);
            }
        };
        let rows = req.aux[0];
        let plan = [(PAGES, vec_of(0..rows)), (ROWS, vec_of(rows..req.len))];
        let id = match self.mooncake.inbox().register_region(room, req.len, plan) {
            Ok(id) => id,
            Err(e) => {
                self.pool.give_back(lease);
                lock(&self.waiters).remove(&room.get());
                return Err(e.into());
            }
        };
        let mut held = Held { r: self, id, lease, room: room.get(), waiter: tx, done: false };
        self.map(id, &req, lease, &rank_ips)?;
        let rank_addr = format!("{}:{}", rank.rank_ip, rank.rank_port);
        let info = TransferInfo {
            room: room.get(),
            decode_ip: self.pull_ip.clone(),
            decode_port: self.pull_port,
            session: self.session().to_owned(),
            pages: (lease.page..lease.page + lease.pages).map(|p| p as i32).collect(),
            aux_index: lease.row,
            required_dst_info_num: 1,
        };
        self.send(&rank_addr, info.frames()).await?;
        let peer = rank_ips.first().copied();
        self.await_status(&held, &req, rx, peer, deadline).await?;
        let got = self.mooncake.inbox().wait(id, deadline).await?;
        let found = layout::room(&req, &got.buf);
        if found != room.get() {
            return Err(SglangError::RoomMismatch { expected: room.get(), got: found });
        }
        held.done = true;
        let kv = self.layout.to_kv(&req, &got.buf, tokens, shape)?;
        let first_token = layout::first_token(&req, &got.buf);
        Ok(SglangKv { kv, first_token, raw: got.buf, layout: req })
    }

    /// Maps the lease's pages and row onto region `id`.
    fn map(
        &self,
        id: RegionId,
        req: &RequestLayout,
        lease: Lease,
        peers: &[IpAddr],
    ) -> Result<(), SglangError> {
        let item = self.layout.item_len() as u64;
        for (base, &offset) in self.kv_bases.iter().zip(&req.kv) {
            let start = base + lease.page * item;
            self.mooncake.map(id, start, lease.pages * item, offset, peers)?;
        }
        for ((base, &offset), &row) in
            self.aux_bases.iter().zip(&req.aux).zip(&self.layout.aux_row_bytes)
        {
            let start = base + u64::from(lease.row) * row as u64;
            self.mooncake.map(id, start, row as u64, offset, peers)?;
        }
        Ok(())
    }

    /// Sends `frames` to the rank at `addr`, registering with it first on a new socket. A
    /// send that fails (or is abandoned) drops the socket: the next one registers again.
    async fn send(&self, addr: &str, frames: Vec<Bytes>) -> Result<(), SglangError> {
        let slot = {
            let mut pushes = lock(&self.pushes);
            if pushes.len() >= MAX_RANKS && !pushes.contains_key(addr) {
                pushes.retain(|_, p| Arc::strong_count(p) > 1);
            }
            pushes.entry(addr.to_owned()).or_default().clone()
        };
        let mut slot = slot.lock().await;
        let mut push = match slot.take() {
            Some(p) => p,
            None => self.register(addr).await?,
        };
        send_on(&mut push, addr, frames).await?;
        *slot = Some(push);
        Ok(())
    }

    /// A new PUSH socket to the rank at `addr`, with this decode registered on it.
    async fn register(&self, addr: &str) -> Result<PushSocket, SglangError> {
        let mut push = PushSocket::new();
        let endpoint = format!("tcp://{addr}");
        tokio::time::timeout(SEND_TIMEOUT, push.connect(&endpoint))
            .await
            .map_err(|_| zmq(format!("connecting to {addr} timed out")))?
            .map_err(zmq)?;
        let registration = Registration {
            decode_ip: self.pull_ip.clone(),
            decode_port: self.pull_port,
            session: self.session().to_owned(),
            kv_ptrs: self.kv_bases.clone(),
            aux_ptrs: self.aux_bases.clone(),
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            kv_item_len: self.layout.item_len() as u64,
        };
        send_on(&mut push, addr, registration.frames()).await?;
        Ok(push)
    }

    /// Applies `AUX_DATA` rows and waits for the rank's status.
    async fn await_status(
        &self,
        held: &Held<'_>,
        req: &RequestLayout,
        mut rx: mpsc::Receiver<Inbound>,
        peer: Option<IpAddr>,
        deadline: Instant,
    ) -> Result<(), SglangError> {
        let inbox = self.mooncake.inbox();
        loop {
            let msg = tokio::time::timeout_at(deadline, rx.recv()).await;
            let Ok(Some(msg)) = msg else { return Err(SglangError::Timeout(held.room)) };
            match msg {
                Inbound::Status { status: STATUS_SUCCESS, .. } => {
                    inbox.finish(held.id, PAGES)?;
                    inbox.finish(held.id, ROWS)?;
                    return Ok(());
                }
                Inbound::Status { status: STATUS_FAILED, rank, .. } => {
                    return Err(SglangError::PrefillFailed { room: held.room, rank });
                }
                Inbound::Status { status, .. } => {
                    debug!(room = held.room, status, "SGLang status in passing");
                }
                Inbound::AuxData { buffer, row, data, .. } => {
                    let (Some(&offset), Some(&len)) =
                        (req.aux.get(buffer), self.layout.aux_row_bytes.get(buffer))
                    else {
                        return Err(SglangError::Malformed(format!("AUX_DATA buffer {buffer}")));
                    };
                    if row != held.lease.row || data.len() != len {
                        return Err(SglangError::Malformed(format!(
                            "AUX_DATA row {row} of {} bytes (ours: row {}, {len} bytes)",
                            data.len(),
                            held.lease.row
                        )));
                    }
                    let conn = peer_conn(peer.unwrap_or(IpAddr::from([127, 0, 0, 1])));
                    inbox.on_write(held.id, ROWS, conn, &[(offset, &data)])?;
                }
            }
        }
    }
}

fn vec_of(r: std::ops::Range<u64>) -> Vec<std::ops::Range<u64>> {
    std::iter::once(r).collect()
}

/// Prefill ranks with a cached socket; past it, idle ones are dropped.
const MAX_RANKS: usize = 4096;

async fn send_on(push: &mut PushSocket, addr: &str, frames: Vec<Bytes>) -> Result<(), SglangError> {
    let msg = ZmqMessage::try_from(frames).map_err(zmq)?;
    tokio::time::timeout(SEND_TIMEOUT, push.send(msg))
        .await
        .map_err(|_| zmq(format!("sending to {addr} timed out")))?
        .map_err(zmq)
}

/// Routes an inbound message to the request waiting for its room.
fn route(waiters: &Waiters, frames: &[Bytes]) {
    match Inbound::parse(frames) {
        Ok(msg) => {
            let tx = lock(waiters).get(&msg.room()).cloned();
            match tx {
                Some(tx) => {
                    if tx.try_send(msg).is_err() {
                        debug!("SGLang message for a request that is not listening");
                    }
                }
                None => debug!(room = msg.room(), "SGLang message for an unknown room"),
            }
        }
        Err(e) => debug!(error = %e, "SGLang message refused"),
    }
}

/// A request's region, lease and waiter, given back however the request ends; the pages of
/// a request that did not complete are quarantined (a late write must not land in another
/// request's pages).
struct Held<'a> {
    r: &'a SglangReceiver,
    id: RegionId,
    lease: Lease,
    room: u64,
    /// Its waiter (removed only if still its own).
    waiter: mpsc::Sender<Inbound>,
    /// Every write arrived: the pages can be reused at once.
    done: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.r.mooncake.withdraw(self.id);
        self.r.mooncake.inbox().release(self.id);
        if self.done {
            self.r.pool.give_back(self.lease);
        } else {
            self.r.pool.quarantine_at(self.lease, Instant::now());
        }
        let mut waiters = lock(&self.r.waiters);
        if waiters.get(&self.room).is_some_and(|w| w.same_channel(&self.waiter)) {
            waiters.remove(&self.room);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_only_the_request_of_their_room() {
        let waiters: Waiters = Arc::default();
        let (tx, mut rx) = mpsc::channel(4);
        lock(&waiters).insert(7, tx);
        let b = |s: &str| Bytes::copy_from_slice(s.as_bytes());
        route(&waiters, &[b("8"), b("4"), b("0")]); // unknown room: dropped
        route(&waiters, &[b("7"), b("4")]); // missing a part: refused
        route(&waiters, &[b("7"), b("0"), b("3")]);
        assert_eq!(rx.try_recv().unwrap(), Inbound::Status { room: 7, status: 0, rank: 3 });
        assert!(rx.try_recv().is_err(), "nothing else arrived");
    }
}
