//! Real etcd and NATS servers for tests, and `handoff` child processes.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ports::{free_port, listens, on_fresh_ports};

fn binary(name: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/sbin", "/usr/local/bin"] {
        let p = PathBuf::from(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!("{name} not found: scripts/test installs it (apt-get install etcd-server nats-server)");
}

/// How a server is started on the ports it was given.
struct Launch {
    args: Vec<String>,
    /// The port it serves clients on, and is waited on.
    port: u16,
    url: String,
    /// Its data directory, removed on drop.
    dir: Option<PathBuf>,
}

/// A server process killed on drop.
pub(crate) struct Server {
    child: Option<Child>,
    args: Vec<String>,
    bin: PathBuf,
    port: u16,
    dir: Option<PathBuf>,
    /// Its stderr, shown when it does not come up (removed on drop).
    log: PathBuf,
    /// The network namespace it runs in, if not the machine's.
    ns: Option<String>,
    pub(crate) url: String,
}

impl Server {
    /// `bin` as `launch` says on ports it picks, tried again on fresh ones until it listens.
    fn spawn(bin: PathBuf, ns: Option<&str>, launch: impl Fn() -> Launch) -> Self {
        on_fresh_ports(&bin.display().to_string(), |_| {
            let Launch { args, port, url, dir } = launch();
            let log = std::env::temp_dir()
                .join(format!("handoff-server-{}-{port}.log", std::process::id()));
            let ns = ns.map(str::to_owned);
            let mut s = Server { child: None, args, bin: bin.clone(), port, dir, log, ns, url };
            s.try_start().map(|()| s)
        })
    }

    /// (Re)starts the server on the same port and data.
    pub(crate) fn start(&mut self) {
        if let Err(why) = self.try_start() {
            panic!("{why}");
        }
    }

    /// Starts the server and waits until its process listens on its port; says why not when
    /// it exited first (its port taken, say) or did not listen within 20 s.
    fn try_start(&mut self) -> Result<(), String> {
        let mut cmd = match &self.ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        let log = std::fs::File::create(&self.log).unwrap();
        let child = cmd.args(&self.args).stdout(Stdio::null()).stderr(log).spawn().unwrap();
        let (pid, start) = (child.id(), Instant::now());
        self.child = Some(child);
        while !listens(pid, self.port) {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            let why = match exited {
                Some(status) => format!("exited ({status}) before listening"),
                None if start.elapsed() > Duration::from_secs(20) => {
                    "did not listen in 20 s".into()
                }
                None => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            };
            self.stop();
            let said = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail = &said[said.len().saturating_sub(1500)..];
            return Err(format!(
                "{} on {}: {why}; its stderr ends {tail:?}",
                self.bin.display(),
                self.port
            ));
        }
        Ok(())
    }

    /// Stops the server (SIGKILL).
    pub(crate) fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn etcd() -> Self {
        Self::etcd_with(None, "127.0.0.1", None, &[])
    }

    /// etcd whose auth tokens are JWTs signed with `pem`'s key and valid for `ttl_secs`.
    pub(crate) fn etcd_jwt(pem: &PemFiles, ttl_secs: u32) -> Self {
        let (cert, key) = (pem.cert.display(), pem.key.display());
        let token = format!("jwt,pub-key={cert},priv-key={key},sign-method=ES256,ttl={ttl_secs}s");
        Self::etcd_with(None, "127.0.0.1", None, &["--auth-token".to_owned(), token])
    }

    /// etcd in network namespace `ns`, listening on its address `ip`.
    pub(crate) fn etcd_in(ns: &str, ip: &str) -> Self {
        Self::etcd_with(None, ip, Some(ns), &[])
    }

    /// etcd serving clients over TLS with `pem`'s certificate, and accepting only clients
    /// with a certificate its CA signed.
    pub(crate) fn etcd_tls(pem: &PemFiles) -> Self {
        Self::etcd_with(Some(pem), "127.0.0.1", None, &[])
    }

    fn etcd_with(tls: Option<&PemFiles>, ip: &str, ns: Option<&str>, extra: &[String]) -> Self {
        Self::spawn(binary("etcd"), ns, || {
            let (client, peer) = (free_port(), free_port());
            let dir =
                std::env::temp_dir().join(format!("handoff-etcd-{}-{client}", std::process::id()));
            let scheme = if tls.is_some() { "https" } else { "http" };
            let c = format!("{scheme}://{ip}:{client}");
            let p = format!("http://127.0.0.1:{peer}");
            let mut args = [
                "--name",
                "t",
                "--data-dir",
                dir.to_str().unwrap(),
                "--listen-client-urls",
                &c,
                "--advertise-client-urls",
                &c,
                "--listen-peer-urls",
                &p,
                "--initial-advertise-peer-urls",
                &p,
                "--initial-cluster",
                &format!("t={p}"),
            ]
            .map(String::from)
            .to_vec();
            if let Some(t) = tls {
                args.extend(t.args(&["--cert-file", "--key-file", "--trusted-ca-file"]));
                args.push("--client-cert-auth".into());
            }
            args.extend_from_slice(extra);
            Launch { args, port: client, url: c, dir: Some(dir) }
        })
    }

    pub(crate) fn nats() -> Self {
        Self::nats_with("127.0.0.1", None)
    }

    /// NATS in network namespace `ns`, listening on its address `ip`.
    pub(crate) fn nats_in(ns: &str, ip: &str) -> Self {
        Self::nats_with(ip, Some(ns))
    }

    fn nats_with(ip: &str, ns: Option<&str>) -> Self {
        Self::spawn(binary("nats-server"), ns, || {
            let port = free_port();
            let args = ["-a", ip, "-p", &port.to_string()].map(String::from).to_vec();
            Launch { args, port, url: format!("nats://{ip}:{port}"), dir: None }
        })
    }

    /// NATS requiring TLS with `pem`'s certificate, a client certificate its CA signed, and
    /// the user `user` with password `pass`.
    pub(crate) fn nats_tls(pem: &PemFiles, user: &str, pass: &str) -> Self {
        Self::spawn(binary("nats-server"), None, || {
            let port = free_port();
            let mut args =
                ["-a", "127.0.0.1", "-p", &port.to_string(), "--user", user, "--pass", pass]
                    .map(String::from)
                    .to_vec();
            args.extend(pem.args(&["--tlscert", "--tlskey", "--tlscacert"]));
            args.extend(["--tls", "--tlsverify"].map(String::from));
            Launch { args, port, url: format!("nats://127.0.0.1:{port}"), dir: None }
        })
    }
}

/// A port held by another process (here this one's listener, which answers connections) makes
/// the server exit; it is not taken for the server's, and the server comes up on a fresh one.
#[test]
fn a_server_whose_port_is_taken_comes_up_on_a_fresh_one() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = held.local_addr().unwrap().port();
    let tries = std::cell::Cell::new(0);
    let nats = Server::spawn(binary("nats-server"), None, || {
        tries.set(tries.get() + 1);
        let port = if tries.get() == 1 { taken } else { free_port() };
        let args = ["-a", "127.0.0.1", "-p", &port.to_string()].map(String::from).to_vec();
        Launch { args, port, url: format!("nats://127.0.0.1:{port}"), dir: None }
    });
    assert_eq!(tries.get(), 2, "the taken port's start failed, the next came up");
    assert_ne!(nats.port, taken);
    let pid = nats.child.as_ref().unwrap().id();
    assert!(listens(pid, nats.port), "{} listens on its port", nats.url);
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A certificate, its key and its CA written to files (removed on drop), with the flags and
/// access that name them.
pub(crate) struct PemFiles {
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    pub(crate) ca: PathBuf,
    files: handoff_core::tls::test_certs::CertFiles,
}

impl PemFiles {
    /// Writes `cert` (with its CA) into a fresh directory.
    pub(crate) fn write(cert: &handoff_core::tls::test_certs::TestCert) -> Self {
        let files = handoff_core::tls::test_certs::CertFiles::new(cert, &cert.ca);
        let (c, k, ca) = (files.path("tls.crt"), files.path("tls.key"), files.path("ca.crt"));
        PemFiles { cert: c, key: k, ca, files }
    }

    /// Rewrites the certificate, key and CA with `cert`'s and `ca`, each file replaced whole
    /// (the key first).
    pub(crate) fn reissue(&self, cert: &handoff_core::tls::test_certs::TestCert, ca: &str) {
        self.files.put_cert(cert);
        self.files.put("ca.crt", ca);
    }

    /// `[flags[0], cert, flags[1], key, flags[2], ca]`.
    fn args(&self, flags: &[&str; 3]) -> Vec<String> {
        let paths = [&self.cert, &self.key, &self.ca];
        flags
            .iter()
            .zip(paths)
            .flat_map(|(f, p)| [f.to_string(), p.display().to_string()])
            .collect()
    }

    /// As a discovery server's access: its CA, this certificate as the client's.
    pub(crate) fn access(&self) -> handoff_discovery::ServerAccess {
        handoff_discovery::ServerAccess {
            ca: Some(self.ca.clone()),
            identity: Some((self.cert.clone(), self.key.clone())),
            ..Default::default()
        }
    }
}

/// A `handoff` child process; its stdout's first line is returned by `spawn`.
pub(crate) struct Handoff {
    pub(crate) child: Child,
}

impl Handoff {
    /// Starts `handoff ARGS` and waits for its ready line.
    pub(crate) fn spawn(args: &[&str]) -> (Self, String) {
        Self::spawn_logging(args, "warn", Stdio::null())
    }

    /// As [`Handoff::spawn`], in the network namespace `ns`.
    pub(crate) fn spawn_in(ns: &str, args: &[&str]) -> (Self, String) {
        let mut all = vec!["netns", "exec", ns, env!("CARGO_BIN_EXE_handoff")];
        all.extend_from_slice(args);
        Self::start(Command::new("ip").args(all), args, "warn", Stdio::null())
    }

    /// As [`Handoff::spawn`], logging at `level` into `stderr`.
    pub(crate) fn spawn_logging(args: &[&str], level: &str, stderr: Stdio) -> (Self, String) {
        Self::start(Command::new(env!("CARGO_BIN_EXE_handoff")).args(args), args, level, stderr)
    }

    fn start(cmd: &mut Command, args: &[&str], level: &str, stderr: Stdio) -> (Self, String) {
        let mut child =
            cmd.env("RUST_LOG", level).stdout(Stdio::piped()).stderr(stderr).spawn().unwrap();
        let mut line = String::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "handoff {args:?} exited before its ready line");
        // Keep draining stdout so the child never writes into a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        (Handoff { child }, line)
    }

    /// SIGKILL, no goodbye.
    pub(crate) fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A `handoff prefill` (mock engine, ephemeral ports) on `etcd` and `nats`, with `extra` flags.
pub(crate) fn prefill(etcd: &Server, nats: &Server, id: &str, extra: &[&str]) -> Handoff {
    prefill_ready(etcd, nats, id, extra).0
}

/// [`prefill`], and its ready line.
pub(crate) fn prefill_ready(
    etcd: &Server,
    nats: &Server,
    id: &str,
    extra: &[&str],
) -> (Handoff, String) {
    let mut args = vec![
        "prefill",
        "--engine",
        "mock",
        "--id",
        id,
        "--bootstrap-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ];
    args.extend_from_slice(extra);
    Handoff::spawn(&args)
}
