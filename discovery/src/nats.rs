//! The NATS event bus: subjects map one to one; a prefix `a.b.` subscribes `a.b.>`. The
//! client reconnects on its own; while the server is away, publishes fail and are logged by
//! their callers, and subscriptions resume when it is back.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use handoff_core::tls::expiry::Shown;

use crate::{DiscoveryError, EventBus, Message, ServerAccess};

/// An event bus on a NATS server.
#[derive(Debug, Clone)]
pub struct NatsBus {
    client: async_nats::Client,
}

fn unavailable(e: impl std::fmt::Display) -> DiscoveryError {
    DiscoveryError::Unavailable(format!("nats: {e}"))
}

/// Shows when the client certificate in `path` expires, as the NATS client reads it.
fn note_client_certificate(path: &std::path::Path) {
    if let Ok(pem) = std::fs::read(path) {
        handoff_core::tls::expiry::note_pem(Shown::NatsClient, &pem, std::time::SystemTime::now());
    }
}

impl NatsBus {
    /// Connects to `url` (e.g. `nats://127.0.0.1:4222`), retrying in the background if the
    /// server is not up yet.
    pub async fn connect(url: &str) -> Result<Self, DiscoveryError> {
        Self::connect_with(url, &ServerAccess::default()).await
    }

    /// As [`NatsBus::connect`], with TLS and credentials.
    pub async fn connect_with(url: &str, access: &ServerAccess) -> Result<Self, DiscoveryError> {
        let mut opts = async_nats::ConnectOptions::new();
        if let Some(ca) = &access.ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &access.identity {
            // The library reads the files itself at each connect (a renewed certificate is
            // taken at the next reconnect): its end is shown at startup and again at each
            // connect, read from the same file.
            note_client_certificate(cert);
            let shown = cert.clone();
            opts = opts.add_client_certificate(cert.clone(), key.clone()).event_callback(
                move |event| {
                    if matches!(event, async_nats::Event::Connected) {
                        note_client_certificate(&shown);
                    }
                    async {}
                },
            );
        }
        if access.tls() {
            opts = opts.require_tls(true);
        }
        if let Some((user, password)) = &access.user {
            opts = opts.user_and_password(user.clone(), password.clone());
        }
        if let Some(creds) = &access.credentials {
            opts = opts.credentials_file(creds).await.map_err(|e| {
                DiscoveryError::Config(format!("NATS credentials {}: {e}", creds.display()))
            })?;
        }
        let client = opts
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(2))
            // A connection gone silent (a partition: no reset, no close) is found dead when
            // a third ping goes unanswered (about 15 s), and connected again: with the
            // default 60 s, an instance's heartbeats could stay stuck in it for minutes after
            // the partition healed.
            .ping_interval(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(url)
            .await
            .map_err(unavailable)?;
        Ok(NatsBus { client })
    }
}

#[async_trait]
impl EventBus for NatsBus {
    async fn publish(&self, subject: String, payload: Bytes) -> Result<(), DiscoveryError> {
        self.client.publish(subject, payload).await.map_err(unavailable)
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    async fn subscribe(&self, prefix: &str) -> Result<BoxStream<'static, Message>, DiscoveryError> {
        let subject = if prefix.ends_with('.') { format!("{prefix}>") } else { prefix.to_owned() };
        let sub = self.client.subscribe(subject).await.map_err(unavailable)?;
        Ok(sub
            .map(|m| Message {
                subject: m.subject.to_string(),
                payload: m.payload,
                reply: m.reply.map(|r| r.to_string()),
            })
            .boxed())
    }

    async fn request(
        &self,
        subject: String,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, DiscoveryError> {
        match tokio::time::timeout(timeout, self.client.request(subject.clone(), payload)).await {
            Ok(Ok(m)) => Ok(m.payload),
            Ok(Err(e)) => Err(unavailable(e)),
            Err(_) => Err(DiscoveryError::Timeout(subject)),
        }
    }
}
