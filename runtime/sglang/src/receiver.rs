//! [`SglangReceiver`]: an SGLang decode for requests whose KV an SGLang prefill computed.
//!
//! Per request: read the prefill's directory (page size and topology must fit), find its
//! attention-TP ranks' ZMQ addresses, lease pages and a metadata row in the virtual pool and
//! map them onto a fresh receive region, register with each rank (once per rank, on one PUSH
//! socket, so ZMQ keeps registration before metadata), send each the transfer info, and wait
//! on the PULL socket for every rank's status. Pages land through the Mooncake target; a
//! metadata row may instead come as `AUX_DATA` over ZMQ. On success every byte of the region
//! must have been written exactly once, every rank's row must name the room minted for the
//! request, and the ranks must agree on the first token.
//!
//! A prefill of attention TP `N` > 1 sends each rank's heads of every token slot (see
//! [`crate::layout`]); SGLang serves that as this decode being TP 1 (`required_dst_info_num`
//! 1, a status from each of the `N` ranks).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use handoff_bootstrap::{DirectoryClient, ServerInfo};
use handoff_core::{Room, Tasks};
use handoff_engine::{Kv, KvShape};
use handoff_transfer::mooncake::{MooncakeConfig, MooncakeTransfer, peer_conn, resolve};
use handoff_transfer::{Inbox, InboxConfig, RegionId, SenderId, TransferError};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::debug;

use crate::SglangError;
use crate::layout::{self, RequestLayout, SglangLayout};
use crate::pool::{Lease, POOL_PAGES, POOL_ROWS, PagePool};
use crate::sockets::RankSockets;
use crate::topology::{self, MAX_PREFILL_TP};
use crate::wire::{Inbound, Registration, STATUS_FAILED, STATUS_SUCCESS, TransferInfo};

