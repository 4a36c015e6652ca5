//! What a prefill's directory says of its KV, checked against this decode before anything
//! is registered: a prefill whose pages hold other bytes than ours (another dtype, layout or
//! sharding) would write them into our regions unnoticed, the room's row still agreeing.

use handoff_bootstrap::ServerInfo;
use handoff_core::Room;

use crate::SglangError;

/// The most prefill attention-TP ranks one room is read from.
pub const MAX_PREFILL_TP: usize = 16;

/// The KV dtype this decode's pages hold, as SGLang names it (the model's own), compared
/// verbatim as SGLang's decode does.
const OUR_DTYPE: &str = "auto";

/// The dp rank serving `room` on the prefill `info` describes, after checking its page size
/// (against ours, `page_size`), KV dtype and layout, and its topology are ones we read.
pub fn dp_rank(info: &ServerInfo, page_size: usize, room: Room) -> Result<u32, SglangError> {
    let unsupported = |what: String| Err(SglangError::Unsupported(what));
    if info.page_size as usize != page_size {
        return unsupported(format!(
            "the prefill's page size is {}, ours {page_size}",
            info.page_size
        ));
    }
    if info.kv_cache_dtype != OUR_DTYPE {
        return unsupported(format!(
            "the prefill's KV dtype is {:?}, ours {OUR_DTYPE:?}",
            info.kv_cache_dtype
        ));
    }
    if let Some(layout) = &info.kv_layout {
        return unsupported(format!("the prefill's KV layout is {layout:?}, ours the default"));
    }
    if info.dsv41_spec_layout.is_some() {
        return unsupported("the prefill has a speculative-decoding KV layout".into());
    }
    if info.enable_kv_cache_sharding == Some(true)
        || info.enable_dsa_cache_layer_split == Some(true)
    {
        return unsupported("the prefill shards its KV cache (by rank or DSA layer)".into());
    }
    let tp = info.attn_tp_size;
    if (info.attn_cp_size, info.pp_size) != (1, 1) || !(1..=MAX_PREFILL_TP as i64).contains(&tp) {
        return unsupported(format!(
            "prefill attn tp {tp} / cp {} / pp {}: tp 1..={MAX_PREFILL_TP} with cp 1 and pp 1 is served",
            info.attn_cp_size, info.pp_size
        ));
    }
    if info.follow_bootstrap_room {
        Ok((room.get() % info.dp_size.max(1) as u64) as u32)
    } else if info.dp_size == 1 {
        Ok(0)
    } else {
        unsupported("dp ranks not following the room".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefill as SGLang 0.5.23's directory describes one by default (`sglang-sender.md`).
    fn plain() -> ServerInfo {
        serde_json::from_value(serde_json::json!({
            "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1, "page_size": 16,
            "kv_cache_dtype": "auto", "follow_bootstrap_room": true,
            "enable_dsa_cache_layer_split": false, "enable_kv_cache_sharding": false,
        }))
        .unwrap()
    }

    #[test]
    fn a_default_prefill_is_read_on_the_rooms_dp_rank() {
        assert_eq!(dp_rank(&plain(), 16, Room::try_from(7).unwrap()).unwrap(), 1);
        let single = ServerInfo { dp_size: 1, follow_bootstrap_room: false, ..plain() };
        assert_eq!(dp_rank(&single, 16, Room::try_from(7).unwrap()).unwrap(), 0);
    }

    /// Pages holding other bytes than ours are refused before a registration: written into
    /// our regions they would verify (the room's row agrees) and be read as our dtype.
    #[test]
    fn pages_of_another_dtype_layout_or_sharding_are_refused() {
        let room = Room::try_from(7).unwrap();
        let others = [
            ServerInfo { page_size: 32, ..plain() },
            ServerInfo { kv_cache_dtype: "fp8_e4m3".into(), ..plain() },
            ServerInfo { kv_layout: Some("HND".into()), ..plain() },
            ServerInfo { dsv41_spec_layout: Some(serde_json::json!({})), ..plain() },
            ServerInfo { enable_kv_cache_sharding: Some(true), ..plain() },
            ServerInfo { enable_dsa_cache_layer_split: Some(true), ..plain() },
            ServerInfo { attn_tp_size: 32, ..plain() },
            ServerInfo { pp_size: 2, ..plain() },
            ServerInfo { follow_bootstrap_room: false, ..plain() },
        ];
        for info in others {
            let got = dp_rank(&info, 16, room);
            assert!(matches!(got, Err(SglangError::Unsupported(_))), "{info:?}: {got:?}");
        }
    }
}
