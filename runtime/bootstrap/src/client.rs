//! A pooled keep-alive client of the directory protocol, and [`DirectoryCache`], which keeps
//! each instance's server info and rank addresses until the instance's registration changes.
//! A call on a kept connection that does not answer within [`POOLED_CALL_TIMEOUT`] (one the
//! network lost, say) is made again on a fresh connection, which has [`FRESH_CALL_TIMEOUT`]
//! (connecting and the whole answer): a directory the network silently drops fails the call
//! then, not at the caller's deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use handoff_core::tls::ClusterTls;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::{ClientError, RankAddr, Registration, ServerInfo};

mod dial;
use dial::DirectoryDialer;

/// A client of any number of directories, over one connection pool: plain HTTP, or HTTPS
/// with the cluster's mutual TLS.
#[derive(Clone, Debug)]
pub struct DirectoryClient {
    /// Keeps connections.
    http: Client<DirectoryDialer, Full<Bytes>>,
    /// Keeps none: for a call the kept connection did not answer.
    fresh: Client<DirectoryDialer, Full<Bytes>>,
    scheme: &'static str,
    token: Option<String>,
    /// How long a call on a kept connection may take, its answer included.
    pooled_timeout: Duration,
    /// How long the call made again on a fresh connection may take, its answer included.
    fresh_timeout: Duration,
}

/// How long a call on a kept connection may take before it is made on a fresh one.
pub const POOLED_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a call made again on a fresh connection may take before it fails.
pub const FRESH_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest answer read from a directory: its answers are a few hundred bytes.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The most ranks a directory may say one dp group has (tp x cp x pp): a decode resolves the
/// address of each rank it reads from, so this bounds what one answer can make it do.
pub const MAX_GROUP_RANKS: i64 = 4096;

/// The largest size of any one dimension (the directory's own default bound).
pub const MAX_SIZE: i64 = 1024;

impl Default for DirectoryClient {
    fn default() -> Self {
        Self::new(None)
    }
}

impl DirectoryClient {
    /// A client that sends `token` as a bearer token on writes.
    pub fn new(token: Option<String>) -> Self {
        Self::with_tls(token, None)
    }

    /// A client that sends `token` on writes and, with `tls`, speaks HTTPS to directories
    /// with a certificate from the cluster's CA (and presents its own), each checked again
    /// after a reload of the CA ([`dial`]).
    pub fn with_tls(token: Option<String>, tls: Option<&ClusterTls>) -> Self {
        let conn = DirectoryDialer::new(tls);
        // With a timer, idle connections are closed after 90 s: without one, hyper-util never
        // sweeps its pool, and a departed prefill's host kept its entry (and sockets whose
        // peer vanished without a FIN) for good.
        let http = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_max_idle_per_host(64)
            .build(conn.clone());
        let fresh = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(conn);
        let scheme = if tls.is_some() { "https" } else { "http" };
        let (pooled_timeout, fresh_timeout) = (POOLED_CALL_TIMEOUT, FRESH_CALL_TIMEOUT);
        DirectoryClient { http, fresh, scheme, token, pooled_timeout, fresh_timeout }
    }

    /// Gives a call on a kept connection `pooled`, and the call made again `fresh` (instead
    /// of [`POOLED_CALL_TIMEOUT`] and [`FRESH_CALL_TIMEOUT`]).
    pub fn with_timeouts(mut self, pooled: Duration, fresh: Duration) -> Self {
        (self.pooled_timeout, self.fresh_timeout) = (pooled, fresh);
        self
    }

