//! vLLM's `NixlHandshakePayload` and `NixlAgentMetadata` (NIXL connector version 15), decoded
//! from msgpack (msgspec encodes dataclasses as maps by field name) and checked.

use rmpv::Value;

use crate::VllmError;

/// The handshake's answer: the prefill's compatibility hash and its agent's metadata.
#[derive(Debug, Clone)]
pub struct Handshake {
    /// sha256 over vLLM's compatibility factors (model, dtype, layout, versions). In pull
    /// mode only the decode checks it; this decode has no vLLM config to compute its own, so
    /// the caller compares it with the value it expects, if any.
    pub compatibility_hash: String,
    /// The prefill worker's agent and KV cache.
    pub metadata: AgentMetadata,
}

/// The part of `NixlAgentMetadata` a pull-mode decode reads.
#[derive(Debug, Clone)]
pub struct AgentMetadata {
    /// The prefill engine.
    pub engine_id: String,
    /// The NIXL agent metadata blob (its address and every registered region's key).
    pub agent_metadata: Vec<u8>,
    /// Each KV region's base address (vLLM 0.33: one per attention layer, K and V packed).
    pub kv_caches_base_addr: Vec<u64>,
    /// Blocks in each region.
    pub num_blocks: u64,
    /// Bytes of one block, per region.
    pub block_lens: Vec<u64>,
    /// Bytes from one block to the next, per region.
    pub block_strides: Vec<u64>,
    /// The order inside a block, as vLLM 0.33 names it (`KVCacheLayout`'s names): `LBHNC`
    /// (heads, then tokens) or `LBNHC` (tokens, then heads); or their older aliases `HND` and
    /// `NHD`.
    pub kv_cache_layout: String,
    /// Tokens per block.
    pub block_size: u64,
    /// The prefill's attention backend.
    pub attn_backend_name: String,
}

/// Most regions accepted (layers x K/V of large models are a few hundred).
const MAX_REGIONS: usize = 4096;

fn field<'a>(map: &'a [(Value, Value)], name: &str) -> Option<&'a Value> {
    map.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn malformed(s: impl Into<String>) -> VllmError {
    VllmError::Malformed(s.into())
}

fn map_of(v: &Value, what: &str) -> Result<Vec<(Value, Value)>, VllmError> {
    match v {
        Value::Map(m) => Ok(m.clone()),
        _ => Err(malformed(format!("{what} is not a map"))),
    }
}

fn string(map: &[(Value, Value)], name: &str) -> Result<String, VllmError> {
    field(map, name)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| malformed(format!("no string {name}")))
}

fn bytes(map: &[(Value, Value)], name: &str) -> Result<Vec<u8>, VllmError> {
    match field(map, name) {
        Some(Value::Binary(b)) => Ok(b.clone()),
        _ => Err(malformed(format!("no bytes {name}"))),
    }
}

fn uint(map: &[(Value, Value)], name: &str) -> Result<u64, VllmError> {
    field(map, name).and_then(Value::as_u64).ok_or_else(|| malformed(format!("no integer {name}")))
}

fn uints(map: &[(Value, Value)], name: &str) -> Result<Vec<u64>, VllmError> {
    let Some(Value::Array(a)) = field(map, name) else {
        return Err(malformed(format!("no list {name}")));
    };
    if a.len() > MAX_REGIONS {
        return Err(malformed(format!("{name}: {} entries (at most {MAX_REGIONS})", a.len())));
    }
    a.iter()
        .map(|v| v.as_u64().ok_or_else(|| malformed(format!("{name}: not an integer"))))
        .collect()
}

/// An optional integer field: `None` if absent or nil.
fn opt_uint(map: &[(Value, Value)], name: &str) -> Result<Option<u64>, VllmError> {
    match field(map, name) {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| malformed(format!("{name}: not an integer"))),
    }
}

fn decode(bytes: &[u8]) -> Result<Value, VllmError> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, 16)
        .map_err(|e| malformed(format!("msgpack: {e}")))?;
    if !rd.is_empty() {
        return Err(malformed(format!("{} bytes after the message", rd.len())));
    }
    Ok(v)
}

