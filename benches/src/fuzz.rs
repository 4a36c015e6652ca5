//! Fuzzing every decoder of network bytes, on stable Rust: inputs are random bytes and
//! mutations of valid messages (bit flips, truncations, splices, length fields set to
//! extremes), each decoded and applied as the live code would, under `catch_unwind`. Any
//! panic, or a bootstrap answer of 5xx, is a failure. Decoders: tcp transfer frames (into a
//! real inbox), bootstrap HTTP requests (bodies, query strings, paths, through the real
//! router), and bus payloads (KV events, heartbeats, load reports, snapshot pages, into a
//! real scheduler state).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use handoff_core::Room;
use handoff_discovery::{
    Heartbeat, Instance, KvEvent, KvSnapshot, LoadReport, Role, Topology, Update,
};
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use handoff_transfer::{Inbox, InboxConfig, SenderId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What fuzzing one decoder found.
#[derive(Debug)]
pub struct Report {
    /// The decoder.
    pub name: &'static str,
    /// Inputs tried.
    pub inputs: u64,
    /// Seconds it took.
    pub secs: f64,
    /// Inputs that panicked or got a 5xx (the first few, hex-encoded).
    pub failures: Vec<String>,
    /// Failures in all.
    pub failed: u64,
}

impl Report {
    fn new(name: &'static str) -> Self {
        Report { name, inputs: 0, secs: 0.0, failures: Vec::new(), failed: 0 }
    }

    fn fail(&mut self, input: &[u8], why: &str) {
        self.failed += 1;
        if self.failures.len() < 5 {
            let hex: String = input.iter().take(256).map(|b| format!("{b:02x}")).collect();
            self.failures.push(format!("{why}: {hex}"));
        }
    }
}

/// A mutation of `seed` (or random bytes).
pub fn mutate(rng: &mut StdRng, seed: &[u8]) -> Vec<u8> {
    if seed.is_empty() || rng.random_bool(0.1) {
        let n = rng.random_range(0..64);
        return (0..n).map(|_| rng.random()).collect();
    }
    let mut b = seed.to_vec();
    for _ in 0..rng.random_range(1..4) {
        if b.is_empty() {
            break;
        }
        let at = rng.random_range(0..b.len());
        match rng.random_range(0..6) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b.truncate(at),
            2 => b.insert(at, rng.random()),
            3 => {
                b.remove(at);
            }
            4 => {
                // A 4-byte field set to an extreme.
                let v: u32 = [0, 1, u32::MAX, u32::MAX / 2, 0x8000_0000][rng.random_range(0..5)];
                for (i, x) in v.to_le_bytes().iter().enumerate() {
                    if let Some(y) = b.get_mut(at + i) {
                        *y = *x;
                    }
                }
            }
            _ => {
                let other = b.clone();
                let from = rng.random_range(0..other.len());
                b.splice(at..at, other[from..].iter().copied().take(16));
            }
        }
    }
    b
}

fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
    f.push(kind);
    f.extend_from_slice(body);
    f
}

/// Valid frame streams for `region` (8 bytes, senders 0 and 1).
fn frame_seeds(region: u64, room: Room) -> Vec<Vec<u8>> {
    let mut write = region.to_le_bytes().to_vec();
    write.extend_from_slice(&0u32.to_le_bytes());
    write.extend_from_slice(&2u32.to_le_bytes());
    for (off, len) in [(0u64, 2u32), (2, 2)] {
        write.extend_from_slice(&off.to_le_bytes());
        write.extend_from_slice(&len.to_le_bytes());
    }
    write.extend_from_slice(b"abcd");
    let mut notice = region.to_le_bytes().to_vec();
    notice.extend_from_slice(&room.get().to_le_bytes());
    for v in [0u32, 7, 4, 0] {
        notice.extend_from_slice(&v.to_le_bytes());
    }
    notice.extend_from_slice(&4u64.to_le_bytes());
    notice.extend_from_slice(&0u64.to_le_bytes());
    let connect = format!(
        r#"{{"room":{},"receiver":{{"ip":"127.0.0.1","port":1}},"region":{region},"region_len":8,"dst_tp_size":1,"dst_tp_rank":0,"tokens":4,"token":null}}"#,
        room.get()
    );
    let mut both = frame(2, &write);
    both.extend(frame(3, &notice));
    vec![
        both,
        frame(1, connect.as_bytes()),
        frame(5, b"token"),
        frame(4, b"\x00no"),
        frame(2, &write),
    ]
}

/// Fuzzes tcp transfer frames into a real inbox.
pub async fn transfer_frames(inputs: u64, seed: u64) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = Report::new("tcp transfer frames");
    let cfg = InboxConfig { max_regions: 64, max_pending_rooms: 64, ..Default::default() };
    let inbox = Inbox::new(cfg);
    let started = Instant::now();
    let room = Room::mint();
    let (mut seeds, mut live) = (Vec::new(), std::collections::VecDeque::new());
    for i in 0..inputs {
        if i % 256 == 0 {
            // Fresh regions now and then, so mutations keep hitting live ones.
            let s = [(SenderId::new(0, 0), 0..4), (SenderId::new(1, 0), 4..8)]
                .map(|(s, r)| (s, std::iter::once(r).collect::<Vec<_>>()));
            if let Ok(id) = inbox.register_region(room, 8, s) {
                seeds = frame_seeds(id.0, room);
                live.push_back(id);
            }
            if live.len() > 32
                && let Some(old) = live.pop_front()
            {
                inbox.release(old);
            }
        }
        let input = {
            let i = rng.random_range(0..seeds.len());
            mutate(&mut rng, &seeds[i])
        };
        let run = AssertUnwindSafe(handoff_transfer::tcp::apply_frames(&input, &inbox, 1 << 16));
        if run.catch_unwind().await.is_err() {
            report.fail(&input, "panic");
        }
        report.inputs += 1;
    }
    report.secs = started.elapsed().as_secs_f64();
    report
}

