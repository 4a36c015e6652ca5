//! The etcd registry. Each instance is the key `/handoff/v1/instances/{role}/{id}` (its
//! registration as JSON) under a lease of `ttl`, kept alive every `ttl / 3`; deleting the key
//! or letting the lease lapse removes the instance everywhere. When etcd comes back after the
//! lease lapsed, the instance registers again. A watch starts from a snapshot (`Reset`), then
//! follows changes from the snapshot's revision; after a compaction, a cancelled watch or a
//! lost connection it takes a new snapshot and says `Reset` again. While etcd is away,
//! watchers keep their last state and the log says so once per outage, not per retry. An
//! etcd not reachable yet when a process starts is waited for ([`patience`]). The client's
//! TLS files are read again while the process runs, and a changed set makes a new client
//! ([`link`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use futures::StreamExt;
use futures::stream::BoxStream;
use handoff_core::tls::HandedTls;
use handoff_core::tls::expiry::Shown;
use handoff_core::tls::reload::{Reloadable, look, watch_then, zeroed};
use handoff_core::{InstanceId, Tasks};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{DiscoveryError, Instance, Registry, Role, ServerAccess, Update};

mod claim;
mod link;
mod patience;

use link::Link;

/// Where instances live in etcd.
pub const KEY_PREFIX: &str = "/handoff/v1/instances/";

/// The largest registration put in etcd. Registrations are a few hundred bytes; the bound
/// keeps a role's snapshot (every registration under it, in one answer) readable.
pub const MAX_REGISTRATION_BYTES: usize = 64 * 1024;

/// How long a lease's revocation at shutdown may take.
const REVOKE_WITHIN: Duration = Duration::from_secs(5);

/// The largest snapshot of a role read back: a thousand registrations at the bound.
const MAX_SNAPSHOT_BYTES: usize = 64 << 20;

fn role_dir(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Frontend => "frontend",
        Role::Scheduler => "scheduler",
        Role::Engine => "engine",
    }
}

fn key(i: &Instance) -> String {
    format!("{KEY_PREFIX}{}/{}", role_dir(i.role), i.id)
}

fn unavailable(e: impl std::fmt::Display) -> DiscoveryError {
    DiscoveryError::Unavailable(format!("etcd: {e}"))
}

/// A registry in etcd (see the module docs).
pub struct EtcdRegistry {
    link: Arc<Link>,
    ttl: Duration,
    tasks: Tasks,
    leases: Mutex<HashMap<InstanceId, CancellationToken>>,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry").field("ttl", &self.ttl).finish_non_exhaustive()
    }
}

impl EtcdRegistry {
    /// Connects to `endpoints` (comma-separated URLs); leases of `ttl`; keep-alives and
    /// watches run on `tasks`.
    pub async fn connect(
        endpoints: &str,
        ttl: Duration,
        tasks: &Tasks,
    ) -> Result<Self, DiscoveryError> {
        Self::connect_with(endpoints, &ServerAccess::default(), ttl, tasks).await
    }

    /// As [`EtcdRegistry::connect`], with TLS and credentials (`https://` endpoints when the
    /// access has TLS). The TLS files are read again every `access.tls_reload`, when given,
    /// until `tasks` shut down.
    pub async fn connect_with(
        endpoints: &str,
        access: &ServerAccess,
        ttl: Duration,
        tasks: &Tasks,
    ) -> Result<Self, DiscoveryError> {
        let eps: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            // etcd closes connections that ping more often than its --grpc-keepalive-min-time
            // (5 s by default), which would break every watch: ping every 10 s.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // A member cut off from the quorum keeps a watch open and silent: refused, the
            // watch fails and is taken again (through a member that has a leader).
            .with_require_leader(true);
        if access.credentials.is_some() {
            return Err(DiscoveryError::Config("etcd takes no NATS credentials file".into()));
        }
        if let Some((user, password)) = &access.user {
            // etcd's tokens last until it restarts (simple) or their TTL (JWT): a call that
            // finds its token expired authenticates again.
            opts = opts.with_user(user, password).with_auto_token_refresh(true);
        }
        let identity = access.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        let tls = HandedTls::from_files(Shown::EtcdClient, identity, access.ca.as_deref())?;
        let held: Vec<Reloadable> = tls.iter().cloned().map(Reloadable::Handed).collect();
        if access.tls_reload.is_some() {
            zeroed(&held);
        }
        // With credentials the client authenticates at once: an etcd not up yet is waited
        // for (without, nothing is sent until the first call), the files looked at before
        // each try, so that one renewed meanwhile is taken.
        let stop = tasks.shutdown_token();
        let look_now = || {
            if access.tls_reload.is_some() {
                look(&held, std::time::SystemTime::now());
            }
        };
        let link = Link::connect(eps, opts, tls, look_now, &stop).await.map_err(unavailable)?;
        let link = Arc::new(link);
        if let Some(every) = access.tls_reload {
            keep_renewed(&link, held, every, tasks);
        }
        Ok(EtcdRegistry {
            link,
            ttl: ttl.max(Duration::from_secs(2)),
            tasks: tasks.clone(),
            leases: Mutex::default(),
        })
    }

