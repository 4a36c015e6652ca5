//! JSON bodies of the directory protocol.

use serde::{Deserialize, Serialize};

/// One rank's registration (`PUT /route`). Unknown keys are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// Attention tp size.
    pub attn_tp_size: i64,
    /// Attention tp rank.
    pub attn_tp_rank: i64,
    /// Attention cp size.
    pub attn_cp_size: i64,
    /// Attention cp rank.
    pub attn_cp_rank: i64,
    /// Attention dp size.
    pub attn_dp_size: i64,
    /// Attention dp rank.
    pub attn_dp_rank: i64,
    /// Pipeline size.
    pub pp_size: i64,
    /// Pipeline rank.
    pub pp_rank: i64,
    /// System dp size (1 unless dp runs as separate systems).
    pub system_dp_size: i64,
    /// System dp rank.
    pub system_dp_rank: i64,
    /// The rank's transfer endpoint IP.
    pub rank_ip: String,
    /// The rank's transfer endpoint port.
    pub rank_port: i64,
    /// Tokens per KV page.
    pub page_size: i64,
    /// KV dtype, compared verbatim by decode.
    pub kv_cache_dtype: String,
    /// `follow_bootstrap_room` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balance_method: Option<String>,
    /// KV layout name (sglang 0.5.23).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// `early` (default) or `prefill_complete`; the same for all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_allocation_policy: Option<String>,
    /// The prefill's HTTP port (sglang 0.5.19).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_http_port: Option<i64>,
    /// sglang 0.5.19.
    #[serde(default)]
    pub enable_dsa_cache_layer_split: bool,
    /// sglang 0.5.23.
    #[serde(default)]
    pub enable_kv_cache_sharding: bool,
    /// sglang 0.5.23.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<serde_json::Value>,
}

impl Registration {
    /// The instance's dp size as SGLang derives it.
    pub fn dp_size(&self) -> i64 {
        if self.system_dp_size == 1 { self.attn_dp_size } else { self.system_dp_size }
    }

    /// The row's dp group.
    pub fn dp_group(&self) -> i64 {
        if self.system_dp_size == 1 { self.attn_dp_rank } else { self.system_dp_rank }
    }

    /// The decode allocation policy, with its default.
    pub fn allocation_policy(&self) -> &str {
        self.decode_allocation_policy.as_deref().unwrap_or("early")
    }

    /// Whether decode may derive the dp rank as `room % dp_size`.
    pub fn follows_bootstrap_room(&self) -> bool {
        matches!(self.load_balance_method.as_deref(), None | Some("follow_bootstrap_room"))
    }
}

/// The server info answer (`GET /route` with all `-1`). Optional keys are emitted only for
/// peers new enough to accept them (see [`crate::PeerVersion`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Attention tp size.
    pub attn_tp_size: i64,
    /// Attention cp size.
    pub attn_cp_size: i64,
    /// dp size.
    pub dp_size: i64,
    /// Pipeline size.
    pub pp_size: i64,
    /// Tokens per KV page.
    pub page_size: i64,
    /// KV dtype.
    pub kv_cache_dtype: String,
    /// Whether `room % dp_size` names the dp rank.
    pub follow_bootstrap_room: bool,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub target_tp_rank: Option<i64>,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub target_tp_ranks: Option<Vec<i64>>,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub target_cp_ranks: Option<Vec<i64>>,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub target_pp_ranks: Option<Vec<i64>>,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub required_dst_info_num: Option<i64>,
    /// Always null from a prefill directory.
    #[serde(default)]
    pub required_prefill_response_num: Option<i64>,
    /// sglang 0.5.19.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_dsa_cache_layer_split: Option<bool>,
    /// sglang 0.5.19.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_http_port: Option<i64>,
    /// sglang 0.5.23.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_allocation_policy: Option<String>,
    /// sglang 0.5.23.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_kv_cache_sharding: Option<bool>,
    /// sglang 0.5.23, omitted when null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    /// sglang 0.5.23, omitted when null.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dsv41_spec_layout: Option<serde_json::Value>,
}

/// A rank's transfer endpoint (`GET /route` with coordinates).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankAddr {
    /// IP of the rank's transfer endpoint.
    pub rank_ip: String,
    /// Port of the rank's transfer endpoint.
    pub rank_port: u16,
}
