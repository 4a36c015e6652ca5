//! `ctl trace`'s HTTP client: one `GET` to a frontend's HTTP listener, plain or over its
//! public certificate.

use anyhow::{Context, bail};
use tokio_rustls::rustls::pki_types::ServerName;

use super::CALL_TIMEOUT;

/// How frontends' public listeners are asked over TLS (`--public-ca`).
pub(super) struct PublicTls {
    pub(super) connector: tokio_rustls::TlsConnector,
    /// The name their certificate must hold (`--public-name`), else the host asked.
    pub(super) name: Option<ServerName<'static>>,
}

impl PublicTls {
    /// From `--public-ca` (none without it), `--public-name`, and `--public-cert` with
    /// `--public-key`; the others without `--public-ca`, or one of the last two alone, are an
    /// error.
    pub(super) fn from_args(args: &crate::args::CtlArgs) -> anyhow::Result<Option<Self>> {
        let Some(ca) = &args.public_ca else {
            if args.public_name.is_some() || args.public_cert.is_some() || args.public_key.is_some()
            {
                bail!("--public-name, --public-cert and --public-key need --public-ca");
            }
            return Ok(None);
        };
        let read = |flag: &str, p: &std::path::Path| {
            std::fs::read(p).with_context(|| format!("{flag} {}", p.display()))
        };
        let ca = read("--public-ca", ca)?;
        let identity = match (&args.public_cert, &args.public_key) {
            (Some(c), Some(k)) => Some((read("--public-cert", c)?, read("--public-key", k)?)),
            (None, None) => None,
            _ => bail!("--public-cert and --public-key go together"),
        };
        let identity = identity.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice()));
        let connector = handoff_core::tls::public_client(&ca, identity)?;
        let name = args.public_name.as_deref().map(handoff_core::tls::server_name).transpose()?;
        Ok(Some(PublicTls { connector, name }))
    }
}

/// `GET path` at `addr` with the cluster token, over HTTPS with `tls` (checking that the
/// certificate names the host of `addr`, or the name `tls` gives), else plain HTTP: the
/// status and the body (at most
/// 1 MiB, within [`CALL_TIMEOUT`] a try). Over plain HTTP the token is sent only once the
/// listener has answered HTTP without it (401): never in the clear to a listener that
/// speaks TLS, whose first answer is not HTTP.
pub(super) async fn get(
    addr: &str,
    path: &str,
    token: Option<&str>,
    tls: Option<&PublicTls>,
) -> anyhow::Result<(u16, String)> {
    if tls.is_some() {
        return get_once(addr, path, token, tls).await;
    }
    let (code, body) = get_once(addr, path, None, None).await?;
    match (code, token) {
        (401, Some(_)) => get_once(addr, path, token, None).await,
        _ => Ok((code, body)),
    }
}

/// One `GET` of [`get`].
async fn get_once(
    addr: &str,
    path: &str,
    token: Option<&str>,
    tls: Option<&PublicTls>,
) -> anyhow::Result<(u16, String)> {
    let auth = token.map(|t| format!("authorization: Bearer {t}\r\n")).unwrap_or_default();
    let ask = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\n{auth}connection: close\r\n\r\n");
    let call = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        match tls {
            None => exchange(tcp, &ask).await,
            Some(tls) => {
                let name = match &tls.name {
                    Some(name) => name.clone(),
                    None => {
                        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                        handoff_core::tls::server_name(host.trim_matches(['[', ']']))?
                    }
                };
                exchange(tls.connector.connect(name, tcp).await?, &ask).await
            }
        }
    };
    let raw = tokio::time::timeout(CALL_TIMEOUT, call).await.context("timed out")??;
    let text = String::from_utf8_lossy(&raw);
    let code = text.strip_prefix("HTTP/1.").and_then(|t| t.get(2..5)).and_then(|c| c.parse().ok());
    let code = match (code, tls) {
        (Some(code), _) => code,
        (None, None) => bail!("not an HTTP answer (a listener with TLS? give --public-ca)"),
        (None, Some(_)) => bail!("not an HTTP answer"),
    };
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if let Some(len) = content_length(head)
        && body.len() < len
    {
        bail!("the answer was cut short ({} of {len} bytes)", body.len());
    }
    Ok((code, body.to_owned()))
}

/// The `content-length` an answer's head gives, if any.
fn content_length(head: &str) -> Option<usize> {
    head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok())?
    })
}

/// Writes `ask` on `s` and reads the answer to its end (at most 1 MiB). A TLS peer that
/// closes without saying so (no `close_notify`, as some proxies do) ends the answer too.
async fn exchange<S>(mut s: S, ask: &str) -> anyhow::Result<Vec<u8>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(ask.as_bytes()).await?;
    let mut raw = Vec::new();
    match s.take(1 << 20).read_to_end(&mut raw).await {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => Ok(raw),
        Err(e) => Err(e.into()),
        Ok(_) => Ok(raw),
    }
}

#[cfg(test)]
mod tests;
