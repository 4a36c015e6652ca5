//! A test bed of hosts on one machine: each host a network namespace with its own address on
//! a bridge, the machine itself on the bridge too (where the tests' clients run). A host's link to an address can be cut (its packets there refused),
//! limited in rate (a `tbf` qdisc), or delayed, jittered and made lossy ([`Shaper`]: this
//! machine's kernel has no `netem` qdisc, so that is done in user space through NFQUEUE).
//! Everything is removed on drop. Needs root (`ip netns`, `iptables`), as CI has.

mod shaper;

use std::process::Command;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};

pub(crate) use shaper::{Counts, Link, Shaper};

/// Runs `ip ARGS` (or another tool), panicking with its output when it fails.
fn run(tool: &str, args: &[&str]) {
    let out = Command::new(tool).args(args).output().unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One host: its namespace and address.
#[derive(Debug, Clone)]
pub(crate) struct Host {
    /// The network namespace.
    pub(crate) ns: String,
    /// Its address on the bridge.
    pub(crate) ip: String,
}

/// The bed: a bridge and its hosts.
#[derive(Debug)]
pub(crate) struct Bed {
    bridge: String,
    /// The machine's own address on the bridge.
    gateway: String,
    pub(crate) hosts: Vec<Host>,
}

impl Bed {
    /// A bridge with `n` hosts on a /24 of its own (chosen from the process id).
    pub(crate) fn new(n: usize) -> Bed {
        static BEDS: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let n_bed = BEDS.fetch_add(1, Ordering::Relaxed) % 10;
        let tag = format!("hb{}{n_bed}", pid % 100_000);
        // 198.18.0.0/15 is for benchmarking networks: no real network of CI's is there. A /24
        // some interface (another test's bed) already has is passed over.
        let taken = Command::new("ip").args(["-o", "addr"]).output().unwrap().stdout;
        let taken = String::from_utf8_lossy(&taken);
        let net = (0..512)
            .map(|k| (pid.wrapping_mul(10) + n_bed + k) % 512)
            .map(|slot| format!("198.{}.{}", 18 + slot / 256, slot % 256))
            .find(|net| !taken.contains(&format!(" {net}.")))
            .expect("a free /24 in 198.18.0.0/15");
        let mut bed =
            Bed { bridge: format!("{tag}b"), gateway: format!("{net}.1"), hosts: Vec::new() };
        run("ip", &["link", "add", &bed.bridge, "type", "bridge"]);
        run("ip", &["addr", "add", &format!("{}/24", bed.gateway), "dev", &bed.bridge]);
        run("ip", &["link", "set", &bed.bridge, "up"]);
        for i in 0..n {
            let host = Host { ns: format!("{tag}n{i}"), ip: format!("{net}.{}", 10 + i) };
            let (outer, inner) = (format!("{tag}v{i}"), format!("{tag}p{i}"));
            run("ip", &["netns", "add", &host.ns]);
            bed.hosts.push(host.clone());
            run("ip", &["link", "add", &outer, "type", "veth", "peer", "name", &inner]);
            run("ip", &["link", "set", &inner, "netns", &host.ns]);
            run("ip", &["link", "set", &outer, "master", &bed.bridge, "up"]);
            let ns = host.ns.as_str();
            run("ip", &["-n", ns, "link", "set", &inner, "name", "eth0"]);
            run("ip", &["-n", ns, "addr", "add", &format!("{}/24", host.ip), "dev", "eth0"]);
            run("ip", &["-n", ns, "link", "set", "eth0", "up"]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        bed
    }

    /// Host `i` can no longer reach `ip` (its packets there are refused at once; the other
    /// direction is untouched).
    pub(crate) fn cut(&self, i: usize, ip: &str) {
        let ns = self.hosts[i].ns.as_str();
        run("ip", &["-n", ns, "route", "add", "unreachable", &format!("{ip}/32")]);
    }

    /// Host `i` sends at most `rate` (tc's syntax, `100mbit`): a token bucket on its link's
    /// way out, so what it sends queues and then trickles (nothing is dropped under 500 ms).
    pub(crate) fn limit(&self, i: usize, rate: &str) {
        let ns = self.hosts[i].ns.as_str();
        let tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "500ms"];
        run(
            "ip",
            &[&["netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"][..], &tbf]
                .concat(),
        );
    }

    /// Shapes what host `i` receives from each of `from` as `link` (delay, jitter, loss),
    /// until the shaper is dropped or stopped; randomness from `seed`.
    pub(crate) fn shape(&self, i: usize, from: &[&str], link: Link, seed: u64) -> Shaper {
        static QUEUES: AtomicU16 = AtomicU16::new(0);
        let queue = QUEUES.fetch_add(1, Ordering::Relaxed);
        let from: Vec<String> = from.iter().map(|s| s.to_string()).collect();
        Shaper::start(&self.hosts[i].ns, queue, &from, link, seed)
    }

    /// Host `i` loses the network altogether (its link goes down: nothing in or out) until
    /// [`Bed::rejoin`].
    pub(crate) fn isolate(&self, i: usize) {
        run("ip", &["-n", &self.hosts[i].ns, "link", "set", "eth0", "down"]);
    }

    /// Undoes [`Bed::isolate`].
    pub(crate) fn rejoin(&self, i: usize) {
        run("ip", &["-n", &self.hosts[i].ns, "link", "set", "eth0", "up"]);
    }

    /// Undoes [`Bed::cut`].
    pub(crate) fn heal(&self, i: usize, ip: &str) {
        let ns = self.hosts[i].ns.as_str();
        run("ip", &["-n", ns, "route", "del", "unreachable", &format!("{ip}/32")]);
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        // A namespace takes its end of the veth pair with it, and the pair's other end goes too.
        for h in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", &h.ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge]).status();
    }
}