/// Fuzzes the bootstrap directory's HTTP surface through its real router.
pub async fn bootstrap_http(inputs: u64, seed: u64) -> Report {
    use tower::ServiceExt;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = Report::new("bootstrap HTTP requests");
    let dir = Arc::new(handoff_bootstrap::Directory::new(Default::default()));
    let router = handoff_bootstrap::server::router(dir);
    let bodies: Vec<&[u8]> = vec![
        br#"{"role":"Prefill","rank_ip":"127.0.0.1","rank_port":9000,"engine_rank":0,"system_dp_rank":0,"tp_rank":0,"pp_rank":0,"attn_tp_size":1,"attn_cp_size":1,"attn_dp_size":1,"pp_size":1}"#,
        br#"{"bootstrap_room":7,"dp_rank":0}"#,
        br#"{"bootstrap_rooms":[1,2,3]}"#,
        b"",
    ];
    let queries = [
        "engine_rank=-1&target_dp_group=-1&target_pp_rank=-1",
        "engine_rank=0&target_dp_group=0&target_pp_rank=0",
        "prefill_dp_rank=0&engine_rank=0&target_dp_group=0&target_pp_rank=0",
    ];
    let paths = ["/route", "/register_dp_rank", "/query_dp_ranks", "/health", "/x"];
    let started = Instant::now();
    for _ in 0..inputs {
        let path = paths[rng.random_range(0..paths.len())];
        let q = {
            let i = rng.random_range(0..queries.len());
            mutate(&mut rng, queries[i].as_bytes())
        };
        let q: String = String::from_utf8_lossy(&q)
            .chars()
            .filter(|c| c.is_ascii_graphic() && *c != '#')
            .collect();
        let body = {
            let i = rng.random_range(0..bodies.len());
            mutate(&mut rng, bodies[i])
        };
        let method = ["GET", "PUT", "POST", "DELETE"][rng.random_range(0..4)];
        let Ok(req) = axum::http::Request::builder()
            .method(method)
            .uri(format!("{path}?{q}"))
            .body(axum::body::Body::from(body.clone()))
        else {
            continue;
        };
        let call = AssertUnwindSafe(router.clone().oneshot(req));
        match call.catch_unwind().await {
            Err(_) => report.fail(&body, "panic"),
            Ok(Ok(r)) if r.status().is_server_error() => report.fail(&body, "5xx"),
            Ok(_) => {}
        }
        report.inputs += 1;
    }
    report.secs = started.elapsed().as_secs_f64();
    report
}

fn instance(id: &str) -> Instance {
    Instance {
        id: id.parse().unwrap_or_else(|_| unreachable!()),
        role: Role::Prefill,
        model: "m".into(),
        bootstrap_addr: "127.0.0.1:1".into(),
        grpc_addr: "127.0.0.1:2".into(),
        topology: Topology { dp: 2, tp: 1, pp: 1, cp: 1 },
        page_size: 16,
        version: 1,
        engine: None,
    }
}

/// Fuzzes bus payloads (KV events, heartbeats, load reports, snapshot pages) into a real
/// scheduler state, then checks it still selects.
pub fn bus_payloads(inputs: u64, seed: u64) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = Report::new("bus payloads");
    let state = SchedulerState::new(SchedulerConfig::default());
    state.apply_update(Update::Reset(vec![instance("p0"), instance("p1")]));
    let seeds: Vec<&[u8]> = vec![
        br#"{"instance":"p0","dp_rank":1,"seq":1,"kind":{"type":"stored","parent":5,"blocks":[1,2,3]}}"#,
        br#"{"instance":"p1","dp_rank":0,"seq":9,"kind":{"type":"removed","blocks":[2]}}"#,
        br#"{"instance":"p0","dp_rank":0,"seq":2,"kind":{"type":"cleared"}}"#,
        br#"{"instance":"p0","queued_tokens":10,"running":1,"kv_bytes":5,"prefill_ns_per_token":900}"#,
        br#"{"replica":"r1","loads":[{"instance":"p0","dp_rank":0,"in_flight":4,"queued_tokens":100}],"routed":[{"instance":"p1","dp_rank":1,"blocks":[1,2]}]}"#,
        br#"{"instance":"p1","seq":3,"dp_blocks":[[1,2],[3]],"dp_parents":[[null,1],[null]],"snapshot":4,"page":0,"pages":2}"#,
    ];
    let hashes: Vec<handoff_core::BlockHash> = (1..5).map(handoff_core::BlockHash).collect();
    let started = Instant::now();
    for _ in 0..inputs {
        let input = {
            let i = rng.random_range(0..seeds.len());
            mutate(&mut rng, seeds[i])
        };
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if let Ok(ev) = serde_json::from_slice::<KvEvent>(&input) {
                state.apply_event(ev);
            }
            if let Ok(hb) = serde_json::from_slice::<Heartbeat>(&input) {
                state.heartbeat(&hb);
            }
            if let Ok(r) = serde_json::from_slice::<LoadReport>(&input) {
                state.apply_load_report(r, "me");
            }
            if let Ok(p) = serde_json::from_slice::<KvSnapshot>(&input) {
                state.apply_snapshot(p);
            }
            let ask = handoff_scheduler::Ask::new(&hashes, 64);
            if let Ok(sel) = state.select(&ask) {
                state.report(sel.booking, handoff_scheduler::Outcome::Success);
            }
        }));
        if run.is_err() {
            report.fail(&input, "panic");
        }
        report.inputs += 1;
    }
    report.secs = started.elapsed().as_secs_f64();
    report
}