impl Handshake {
    /// Decodes the handshake's first answer frame.
    pub fn decode(frame: &[u8]) -> Result<Self, VllmError> {
        let payload = map_of(&decode(frame)?, "NixlHandshakePayload")?;
        let compatibility_hash = string(&payload, "compatibility_hash")?;
        let inner = bytes(&payload, "agent_metadata_bytes")?;
        let metadata = AgentMetadata::decode(&inner)?;
        Ok(Handshake { compatibility_hash, metadata })
    }
}

/// Refuses what `read_blocks` would read wrongly: several KV cache groups (their blocks are
/// listed per group), state-space or packed regions, a block order other than NHD or HND.
fn refuse_other_layouts(m: &[(Value, Value)], meta: &AgentMetadata) -> Result<(), VllmError> {
    let unsupported = |s: String| Err(VllmError::Unsupported(s));
    if !matches!(meta.kv_cache_layout.as_str(), "LBHNC" | "LBNHC" | "HND" | "NHD") {
        return unsupported(format!("kv_cache_layout {:?}", meta.kv_cache_layout));
    }
    if let Some(Value::Array(groups)) = field(m, "region_group_ids")
        && groups.iter().any(|g| g != &groups[0])
    {
        return unsupported("several KV cache groups".into());
    }
    if let Some(Value::Array(ssm)) = field(m, "ssm_sizes")
        && ssm.iter().any(|v| v.as_u64() != Some(0))
    {
        return unsupported("state-space (Mamba) regions".into());
    }
    if let Some(Value::Map(packed)) = field(m, "packed_member_layouts")
        && !packed.is_empty()
    {
        return unsupported("packed KV rows".into());
    }
    Ok(())
}

impl AgentMetadata {
    /// Decodes and checks an encoded `NixlAgentMetadata`.
    pub fn decode(encoded: &[u8]) -> Result<Self, VllmError> {
        let m = map_of(&decode(encoded)?, "NixlAgentMetadata")?;
        let meta = AgentMetadata {
            engine_id: string(&m, "engine_id")?,
            agent_metadata: bytes(&m, "agent_metadata")?,
            kv_caches_base_addr: uints(&m, "kv_caches_base_addr")?,
            num_blocks: uint(&m, "num_blocks")?,
            block_lens: uints(&m, "block_lens")?,
            block_strides: uints(&m, "block_strides")?,
            kv_cache_layout: string(&m, "kv_cache_layout")?,
            block_size: uint(&m, "block_size")?,
            attn_backend_name: string(&m, "attn_backend_name")?,
        };
        let one = |name: &str| -> Result<(), VllmError> {
            match opt_uint(&m, name)? {
                None | Some(1) => Ok(()),
                Some(n) => Err(VllmError::Unsupported(format!("{name} {n} (this decode reads 1)"))),
            }
        };
        one("dcp_size")?;
        one("pcp_size")?;
        one("physical_blocks_per_logical_kv_block")?;
        if let Some(Value::Array(counts)) = field(&m, "region_num_blocks")
            && counts.iter().any(|c| c.as_u64() != Some(meta.num_blocks))
        {
            return Err(VllmError::Unsupported("regions of different block counts".into()));
        }
        refuse_other_layouts(&m, &meta)?;
        meta.check()?;
        Ok(meta)
    }

    /// The layout is one this decode can read, and its arithmetic stays in range.
    fn check(&self) -> Result<(), VllmError> {
        let regions = self.kv_caches_base_addr.len();
        if regions == 0 || self.block_lens.len() != regions || self.block_strides.len() != regions {
            return Err(malformed(format!(
                "{regions} regions with {} block lengths and {} strides",
                self.block_lens.len(),
                self.block_strides.len()
            )));
        }
        if self.num_blocks == 0 {
            return Err(malformed("no blocks"));
        }
        for r in 0..regions {
            let (len, stride) = (self.block_lens[r], self.block_strides[r]);
            let end = stride.checked_mul(self.num_blocks - 1).and_then(|o| o.checked_add(len));
            let fits = end.and_then(|e| self.kv_caches_base_addr[r].checked_add(e)).is_some();
            if len == 0 || stride < len || !fits {
                return Err(malformed(format!(
                    "region {r}: block length {len}, stride {stride}, {} blocks",
                    self.num_blocks
                )));
            }
        }
        Ok(())
    }

