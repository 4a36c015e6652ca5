//! Decoding a `KVEventBatch` (see the crate docs). A batch is `[ts, events, dp_rank?]`; an
//! event is a map with `"type"` first, or an array with the tag first and fields by
//! position. Anything unrecognised is an error for that payload only.

use rmpv::Value;

/// An engine's block hash, reduced to 64 bits: unsigned as is, signed (SGLang) cast, bytes
/// (vLLM's full digests) by their last 8 bytes, big-endian.
pub type EngineHash = u64;

/// Why a payload was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EventsError {
    /// Not msgpack, or not a batch.
    #[error("malformed KV event batch: {0}")]
    Malformed(String),
}

fn bad(reason: impl Into<String>) -> EventsError {
    EventsError::Malformed(reason.into())
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks stored, chained after `parent`.
    Stored {
        /// The blocks' engine hashes, in order.
        hashes: Vec<EngineHash>,
        /// The engine hash of the block before the first, if any.
        parent: Option<EngineHash>,
        /// Every token of the blocks, in order.
        token_ids: Vec<u32>,
        /// Tokens per engine block.
        block_size: u32,
        /// The LoRA adapter, if any.
        lora_name: Option<String>,
        /// Whether the blocks are namespaced in some other way the event names but a request's
        /// hashes here do not include: a LoRA by id only (vLLM before 0.14, SGLang before
        /// 0.5.23) or a cache salt (SGLang from 0.5.21).
        namespaced: bool,
        /// The kind of KV cache (`full_attention`, `sliding_window`, ...), when it says.
        spec_kind: Option<String>,
        /// Where the blocks live (`GPU`, `CPU`, ...); `None` means the device.
        medium: Option<String>,
        /// Whether any block carries extra keys (multimodal, cache salt, ...).
        extra_keys: bool,
        /// The KV cache group (hybrid models); `None` or 0 is the main one.
        group_idx: Option<i64>,
        /// Whether `token_ids` are bigram pairs (EAGLE), not tokens.
        bigram: bool,
    },
    /// Blocks evicted.
    Removed {
        /// Their engine hashes.
        hashes: Vec<EngineHash>,
        /// Where they lived.
        medium: Option<String>,
        /// The KV cache group (hybrid models); `None` or 0 is the main one.
        group_idx: Option<i64>,
    },
    /// Every block of the worker gone.
    Cleared,
    /// An event type this decoder does not know (skipped).
    Unknown(String),
}

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// When the engine made it (seconds).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<Event>,
    /// The engine's dp rank, when it says.
    pub dp_rank: Option<i64>,
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, EventsError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, 16)
        .map_err(|e| bad(format!("msgpack: {e}")))?;
    let Value::Array(parts) = v else { return Err(bad("a batch is not an array")) };
    let ts = parts.first().and_then(|t| t.as_f64().or_else(|| t.as_i64().map(|i| i as f64)));
    let ts = ts.ok_or_else(|| bad("batch without a timestamp"))?;
    let Some(Value::Array(events)) = parts.get(1) else {
        return Err(bad("batch without an event list"));
    };
    let dp_rank = parts.get(2).and_then(Value::as_i64);
    let events = events.iter().map(event).collect::<Result<_, _>>()?;
    Ok(Batch { ts, events, dp_rank })
}

/// The fields of an event, by name, whichever encoding it came in.
struct Fields<'a> {
    tag: &'a str,
    named: Vec<(&'a str, &'a Value)>,
}

/// Field order of the array encoding (vLLM up to 0.23, SGLang up to 0.5.18).
const STORED_ORDER: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_ORDER: &[&str] = &["block_hashes", "medium", "group_idx"];

fn fields(v: &Value) -> Result<Fields<'_>, EventsError> {
    match v {
        Value::Map(entries) => {
            let mut tag = None;
            let mut named = Vec::with_capacity(entries.len());
            for (k, val) in entries {
                let Some(k) = k.as_str() else { continue };
                if k == "type" {
                    tag = val.as_str();
                } else {
                    named.push((k, val));
                }
            }
            let tag = tag.ok_or_else(|| bad("an event map without \"type\""))?;
            Ok(Fields { tag, named })
        }
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str);
            let tag = tag.ok_or_else(|| bad("an event array without its tag"))?;
            let order = match tag {
                "BlockStored" => STORED_ORDER,
                "BlockRemoved" => REMOVED_ORDER,
                _ => &[],
            };
            let named = order.iter().copied().zip(items.iter().skip(1)).collect();
            Ok(Fields { tag, named })
        }
        _ => Err(bad("an event is neither a map nor an array")),
    }
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.named.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).filter(|v| !v.is_nil())
    }

    fn text(&self, name: &str) -> Option<String> {
        self.get(name).and_then(Value::as_str).map(str::to_owned)
    }
}

fn hash(v: &Value) -> Result<EngineHash, EventsError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .ok_or_else(|| bad("a hash out of range")),
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| acc << 8 | u64::from(x)))
        }
        _ => Err(bad("a hash that is neither an integer nor bytes")),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<EngineHash>, EventsError> {
    match v {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => Err(bad("an event without block_hashes")),
    }
}

/// Tokens, and whether they came as bigram pairs.
fn tokens(v: Option<&Value>) -> Result<(Vec<u32>, bool), EventsError> {
    let Some(Value::Array(items)) = v else { return Err(bad("BlockStored without token_ids")) };
    let token = |t: &Value| {
        t.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad("a token id out of range"))
    };
    let mut out = Vec::with_capacity(items.len());
    let mut bigram = false;
    for t in items {
        match t {
            Value::Array(pair) => {
                bigram = true;
                out.push(token(pair.first().ok_or_else(|| bad("an empty bigram"))?)?);
            }
            t => out.push(token(t)?),
        }
    }
    Ok((out, bigram))
}

fn event(v: &Value) -> Result<Event, EventsError> {
    let f = fields(v)?;
    Ok(match f.tag {
        "BlockStored" => {
            let (token_ids, bigram) = tokens(f.get("token_ids"))?;
            let block_size = f.get("block_size").and_then(Value::as_u64);
            let block_size = block_size
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or_else(|| bad("BlockStored without a positive block_size"))?;
            let extra_keys = match f.get("extra_keys") {
                Some(Value::Array(per_block)) => per_block.iter().any(|k| !k.is_nil()),
                _ => false,
            };
            Event::Stored {
                hashes: hashes(f.get("block_hashes"))?,
                parent: f.get("parent_block_hash").map(hash).transpose()?,
                token_ids,
                block_size,
                lora_name: f.text("lora_name"),
                namespaced: ["lora_id", "cache_salt"]
                    .iter()
                    .any(|k| f.get(k).is_some_and(|v| !v.is_nil())),
                spec_kind: f.text("kv_cache_spec_kind"),
                medium: f.text("medium"),
                extra_keys,
                group_idx: f.get("group_idx").and_then(Value::as_i64),
                bigram,
            }
        }
        "BlockRemoved" => Event::Removed {
            hashes: hashes(f.get("block_hashes"))?,
            medium: f.text("medium"),
            group_idx: f.get("group_idx").and_then(Value::as_i64),
        },
        "AllBlocksCleared" => Event::Cleared,
        other => Event::Unknown(other.to_owned()),
    })
}

#[cfg(test)]
mod tests;
