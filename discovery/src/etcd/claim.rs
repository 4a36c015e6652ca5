//! An instance id is one process's: a registration under an id another live process holds
//! is refused. Before, the second put overwrote the first: one process unroutable, both
//! beating and announcing KV under the id, the scheduler's index mixing their caches.

use std::time::Duration;

use etcd_client::Client;
use tokio::time::Instant;

use crate::{DiscoveryError, Instance};

/// How often a held id is looked at again while its holder's lease may be running out.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// Returns once `key` may be registered as `instance`: it is free, or held by a
/// registration at the same addresses (this id's earlier process on this host, or this
/// process), or its holder's lease ran out (a predecessor that died without deregistering),
/// waited for as long as that lease had left when first seen (this process's `ttl` at
/// least), and a second. Refused ([`DiscoveryError::Taken`]) while another
/// live process holds it past that. An etcd that does not answer is left to the
/// registration's own wait. Not atomic: two processes starting at once may both pass.
pub(super) async fn await_free(
    client: &mut Client,
    key: &str,
    instance: &Instance,
    ttl: Duration,
) -> Result<(), DiscoveryError> {
    let mut until = None;
    loop {
        let Ok(held) = client.get(key, None).await else { return Ok(()) };
        let Some(kv) = held.kvs().first() else { return Ok(()) };
        let Ok(holder) = serde_json::from_slice::<Instance>(kv.value()) else { return Ok(()) };
        if same_place(&holder, instance) {
            return Ok(());
        }
        // At least this process's TTL: etcd says whole seconds, and deletes the keys of an
        // expired lease a moment after.
        let left = match client.lease_time_to_live(kv.lease(), None).await {
            Ok(l) => Duration::from_secs(u64::try_from(l.ttl()).unwrap_or(0)).max(ttl),
            Err(_) => ttl,
        };
        let until = *until.get_or_insert_with(|| Instant::now() + left + Duration::from_secs(1));
        if Instant::now() >= until {
            return Err(DiscoveryError::Taken {
                id: instance.id.to_string(),
                holder: holder.grpc_addr,
            });
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

/// Whether two registrations are at the same addresses (one process, or its successor on
/// the same ports).
fn same_place(a: &Instance, b: &Instance) -> bool {
    (a.role, &a.grpc_addr, &a.bootstrap_addr) == (b.role, &b.grpc_addr, &b.bootstrap_addr)
}
