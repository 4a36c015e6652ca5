//! Following engine instances (vLLM, SGLang): their KV event streams into the index, and
//! their liveness from those streams and an HTTP health probe (see `state/engines.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_core::Tasks;
use handoff_discovery::Instance;
use handoff_kv_events::{EngineEndpoint, EngineStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

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

impl Scheduler {
    /// Routes to `spec`'s engine: registers it, follows each dp rank's KV events into the
    /// index, and keeps it in routing while it publishes or answers its health probe.
    pub fn follow_engine(&self, spec: EngineSpec, tasks: &Tasks) {
        let state = self.state().clone();
        let id = spec.instance.id.clone();
        let page_size = spec.instance.page_size.max(1) as usize;
        state.add_engine(spec.instance);
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
    }
}

async fn probe(
    state: Arc<SchedulerState>,
    id: handoff_core::InstanceId,
    addr: String,
    every: Duration,
    tasks: Tasks,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tasks.shutdown_requested() => break,
            _ = tick.tick() => {}
        }
        if tokio::time::timeout(every, healthy(&addr)).await.unwrap_or(false) {
            state.engine_heard_at(&id, Instant::now());
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