    async fn call(
        &self,
        addr: &str,
        method: Method,
        path_and_query: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let bad = |reason: String| ClientError::Address { addr: addr.to_owned(), reason };
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}://{addr}{path_and_query}", self.scheme));
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
            if let Some(t) = &self.token {
                req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
            }
        }
        let body = Bytes::from(body.unwrap_or_default());
        let req = req.body(Full::new(body.clone())).map_err(|e| bad(e.to_string()))?;
        let (parts, _) = req.into_parts();
        let request = |body: Bytes| Request::from_parts(parts.clone(), Full::new(body));
        let exchange = |client: &Client<DirectoryDialer, Full<Bytes>>, body| {
            let asked = client.request(request(body));
            async move {
                let unreachable =
                    |source| ClientError::Unreachable { addr: addr.to_owned(), source };
                read_answer(addr, asked.await.map_err(unreachable)?).await
            }
        };
        // Directory calls are reads and idempotent registrations: safe to make again.
        match tokio::time::timeout(self.pooled_timeout, exchange(&self.http, body.clone())).await {
            Ok(answer) => answer,
            Err(_) => tokio::time::timeout(self.fresh_timeout, exchange(&self.fresh, body))
                .await
                .unwrap_or_else(|_| {
                    Err(ClientError::TimedOut { addr: addr.to_owned(), after: self.fresh_timeout })
                }),
        }
    }

    fn expect_ok(addr: &str, status: StatusCode, body: &Bytes) -> Result<(), ClientError> {
        let text = || String::from_utf8_lossy(body).into_owned();
        match status {
            StatusCode::OK => Ok(()),
            StatusCode::SERVICE_UNAVAILABLE => {
                Err(ClientError::NotReady { addr: addr.to_owned(), body: text() })
            }
            s => {
                Err(ClientError::Status { addr: addr.to_owned(), status: s.as_u16(), body: text() })
            }
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(addr: &str, body: &Bytes) -> Result<T, ClientError> {
        serde_json::from_slice(body)
            .map_err(|source| ClientError::Malformed { addr: addr.to_owned(), source })
    }

    /// The instance's server info (the all `-1` query).
    pub async fn server_info(&self, addr: &str) -> Result<ServerInfo, ClientError> {
        let q = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";
        let (status, body) = self.call(addr, Method::GET, q, None).await?;
        Self::expect_ok(addr, status, &body)?;
        let info: ServerInfo = Self::parse(addr, &body)?;
        let unusable = |reason| ClientError::Unusable { addr: addr.to_owned(), reason };
        let sizes = [info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size];
        if sizes.iter().any(|&s| !(1..=MAX_SIZE).contains(&s)) {
            return Err(unusable(format!("sizes tp/cp/dp/pp {sizes:?} out of 1..={MAX_SIZE}")));
        }
        let group = info.attn_tp_size * info.attn_cp_size * info.pp_size;
        if group > MAX_GROUP_RANKS {
            return Err(unusable(format!(
                "{group} ranks in a dp group (tp x cp x pp), more than {MAX_GROUP_RANKS}"
            )));
        }
        if !(1..=1 << 16).contains(&info.page_size) {
            return Err(unusable(format!("page size {} out of 1..=65536", info.page_size)));
        }
        Ok(info)
    }

    /// The transfer endpoint of one rank.
    pub async fn rank(
        &self,
        addr: &str,
        dp: u32,
        cp: u32,
        tp: u32,
        pp: u32,
    ) -> Result<RankAddr, ClientError> {
        let q = format!(
            "/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
        );
        let (status, body) = self.call(addr, Method::GET, &q, None).await?;
        Self::expect_ok(addr, status, &body)?;
        Self::parse(addr, &body)
    }

    /// Registers one rank.
    pub async fn register(&self, addr: &str, reg: &Registration) -> Result<(), ClientError> {
        let body = serde_json::to_vec(reg)
            .map_err(|source| ClientError::Malformed { addr: addr.to_owned(), source })?;
        let (status, body) = self.call(addr, Method::PUT, "/route", Some(body)).await?;
        Self::expect_ok(addr, status, &body)
    }
}

type RankKey = (u32, u32, u32, u32);

#[derive(Debug, Default)]
struct Entry {
    addr: String,
    info: Option<Arc<ServerInfo>>,
    ranks: HashMap<RankKey, RankAddr>,
}

/// Server info and rank addresses per instance, fetched once and kept until
/// [`DirectoryCache::invalidate`] (the instance's registration changed) or its directory
/// address changes.
#[derive(Debug, Default)]
pub struct DirectoryCache {
    client: DirectoryClient,
    entries: Mutex<HashMap<String, Entry>>,
}

/// Most instances the cache holds before it starts over.
const MAX_CACHED_INSTANCES: usize = 4096;

impl DirectoryCache {
    /// A cache over `client`.
    pub fn new(client: DirectoryClient) -> Self {
        DirectoryCache { client, entries: Mutex::default() }
    }

    fn with_entry<R>(&self, instance: &str, addr: &str, f: impl FnOnce(&mut Entry) -> R) -> R {
        let mut map = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_CACHED_INSTANCES && !map.contains_key(instance) {
            map.clear();
        }
        let e = map.entry(instance.to_owned()).or_default();
        if e.addr != addr {
            *e = Entry { addr: addr.to_owned(), ..Entry::default() };
        }
        f(e)
    }

    /// The instance's server info, from the cache or its directory.
    pub async fn server_info(
        &self,
        instance: &str,
        addr: &str,
    ) -> Result<Arc<ServerInfo>, ClientError> {
        if let Some(info) = self.with_entry(instance, addr, |e| e.info.clone()) {
            return Ok(info);
        }
        let info = Arc::new(self.client.server_info(addr).await?);
        self.with_entry(instance, addr, |e| e.info = Some(info.clone()));
        Ok(info)
    }

    /// One rank's transfer endpoint, from the cache or the directory.
    pub async fn rank(
        &self,
        instance: &str,
        addr: &str,
        key: RankKey,
    ) -> Result<RankAddr, ClientError> {
        if let Some(r) = self.with_entry(instance, addr, |e| e.ranks.get(&key).cloned()) {
            return Ok(r);
        }
        let (dp, cp, tp, pp) = key;
        let r = self.client.rank(addr, dp, cp, tp, pp).await?;
        self.with_entry(instance, addr, |e| e.ranks.insert(key, r.clone()));
        Ok(r)
    }

    /// Forgets everything cached about `instance`.
    pub fn invalidate(&self, instance: &str) {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).remove(instance);
    }

    /// Forgets everything.
    pub fn clear(&self) {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Instances cached.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reads `resp`'s status and body (at most [`MAX_ANSWER_BYTES`]).
async fn read_answer(
    addr: &str,
    resp: hyper::Response<hyper::body::Incoming>,
) -> Result<(StatusCode, Bytes), ClientError> {
    let status = resp.status();
    let mut body = resp.into_body();
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|source| ClientError::Body { addr: addr.to_owned(), source })?;
        if let Ok(data) = frame.into_data() {
            if read.len() + data.len() > MAX_ANSWER_BYTES {
                return Err(ClientError::Oversized {
                    addr: addr.to_owned(),
                    limit: MAX_ANSWER_BYTES,
                });
            }
            read.extend_from_slice(&data);
        }
    }
    Ok((status, Bytes::from(read)))
}

#[cfg(test)]
mod tests;
