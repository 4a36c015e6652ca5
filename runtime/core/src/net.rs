//! Listener helpers.

/// `host:port` as an address to dial: an IPv6 literal in brackets (`[fd00::1]:8998`), so a
/// URI or a socket address parses it.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod host_port_tests {
    use super::host_port;

    #[test]
    fn an_ipv6_host_is_bracketed_once() {
        assert_eq!(host_port("10.0.0.7", 80), "10.0.0.7:80");
        assert_eq!(host_port("prefill-0.svc", 80), "prefill-0.svc:80");
        assert_eq!(host_port("fd00::1", 8998), "[fd00::1]:8998");
        assert_eq!(host_port("[fd00::1]", 8998), "[fd00::1]:8998");
        let uri: axum::http::Uri =
            format!("http://{}/", host_port("fd00::1", 8998)).parse().unwrap();
        assert_eq!(uri.port_u16(), Some(8998));
    }
}
