//! [`SmolLm`]: the engine handle and its compute thread.
//!
//! Each handle owns one OS thread that runs every forward pass of that handle: a prefill
//! whole, and decode steps batched across all sequences that are waiting for a step
//! (iteration-level interleaving: each pass advances every ready sequence by one token).
//! Handles made with [`SmolLm::fork`] share the weights and get their own thread.
//! Matrix products run on candle's thread pool (`CANDLE_NUM_THREADS`), which serializes its
//! callers, so several handles in one process do not oversubscribe the cores.

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use async_trait::async_trait;
use handoff_engine::{
    ChatMessage, Decoder, Engine, EngineError, Kv, LayerKv, LayerSink, ModelInfo, Prefilled,
    Sampling,
};
use tokenizers::Tokenizer;
use tokio::sync::oneshot;
use tracing::{debug, info};

use crate::forward::{Seq, forward};
use crate::sampling::sample;
use crate::weights::{self, Weights};
use crate::{SmolError, tokenizer};

/// Settings of the smollm engine.
#[derive(Debug, Clone)]
pub struct SmolConfig {
    /// The GGUF file.
    pub path: PathBuf,
    /// The name clients ask for.
    pub name: String,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Longest sequence (capped by the model's own context).
    pub max_context: usize,
    /// Most sequences advanced in one decode pass.
    pub max_batch: usize,
}

impl SmolConfig {
    /// Defaults for the model at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SmolConfig {
            path: path.into(),
            name: "SmolLM2-135M-Instruct".into(),
            page_size: 16,
            max_context: 4096,
            max_batch: 32,
        }
    }
}

struct Shared {
    weights: Weights,
    tokenizer: Tokenizer,
    /// `tokenizer` reading control tokens as plain text (chat messages' contents).
    plain: Tokenizer,
    /// The chat template's control tokens.
    chat: tokenizer::ChatIds,
    /// Bytes of the vocabulary's longest token: a text longer than the context's tokens of
    /// it cannot fit, and is refused before it is encoded.
    longest_token: usize,
    info: ModelInfo,
    max_batch: usize,
}

type StepReply = oneshot::Sender<(Box<Seq>, Result<u32, SmolError>)>;

enum Job {
    Prefill {
        tokens: Vec<u32>,
        prefix: Option<Kv>,
        sampling: Sampling,
        /// Where each layer goes as soon as it is computed (a streamed prefill).
        layers: Option<LayerSink>,
        reply: oneshot::Sender<Result<Prefilled, SmolError>>,
    },
    Step {
        seq: Box<Seq>,
        last: u32,
        index: u64,
        sampling: Sampling,
        reply: StepReply,
    },
}

struct Worker {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Compute threads alive in this process. They all draw on candle's one thread pool, so
/// each runs at 1/n of its solo speed when all are busy.
static WORKERS: AtomicUsize = AtomicUsize::new(0);

impl Worker {
    fn start(shared: Arc<Shared>) -> Result<Arc<Self>, SmolError> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("smollm-engine".into())
            .spawn(move || {
                yield_to_serving();
                run(&shared, &rx)
            })
            .map_err(|e| SmolError::Io(format!("spawning the engine thread: {e}")))?;
        WORKERS.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Worker { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)) }))
    }

    fn send(&self, job: Job) -> Result<(), SmolError> {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.as_ref().ok_or(SmolError::Stopped)?.send(job).map_err(|_| SmolError::Stopped)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has answered what it holds.
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        WORKERS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How much nicer than the serving threads compute runs (Unix nice levels).
const COMPUTE_NICENESS: i32 = 10;

/// Lowers the calling thread's scheduling priority, so that when the cores are saturated
/// the process's serving threads (admission, refusals, streaming) still run at once and
/// the compute takes what is left. Best effort: a system that refuses leaves it as it is.
fn yield_to_serving() {
    let me = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(me), COMPUTE_NICENESS) {
        debug!(error = %e, "compute thread priority left as it was");
    }
}

