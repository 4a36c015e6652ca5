//! JSON over HTTP to engine servers driven as prefills (SGLang's `/generate`, vLLM's
//! `/v1/completions`): the POST, the answer read within a bound, and what a refusal means.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;

use crate::{Cause, FrontendError};

/// Most bytes of an answer read (a prefill's answer is one token's).
const MAX_ANSWER: usize = 1 << 20;

/// The client prefill servers are called with.
pub(crate) type EngineHttp = Client<HttpConnector, Full<Bytes>>;

/// A fresh client: its idle connections closed after 90 s (without a timer hyper-util never
/// sweeps its pool, and an engine gone kept its entry for good).
pub(crate) fn client() -> EngineHttp {
    Client::builder(TokioExecutor::new()).pool_timer(TokioTimer::new()).build_http()
}

/// POSTs `body` to `http://{url}{path}` with `headers`: its JSON answer, or why not.
pub(crate) async fn post_json(
    http: &EngineHttp,
    url: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<Value, FrontendError> {
    let mut req = hyper::Request::post(format!("http://{url}{path}"))
        .header(hyper::header::CONTENT_TYPE, "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| FrontendError::at("prefill", format!("request to {url}: {e}")))?;
    let resp = http
        .request(req)
        .await
        .map_err(|e| FrontendError::at("connect", format!("POST {url}{path}: {e}")))?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| FrontendError::at("prefill", format!("reading {url}'s answer: {e}")))?
        .to_bytes();
    if !status.is_success() {
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
        // 400 and 413 are the prompt's (too long, a token out of range); a body the server
        // refuses otherwise (422: a field it does not take) is between us and it.
        let cause = match status.as_u16() {
            429 | 503 => Cause::Overloaded,
            400 | 413 => Cause::Invalid,
            _ => Cause::Instance,
        };
        return Err(FrontendError::because("prefill", cause, format!("{status}: {text}")));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| FrontendError::at("prefill", format!("{url}'s answer is not JSON: {e}")))
}