/// The senders of an SGLang region, two per prefill rank: its pages come over its Mooncake
/// connections, its metadata rows over Mooncake or over ZMQ.
fn pages_of(rank: usize) -> SenderId {
    SenderId(2 * rank as u32)
}
fn rows_of(rank: usize) -> SenderId {
    SenderId(2 * rank as u32 + 1)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One attention-TP rank of a prefill: where its ZMQ socket is, and the addresses its
/// Mooncake writes may come from.
struct Rank {
    addr: String,
    ips: Vec<IpAddr>,
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

/// An SGLang decode (see the module docs).
pub struct SglangReceiver {
    layout: SglangLayout,
    mooncake: MooncakeTransfer,
    directory: DirectoryClient,
    pool: PagePool,
    kv_bases: Vec<u64>,
    /// Each prefill rank's metadata buffers (rank `t`'s rows land in rows of its own).
    aux_bases: Vec<Vec<u64>>,
    pull_ip: String,
    pull_port: u16,
    sockets: RankSockets,
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

/// The virtual pool's base addresses: K/V buffers, then each prefill rank's metadata
/// buffers.
fn pool_bases(layout: &SglangLayout) -> (Vec<u64>, Vec<Vec<u64>>) {
    let base = rand::random_range(1u64 << 40..1 << 44) & !0xfffff;
    let buffer = POOL_PAGES * layout.item_len() as u64;
    let kv: Vec<u64> = (0..2 * layout.layers as u64).map(|i| base + i * buffer).collect();
    let mut at = base + 2 * layout.layers as u64 * buffer;
    let mut rank_bases = || {
        layout
            .aux_row_bytes
            .iter()
            .map(|&row| {
                let here = at;
                at += u64::from(POOL_ROWS) * row as u64;
                here
            })
            .collect()
    };
    let aux = (0..MAX_PREFILL_TP).map(|_| rank_bases()).collect();
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
        let pull = TcpListener::bind((bind_ip, 0)).await.map_err(io)?;
        let pull_port = pull.local_addr().map_err(io)?.port();
        let waiters: Waiters = Arc::default();
        let (w, t) = (waiters.clone(), tasks.clone());
        tasks.spawn(async move {
            crate::pull::serve(pull, move |frames| route(&w, frames), t.shutdown_requested()).await
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
            sockets: RankSockets::default(),
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
        let ranks = self.ranks(bootstrap, &info, room).await?;
        let req = self.layout.request_from(tokens, ranks.len())?;
        // Room for everything the ranks send before it is read: a status and every metadata
        // row (over ZMQ) from each, and as much again.
        let (tx, rx) = mpsc::channel(2 * ranks.len() * (self.layout.aux_row_bytes.len() + 1));
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
        let plan = (0..ranks.len()).flat_map(|t| {
            [(pages_of(t), self.layout.rank_pages(&req, t)), (rows_of(t), vec![req.rows_span(t)])]
        });
        let id = match self.mooncake.inbox().register_region(room, req.len, plan) {
            Ok(id) => id,
            Err(e) => {
                self.pool.give_back(lease);
                lock(&self.waiters).remove(&room.get());
                return Err(e.into());
            }
        };
        let mut held = Held { r: self, id, lease, room: room.get(), waiter: tx, done: false };
        self.map(id, &req, lease, &ranks)?;
        let info = TransferInfo {
            room: room.get(),
            decode_ip: self.pull_ip.clone(),
            decode_port: self.pull_port,
            session: self.session().to_owned(),
            pages: (lease.page..lease.page + lease.pages).map(|p| p as i32).collect(),
            aux_index: lease.row,
            required_dst_info_num: 1,
        };
        let sends = async {
            for (t, rank) in ranks.iter().enumerate() {
                let register = || self.registration(t);
                self.sockets.send(&rank.addr, t, register, info.frames()).await?;
            }
            Ok::<(), SglangError>(())
        };
        tokio::time::timeout_at(deadline, sends)
            .await
            .map_err(|_| SglangError::Timeout(room.get()))??;
        let peer = ranks[0].ips.first().copied();
        self.await_status(&held, &req, rx, peer, deadline).await?;
        let got = self.mooncake.inbox().wait(id, deadline).await?;
        let first_token = agreed_rows(&req, &got.buf, room.get())?;
        held.done = true;
        let kv = self.layout.to_kv(&req, &got.buf, tokens, shape)?;
        Ok(SglangKv { kv, first_token, raw: got.buf, layout: req })
    }

    /// The prefill's attention-TP ranks serving `room` (its dp rank follows the room), after
    /// checking the directory's KV and topology fit ours ([`topology::dp_rank`]).
    async fn ranks(
        &self,
        bootstrap: &str,
        info: &ServerInfo,
        room: Room,
    ) -> Result<Vec<Rank>, SglangError> {
        let dp = topology::dp_rank(info, self.layout.page_size, room)?;
        let tp = info.attn_tp_size;
        let mut ranks = Vec::with_capacity(tp as usize);
        for t in 0..tp as u32 {
            let rank = self.directory.rank(bootstrap, dp, 0, t, 0).await?;
            let ips = resolve(&rank.rank_ip).await;
            if ips.is_empty() {
                return Err(SglangError::Unsupported(format!(
                    "tp rank {t}'s address {:?} does not resolve",
                    rank.rank_ip
                )));
            }
            ranks.push(Rank { addr: format!("{}:{}", rank.rank_ip, rank.rank_port), ips });
        }
        Ok(ranks)
    }

    /// This decode's registration with prefill tp rank `rank`: the pages are shared, the
    /// metadata buffers the rank's own.
    fn registration(&self, rank: usize) -> Registration {
        Registration {
            decode_ip: self.pull_ip.clone(),
            decode_port: self.pull_port,
            session: self.session().to_owned(),
            kv_ptrs: self.kv_bases.clone(),
            aux_ptrs: self.aux_bases[rank].clone(),
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            kv_item_len: self.layout.item_len() as u64,
        }
    }

    /// Maps the lease's pages and each rank's row onto region `id`.
    fn map(
        &self,
        id: RegionId,
        req: &RequestLayout,
        lease: Lease,
        ranks: &[Rank],
    ) -> Result<(), SglangError> {
        let item = self.layout.item_len() as u64;
        let every: Vec<IpAddr> = ranks.iter().flat_map(|r| r.ips.iter().copied()).collect();
        for (base, &offset) in self.kv_bases.iter().zip(&req.kv) {
            let start = base + lease.page * item;
            self.mooncake.map(id, start, lease.pages * item, offset, &every)?;
        }
        for (t, rank) in ranks.iter().enumerate() {
            let rows = self.aux_bases[t].iter().zip(req.rows_of(t)).zip(&self.layout.aux_row_bytes);
            for ((base, offset), &row) in rows {
                let start = base + u64::from(lease.row) * row as u64;
                self.mooncake.map(id, start, row as u64, offset, &rank.ips)?;
            }
        }
        Ok(())
    }

    /// Applies `AUX_DATA` rows and waits for every rank's status.
    async fn await_status(
        &self,
        held: &Held<'_>,
        req: &RequestLayout,
        mut rx: mpsc::Receiver<Inbound>,
        peer: Option<IpAddr>,
        deadline: Instant,
    ) -> Result<(), SglangError> {
        let inbox = self.mooncake.inbox();
        let mut succeeded = vec![false; req.ranks];
        // `AUX_DATA` does not say which rank sent it: the n-th row of a buffer is rank n's.
        let mut aux_rows = vec![0usize; self.layout.aux_row_bytes.len()];
        while succeeded.contains(&false) {
            let msg = tokio::time::timeout_at(deadline, rx.recv()).await;
            let Ok(Some(msg)) = msg else { return Err(SglangError::Timeout(held.room)) };
            match msg {
                Inbound::Status { status: STATUS_SUCCESS, rank, .. } => {
                    match succeeded.get_mut(rank as usize) {
                        Some(done) if !*done => *done = true,
                        _ => {
                            return Err(SglangError::Malformed(format!(
                                "a second or unknown success from rank {rank} of {}",
                                req.ranks
                            )));
                        }
                    }
                }
                Inbound::Status { status: STATUS_FAILED, rank, .. } => {
                    return Err(SglangError::PrefillFailed { room: held.room, rank });
                }
                Inbound::Status { status, .. } => {
                    debug!(room = held.room, status, "SGLang status in passing");
                }
                Inbound::AuxData { buffer, row, data, .. } => {
                    let (Some(&len), Some(n)) =
                        (self.layout.aux_row_bytes.get(buffer), aux_rows.get_mut(buffer))
                    else {
                        return Err(SglangError::Malformed(format!("AUX_DATA buffer {buffer}")));
                    };
                    if row != held.lease.row || data.len() != len || *n >= req.ranks {
                        return Err(SglangError::Malformed(format!(
                            "AUX_DATA row {row} of {} bytes, number {} of buffer {buffer} (ours: row {}, {len} bytes, {} ranks)",
                            data.len(),
                            *n + 1,
                            held.lease.row,
                            req.ranks
                        )));
                    }
                    let offset = req.rows_of(*n)[buffer];
                    *n += 1;
                    let conn = peer_conn(peer.unwrap_or(IpAddr::from([127, 0, 0, 1])));
                    inbox.on_write(held.id, rows_of(*n - 1), conn, &[(offset, &data)])?;
                }
            }
        }
        for t in 0..req.ranks {
            inbox.finish(held.id, pages_of(t)).map_err(|e| match e {
                // The likeliest cause of a gap: pages of another element size than ours.
                TransferError::Failed(why) => TransferError::Failed(format!(
                    "{why} (if bytes are missing: pages of {} bytes expected, f32 KV, --dtype float32)",
                    self.layout.item_len()
                )),
                e => e,
            })?;
            inbox.finish(held.id, rows_of(t))?;
        }
        Ok(())
    }
}

/// Checks every rank's metadata row names `room` and the ranks agree on the first token,
/// which it returns.
fn agreed_rows(req: &RequestLayout, region: &[u8], room: u64) -> Result<u32, SglangError> {
    let first = layout::first_token(req, region, 0);
    for t in 0..req.ranks {
        let found = layout::room(req, region, t);
        if found != room {
            return Err(SglangError::RoomMismatch { expected: room, got: found });
        }
        let token = layout::first_token(req, region, t);
        if token != first {
            return Err(SglangError::Malformed(format!(
                "prefill ranks disagree on the first token: rank 0 says {first}, rank {t} {token}"
            )));
        }
    }
    Ok(first)
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
        let now = Instant::now();
        if self.done {
            self.r.mooncake.withdraw(self.id);
        } else {
            // Its writes may still come: dropped while its pages rest, not refused (a refusal
            // fails the prefill's whole session with this decode).
            self.r.mooncake.retire(self.id, now + crate::pool::QUARANTINE);
        }
        self.r.mooncake.inbox().release(self.id);
        if self.done {
            self.r.pool.give_back(self.lease);
        } else {
            self.r.pool.quarantine_at(self.lease, now);
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
