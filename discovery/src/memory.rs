//! In-process discovery: the real backend of single-node mode (`handoff up`), not a test
//! double. A watcher that falls behind gets a fresh `Reset` rather than a gap.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use handoff_core::InstanceId;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;

use crate::{DiscoveryError, EventBus, Instance, Message, Registry, Role, Update};

/// An in-process registry.
#[derive(Debug, Clone)]
pub struct MemoryRegistry {
    inner: Arc<Mutex<BTreeMap<InstanceId, Instance>>>,
    changes: broadcast::Sender<(Role, Update)>,
}

impl Default for MemoryRegistry {
    fn default() -> Self {
        MemoryRegistry { inner: Arc::default(), changes: broadcast::channel(1024).0 }
    }
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn snapshot(&self, role: Role) -> Vec<Instance> {
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        map.values().filter(|i| i.role == role).cloned().collect()
    }
}

#[async_trait]
impl Registry for MemoryRegistry {
    async fn register(&self, instance: Instance) -> Result<(), DiscoveryError> {
        let role = instance.role;
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(instance.id.clone(), instance.clone());
        let _ = self.changes.send((role, Update::Add(instance)));
        Ok(())
    }

    async fn deregister(&self, id: &InstanceId) -> Result<(), DiscoveryError> {
        let removed = self.inner.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        if let Some(i) = removed {
            let _ = self.changes.send((i.role, Update::Remove(i.id)));
        }
        Ok(())
    }

    async fn watch(&self, role: Role) -> Result<BoxStream<'static, Update>, DiscoveryError> {
        // Subscribe before the snapshot so no change falls between them.
        let rx = self.changes.subscribe();
        let first = Update::Reset(self.snapshot(role));
        let me = self.clone();
        let rest = stream::unfold(rx, move |mut rx| {
            let me = me.clone();
            async move {
                loop {
                    match rx.recv().await {
                        Ok((r, u)) if r == role => return Some((u, rx)),
                        Ok(_) => continue,
                        Err(RecvError::Lagged(_)) => {
                            return Some((Update::Reset(me.snapshot(role)), rx));
                        }
                        Err(RecvError::Closed) => return None,
                    }
                }
            }
        });
        Ok(stream::once(async { first }).chain(rest).boxed())
    }
}

/// An in-process event bus.
#[derive(Debug, Clone)]
pub struct MemoryBus {
    tx: broadcast::Sender<Message>,
}

impl Default for MemoryBus {
    fn default() -> Self {
        MemoryBus { tx: broadcast::channel(1 << 16).0 }
    }
}

impl MemoryBus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl EventBus for MemoryBus {
    async fn publish(&self, subject: String, payload: Bytes) -> Result<(), DiscoveryError> {
        let _ = self.tx.send(Message { subject, payload, reply: None });
        Ok(())
    }

    async fn request(
        &self,
        subject: String,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, DiscoveryError> {
        let inbox = format!("_INBOX.{:016x}", rand::random::<u64>());
        let mut answers = self.subscribe(&inbox).await?;
        let _ = self.tx.send(Message { subject: subject.clone(), payload, reply: Some(inbox) });
        match tokio::time::timeout(timeout, answers.next()).await {
            Ok(Some(m)) => Ok(m.payload),
            _ => Err(DiscoveryError::Timeout(subject)),
        }
    }

    async fn subscribe(&self, prefix: &str) -> Result<BoxStream<'static, Message>, DiscoveryError> {
        let prefix = prefix.to_owned();
        let rx = self.tx.subscribe();
        Ok(stream::unfold(rx, move |mut rx| {
            let prefix = prefix.clone();
            async move {
                loop {
                    match rx.recv().await {
                        Ok(m) if crate::subject_matches(&prefix, &m.subject) => {
                            return Some((m, rx));
                        }
                        Ok(_) | Err(RecvError::Lagged(_)) => continue,
                        Err(RecvError::Closed) => return None,
                    }
                }
            }
        })
        .boxed())
    }
}

#[cfg(test)]
mod tests;
