//! The directory's state: which rank sits at which (dp, cp, tp, pp) coordinate, whether the
//! instance is fully registered, and the bounded dp-rank table.

mod dp_table;

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{BootstrapError, RankAddr, Registration, ServerInfo};
use dp_table::DpTable;

/// The SGLang version a directory answers for: newer peers accept more server-info keys,
/// older ones reject any key they do not know.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum PeerVersion {
    /// sglang 0.5.10 to 0.5.18: the base keys only.
    #[default]
    V0_5_10,
    /// sglang 0.5.19 to 0.5.22: adds `enable_dsa_cache_layer_split`, `prefill_http_port`.
    V0_5_19,
    /// sglang 0.5.23 and later: adds `decode_allocation_policy`, `enable_kv_cache_sharding`,
    /// `kv_layout`, `dsv41_spec_layout`.
    V0_5_23,
}

/// Settings of a directory.
#[derive(Debug, Clone)]
pub struct DirectoryConfig {
    /// When set, `PUT /route` and `POST /register_dp_rank` need `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Which server-info keys to emit.
    pub peer_version: PeerVersion,
    /// How long a dp-rank table entry lives.
    pub dp_entry_ttl: Duration,
    /// Most entries the dp-rank table holds; the oldest go first.
    pub dp_table_capacity: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Largest accepted parallel size per dimension.
    pub max_parallel: i64,
    /// Most rooms one `/query_dp_ranks` answers for: the first this many of a longer list
    /// (a decode asks again for the rest, as it does for rooms not registered yet).
    pub max_query_rooms: usize,
    /// Largest accepted `/query_dp_ranks` body: an SGLang decode sends every room it still
    /// waits on in one list, about 21 bytes a room.
    pub max_query_body_bytes: usize,
    /// The cluster's mutual TLS on the listener (readers and writers need a certificate from
    /// the cluster's CA).
    pub tls: Option<handoff_core::tls::ClusterTls>,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        DirectoryConfig {
            token: None,
            peer_version: PeerVersion::default(),
            dp_entry_ttl: Duration::from_secs(120),
            dp_table_capacity: 100_000,
            max_body_bytes: 64 * 1024,
            max_parallel: 1024,
            max_query_rooms: 65_536,
            max_query_body_bytes: 1 << 20,
            tls: None,
        }
    }
}

type Coord = (i64, i64, i64, i64);

/// A prefill instance's bootstrap directory.
#[derive(Debug)]
pub struct Directory {
    cfg: DirectoryConfig,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    first: Option<Registration>,
    rows: HashMap<Coord, RankAddr>,
    dp_ranks: DpTable,
}

impl Directory {
    /// An empty directory.
    pub fn new(cfg: DirectoryConfig) -> Self {
        let dp_ranks = DpTable::new(cfg.dp_table_capacity, cfg.dp_entry_ttl);
        Directory { cfg, inner: Mutex::new(Inner { first: None, rows: HashMap::new(), dp_ranks }) }
    }

