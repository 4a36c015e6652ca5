//! Following engine instances (vLLM, SGLang): their KV event streams into the index, and
//! their liveness from those streams and an HTTP health probe (see `state/engines.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use futures::StreamExt;
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{Instance, Registry, Role, Update};
use handoff_kv_events::{EngineEndpoint, EngineStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, warn};

use crate::{Scheduler, SchedulerState};

/// Engine blocks remembered per dp rank before its map is rebuilt.
const MAX_ENGINE_BLOCKS: usize = 1 << 20;

/// An engine instance to route to.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// Its id, model, topology (dp ranks) and page size (ours: how requests hash their
    /// prompts); `grpc_addr` is the address routers send its requests to.
    pub instance: Instance,
    /// Each dp rank's event stream, in rank order.
    pub events: Vec<EngineEndpoint>,
    /// `host:port` answering `GET /health` with 200 while the engine is up.
    pub health: Option<String>,
    /// How often the health probe runs.
    pub probe_every: Duration,
}

impl EngineSpec {
    /// What to follow for an engine's registration in discovery (role engine); `None` when
    /// it names no event stream.
    pub fn from_registration(instance: Instance) -> Option<EngineSpec> {
        let e = *instance.engine.clone()?;
        let dp = instance.topology.dp;
        let tcp = |s: &String| s.starts_with("tcp://") && s.len() <= 256;
        let plausible = instance.role == Role::Engine
            && (1..=MAX_ENGINE_DP).contains(&dp)
            && e.events.len() == dp as usize
            && e.events.iter().all(tcp)
            && e.replay.len() <= dp as usize
            && e.replay.iter().all(|r| r.is_empty() || tcp(r))
            && (1..=4096).contains(&instance.page_size)
            && e.topic.len() <= 256;
        if !plausible {
            return None;
        }
        let events = e
            .events
            .iter()
            .enumerate()
            .map(|(r, ev)| EngineEndpoint {
                events: ev.clone(),
                replay: e.replay.get(r).filter(|r| !r.is_empty()).cloned(),
                topic: e.topic.clone(),
            })
            .collect();
        Some(EngineSpec { instance, events, health: e.health, probe_every: PROBE_EVERY })
    }
}

/// Most dp ranks an engine registration may name (one event stream each).
pub const MAX_ENGINE_DP: u32 = 1024;

/// How often a registered engine's health is probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

impl Scheduler {
    /// Follows the engines registered in `registry` (role engine) on `tasks`: each one from
    /// its registration until it is removed (or registered again, then afresh).
    pub async fn follow_registered_engines(
        &self,
        registry: Arc<dyn Registry>,
        tasks: &Tasks,
    ) -> Result<(), handoff_discovery::DiscoveryError> {
        let mut updates = registry.watch(Role::Engine).await?;
        let (me, t) = (self.clone(), tasks.clone());
        tasks.spawn(async move {
            let mut followed: HashMap<InstanceId, (u64, Tasks)> = HashMap::new();
            loop {
                let u = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u { Some(u) => u, None => break },
                };
                let (add, remove): (Vec<Instance>, Vec<InstanceId>) = match u {
                    Update::Reset(all) => {
                        let ids: Vec<InstanceId> = all.iter().map(|i| i.id.clone()).collect();
                        let gone =
                            followed.keys().filter(|k| !ids.contains(k)).cloned().collect();
                        (all, gone)
                    }
                    Update::Add(i) => (vec![i], Vec::new()),
                    Update::Remove(id) => (Vec::new(), vec![id]),
                };
                for id in remove {
                    me.unfollow_engine(&id, &mut followed).await;
                }
                for i in add {
                    if followed.get(&i.id).is_some_and(|(v, _)| *v == i.version) {
                        continue;
                    }
                    me.unfollow_engine(&i.id, &mut followed).await;
                    let (id, version) = (i.id.clone(), i.version);
                    let Some(spec) = EngineSpec::from_registration(i) else {
                        warn!(instance = %id, "engine registration ignored: not role engine with 1 to 1024 dp ranks, one tcp:// event stream each, and a page size");
                        continue;
                    };
                    let own = t.child();
                    if me.follow_engine(spec, &own) {
                        followed.insert(id, (version, own));
                    } else {
                        warn!(instance = %id, "engine registration ignored: its id is taken");
                    }
                }
            }
            for (_, (_, own)) in followed {
                own.shutdown().await;
            }
        });
        Ok(())
    }

    async fn unfollow_engine(
        &self,
        id: &InstanceId,
        followed: &mut HashMap<InstanceId, (u64, Tasks)>,
    ) {
        if let Some((_, own)) = followed.remove(id) {
            own.shutdown().await;
            self.state().remove_engine(id);
            self.state().metrics().forget_engine(id);
        }
    }

    /// Routes to `spec`'s engine: registers it, follows each dp rank's KV events into the
    /// index, and keeps it in routing while it publishes or answers its health probe.
    /// `false` (nothing followed) when its id is already taken.
    pub fn follow_engine(&self, spec: EngineSpec, tasks: &Tasks) -> bool {
        let state = self.state().clone();
        let id = spec.instance.id.clone();
        let page_size = spec.instance.page_size.max(1) as usize;
        if !state.add_engine(spec.instance) {
            return false;
        }
        for (dp, endpoint) in spec.events.into_iter().enumerate() {
            let (s, id, t) = (state.clone(), id.clone(), tasks.clone());
            let meter = state.metrics().engine_stream(&id, dp as u32);
            tasks.spawn(async move {
                let stream =
                    EngineStream::new(endpoint, page_size, MAX_ENGINE_BLOCKS).with_meter(meter);
                let mut epoch = 0;
                let sink = |ops| {
                    s.engine_heard_at(&id, Instant::now());
                    s.apply_engine_ops(&id, dp as u32, &mut epoch, ops)
                };
                let stats = stream.run(sink, t.shutdown_requested()).await;
                debug!(instance = %id, dp, ?stats, "engine KV event stream ended");
            });
        }
        if let Some(addr) = spec.health {
            let (t, every) = (tasks.clone(), spec.probe_every.max(Duration::from_millis(100)));
            tasks.spawn(probe(state, id, addr, every, t));
        }
        true
    }
}