/// Starts the process's compute pool (rayon's global pool, which candle's matrix products
/// run on) with lowered priority, unless something already started it.
fn start_compute_pool() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("smollm-pool-{i}"))
            .start_handler(|_| yield_to_serving());
        if let Err(e) = pool.build_global() {
            debug!(error = %e, "compute pool already started; its priority is left as it was");
        }
    });
}

fn run(shared: &Shared, rx: &mpsc::Receiver<Job>) {
    let mut pending = VecDeque::new();
    loop {
        let job = match pending.pop_front() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
        };
        match job {
            // Nobody waits for it any more (the request was cancelled): not computed.
            Job::Prefill { reply, .. } if reply.is_closed() => {}
            Job::Prefill { tokens, prefix, sampling, layers, reply } => {
                // Cancelled midway, it stops at the next layer: the engine's slot was given
                // back, and the next request would queue behind the rest of its compute.
                let gone = || reply.is_closed();
                let run = || prefill(shared, &tokens, prefix, &sampling, layers.as_ref(), &gone);
                let r = catch_unwind(AssertUnwindSafe(run))
                    .unwrap_or_else(|_| Err(SmolError::Format("prefill panicked".into())));
                let _ = reply.send(r);
            }
            Job::Step { seq, last, index, sampling, reply } => {
                let mut batch = vec![(seq, last, index, sampling, reply)];
                while batch.len() < shared.max_batch {
                    match rx.try_recv() {
                        Ok(Job::Step { seq, last, index, sampling, reply }) => {
                            batch.push((seq, last, index, sampling, reply))
                        }
                        Ok(other) => {
                            pending.push_back(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                steps(shared, batch);
            }
        }
    }
}

/// Computes the prompt's KV layer by layer into the canonical layout (handing each layer to
/// `layers` as it is done) and samples the first token.
fn prefill(
    shared: &Shared,
    tokens: &[u32],
    prefix: Option<Kv>,
    sampling: &Sampling,
    layers: Option<&LayerSink>,
    cancelled: &dyn Fn() -> bool,
) -> Result<Prefilled, SmolError> {
    let hp = &shared.weights.hp;
    if tokens.is_empty() {
        return Err(SmolError::Input("empty prompt".into()));
    }
    if tokens.len() >= hp.context {
        return Err(SmolError::Input(format!(
            "prompt of {} tokens exceeds the context of {}",
            tokens.len(),
            hp.context
        )));
    }
    let mut seq = match prefix {
        Some(kv) => Seq::from_kv(hp, kv)?,
        None => Seq::new(hp),
    };
    if seq.len >= tokens.len() {
        return Err(SmolError::Input("cached prefix covers the whole prompt".into()));
    }
    let rows: Vec<(usize, u32)> = tokens[seq.len..].iter().map(|&t| (0, t)).collect();
    let shape = Seq::shape(hp);
    // Each layer in a buffer of its own, so it is handed on as it is (not copied) while the
    // next one computes; the KV is then those buffers (a layer never done is empty, and
    // `from_layers` refuses it; so is a layer of another length than the prompt's, which is
    // never handed on).
    let mut done = vec![bytes::Bytes::new(); hp.layers];
    let layer_len = shape.layer_bytes(tokens.len());
    let mut layer_done = |l: usize, s: &Seq| {
        if cancelled() {
            return ControlFlow::Break(());
        }
        let kv = s.layer_kv(hp, l);
        if kv.len() != layer_len {
            return ControlFlow::Continue(());
        }
        let bytes = bytes::Bytes::from(kv);
        if let Some(sink) = layers {
            // A listener gone (the request failed) leaves the compute to finish on its own.
            let _ = sink.send(LayerKv { layer: l, bytes: bytes.clone() });
        }
        done[l] = bytes;
        ControlFlow::Continue(())
    };
    let logits =
        forward(&shared.weights, &mut [&mut seq], &rows, &[rows.len() - 1], &mut layer_done)?;
    let kv = Kv::from_layers(shape, tokens.len(), done)
        .map_err(|e| SmolError::Shape(format!("the prefill's own layers: {e}")))?;
    let first_token = sample(&logits[0], sampling, 0);
    Ok(Prefilled { kv, first_token })
}

fn steps(shared: &Shared, batch: Vec<(Box<Seq>, u32, u64, Sampling, StepReply)>) {
    let context = shared.weights.hp.context;
    let (mut ready, full): (Vec<_>, Vec<_>) =
        batch.into_iter().partition(|b| b.0.len + 1 < context);
    for (seq, .., reply) in full {
        let _ = reply
            .send((seq, Err(SmolError::Input(format!("context of {context} tokens is full")))));
    }
    if ready.is_empty() {
        return;
    }
    let rows: Vec<(usize, u32)> = ready.iter().enumerate().map(|(i, b)| (i, b.1)).collect();
    let all: Vec<usize> = (0..rows.len()).collect();
    let result = {
        let mut seqs: Vec<&mut Seq> = ready.iter_mut().map(|b| &mut *b.0).collect();
        let run = || {
            forward(&shared.weights, &mut seqs, &rows, &all, &mut |_, _| ControlFlow::Continue(()))
        };
        catch_unwind(AssertUnwindSafe(run))
            .unwrap_or_else(|_| Err(SmolError::Format("decode panicked".into())))
    };
    match result {
        Ok(logits) => {
            for ((seq, _, index, sampling, reply), l) in ready.into_iter().zip(logits) {
                let t = sample(&l, &sampling, index);
                let _ = reply.send((seq, Ok(t)));
            }
        }
        Err(e) => {
            let msg = e.to_string();
            for (seq, .., reply) in ready {
                let _ = reply.send((seq, Err(SmolError::Format(msg.clone()))));
            }
        }
    }
}

/// The smollm engine (see the module docs).
#[derive(Clone)]
pub struct SmolLm {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
}

impl std::fmt::Debug for SmolLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmolLm").field("info", &self.shared.info).finish_non_exhaustive()
    }
}

impl SmolLm {
    /// Loads the model and starts its compute thread.
    pub fn load(cfg: &SmolConfig) -> Result<Self, SmolError> {
        let started = Instant::now();
        let (weights, content) = weights::load(&cfg.path, cfg.max_context)?;
        let tokenizer = tokenizer::build(&content)?;
        let hp = weights.hp;
        let end_tokens = tokenizer::end_tokens(&content, &tokenizer);
        let info = ModelInfo {
            name: cfg.name.clone(),
            shape: Seq::shape(&hp),
            page_size: cfg.page_size,
            vocab: hp.vocab as u32,
            max_context: hp.context,
            end_tokens,
            fingerprint: weights::fingerprint(&cfg.path)?,
        };
        info!(path = %cfg.path.display(), layers = hp.layers, context = hp.context, ms = started.elapsed().as_millis() as u64, "model loaded");
        let longest_token = tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1);
        let max_batch = cfg.max_batch.max(1);
        let (plain, chat) = (tokenizer::plain(&tokenizer), tokenizer::chat_ids(&tokenizer)?);
        let shared =
            Arc::new(Shared { weights, tokenizer, plain, chat, longest_token, info, max_batch });
        start_compute_pool();
        let worker = Worker::start(shared.clone())?;
        Ok(SmolLm { shared, worker })
    }

    async fn run_prefill(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
        layers: Option<LayerSink>,
    ) -> Result<Prefilled, EngineError> {
        let (reply, rx) = oneshot::channel();
        let job = Job::Prefill {
            tokens: tokens.to_vec(),
            prefix,
            sampling: sampling.clone(),
            layers,
            reply,
        };
        self.worker.send(job)?;
        Ok(rx.await.map_err(|_| SmolError::Stopped)??)
    }

    /// Refuses a text of `bytes` that cannot fit the context: encoding takes about 1.6 us a
    /// byte (4 MiB of digits: 6.5 s).
    fn fits(&self, bytes: usize) -> Result<(), EngineError> {
        let (context, longest) = (self.shared.info.max_context, self.shared.longest_token);
        if bytes > context.saturating_mul(longest) {
            return Err(EngineError::InvalidInput(format!(
                "a text of {bytes} bytes cannot fit the context of {context} tokens (of at most {longest} bytes)"
            )));
        }
        Ok(())
    }

    /// Another handle on the same weights, with its own compute thread.
    pub fn fork(&self) -> Result<Self, SmolError> {
        Ok(SmolLm { shared: self.shared.clone(), worker: Worker::start(self.shared.clone())? })
    }
}

