//! [`Engine`]: this process's NIXL agent with its UCX backend, and the few calls the backend
//! makes on it. NIXL's calls return at once; a transfer is waited for by polling its status
//! on a blocking thread, sleeping between polls.
//!
//! A transfer that fails once NIXL took it (its deadline passed, its peer gone) may still
//! read or write its buffer, so the buffer is kept, with the request, and each later
//! transfer first frees those NIXL says completed. Before, every such buffer was leaked for
//! good (a whole read's KV at each failed read, hundreds of MiB for a long prompt on a large
//! model) and the process's memory only grew. One whose status NIXL no longer knows (an
//! error: its peer forgotten, say) or still running after [`KEPT_FOR`] is leaked as before,
//! the only safe end when UCX may still write it. While [`MAX_KEPT_BYTES`] are kept, new
//! transfers are refused (as the decode's memory full, not the peer's fault).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, OptArgs, RegDescList, ThreadSync, XferDescList, XferOp,
    XferRequest, XferStatus,
};

use super::memory::{Pinned, Registered};
use crate::TransferError;

/// One WRITE's segment: `len` bytes at `src` (an offset into the source buffer) to the
/// remote address `dst`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    pub(crate) src: usize,
    pub(crate) dst: u64,
    pub(crate) len: usize,
}

/// Bytes of failed transfers' buffers kept until NIXL says they ended; while as many are
/// kept, new transfers are refused.
pub(crate) const MAX_KEPT_BYTES: usize = 1 << 30;

/// How long a failed transfer's buffer is kept, waiting for NIXL to complete it, before it
/// is leaked (and no longer counted).
pub(crate) const KEPT_FOR: Duration = Duration::from_secs(600);

/// Time a transfer must have left to be posted at all: one posted with less fails while in
/// progress, and its buffer must then be kept.
const MIN_TIME_TO_POST: Duration = Duration::from_millis(1);

/// This process's agent (see the module docs).
pub(crate) struct Engine {
    agent: Agent,
    ucx: Backend,
    name: String,
    /// The agent's metadata before anything was registered: its address, no memory.
    introduction: Vec<u8>,
    kept: Mutex<Kept>,
}

/// Transfers that failed once NIXL took them, and their buffers' bytes.
#[derive(Default)]
struct Kept {
    failed: Vec<KeptTransfer>,
    bytes: usize,
    /// Bytes leaked so far, in the process's life.
    leaked: usize,
    /// When NIXL was last asked about them: at most every [`ASK_EVERY`], so a transfer
    /// does not pay a status call per kept one (each takes the agent's lock).
    asked: Option<Instant>,
}

/// How often the kept transfers' statuses are asked, at most.
const ASK_EVERY: Duration = Duration::from_millis(100);

/// A failed transfer's request and buffer (the request is released first: fields drop in
/// order), and when it failed.
struct KeptTransfer {
    req: XferRequest,
    buf: Registered,
    since: Instant,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("name", &self.name).finish_non_exhaustive()
    }
}

fn failed(what: &str, e: nixl_sys::NixlError) -> TransferError {
    TransferError::Failed(format!("nixl {what}: {e}"))
}

