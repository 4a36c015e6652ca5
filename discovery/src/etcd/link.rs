//! [`Link`]: the etcd client in use. etcd's client library builds its TLS once, from PEM, so
//! a renewed client certificate (or a changed CA) is taken by making the client again. The
//! files are read again every `--tls-reload-secs` ([`HandedTls`]); once they changed, the
//! next caller to ask for the client makes a new one. The lease keeper and the watches ask
//! again each time they start over after an error (a restarted etcd that refuses the old
//! certificate, say). Calls and streams already running go on with the client they began
//! with: an old certificate is never checked again on a connection that is up.

use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use handoff_core::tls::{HandedPem, HandedTls};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::patience;

/// The etcd client in use, and how to make it again (see the module docs).
pub(crate) struct Link {
    endpoints: Vec<String>,
    /// Everything but TLS.
    options: ConnectOptions,
    tls: Option<HandedTls>,
    made: Mutex<Made>,
}

struct Made {
    client: Client,
    /// The generation of the TLS files it was made with.
    generation: u64,
    /// The last generation a new client could not be made with (said once).
    failed: Option<u64>,
}

/// `options` with `pem`'s TLS, if any.
fn with_tls(options: &ConnectOptions, pem: Option<&HandedPem>) -> ConnectOptions {
    let Some(pem) = pem else { return options.clone() };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &pem.ca {
        tls = tls.ca_certificate(Certificate::from_pem(ca));
    }
    if let Some((cert, key)) = &pem.identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    options.clone().with_tls(tls)
}

impl Link {
    /// A client of `endpoints` with `options` and `tls`'s files, waited for while etcd is
    /// not reached, until `stop`.
    pub(crate) async fn connect(
        endpoints: Vec<String>,
        options: ConnectOptions,
        tls: Option<HandedTls>,
        stop: &CancellationToken,
    ) -> Result<Self, etcd_client::Error> {
        let pem = tls.as_ref().map(HandedTls::current);
        let opts = with_tls(&options, pem.as_ref());
        let client = patience::until_reached("connected", stop, || {
            Client::connect(&endpoints, Some(opts.clone()))
        })
        .await?;
        let generation = pem.map_or(0, |p| p.generation);
        let made = Mutex::new(Made { client, generation, failed: None });
        Ok(Link { endpoints, options, tls, made })
    }

    /// The client in use, made again first when the TLS files changed since it was made. A
    /// client that cannot be made (an etcd away that has credentials to check) is tried again
    /// at the next call, and the one in use returned meanwhile.
    pub(crate) async fn client(&self) -> Client {
        let mut made = self.made.lock().await;
        if let Some(pem) = self.tls.as_ref().map(HandedTls::current)
            && pem.generation != made.generation
        {
            let opts = with_tls(&self.options, Some(&pem));
            let within = Duration::from_secs(10);
            let new = tokio::time::timeout(within, Client::connect(&self.endpoints, Some(opts)));
            match new.await {
                Ok(Ok(client)) => {
                    info!("etcd client made again with its renewed TLS files");
                    *made = Made { client, generation: pem.generation, failed: None };
                }
                outcome => {
                    if made.failed.replace(pem.generation) != Some(pem.generation) {
                        let error = match outcome {
                            Ok(Err(e)) => e.to_string(),
                            _ => format!("no answer in {within:?}"),
                        };
                        warn!(%error, "etcd client not made again with its renewed TLS files yet; the one in use kept, tried again at the next call");
                    }
                }
            }
        }
        made.client.clone()
    }
}