    /// The directory's settings.
    pub fn config(&self) -> &DirectoryConfig {
        &self.cfg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere mid-update of plain data; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks a write's `Authorization` header against the configured token.
    pub fn authorize(&self, header: Option<&str>) -> Result<(), BootstrapError> {
        match &self.cfg.token {
            None => Ok(()),
            // The scheme's name in any case (RFC 9110), as SGLang's own check takes it.
            Some(token) => match header
                .and_then(|h| h.split_once(' '))
                .and_then(|(scheme, given)| scheme.eq_ignore_ascii_case("bearer").then_some(given))
            {
                Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => Ok(()),
                _ => Err(BootstrapError::Unauthorized),
            },
        }
    }

    /// Registers (or replaces) one rank.
    pub fn register(&self, reg: Registration) -> Result<(), BootstrapError> {
        self.validate(&reg)?;
        let mut inner = self.lock();
        if let Some(first) = &inner.first {
            if first.allocation_policy() != reg.allocation_policy() {
                return Err(BootstrapError::Inconsistent(
                    "Inconsistent prefill allocation policies".into(),
                ));
            }
            let sizes = |r: &Registration| {
                (r.attn_tp_size, r.attn_cp_size, r.dp_size(), r.pp_size, r.page_size)
            };
            if sizes(first) != sizes(&reg) || first.kv_cache_dtype != reg.kv_cache_dtype {
                return Err(BootstrapError::Inconsistent(format!(
                    "Inconsistent registration: tp/cp/dp/pp/page_size/dtype {:?}/{} differ from \
                     the instance's {:?}/{}",
                    sizes(&reg),
                    reg.kv_cache_dtype,
                    sizes(first),
                    first.kv_cache_dtype
                )));
            }
        }
        let coord = (reg.dp_group(), reg.attn_cp_rank, reg.attn_tp_rank, reg.pp_rank);
        let addr = RankAddr { rank_ip: reg.rank_ip.clone(), rank_port: reg.rank_port as u16 };
        inner.rows.insert(coord, addr);
        if inner.first.is_none() {
            inner.first = Some(reg);
        }
        Ok(())
    }

    fn validate(&self, r: &Registration) -> Result<(), BootstrapError> {
        let max = self.cfg.max_parallel;
        let dims = [
            ("attn_tp", r.attn_tp_size, r.attn_tp_rank),
            ("attn_cp", r.attn_cp_size, r.attn_cp_rank),
            ("dp", r.dp_size(), r.dp_group()),
            ("pp", r.pp_size, r.pp_rank),
        ];
        for (name, size, rank) in dims {
            if !(1..=max).contains(&size) {
                return Err(BootstrapError::BadRequest(format!(
                    "{name}_size must be in 1..={max}, got {size}"
                )));
            }
            if !(0..size).contains(&rank) {
                return Err(BootstrapError::BadRequest(format!(
                    "{name}_rank must be in 0..{size}, got {rank}"
                )));
            }
        }
        if r.system_dp_size < 1 || r.attn_dp_size < 1 {
            return Err(BootstrapError::BadRequest("dp sizes must be positive".into()));
        }
        if !(1..=65535).contains(&r.rank_port) {
            return Err(BootstrapError::BadRequest(format!(
                "rank_port must be in 1..=65535, got {}",
                r.rank_port
            )));
        }
        if r.rank_ip.parse::<std::net::IpAddr>().is_err() {
            return Err(BootstrapError::BadRequest(format!(
                "rank_ip must be an IP address, got {:?}",
                r.rank_ip
            )));
        }
        if r.page_size < 1 {
            return Err(BootstrapError::BadRequest("page_size must be positive".into()));
        }
        if !matches!(r.allocation_policy(), "early" | "prefill_complete") {
            return Err(BootstrapError::BadRequest(format!(
                "decode_allocation_policy must be early or prefill_complete, got {:?}",
                r.allocation_policy()
            )));
        }
        Ok(())
    }

    /// Distinct coordinates registered.
    pub fn registered(&self) -> usize {
        self.lock().rows.len()
    }

    fn ready(inner: &Inner) -> Result<&Registration, BootstrapError> {
        match &inner.first {
            Some(f) => {
                let want = f.attn_tp_size * f.attn_cp_size * f.dp_size() * f.pp_size;
                if inner.rows.len() as i64 >= want {
                    Ok(f)
                } else {
                    Err(BootstrapError::NotReady(inner.rows.len()))
                }
            }
            None => Err(BootstrapError::NotReady(0)),
        }
    }

    /// The server info (all `-1` query), once every rank has registered.
    pub fn server_info(&self) -> Result<ServerInfo, BootstrapError> {
        let inner = self.lock();
        let f = Self::ready(&inner)?;
        let v = self.cfg.peer_version;
        let since = |min: PeerVersion| v >= min;
        Ok(ServerInfo {
            attn_tp_size: f.attn_tp_size,
            attn_cp_size: f.attn_cp_size,
            dp_size: f.dp_size(),
            pp_size: f.pp_size,
            page_size: f.page_size,
            kv_cache_dtype: f.kv_cache_dtype.clone(),
            follow_bootstrap_room: f.follows_bootstrap_room(),
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
            enable_dsa_cache_layer_split: since(PeerVersion::V0_5_19)
                .then_some(f.enable_dsa_cache_layer_split),
            prefill_http_port: since(PeerVersion::V0_5_19).then_some(f.prefill_http_port).flatten(),
            decode_allocation_policy: since(PeerVersion::V0_5_23)
                .then(|| f.allocation_policy().to_owned()),
            enable_kv_cache_sharding: since(PeerVersion::V0_5_23)
                .then_some(f.enable_kv_cache_sharding),
            kv_layout: since(PeerVersion::V0_5_23).then(|| f.kv_layout.clone()).flatten(),
            dsv41_spec_layout: since(PeerVersion::V0_5_23)
                .then(|| f.dsv41_spec_layout.clone())
                .flatten(),
        })
    }

    /// The transfer endpoint of one rank, once every rank has registered.
    pub fn rank(&self, dp: i64, cp: i64, tp: i64, pp: i64) -> Result<RankAddr, BootstrapError> {
        let inner = self.lock();
        Self::ready(&inner)?;
        inner.rows.get(&(dp, cp, tp, pp)).cloned().ok_or(BootstrapError::NotFound {
            dp,
            cp,
            tp,
            pp,
        })
    }

    /// Records which dp rank serves `room`.
    pub fn register_dp_rank(&self, room: u64, dp_rank: u32) {
        self.lock().dp_ranks.insert(room, dp_rank, Instant::now());
    }

    /// The dp ranks of the rooms that are known; unknown rooms are omitted.
    pub fn query_dp_ranks(&self, rooms: &[u64]) -> BTreeMap<String, u32> {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.dp_ranks.expire(now);
        rooms.iter().filter_map(|r| inner.dp_ranks.get(*r).map(|d| (r.to_string(), d))).collect()
    }

    /// Entries in the dp-rank table.
    pub fn dp_table_len(&self) -> usize {
        self.lock().dp_ranks.len()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests;
