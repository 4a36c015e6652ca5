//! Listener helpers.

use std::net::{IpAddr, Ipv6Addr};

use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt};

/// Accepted connections of `listener` with `TCP_NODELAY` set: request/response and
/// token-streaming protocols must not wait on Nagle's algorithm (40 ms with delayed ACKs).
pub fn nodelay_incoming(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            // Best effort: a socket that refuses the option still works, only slower.
            let _ = s.set_nodelay(true);
        }
        s
    })
}

/// Who a connection is from, for per-host bounds: an IPv4 address (an IPv4-mapped IPv6 one
/// too), or an IPv6 address's /64 (one host is typically given a whole /64, and could
/// otherwise take a fresh address for each connection).
pub fn host_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// IPv6 addresses of one /64 are one host; IPv4 and IPv4-mapped addresses are themselves.
    #[test]
    fn a_host_is_an_ipv4_address_or_an_ipv6_slash_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(host_of(ip("2001:db8:1:2::1")), host_of(ip("2001:db8:1:2:ffff::9")));
        assert_ne!(host_of(ip("2001:db8:1:2::1")), host_of(ip("2001:db8:1:3::1")));
        assert_eq!(host_of(ip("10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(host_of(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_ne!(host_of(ip("10.0.0.7")), host_of(ip("10.0.0.8")));
    }
}
