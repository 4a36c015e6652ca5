use std::time::{Duration, Instant};

use super::dp_table::DpTable;
use super::*;

pub(crate) fn reg(tp_size: i64, tp_rank: i64, port: i64) -> Registration {
    serde_json::from_value(serde_json::json!({
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": 64, "kv_cache_dtype": "auto"
    }))
    .unwrap()
}

#[test]
fn readiness_counts_distinct_coordinates() {
    let d = Directory::new(DirectoryConfig::default());
    d.register(reg(2, 0, 40000)).unwrap();
    d.register(reg(2, 0, 40002)).unwrap();
    assert_eq!(d.server_info(), Err(BootstrapError::NotReady(1)));
    d.register(reg(2, 1, 40001)).unwrap();
    assert_eq!(d.server_info().unwrap().attn_tp_size, 2);
    assert_eq!(d.rank(0, 0, 0, 0).unwrap().rank_port, 40002);
}

#[test]
fn newer_peers_get_newer_keys_only() {
    let mut cfg = DirectoryConfig::default();
    let d = Directory::new(cfg.clone());
    d.register(reg(1, 0, 40000)).unwrap();
    let old = serde_json::to_value(d.server_info().unwrap()).unwrap();
    assert_eq!(old.as_object().unwrap().len(), 13);
    cfg.peer_version = PeerVersion::V0_5_23;
    let d = Directory::new(cfg);
    d.register(reg(1, 0, 40000)).unwrap();
    let new = serde_json::to_value(d.server_info().unwrap()).unwrap();
    assert_eq!(new["decode_allocation_policy"], "early");
    assert_eq!(new["enable_dsa_cache_layer_split"], false);
    assert!(new.get("kv_layout").is_none(), "null kv_layout is omitted");
}

#[test]
fn registrations_out_of_range_are_rejected() {
    let d = Directory::new(DirectoryConfig::default());
    for bad in [reg(2, 2, 40000), reg(0, 0, 40000), reg(1, 0, 0), reg(1, 0, 70000)] {
        assert!(matches!(d.register(bad), Err(BootstrapError::BadRequest(_))));
    }
    let mut r = reg(1, 0, 1);
    r.rank_ip = "not an ip".into();
    assert!(matches!(d.register(r), Err(BootstrapError::BadRequest(_))));
    assert_eq!(d.registered(), 0);
}

#[test]
fn dp_table_expires_and_stays_bounded() {
    let t0 = Instant::now();
    let mut t = DpTable::new(100, Duration::from_secs(120));
    for room in 0..10_000u64 {
        t.insert(room, (room % 4) as u32, t0);
    }
    assert_eq!(t.len(), 100);
    assert_eq!(t.get(9_999), Some(3));
    assert_eq!(t.get(0), None, "oldest evicted");
    for _ in 0..10_000 {
        t.insert(9_999, 1, t0);
    }
    assert!(t.order.len() <= 200);
    t.expire(t0 + Duration::from_secs(121));
    assert_eq!(t.len(), 0);
}

#[test]
fn token_is_required_when_configured() {
    let d = Directory::new(DirectoryConfig { token: Some("s3cret".into()), ..Default::default() });
    assert_eq!(d.authorize(None), Err(BootstrapError::Unauthorized));
    assert_eq!(d.authorize(Some("Bearer nope")), Err(BootstrapError::Unauthorized));
    assert_eq!(d.authorize(Some("Bearer s3cret")), Ok(()));
}