    /// Whether a block holds each head's tokens together (`LBHNC`, alias `HND`) rather than
    /// each token's heads (`LBNHC`, alias `NHD`).
    pub fn heads_outer(&self) -> bool {
        matches!(self.kv_cache_layout.as_str(), "LBHNC" | "HND")
    }

    /// Regions in the prefill's cache.
    pub fn regions(&self) -> usize {
        self.kv_caches_base_addr.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn meta(extra: Vec<(&str, Value)>) -> Vec<u8> {
        let mut m: Vec<(Value, Value)> = vec![
            ("engine_id".into(), "e".into()),
            ("agent_metadata".into(), Value::Binary(vec![1, 2])),
            ("kv_caches_base_addr".into(), Value::Array(vec![4096.into(), 1_000_000.into()])),
            ("device_id".into(), 0.into()),
            ("num_blocks".into(), 8.into()),
            ("block_lens".into(), Value::Array(vec![64.into(), 64.into()])),
            ("block_strides".into(), Value::Array(vec![64.into(), 128.into()])),
            ("kv_cache_layout".into(), "LBHNC".into()),
            ("block_size".into(), 16.into()),
            ("attn_backend_name".into(), "FLASH_ATTN".into()),
            ("physical_blocks_per_logical_kv_block".into(), 1.into()),
            ("region_num_blocks".into(), Value::Nil),
        ];
        for (k, v) in extra {
            m.retain(|(key, _)| key.as_str() != Some(k));
            m.push((k.into(), v));
        }
        encode(&Value::Map(m))
    }

    #[test]
    fn a_valid_payload_decodes() {
        let payload = Value::Map(vec![
            ("compatibility_hash".into(), "abc".into()),
            ("agent_metadata_bytes".into(), Value::Binary(meta(vec![]))),
        ]);
        let h = Handshake::decode(&encode(&payload)).unwrap();
        assert_eq!(h.compatibility_hash, "abc");
        assert_eq!(h.metadata.regions(), 2);
        assert_eq!(h.metadata.block_strides, vec![64, 128]);
    }

    #[test]
    fn bad_or_unsupported_metadata_is_refused_with_the_reason() {
        let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
            (vec![("dcp_size", 2.into())], "dcp_size 2"),
            (vec![("physical_blocks_per_logical_kv_block", 4.into())], "physical_blocks"),
            (vec![("region_num_blocks", Value::Array(vec![8.into(), 4.into()]))], "block counts"),
            (vec![("block_lens", Value::Array(vec![64.into()]))], "block lengths"),
            (vec![("block_strides", Value::Array(vec![32.into(), 64.into()]))], "stride 32"),
            (vec![("num_blocks", 0.into())], "no blocks"),
            (
                vec![("kv_caches_base_addr", Value::Array(vec![u64::MAX.into(), 1.into()]))],
                "region 0",
            ),
            (vec![("engine_id", 5.into())], "engine_id"),
            (vec![("kv_cache_layout", "XYZ".into())], "kv_cache_layout"),
            // Heads outside blocks: a block is not one contiguous run.
            (vec![("kv_cache_layout", "LHBNC".into())], "kv_cache_layout"),
            (vec![("region_group_ids", Value::Array(vec![0.into(), 1.into()]))], "groups"),
            (vec![("ssm_sizes", Value::Array(vec![64.into(), 0.into()]))], "Mamba"),
            (
                vec![(
                    "packed_member_layouts",
                    Value::Map(vec![("k".into(), Value::Array(vec![0.into(), 8.into()]))]),
                )],
                "packed",
            ),
        ];
        for (extra, want) in cases {
            let e = AgentMetadata::decode(&meta(extra)).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        assert!(Handshake::decode(&[0xc1]).is_err());
        assert!(Handshake::decode(&encode(&Value::from(3))).is_err());
    }
}
