//! What the benchmarks share: the shapes of the Dynamo comparison (W instances each storing
//! sequences of D blocks that share a P-block prefix) and a scheduler holding them; the path
//! helpers; [`pacer::Pacer`], an open loop's schedule; [`stages::Stages`], where a frontend's
//! requests spent their time; and [`record::Report`], the JSON record every bench writes
//! beside its table.

pub mod fuzz;
pub mod pacer;
pub mod path;
pub mod record;
pub mod stages;

use handoff_core::{BlockHash, InstanceId};
use handoff_discovery::{Instance, KvEvent, KvEventKind, Role, Topology, Update};
use handoff_kv_index::WorkerKey;
use handoff_scheduler::{SchedulerConfig, SchedulerState};

/// Blocks per sequence.
pub const DEPTH: u64 = 64;
/// Leading blocks every sequence shares.
pub const PREFIX: u64 = 32;
/// Sequences each instance stores.
pub const PER_WORKER: u64 = 16;
/// Tokens per block.
pub const PAGE: u32 = 16;

/// Block `d` of sequence `s` of worker `w`: shared for the first [`PREFIX`] blocks.
pub fn block(w: u64, s: u64, d: u64) -> u64 {
    if d < PREFIX { d + 1 } else { (w + 1) << 40 | (s + 1) << 16 | d }
}

/// Sequence `s` of worker `w`, as our block hashes.
pub fn sequence(w: u64, s: u64) -> Vec<BlockHash> {
    (0..DEPTH).map(|d| BlockHash(block(w, s, d))).collect()
}

/// Worker `w` (dp rank 0 of instance `w{w}`).
pub fn worker(w: u64) -> WorkerKey {
    let instance = InstanceId::try_from(format!("w{w}")).unwrap_or_else(|_| unreachable!());
    WorkerKey { instance, dp_rank: 0 }
}

/// Instance `w{w}`: one dp rank, pages of [`PAGE`] tokens.
pub fn instance(w: u64) -> Instance {
    Instance {
        id: worker(w).instance,
        role: Role::Prefill,
        model: "m".into(),
        bootstrap_addr: "127.0.0.1:1".into(),
        grpc_addr: "127.0.0.1:2".into(),
        topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
        page_size: PAGE,
        version: 1,
        engine: None,
    }
}

/// A scheduler over `w_count` instances, each holding its [`PER_WORKER`] sequences (stored
/// through KV events, as a running scheduler learns them).
pub fn fleet(w_count: u64) -> SchedulerState {
    let state = SchedulerState::new(SchedulerConfig::default());
    let all = (0..w_count).map(instance).collect();
    state.apply_update(Update::Reset(all));
    for w in 0..w_count {
        for s in 0..PER_WORKER {
            state.apply_event(KvEvent {
                instance: worker(w).instance,
                dp_rank: 0,
                seq: s + 1,
                incarnation: 0,
                kind: KvEventKind::Stored { parent: None, blocks: sequence(w, s) },
            });
        }
    }
    state
}

/// Reads `--flag value` pairs from the command line, handing each to `apply`.
pub fn parse_flags(mut apply: impl FnMut(&str, &str) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
        apply(&flag, &val)?;
    }
    Ok(())
}
