//! One rank of a prefill instance, and how it sends its KV shard.

use bytes::Bytes;
use futures::future::try_join_all;
use handoff_bootstrap::mapping::{self, Parallel, RegionLayout};
use handoff_core::Room;
use handoff_engine::{Kv, KvShape, kv::run_range};
use handoff_transfer::{Agent, ConnectRequest, SenderId, WriteRequest};
use tokio::time::Instant;

use crate::PrefillError;

/// A prompt's KV, shared (not copied) by every rank's sends.
#[derive(Debug, Clone)]
pub struct SharedKv {
    bytes: Bytes,
    shape: KvShape,
    tokens: usize,
}

impl SharedKv {
    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }
}

impl From<Kv> for SharedKv {
    fn from(kv: Kv) -> Self {
        let (shape, tokens) = (kv.shape(), kv.tokens());
        SharedKv { bytes: Bytes::from(kv.into_bytes()), shape, tokens }
    }
}

/// What every notice of a request carries besides the room.
#[derive(Debug, Clone, Copy)]
pub struct SendMeta {
    /// First generated token.
    pub first_token: u32,
    /// Prompt tokens that came from the prefix cache.
    pub cached_tokens: u32,
}

/// One rank (dp, cp, tp, pp) and its transfer agent.
#[derive(Debug, Clone)]
pub struct Rank {
    /// dp rank.
    pub dp: u32,
    /// cp rank.
    pub cp: u32,
    /// tp rank.
    pub tp: u32,
    /// pp rank.
    pub pp: u32,
    /// Its transfer endpoint.
    pub agent: Agent,
}

impl Rank {
    /// Waits for the handshakes of every decode rank that reads from this rank for `room`,
    /// and sends each its shard. Returns the handshakes served.
    pub async fn send(
        &self,
        par: Parallel,
        room: Room,
        kv: &SharedKv,
        meta: SendMeta,
        deadline: Instant,
    ) -> Result<usize, PrefillError> {
        let inbox = self.agent.inbox();
        let mut hs = inbox.accept(room, 1, deadline).await?;
        let d = hs[0].dst_tp_size as usize;
        if !mapping::tp_compatible(d, par.tp) {
            return Err(PrefillError::Invalid(format!(
                "decode tp {d} does not divide with prefill tp {}",
                par.tp
            )));
        }
        let peers = if d > par.tp { d / par.tp } else { 1 };
        if hs.len() < peers {
            hs.extend(inbox.accept(room, peers - hs.len(), deadline).await?);
        }
        let sends = hs.iter().map(|h| self.send_one(par, room, kv, meta, h, d));
        Ok(try_join_all(sends).await?.len())
    }

    async fn send_one(
        &self,
        par: Parallel,
        room: Room,
        kv: &SharedKv,
        meta: SendMeta,
        h: &ConnectRequest,
        d: usize,
    ) -> Result<(), PrefillError> {
        let (tp, pp, dst) = (self.tp as usize, self.pp as usize, h.dst_tp_rank as usize);
        let heads = kv.shape.kv_heads;
        if h.dst_tp_size as usize != d || dst >= d || h.tokens as usize != kv.tokens {
            return Err(PrefillError::Invalid(format!(
                "handshake for decode rank {dst}/{} of {} tokens does not match this request ({} tokens)",
                h.dst_tp_size, h.tokens, kv.tokens
            )));
        }
        let decode = Parallel { tp: d, pp: 1, cp: 1 };
        let plan = mapping::plan_ranks(par, decode, dst, 0, false)
            .map_err(|e| PrefillError::Invalid(e.to_string()))?;
        if !plan.tp_ranks.contains(&tp) {
            return Err(PrefillError::Invalid(format!(
                "decode rank {dst} does not read from tp rank {tp}"
            )));
        }
        let shard = mapping::shard(par, d, tp, pp, dst, heads, kv.shape.layers);
        let layout = RegionLayout {
            layers: kv.shape.layers,
            heads: mapping::heads_per_rank(d, heads),
            tokens: kv.tokens,
            head_bytes: kv.shape.head_bytes,
        };
        if h.region_len != layout.len() {
            return Err(PrefillError::Invalid(format!(
                "decode region of {} bytes, this shard needs {}",
                h.region_len,
                layout.len()
            )));
        }
        let mut pairs = Vec::with_capacity(shard.layers.len() * 2 * shard.heads);
        for l in shard.layers.clone() {
            for k in 0..2 {
                for i in 0..shard.heads {
                    let src =
                        run_range(kv.shape, kv.tokens, l, k, shard.src_head + i, 0..kv.tokens);
                    pairs.push((kv.bytes.slice(src), layout.run_offset(l, k, shard.dst_head + i)));
                }
            }
        }
        let sender = SenderId::new(self.tp as u16, self.pp as u16);
        let w = WriteRequest::new(
            h.region,
            pairs,
            room,
            sender,
            meta.first_token,
            kv.tokens as u32,
            meta.cached_tokens,
        );
        self.agent.post_write(&h.receiver, w).await?;
        Ok(())
    }
}
