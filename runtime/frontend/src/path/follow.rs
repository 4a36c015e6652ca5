//! Following what this frontend can prefill on in discovery: handoff prefills, and engines it
//! drives itself (SGLang servers with a bootstrap directory; vLLM ones with a NIXL side
//! channel when it drives vLLM). An instance that leaves or registers again loses its cached
//! topology and rank addresses; the count of them is what readiness asks for.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use handoff_discovery::{Instance, Registry, Role, Update};

use super::Frontend;
use super::select::PROTOCOLS;
use crate::FrontendError;

/// The ids followed, by role: a fresh list of one role replaces only that role's.
#[derive(Debug, Default)]
struct Known {
    prefills: HashSet<String>,
    engines: HashSet<String>,
}

impl Known {
    fn of(&mut self, role: Role) -> &mut HashSet<String> {
        match role {
            Role::Engine => &mut self.engines,
            _ => &mut self.prefills,
        }
    }

    fn len(&self) -> usize {
        self.prefills.len() + self.engines.len()
    }
}

/// Whether this frontend can prefill on `i` (a registration of role `prefill` or `engine`).
fn drivable(i: &Instance, drive_vllm: bool) -> bool {
    let name = i.protocol_name();
    PROTOCOLS.contains(&name) || (drive_vllm && name == "vllm")
}

impl Frontend {
    /// Follows the prefill instances and drivable engines in `registry` on the frontend's
    /// tasks (see the module docs).
    pub async fn follow(
        self: &Arc<Self>,
        registry: Arc<dyn Registry>,
    ) -> Result<(), FrontendError> {
        let watch = |role| {
            let registry = registry.clone();
            async move {
                let updates = registry
                    .watch(role)
                    .await
                    .map_err(|e| FrontendError::Unavailable(e.to_string()))?;
                Ok::<_, FrontendError>(updates.map(move |u| (role, u)))
            }
        };
        let mut updates =
            futures::stream::select(watch(Role::Prefill).await?, watch(Role::Engine).await?);
        let (me, t) = (self.clone(), self.tasks.clone());
        self.tasks.spawn(async move {
            let mut known = Known::default();
            loop {
                let (role, u) = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u { Some(u) => u, None => break },
                };
                me.followed(known.of(role), u);
                me.prefills_known.store(known.len(), Ordering::Relaxed);
            }
        });
        Ok(())
    }

    /// Applies `u` to the ids in `known` (one role's).
    fn followed(&self, known: &mut HashSet<String>, u: Update) {
        let drive_vllm = self.cfg.drive_vllm;
        match u {
            Update::Reset(all) => {
                self.directory.clear();
                *known = all
                    .into_iter()
                    .filter(|i| drivable(i, drive_vllm))
                    .map(|i| i.id.to_string())
                    .collect();
            }
            Update::Add(i) => {
                self.directory.invalidate(i.id.as_str());
                // A registration is a process started: what the last one failed to reach
                // says nothing of it.
                self.reach.reached(i.id.as_str());
                // Nor what the last one said it takes (a rollback to a build that drops
                // the handshakes sent in the call failed each attempt after 10 s).
                self.forget_prefill_features(&i.grpc_addr);
                known.remove(i.id.as_str());
                if drivable(&i, drive_vllm) {
                    known.insert(i.id.to_string());
                }
            }
            Update::Remove(id) => {
                self.directory.invalidate(id.as_str());
                known.remove(id.as_str());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_discovery::EngineEndpoints;

    fn engine(kind: &str, directory: bool) -> Instance {
        let mut i = Instance::fixture("e1".parse().unwrap(), Role::Engine);
        i.engine = Some(Box::new(EngineEndpoints { kind: kind.into(), ..Default::default() }));
        if !directory {
            i.bootstrap_addr.clear();
        }
        i
    }

    #[test]
    fn engines_count_when_this_frontend_drives_them() {
        assert!(drivable(&Instance::fixture("p".parse().unwrap(), Role::Prefill), false));
        assert!(drivable(&engine("sglang", true), false));
        assert!(!drivable(&engine("sglang", false), true), "no directory: not SGLang's PD");
        assert!(!drivable(&engine("vllm", true), false));
        assert!(drivable(&engine("vllm", true), true));
        assert!(!drivable(&engine("trtllm", true), true));
    }
}