/// How many of an engine's health probes may be out at once: a probe may take this many
/// periods (a lost SYN is sent again after 1 s; a busy engine's API answers late), while the
/// next ones start on time.
const PROBES_OUT: usize = 2;

/// Probes `addr` every `every` until `tasks` stop, each probe given [`PROBES_OUT`] periods;
/// each healthy answer hears the engine. Before, a probe had one period: under 1 s of loss
/// or delay three in a row failed and an idle engine was swept, its index entries with it.
async fn probe(
    state: Arc<SchedulerState>,
    id: handoff_core::InstanceId,
    addr: String,
    every: Duration,
    tasks: Tasks,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut out = futures::stream::FuturesUnordered::new();
    let patience = every * PROBES_OUT as u32;
    loop {
        tokio::select! {
            _ = tasks.shutdown_requested() => break,
            _ = tick.tick(), if out.len() < PROBES_OUT => {
                out.push(tokio::time::timeout(patience, healthy(&addr)));
            }
            Some(answer) = out.next() => {
                if answer.unwrap_or(false) {
                    state.engine_heard_at(&id, Instant::now());
                }
            }
        }
    }
}

/// Whether `GET /health` at `addr` answers 200.
async fn healthy(addr: &str) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else { return false };
    let ask = format!("GET /health HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    if s.write_all(ask.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 32];
    let mut got = 0;
    while got < 12 {
        match s.read(&mut head[got..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    head[..got].starts_with(b"HTTP/1.") && head[..got].get(9..12) == Some(b"200")
}

#[cfg(test)]
mod tests {
    use handoff_discovery::Role;
    use tokio::net::TcpListener;

    use super::*;
    use crate::SchedulerConfig;

    /// A health endpoint answering 200 after `delay`, each connection.
    async fn late_health(delay: Duration) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut ask = [0u8; 512];
                    let _ = s.read(&mut ask).await;
                    tokio::time::sleep(delay).await;
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                });
            }
        });
        addr
    }

    /// An engine whose health answers come later than one probe period (a lost SYN, a busy
    /// API server) is still heard: probes overlap. Before, each timed out at one period and
    /// an idle engine was swept, its index entries with it.
    #[tokio::test]
    async fn health_answered_later_than_a_period_still_hears_the_engine() {
        let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
        let now = Instant::now();
        let long_ago = now.checked_sub(Duration::from_secs(30)).unwrap_or(now);
        let instance = Instance::fixture("vllm-0".parse().unwrap(), Role::Engine);
        assert!(state.add_engine_at(instance, long_ago));
        let every = Duration::from_millis(100);
        let addr = late_health(every * 13 / 10).await;
        let tasks = Tasks::new();
        let id: InstanceId = "vllm-0".parse().unwrap();
        let probing = probe(state.clone(), id.clone(), addr, every, tasks.clone());
        let _ = tokio::time::timeout(Duration::from_secs(1), probing).await;
        let silent =
            state.instances().into_iter().find(|s| s.instance.id == id).unwrap().silent_for;
        assert!(silent < Duration::from_secs(5), "heard {silent:?} ago");
    }
}