#[async_trait]
impl Engine for SmolLm {
    fn info(&self) -> &ModelInfo {
        &self.shared.info
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.fits(text.len())?;
        let enc = self
            .shared
            .tokenizer
            .encode(text, false)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    fn detokenize(&self, tokens: &[u32]) -> String {
        self.shared.tokenizer.decode(tokens, true).unwrap_or_default()
    }

    fn compute_shared_by(&self) -> usize {
        WORKERS.load(Ordering::Relaxed).max(1)
    }

    fn decode_batch(&self) -> Option<usize> {
        Some(self.shared.max_batch)
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        if messages.is_empty() {
            return Err(EngineError::InvalidInput("no chat messages".into()));
        }
        Ok(tokenizer::chatml(messages))
    }

    fn tokenize_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        if messages.is_empty() {
            return Err(EngineError::InvalidInput("no chat messages".into()));
        }
        self.fits(messages.iter().map(|m| m.content.len() + m.role.len()).sum())?;
        tokenizer::encode_chat(&self.shared.plain, self.shared.chat, messages)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))
    }

    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
    ) -> Result<Prefilled, EngineError> {
        self.run_prefill(tokens, prefix, sampling, None).await
    }

    async fn prefill_streamed(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
        layers: LayerSink,
    ) -> Result<Prefilled, EngineError> {
        self.run_prefill(tokens, prefix, sampling, Some(layers)).await
    }

    fn decoder(
        &self,
        kv: Kv,
        last_token: u32,
        sampling: &Sampling,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        // Checked here, not at the step: a bad token would fail its whole batch there.
        let vocab = self.info().vocab;
        if last_token >= vocab {
            let why = format!("token {last_token} outside the vocabulary of {vocab}");
            return Err(EngineError::InvalidInput(why));
        }
        let seq = Seq::from_kv(&self.shared.weights.hp, kv)?;
        Ok(Box::new(SmolDecoder {
            worker: self.worker.clone(),
            seq: Some(Box::new(seq)),
            last: last_token,
            index: 1,
            sampling: sampling.clone(),
        }))
    }
}

/// One sequence decoding on a [`SmolLm`].
struct SmolDecoder {
    worker: Arc<Worker>,
    seq: Option<Box<Seq>>,
    last: u32,
    index: u64,
    sampling: Sampling,
}

#[async_trait]
impl Decoder for SmolDecoder {
    async fn step(&mut self) -> Result<u32, EngineError> {
        let seq = self.seq.take().ok_or(SmolError::Stopped)?;
        let (reply, rx) = oneshot::channel();
        self.worker.send(Job::Step {
            seq,
            last: self.last,
            index: self.index,
            sampling: self.sampling.clone(),
            reply,
        })?;
        let (seq, token) = rx.await.map_err(|_| SmolError::Stopped)?;
        self.seq = Some(seq);
        let token = token?;
        self.last = token;
        self.index += 1;
        Ok(token)
    }
}

#[cfg(test)]
pub(crate) mod tests;