    async fn put_with_lease(
        client: &mut Client,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> Result<i64, etcd_client::Error> {
        let lease = client.lease_grant(ttl.as_secs() as i64, None).await?.id();
        client.put(key, value, Some(PutOptions::new().with_lease(lease))).await?;
        Ok(lease)
    }
}

/// Looks at `held` (the client's TLS files) every `every` until `tasks` shut down, and makes
/// a new client after each look if they changed, so that a set etcd refuses is said at the
/// renewal, not at the next reconnect.
fn keep_renewed(link: &Arc<Link>, held: Vec<Reloadable>, every: Duration, tasks: &Tasks) {
    if held.is_empty() {
        return;
    }
    let renewing = link.clone();
    let renew = move |_| {
        let link = renewing.clone();
        async move { link.renew().await }
    };
    let t = tasks.clone();
    let stop = async move { t.shutdown_requested().await };
    tasks.spawn(watch_then(held, every, stop, renew));
}

/// Keeps `lease` alive until `stop`; registers again if the lease lapses (etcd was away for
/// longer than the TTL), and puts the key back if it went or changed while the lease lived (an
/// operator's `etcdctl del`, an earlier process of the same id deregistering, another
/// writer's addresses); revokes the lease on `stop`. Each try after a failure takes the
/// client in use ([`link`]).
async fn keep(
    link: Arc<Link>,
    key: String,
    value: Vec<u8>,
    ttl: Duration,
    mut lease: i64,
    stop: CancellationToken,
) {
    let period = ttl / 3;
    let (mut outage, mut said_taken) = (false, false);
    loop {
        let mut client = tokio::select! {
            _ = stop.cancelled() => break,
            client = link.client() => client,
        };
        let alive = async {
            let (mut keeper, mut stream) =
                client.lease_keep_alive(lease).await.map_err(unavailable)?;
            let mut beat = 0u64;
            loop {
                beat += 1;
                keeper.keep_alive().await.map_err(unavailable)?;
                match stream.message().await.map_err(unavailable)? {
                    Some(r) if r.ttl() > 0 => {}
                    _ => return Err::<(), _>(DiscoveryError::Unavailable("lease lapsed".into())),
                }
                // Once a TTL: the key itself is still there, and still says what this
                // process registered (a writer that changed its addresses would have had
                // this instance's traffic for as long as it lived). Held under another live
                // lease, it is another process's registration under this id (they would
                // put theirs back in turn, flipping routing every TTL): said, not fought.
                if beat.is_multiple_of(3) {
                    let held = client.get(key.as_str(), None).await.map_err(unavailable)?;
                    let stored = held.kvs().first().map(|kv| (kv.value(), kv.lease()));
                    match stored {
                        Some((v, l)) if v == value.as_slice() && l == lease => {}
                        Some((_, l)) if l != 0 && l != lease => {
                            if !said_taken {
                                warn!(%key, "registration held by another process's lease: left to it (give each instance its own --id)");
                                said_taken = true;
                            }
                        }
                        _ => {
                            let put = PutOptions::new().with_lease(lease);
                            client
                                .put(key.as_str(), value.as_slice(), Some(put))
                                .await
                                .map_err(unavailable)?;
                            match stored {
                                None => {
                                    info!(%key, "registration deleted under a live lease; put back")
                                }
                                Some(_) => warn!(
                                    %key,
                                    "registration changed by another writer; put back (check who can write etcd)"
                                ),
                            }
                        }
                    }
                }
                if outage {
                    info!(%key, "etcd reachable again; lease kept");
                    outage = false;
                }
                tokio::time::sleep(period).await;
            }
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            Err(e) = alive => {
                if !outage {
                    warn!(%key, error = %e, "etcd keep-alive failed; retrying, and registering again if the lease lapsed");
                    outage = true;
                }
            }
        }
        // Back off, then try a new lease and put if the old one lapsed.
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        let expired = match client.lease_time_to_live(lease, None).await {
            Ok(r) => r.ttl() <= 0,
            Err(_) => continue,
        };
        if expired && let Ok(l) = EtcdRegistry::put_with_lease(&mut client, &key, &value, ttl).await
        {
            info!(%key, "registered again after the lease lapsed");
            lease = l;
            outage = false;
        }
    }
    let _ = tokio::time::timeout(REVOKE_WITHIN, link.current().lease_revoke(lease)).await;
}

#[async_trait]
impl Registry for EtcdRegistry {
    async fn register(&self, instance: Instance) -> Result<(), DiscoveryError> {
        let key = key(&instance);
        let value = serde_json::to_vec(&instance)?;
        if value.len() > MAX_REGISTRATION_BYTES {
            return Err(DiscoveryError::TooLarge {
                bytes: value.len(),
                limit: MAX_REGISTRATION_BYTES,
            });
        }
        // Another live process's id is refused; this process's own (registering again) and a
        // predecessor's whose lease runs out are not.
        let own = self.leases.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&instance.id);
        if !own {
            claim::await_free(&mut self.link.client().await, &key, &instance, self.ttl).await?;
        }
        // An etcd not reachable yet (the process started first) is waited for.
        let what = format!("{key} registered");
        let lease = patience::until_reached(&what, &self.tasks.shutdown_token(), || {
            let (link, key, value, ttl) = (&self.link, key.clone(), value.clone(), self.ttl);
            async move { Self::put_with_lease(&mut link.client().await, &key, &value, ttl).await }
        })
        .await
        .map_err(unavailable)?;
        let stop = self.tasks.shutdown_token().child_token();
        if let Some(old) = self
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(instance.id.clone(), stop.clone())
        {
            old.cancel();
        }
        self.tasks.spawn(keep(self.link.clone(), key, value, self.ttl, lease, stop));
        Ok(())
    }