impl Engine {
    /// An agent named `name` with a UCX backend. Its progress thread waits on UCX's event fd
    /// and wakes at least every `progress_delay` (NIXL rounds it up to whole milliseconds):
    /// idle, it costs a wakeup per period instead of a core.
    pub(crate) fn start(name: &str, progress_delay: Duration) -> Result<Self, TransferError> {
        if nixl_sys::is_stub() {
            return Err(TransferError::Failed(
                "libnixl_capi.so not found: put the directory `scripts/fetch-nixl` prints on \
                 LD_LIBRARY_PATH (NIXL 1.5.1, from the nixl-cu13 wheel)"
                    .into(),
            ));
        }
        let cfg = AgentConfig {
            enable_prog_thread: true,
            pthr_delay_us: progress_delay.as_micros().clamp(1, u128::from(u32::MAX)) as u64,
            thread_sync: ThreadSync::Rw,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(name, &cfg).map_err(|e| failed("agent", e))?;
        let (_mems, params) =
            agent.get_plugin_params("UCX").map_err(|e| failed("UCX plugin", e))?;
        let ucx = agent.create_backend("UCX", &params).map_err(|e| failed("UCX backend", e))?;
        let introduction = agent.get_local_md().map_err(|e| failed("metadata", e))?;
        let kept = Mutex::default();
        Ok(Engine { agent, ucx, name: name.to_owned(), introduction, kept })
    }

    /// The agent's name, as peers' notifications and metadata name it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Staging memory of `len` bytes, registered for the agent's life.
    pub(crate) fn arena(&self, len: usize) -> Result<super::memory::Arena, TransferError> {
        super::memory::Arena::new(&self.agent, len).map_err(|e| failed("register", e))
    }

    /// Registers `mem`: peers that load this agent's metadata afterwards can reach it.
    pub(crate) fn register(&self, mem: Pinned) -> Result<Registered, TransferError> {
        Registered::new(&self.agent, mem).map_err(|e| failed("register", e))
    }

    /// This agent's metadata as it started: its UCX address and no memory. Peers load it
    /// before any buffer's ([`Engine::metadata_of`]).
    pub(crate) fn introduction(&self) -> &[u8] {
        &self.introduction
    }

    /// The metadata of `buf` alone (its key, not the agent's address).
    pub(crate) fn metadata_of(&self, buf: &Registered) -> Result<Vec<u8>, TransferError> {
        let mut descs = RegDescList::new(MemType::Dram).map_err(|e| failed("descriptors", e))?;
        descs.add_desc(buf.addr(), buf.len(), 0);
        let mut opts = OptArgs::new().map_err(|e| failed("options", e))?;
        opts.add_backend(&self.ucx).map_err(|e| failed("options", e))?;
        self.agent.get_local_partial_md(&descs, Some(&opts)).map_err(|e| failed("metadata", e))
    }

    /// Loads (or refreshes) a peer's metadata; returns the peer's agent name.
    pub(crate) fn load(&self, md: &[u8]) -> Result<String, TransferError> {
        self.agent.load_remote_md(md).map_err(|e| failed("load metadata", e))
    }

    /// READs `segments` of `remote`'s memory (`dst` the remote address, `src` the offset in
    /// `into`) into `into`, then has NIXL send `remote` the notification `notify`; waits
    /// until the bytes are here, or `deadline`. As [`Engine::write`] otherwise.
    pub(crate) fn read(
        &self,
        into: Registered,
        segments: &[Segment],
        remote: &str,
        notify: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<Registered, TransferError> {
        let opts = match notify {
            Some(msg) => {
                let mut o = OptArgs::new().map_err(|e| failed("options", e))?;
                o.set_notification_message(msg).map_err(|e| failed("options", e))?;
                o.set_has_notification(true).map_err(|e| failed("options", e))?;
                Some(o)
            }
            None => None,
        };
        self.transfer(XferOp::Read, into, segments, remote, opts.as_ref(), deadline)
    }

    /// Forgets a peer's metadata (and NIXL's connection to it).
    pub(crate) fn forget(&self, remote: &str) {
        if let Err(e) = self.agent.invalidate_remote_md(remote) {
            tracing::debug!(%remote, error = %e, "nixl peer not forgotten");
        }
    }

    /// Sends `remote` the notification `msg` (a peer's own protocol message).
    pub(crate) fn notify(&self, remote: &str, msg: &[u8]) -> Result<(), TransferError> {
        self.agent.send_notification(remote, msg, Some(&self.ucx)).map_err(|e| failed("notify", e))
    }

    /// WRITEs `segments` of `src` into `remote`'s memory and waits until they are complete
    /// there (NIXL flushes the endpoint before it reports success), or `deadline`; returns the
    /// source. Blocks the calling thread: run it on a blocking thread. A write that fails or
    /// passes its deadline once posted may still read its source, so the source is then
    /// kept until NIXL says the write ended (see the module docs).
    pub(crate) fn write(
        &self,
        src: Registered,
        segments: &[Segment],
        remote: &str,
        deadline: Instant,
    ) -> Result<Registered, TransferError> {
        self.transfer(XferOp::Write, src, segments, remote, None, deadline)
    }

    /// One transfer between `local` (at each segment's `src` offset) and `remote`'s memory
    /// (at each segment's `dst` address).
    fn transfer(
        &self,
        op: XferOp,
        src: Registered,
        segments: &[Segment],
        remote: &str,
        opts: Option<&OptArgs>,
        deadline: Instant,
    ) -> Result<Registered, TransferError> {
        let what = if op == XferOp::Write { "write" } else { "read" };
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| failed("descriptors", e))?;
        let mut far = XferDescList::new(MemType::Dram).map_err(|e| failed("descriptors", e))?;
        for s in segments {
            if s.src.checked_add(s.len).is_none_or(|end| end > src.len()) {
                return Err(TransferError::Malformed(format!(
                    "segment [{}, +{}) outside the {}-byte source",
                    s.src,
                    s.len,
                    src.len()
                )));
            }
            local.add_desc(src.addr() + s.src, s.len, 0);
            far.add_desc(s.dst as usize, s.len, 0);
        }
        if self.kept_bytes() >= MAX_KEPT_BYTES {
            return Err(TransferError::Full("memory of failed nixl transfers"));
        }
        if deadline.saturating_duration_since(Instant::now()) < MIN_TIME_TO_POST {
            return Err(TransferError::Timeout(format!("nixl {what}: no time left to post it")));
        }
        let req = self
            .agent
            .create_xfer_req(op, &local, &far, remote, opts)
            .map_err(|e| failed(&format!("{what} request"), e))?;
        match self.run(&req, what, deadline) {
            Ok(()) => Ok(src),
            Err(e) => {
                // A post refused may have gone out in part: kept as well.
                let len = src.len();
                tracing::warn!(len, %remote, error = %e, "nixl {what} failed: buffer kept");
                let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
                kept.bytes += src.len();
                kept.failed.push(KeptTransfer { req, buf: src, since: Instant::now() });
                Err(e)
            }
        }
    }

    /// Frees the kept buffers of failed transfers NIXL has since completed, and leaks those
    /// it no longer knows or that ran past [`KEPT_FOR`]; the bytes still kept.
    pub(crate) fn kept_bytes(&self) -> usize {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.failed.is_empty() {
            return 0;
        }
        let (agent, now) = (&self.agent, Instant::now());
        if kept.asked.is_some_and(|t| now.duration_since(t) < ASK_EVERY) {
            return kept.bytes;
        }
        kept.asked = Some(now);
        let mut gone = 0;
        let failed = std::mem::take(&mut kept.failed);
        for t in failed {
            match agent.get_xfer_status(&t.req) {
                Ok(XferStatus::InProgress) if now.duration_since(t.since) < KEPT_FOR => {
                    kept.failed.push(t);
                    continue;
                }
                Ok(XferStatus::Success) => gone += t.buf.len(),
                status => {
                    let why = match status {
                        Err(_) => "NIXL says no more of it",
                        Ok(_) => "still running",
                    };
                    let len = t.buf.len();
                    gone += len;
                    kept.leaked += len;
                    let leaked = kept.leaked;
                    tracing::warn!(len, leaked, "a failed nixl transfer's buffer leaked: {why}");
                    std::mem::forget(t);
                }
            }
        }
        kept.bytes -= gone;
        kept.bytes
    }

    /// Bytes of failed transfers' buffers leaked so far.
    #[cfg(test)]
    pub(crate) fn leaked_bytes(&self) -> usize {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).leaked
    }

    /// Posts `req` and polls it until it succeeds, fails or passes `deadline`.
    fn run(
        &self,
        req: &nixl_sys::XferRequest,
        what: &str,
        deadline: Instant,
    ) -> Result<(), TransferError> {
        let mut in_progress = self.agent.post_xfer_req(req, None).map_err(|e| failed("post", e))?;
        let mut pause = Duration::from_micros(20);
        while in_progress {
            match self.agent.get_xfer_status(req).map_err(|e| failed(what, e))? {
                XferStatus::Success => in_progress = false,
                XferStatus::InProgress if Instant::now() >= deadline => {
                    return Err(TransferError::Timeout(format!("nixl {what} in progress")));
                }
                XferStatus::InProgress => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(250));
                }
            }
        }
        Ok(())
    }
}
