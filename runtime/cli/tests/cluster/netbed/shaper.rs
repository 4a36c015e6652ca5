//! [`Shaper`]: delay, jitter and loss on the packets one host receives from chosen addresses,
//! done in user space. This machine's kernel has no `netem` qdisc, but it has NFQUEUE:
//! `iptables` in the host's namespace hands the chosen incoming packets to a queue, and a
//! thread of the test process, moved into that namespace, holds each one for the delay (give
//! or take the jitter) and then lets it go, or drops it with the loss probability. Packets
//! are held on arrival, not on the way out: a packet held in the sender's OUTPUT chain is
//! still charged to its socket, and TCP's small-queue limit would then stall the sender
//! after a few KB per delay (netem avoids that; a real link does not have it). Like `netem` with
//! jitter, packets may leave in another order than they came. The rules are removed on drop
//! (and go with the namespace anyway); `--queue-bypass` lets packets pass while no thread
//! listens.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nfq::{Queue, Verdict};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What a shaped link does to each packet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Link {
    /// Held this long before it leaves...
    pub(crate) delay: Duration,
    /// ... give or take up to this much (uniformly).
    pub(crate) jitter: Duration,
    /// The probability it is dropped instead.
    pub(crate) loss: f64,
}

/// Packets a shaper saw.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counts {
    /// Let go after their delay.
    pub(crate) passed: u64,
    /// Dropped.
    pub(crate) dropped: u64,
}

/// A host's shaped links (see the module docs); undone on drop.
pub(crate) struct Shaper {
    ns: String,
    rules: Vec<Vec<String>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Counts>>,
}

impl Shaper {
    /// Shapes what namespace `ns` receives from each of `from` as `link`, on NFQUEUE number
    /// `queue` (one per shaper in a namespace), its randomness from `seed`.
    pub(crate) fn start(ns: &str, queue: u16, from: &[String], link: Link, seed: u64) -> Shaper {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready) = mpsc::channel();
        let (path, halt) = (format!("/var/run/netns/{ns}"), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut q = match open_in(&path, queue) {
                Ok(q) => q,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return Counts::default();
                }
            };
            let _ = ready_tx.send(Ok(()));
            shape(&mut q, link, &mut StdRng::seed_from_u64(seed), &halt)
        });
        if let Err(e) = ready.recv().expect("the shaper thread reports") {
            panic!("shaping {ns}: {e}");
        }
        let mut shaper =
            Shaper { ns: ns.to_owned(), rules: Vec::new(), stop, thread: Some(thread) };
        for ip in from {
            let rule: Vec<String> = [
                "INPUT",
                "-s",
                ip,
                "-j",
                "NFQUEUE",
                "--queue-num",
                &queue.to_string(),
                "--queue-bypass",
            ]
            .map(String::from)
            .to_vec();
            iptables(ns, "-A", &rule);
            shaper.rules.push(rule);
        }
        shaper
    }

    /// Stops shaping (the packets held are let go): what it saw.
    pub(crate) fn stop(mut self) -> Counts {
        self.undo()
    }

    /// Removes the rules and stops the thread. While a test is already failing (unwinding)
    /// nothing here panics: a second panic would abort the process before the bed is
    /// cleaned up.
    fn undo(&mut self) -> Counts {
        let quiet = std::thread::panicking();
        for rule in std::mem::take(&mut self.rules) {
            if quiet {
                let _ = iptables_status(&self.ns, "-D", &rule);
            } else {
                iptables(&self.ns, "-D", &rule);
            }
        }
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(counts)) => counts,
            Some(Err(_)) if !quiet => panic!("the shaper thread panicked"),
            _ => Counts::default(),
        }
    }
}

impl Drop for Shaper {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.undo();
        }
    }
}

/// Runs `iptables OP RULE` in namespace `ns`: its output.
fn iptables_status(ns: &str, op: &str, rule: &[String]) -> std::io::Result<std::process::Output> {
    std::process::Command::new("ip").args(["netns", "exec", ns, "iptables", op]).args(rule).output()
}

/// Runs `iptables OP RULE` in namespace `ns`, panicking with the reason if it fails.
fn iptables(ns: &str, op: &str, rule: &[String]) {
    let out = iptables_status(ns, op, rule)
        .expect("ip netns exec iptables runs (scripts/install-tools installs iptables)");
    assert!(
        out.status.success(),
        "iptables {op} {} in {ns}: {}",
        rule.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Moves this thread into the namespace at `path` and binds NFQUEUE `queue` there.
fn open_in(path: &str, queue: u16) -> std::io::Result<Queue> {
    let ns = std::fs::File::open(path)?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
    let mut q = Queue::open()?;
    q.bind(queue)?;
    // Only the verdict matters: no payload copied up.
    q.set_copy_range(queue, 0)?;
    q.set_queue_max_len(queue, 16_384)?;
    q.set_fail_open(queue, true)?;
    q.set_nonblocking(true);
    Ok(q)
}

/// Holds, drops and releases packets until `stop`; then releases what it holds.
fn shape(q: &mut Queue, link: Link, rng: &mut StdRng, stop: &AtomicBool) -> Counts {
    let mut held = BTreeMap::new();
    let (mut counts, mut seq) = (Counts::default(), 0u64);
    let jitter = link.jitter.as_secs_f64();
    while !stop.load(Ordering::Relaxed) {
        let arrived = match q.recv() {
            Ok(mut m) => {
                if rng.random_bool(link.loss) {
                    m.set_verdict(Verdict::Drop);
                    let _ = q.verdict(m);
                    counts.dropped += 1;
                } else {
                    let off = if jitter > 0.0 { rng.random_range(-jitter..jitter) } else { 0.0 };
                    let hold = (link.delay.as_secs_f64() + off).max(0.0);
                    held.insert((Instant::now() + Duration::from_secs_f64(hold), seq), m);
                    seq += 1;
                }
                true
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => false,
            Err(_) => false,
        };
        let now = Instant::now();
        while let Some(entry) = held.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let mut m = entry.remove();
            m.set_verdict(Verdict::Accept);
            let _ = q.verdict(m);
            counts.passed += 1;
        }
        if !arrived {
            let next = held.keys().next().map_or(Duration::from_millis(1), |k| k.0 - now);
            std::thread::sleep(next.min(Duration::from_micros(200)));
        }
    }
    for (_, mut m) in held {
        m.set_verdict(Verdict::Accept);
        let _ = q.verdict(m);
        counts.passed += 1;
    }
    counts
}