    async fn deregister(&self, id: &InstanceId) -> Result<(), DiscoveryError> {
        if let Some(stop) = self.leases.lock().unwrap_or_else(|e| e.into_inner()).remove(id) {
            stop.cancel();
        }
        // The client in use: a deregistration at shutdown does not wait for a new one.
        let mut client = self.link.current();
        for role in [Role::Prefill, Role::Frontend, Role::Scheduler, Role::Engine] {
            client
                .delete(format!("{KEY_PREFIX}{}/{id}", role_dir(role)), None)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    async fn watch(&self, role: Role) -> Result<BoxStream<'static, Update>, DiscoveryError> {
        let prefix = format!("{KEY_PREFIX}{}/", role_dir(role));
        let (tx, rx) = mpsc::channel(256);
        let link = self.link.clone();
        let stop = self.tasks.shutdown_token();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = follow(&link, prefix, tx) => {}
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx).boxed())
    }
}

fn parse(value: &[u8]) -> Option<Instance> {
    serde_json::from_slice(value)
        .map_err(|e| warn!(error = %e, "malformed registration ignored"))
        .ok()
}

/// Snapshot, then changes; a new snapshot (through the client in use) after anything goes
/// wrong. Ends when the watcher drops its stream.
async fn follow(link: &Link, prefix: String, tx: mpsc::Sender<Update>) {
    let mut outage = false;
    loop {
        let mut client = link.client().await;
        let run = async {
            let snap = client
                .kv_client()
                .max_decoding_message_size(MAX_SNAPSHOT_BYTES)
                .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
                .map_err(unavailable)?;
            let rev = snap.header().map_or(0, |h| h.revision());
            let all = snap.kvs().iter().filter_map(|kv| parse(kv.value())).collect();
            if tx.send(Update::Reset(all)).await.is_err() {
                return Ok(());
            }
            if outage {
                info!(%prefix, "etcd watch restored from a fresh snapshot");
                outage = false;
            }
            let opts = WatchOptions::new().with_prefix().with_start_revision(rev + 1);
            let mut stream =
                client.watch(prefix.as_str(), Some(opts)).await.map_err(unavailable)?;
            while let Some(resp) = stream.message().await.map_err(unavailable)? {
                if resp.canceled() || resp.compact_revision() > 0 {
                    return Err(DiscoveryError::Unavailable(format!(
                        "watch cancelled: {}",
                        resp.cancel_reason()
                    )));
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let update = match ev.event_type() {
                        EventType::Put => parse(kv.value()).map(Update::Add),
                        EventType::Delete => kv
                            .key_str()
                            .ok()
                            .and_then(|k| k.rsplit('/').next())
                            .and_then(|id| id.parse().ok())
                            .map(Update::Remove),
                    };
                    if let Some(u) = update
                        && tx.send(u).await.is_err()
                    {
                        return Ok(());
                    }
                }
            }
            Err(DiscoveryError::Unavailable("watch stream ended".into()))
        };
        match run.await {
            Ok(()) => return,
            Err(e) => {
                if !outage {
                    warn!(%prefix, error = %e, "etcd watch lost; keeping the last state and retrying");
                    outage = true;
                }
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}
