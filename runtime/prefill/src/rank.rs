//! One rank of a prefill instance, and how it sends its KV shard: to each decode rank that
//! reads from it, a part (one or more layers) at a time as the engine computes them, one
//! notice over them all.

use std::ops::Range;

use futures::future::try_join_all;
use handoff_bootstrap::mapping::{self, Parallel, RegionLayout, Shard};
use handoff_core::Room;
use handoff_engine::{EngineError, KvShape, LayerKv, kv::run_in_layer};
use handoff_transfer::{Agent, ConnectRequest, SenderId, WriteStream};
use tokio::time::Instant;

use crate::PrefillError;

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
    /// Takes the handshakes of every decode rank that reads from this rank for `room`
    /// (`tokens` prompt tokens of `shape`): `given` when the call carried them, else as they
    /// arrive over the transfer connections (until `deadline`); and opens a streamed write to
    /// each.
    pub async fn destinations(
        &self,
        par: Parallel,
        room: Room,
        shape: KvShape,
        tokens: usize,
        given: Vec<ConnectRequest>,
        deadline: Instant,
    ) -> Result<Vec<Destination>, PrefillError> {
        let inbox = self.agent.inbox();
        let in_call = !given.is_empty();
        let mut hs = if in_call { given } else { inbox.accept(room, 1, deadline).await? };
        let d = hs[0].dst_tp_size as usize;
        if !mapping::tp_compatible(d, par.tp) {
            return Err(PrefillError::Mismatch(format!(
                "decode tp {d} does not divide with prefill tp {}",
                par.tp
            )));
        }
        let peers = mapping::readers_per_sender(d, par.tp);
        if in_call && hs.len() != peers {
            return Err(PrefillError::Mismatch(format!(
                "{} handshakes for tp rank {} pp rank {}, decode tp {d} needs {peers}",
                hs.len(),
                self.tp,
                self.pp
            )));
        }
        if hs.len() < peers {
            hs.extend(inbox.accept(room, peers - hs.len(), deadline).await?);
        }
        // More than the decode's tp needs, or two for one decode rank: another receiver
        // claims this room (or one sent twice), and the KV would go to each.
        let mut ranks: Vec<u32> = hs.iter().map(|h| h.dst_tp_rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        if hs.len() > peers || ranks.len() < hs.len() {
            return Err(PrefillError::Mismatch(format!(
                "{} handshakes for room {room} at tp rank {} pp rank {} ({} decode ranks), decode tp {d} needs {peers}",
                hs.len(),
                self.tp,
                self.pp,
                ranks.len()
            )));
        }
        let opens = hs.iter().map(|h| self.destination(par, shape, tokens, h, d));
        try_join_all(opens).await
    }

    async fn destination(
        &self,
        par: Parallel,
        shape: KvShape,
        tokens: usize,
        h: &ConnectRequest,
        d: usize,
    ) -> Result<Destination, PrefillError> {
        let (tp, pp, dst) = (self.tp as usize, self.pp as usize, h.dst_tp_rank as usize);
        let heads = shape.kv_heads;
        if h.dst_tp_size as usize != d || dst >= d || h.tokens as usize != tokens {
            return Err(PrefillError::Mismatch(format!(
                "handshake for decode rank {dst}/{} of {} tokens does not match this request ({tokens} tokens)",
                h.dst_tp_size, h.tokens
            )));
        }
        let decode = Parallel { tp: d, pp: 1, cp: 1 };
        let plan = mapping::plan_ranks(par, decode, dst, 0, false)
            .map_err(|e| PrefillError::Mismatch(e.to_string()))?;
        if !plan.tp_ranks.contains(&tp) {
            return Err(PrefillError::Mismatch(format!(
                "decode rank {dst} does not read from tp rank {tp}"
            )));
        }
        let shard = mapping::shard(par, d, tp, pp, dst, heads, shape.layers);
        let layout = RegionLayout {
            layers: shape.layers,
            heads: mapping::heads_per_rank(d, heads),
            tokens,
            head_bytes: shape.head_bytes,
        };
        if h.region_len != layout.len() {
            return Err(PrefillError::Mismatch(format!(
                "decode region of {} bytes, this shard needs {}",
                h.region_len,
                layout.len()
            )));
        }
        let sender = SenderId::new(self.tp as u16, self.pp as u16);
        let stream =
            self.agent.open_write(&h.receiver, h.region, sender).await.map_err(|e| match e {
                handoff_transfer::TransferError::Unreachable { .. } => {
                    PrefillError::ReceiverUnreachable(e)
                }
                e => e.into(),
            })?;
        Ok(Destination { shard, layout, shape, tokens, stream })
    }
}

/// One decode rank this rank sends a room's KV to: its shard, where each run lands, and the
/// write streamed to it.
#[derive(Debug)]
pub struct Destination {
    shard: Shard,
    layout: RegionLayout,
    shape: KvShape,
    tokens: usize,
    stream: WriteStream,
}

impl Destination {
    /// Posts the shard's runs of `layers` (none of a layer the shard does not hold) in one
    /// part: the layers handed on together travel together.
    pub async fn post_layers(&mut self, layers: &[LayerKv]) -> Result<(), PrefillError> {
        let mut pairs = Vec::with_capacity(2 * layers.len());
        for layer in layers.iter().filter(|l| self.shard.layers.contains(&l.layer)) {
            pairs.extend(self.runs_of(layer)?);
        }
        if pairs.is_empty() {
            return Ok(());
        }
        Ok(self.stream.post(pairs).await?)
    }

    /// The shard's runs of `layer` as (its bytes, destination offset), adjacent runs merged.
    fn runs_of(&self, layer: &LayerKv) -> Result<Vec<(bytes::Bytes, u64)>, PrefillError> {
        let l = layer.layer;
        let runs = (0..2).flat_map(|k| (0..self.shard.heads).map(move |i| (k, i)));
        // (source range in the layer's bytes, destination offset), adjacent runs merged.
        let mut merged: Vec<(Range<usize>, u64)> = Vec::with_capacity(2);
        for (k, i) in runs {
            let src =
                run_in_layer(self.shape, self.tokens, k, self.shard.src_head + i, 0..self.tokens);
            let dst = self.layout.run_offset(l, k, self.shard.dst_head + i);
            match merged.last_mut() {
                Some((r, at)) if r.end == src.start && *at + r.len() as u64 == dst => {
                    r.end = src.end
                }
                _ => merged.push((src, dst)),
            }
        }
        if merged.last().is_some_and(|(r, _)| r.end > layer.bytes.len()) {
            return Err(PrefillError::Engine(EngineError::KvShape(format!(
                "layer {l} of {} bytes is short of its runs",
                layer.bytes.len()
            ))));
        }
        Ok(merged.into_iter().map(|(r, at)| (layer.bytes.slice(r), at)).collect())
    }

    /// Closes the write with its notice and waits for the decode's verification.
    pub async fn finish(self, room: Room, meta: SendMeta) -> Result<(), PrefillError> {
        let tokens = self.tokens as u32;
        Ok(self.stream.finish(room, meta.first_token, tokens, meta.cached_tokens).await?)
    }
}
