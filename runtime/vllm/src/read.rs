//! A request's KV blocks, READ from a vLLM prefill worker over NIXL, then the notification
//! that lets it free them.

use std::time::Duration;

use handoff_transfer::nixl::NixlReader;

use crate::{Peer, VllmError};

/// The blocks read: region by region, and in each region the blocks in the order asked,
/// `block_lens[region]` bytes each (vLLM's layout of one block: `kv_cache_layout`).
#[derive(Debug, Clone)]
pub struct Blocks {
    /// Bytes of each region's blocks, one region after the other.
    pub bytes: Vec<u8>,
    /// Where each region's run of blocks starts in `bytes`.
    pub region_starts: Vec<usize>,
}

impl Blocks {
    /// The `i`-th block asked for, in `region`.
    pub fn block(&self, region: usize, i: usize, block_len: usize) -> &[u8] {
        let at = self.region_starts[region] + i * block_len;
        &self.bytes[at..at + block_len]
    }
}

/// Reads blocks `block_ids` of every region of `peer`'s cache (the request
/// `remote_request_id`'s, as its `kv_transfer_params` list them), then has NIXL notify the
/// prefill `"<remote_request_id>:<consumers>"`, `consumers` being how many decode workers
/// read this request from that prefill worker. With no blocks (a full prefix hit), only the
/// notification goes, as vLLM's decode does. At most `max_bytes` are read.
pub async fn read_blocks(
    nixl: &NixlReader,
    peer: &Peer,
    remote_request_id: &str,
    block_ids: &[u64],
    consumers: u32,
    max_bytes: usize,
    timeout: Duration,
) -> Result<Blocks, VllmError> {
    let meta = &peer.handshake.metadata;
    let notify = format!("{remote_request_id}:{consumers}").into_bytes();
    if block_ids.is_empty() {
        nixl.notify_peer(&peer.agent, &notify)?;
        return Ok(Blocks { bytes: Vec::new(), region_starts: vec![0; meta.regions()] });
    }
    if let Some(b) = block_ids.iter().find(|&&b| b >= meta.num_blocks) {
        return Err(VllmError::Invalid(format!(
            "block {b} of a cache of {} blocks",
            meta.num_blocks
        )));
    }
    let mut ranges = Vec::with_capacity(meta.regions() * block_ids.len());
    let mut region_starts = Vec::with_capacity(meta.regions());
    let mut total = 0usize;
    for r in 0..meta.regions() {
        region_starts.push(total);
        let (base, len, stride) =
            (meta.kv_caches_base_addr[r], meta.block_lens[r], meta.block_strides[r]);
        for &b in block_ids {
            // In range: `AgentMetadata` checked base + stride * (num_blocks - 1) + len.
            ranges.push((base + b * stride, len as usize));
            total = total.saturating_add(len as usize);
        }
    }
    if total > max_bytes {
        return Err(VllmError::TooLarge(format!("{total} bytes of KV (at most {max_bytes})")));
    }
    let bytes = nixl.read_from(&peer.agent, &ranges, Some(notify), timeout).await?;
    Ok(Blocks { bytes, region_starts })
}
