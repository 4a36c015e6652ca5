//! The `handoff.v1.Generate` gRPC service: prefill (with retries) before the first token,
//! then a stream of decoded tokens from an owned task.

use std::future::Future;
use std::sync::Arc;

use handoff_proto::grpc::GrpcError;
use handoff_proto::trace::TraceContext;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::generate_server::{Generate, GenerateServer};
use handoff_proto::v1::{
    Complete, FinishReason, GenerateRequest, GenerateResponse, TokenChunk, Usage,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::decoding::Ticket;
use crate::input::{self, Plan};
use crate::metrics::{Ending, Metrics};
use crate::outbox::Outbox;
use crate::path::Ready;
use crate::text::TextAssembler;
use crate::{Frontend, FrontendError, Limit};

/// Messages a stream's decode runs ahead of its client by, at most: past them it waits for
/// the client, for `client_stall` at most (see [`crate::config::FrontendConfig`]); what
/// waits for each client stays bounded.
const MAX_WAITING: usize = 1024;

/// How long an open-ended chat ended by its deadline has to hand on what its client has not
/// taken yet.
const TAIL_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The Generate service over a [`Frontend`].
#[derive(Debug, Clone)]
pub struct GenerateService {
    frontend: Arc<Frontend>,
}

impl GenerateService {
    /// A service over `frontend`.
    pub fn new(frontend: Arc<Frontend>) -> Self {
        GenerateService { frontend }
    }

    /// As a tonic service.
    pub fn into_server(self) -> GenerateServer<Self> {
        GenerateServer::new(self).max_decoding_message_size(16 << 20)
    }
}

type Tx = mpsc::Sender<Result<GenerateResponse, Status>>;

/// How handing a message to the client's stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Delivered,
    /// The client left.
    Gone,
    /// The client did not take it before the request's deadline.
    Expired,
    /// The frontend is stopping and the client did not take it.
    Stopping,
}

/// The place kept in the client's stream for a request's last message from its start: an
/// error or `Complete` is queued behind whatever the client has not read, never dropped.
type Last = mpsc::OwnedPermit<Result<GenerateResponse, Status>>;

/// Ends the request with the error `why`, counted as `ending`.
fn fail(m: &Metrics, last: Last, ending: Ending, why: Status) {
    m.ended(ending);
    last.send(Err(why));
}

/// Ends a request whose message was not delivered (`sent`) after `generated` tokens.
fn undelivered(m: &Metrics, last: Last, sent: Sent, generated: u32) {
    match sent {
        Sent::Expired => {
            let why =
                format!("deadline passed after {generated} tokens (the client was not reading)");
            fail(m, last, Ending::Expired, Status::deadline_exceeded(why));
        }
        Sent::Stopping => {
            fail(m, last, Ending::Failed, Status::unavailable("frontend shutting down"))
        }
        Sent::Gone | Sent::Delivered => m.ended(Ending::Cancelled),
    }
}

/// Hands `outbox`'s oldest message to the client's stream once it has room, unless the
/// client reads nothing until `by`, leaves, or the frontend stops: a client that neither
/// reads nor leaves must not hold the request's permit and task past its deadline, nor the
/// frontend's shutdown. The message stays in `outbox` unless it went. Room at once takes no
/// timer.
async fn deliver_next(
    fe: &Frontend,
    tx: &Tx,
    outbox: &mut Outbox<Result<GenerateResponse, Status>>,
    by: Instant,
) -> Sent {
    let room = match tx.try_reserve() {
        Ok(room) => room,
        Err(mpsc::error::TrySendError::Closed(())) => return Sent::Gone,
        Err(mpsc::error::TrySendError::Full(())) => tokio::select! {
            biased;
            room = tx.reserve() => match room {
                Ok(room) => room,
                Err(_) => return Sent::Gone,
            },
            _ = tokio::time::sleep_until(by) => return Sent::Expired,
            _ = fe.tasks.shutdown_requested() => return Sent::Stopping,
        },
    };
    if let Some(msg) = outbox.next() {
        room.send(msg);
    }
    Sent::Delivered
}

/// Delivers `outbox`'s oldest messages, each as [`deliver_next`] does, until at most `keep`
/// wait; how the last one went.
async fn deliver_waiting(
    fe: &Frontend,
    tx: &Tx,
    outbox: &mut Outbox<Result<GenerateResponse, Status>>,
    by: Instant,
    keep: usize,
) -> Sent {
    while outbox.len() > keep {
        let sent = deliver_next(fe, tx, outbox, by).await;
        if sent != Sent::Delivered {
            return sent;
        }
    }
    Sent::Delivered
}

fn chunk(token: u32, text: String) -> Result<GenerateResponse, Status> {
    Ok(GenerateResponse { event: Some(Event::Chunk(TokenChunk { token_ids: vec![token], text })) })
}

/// Streams `ready`'s tokens into `tx` until a finish condition, the deadline, the client
/// leaving, or shutdown; decode steps wait for `ticket`'s slot, if it has one, and not for
/// the client to read (see [`crate::outbox`]). The last message is a `Complete`.
pub(crate) async fn stream(
    fe: Arc<Frontend>,
    plan: Plan,
    (mut ready, mut ticket): (Ready, Option<Ticket>),
    tx: Tx,
    arrived: Instant,
) {
    let m = &fe.metrics;
    // The channel is new: a place is free unless the client already left.
    let Ok(last) = tx.clone().reserve_owned().await else {
        m.ended(Ending::Cancelled);
        return;
    };
    let ends = |t: u32| !plan.sampling.ignore_eos && fe.engine.info().end_tokens.contains(&t);
    // A first token that ends the sequence needs no decode step, nor a slot.
    let decodes = plan.max_tokens > 1 && !ends(ready.first_token);
    if let Some(t) = ticket.as_mut().filter(|_| decodes) {
        match decode_turn(&fe, t, &plan, arrived, &tx).await {
            Ok(()) => {}
            Err(None) => return m.ended(Ending::Cancelled),
            Err(Some((ending, why))) => return fail(m, last, ending, why),
        }
    }
    let mut text = TextAssembler::new(&plan.sampling.stop);
    let mut generated = 0u32;
    let mut token = ready.first_token;
    let mut last_sent = arrived;
    // The decode does not wait for the client to read: what it does not take yet waits in
    // `outbox` (text, not KV) and follows once the slot and the decoder are given back.
    let mut outbox = Outbox::new();
    let finish = loop {
        if ends(token) {
            break FinishReason::Eos;
        }
        generated += 1;
        let released = text.push(&*fe.engine, token);
        if outbox.push(&tx, chunk(token, released.text)).is_err() {
            return undelivered(m, last, Sent::Gone, generated);
        }
        // So far behind, the decode waits for the client (what waits stays bounded), and
        // gives its slot and KV up if the client takes nothing for a while. (A client that
        // keeps up costs a length check per token here, no clock read.)
        if outbox.len() >= MAX_WAITING {
            let stall_by = (Instant::now() + fe.cfg.client_stall).min(plan.deadline);
            match deliver_waiting(&fe, &tx, &mut outbox, stall_by, MAX_WAITING - 1).await {
                Sent::Delivered => {}
                Sent::Expired if Instant::now() < plan.deadline => {
                    drop(ticket.take());
                    drop(ready.decoder);
                    let sent = deliver_waiting(&fe, &tx, &mut outbox, plan.deadline, 0).await;
                    if sent != Sent::Delivered {
                        return undelivered(m, last, sent, generated);
                    }
                    let why = format!(
                        "the client took nothing for {:?} with {MAX_WAITING} tokens waiting: the \
                         decode stopped after {generated} tokens",
                        fe.cfg.client_stall
                    );
                    return fail(m, last, Ending::Cancelled, Status::resource_exhausted(why));
                }
                sent => return undelivered(m, last, sent, generated),
            }
        }
        // Token times are the decode's, whether or not the client took them yet.
        let now = Instant::now();
        if generated == 1 {
            m.first_token(now - arrived);
        } else {
            m.next_token(now - last_sent);
        }
        last_sent = now;
        if released.stopped {
            break FinishReason::Stop;
        }
        if generated >= plan.max_tokens {
            break FinishReason::Length;
        }
        if Instant::now() >= plan.deadline {
            if plan.open_ended {
                // Its end: it held its slot this long, as open-ended chats do.
                break FinishReason::Length;
            }
            let why = format!("deadline passed after {generated} tokens");
            return fail(m, last, Ending::Expired, Status::deadline_exceeded(why));
        }
        let step = tokio::select! {
            _ = fe.tasks.shutdown_requested() => {
                let why = Status::unavailable("frontend shutting down");
                return fail(m, last, Ending::Failed, why);
            }
            s = async {
                let started = Instant::now();
                let s = ready.decoder.step().await;
                // The first step also loads the KV into the engine: not a step's time.
                if generated > 1 {
                    m.note_step(started.elapsed());
                }
                s
            } => s,
        };
        token = match step {
            Ok(t) => t,
            Err(e) => {
                // The decode engine's own fault (the prefill and the KV were good): worth a
                // line, as an instance's fault is.
                tracing::warn!(error = %e, generated, "decode failed after the first token");
                // The tokens decoded before go first (until the deadline), then the error;
                // neither the slot nor the KV is held meanwhile.
                drop(ticket.take());
                drop(ready.decoder);
                deliver_waiting(&fe, &tx, &mut outbox, plan.deadline, 0).await;
                return fail(m, last, Ending::Failed, FrontendError::Decode(e.to_string()).into());
            }
        };
    };
    if finish != FinishReason::Stop {
        let rest = text.finish();
        if !rest.is_empty() {
            let chunk = TokenChunk { token_ids: vec![], text: rest };
            let msg = Ok(GenerateResponse { event: Some(Event::Chunk(chunk)) });
            if outbox.push(&tx, msg).is_err() {
                return undelivered(m, last, Sent::Gone, generated);
            }
        }
    }
    // The decode is over: its slot and its KV go before the client has read it all, so a
    // slow reader holds neither, and a client's next request finds the slot free.
    if let Some(mut t) = ticket.take() {
        t.ran_to_end(generated);
    }
    drop(ready.decoder);
    // An open-ended chat ended by its deadline still hands on what it has.
    let by = if plan.open_ended {
        plan.deadline.max(Instant::now() + TAIL_GRACE)
    } else {
        plan.deadline
    };
    let sent = deliver_waiting(&fe, &tx, &mut outbox, by, 0).await;
    if sent != Sent::Delivered {
        return undelivered(m, last, sent, generated);
    }
    m.tokens.add(u64::from(generated));
    let usage = Usage {
        prompt_tokens: plan.tokens.len() as u32,
        completion_tokens: generated,
        cached_tokens: ready.cached_tokens,
    };
    let done = Complete {
        finish_reason: finish as i32,
        usage: Some(usage),
        evidence: Some(ready.evidence),
    };
    if tx.is_closed() {
        return m.ended(Ending::Cancelled);
    }
    last.send(Ok(GenerateResponse { event: Some(Event::Complete(done)) }));
    m.ended(Ending::Ok);
    m.finished(arrived.elapsed());
}

/// Waits for `ticket`'s decode slot, before the request's first token goes out: until the
/// deadline, shutdown or the client leaving (`Err(None)`), and a slot that comes too late
/// for the decode the request expects is given up at once, for the next one in line (see
/// [`crate::decoding`]).
async fn decode_turn(
    fe: &Frontend,
    ticket: &mut Ticket,
    plan: &Plan,
    arrived: Instant,
    tx: &Tx,
) -> Result<(), Option<(Ending, Status)>> {
    tokio::select! {
        _ = fe.tasks.shutdown_requested() => {
            return Err(Some((Ending::Failed, Status::unavailable("frontend shutting down"))));
        }
        _ = tokio::time::sleep_until(plan.deadline) => {
            let why = "the deadline passed waiting for a decode slot";
            return Err(Some((Ending::Expired, Status::deadline_exceeded(why))));
        }
        // The client left: its place in line goes to the next one.
        _ = tx.closed() => return Err(None),
        _ = ticket.slot() => {}
    }
    // An open-ended chat is cut at its deadline, whatever it gets done by then.
    if plan.open_ended {
        return Ok(());
    }
    let now = Instant::now();
    let left = plan.deadline.saturating_duration_since(now);
    let whole = plan.deadline.saturating_duration_since(arrived);
    let decode = fe.expected_decode(plan.max_tokens);
    if left < decode.min(whole / 2) {
        let why = format!(
            "a decode slot came with {} ms left, {} ms of decode expected",
            left.as_millis(),
            decode.as_millis()
        );
        return Err(Some((Ending::Expired, Status::deadline_exceeded(why))));
    }
    Ok(())
}

/// Counts a request that was dropped before it was answered (its client went away).
struct Unanswered<'a>(Option<&'a Frontend>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(fe) = self.0 {
            fe.metrics.ended(Ending::Cancelled);
        }
    }
}

/// Checks a request, prefills it (with retries) and starts streaming it on the frontend's
/// tasks: the one entry of the gRPC and HTTP APIs, and the one place their counters move.
pub(crate) async fn start(
    fe: &Arc<Frontend>,
    req: GenerateRequest,
    trace: TraceContext,
) -> Result<mpsc::Receiver<Result<GenerateResponse, Status>>, FrontendError> {
    let arrived = Instant::now();
    let in_flight = fe.metrics.arrived();
    let mut unanswered = Unanswered(Some(&**fe));
    let result = async {
        let permit =
            fe.limit.clone().try_acquire_owned().map_err(|_| FrontendError::Overloaded {
                retry_after: std::time::Duration::from_secs(1),
                limit: Limit::Requests,
                reason: format!("{} requests in progress", fe.cfg.max_concurrent),
            })?;
        let plan = Plan { trace, ..input::checked(fe, req).await? };
        let ticket = crate::decoding::admit_request(fe, &plan)?;
        let ready = fe.prefill(&plan).await?;
        let (tx, rx) = mpsc::channel(64);
        let f = fe.clone();
        fe.tasks.spawn(async move {
            stream(f, plan, (ready, ticket), tx, arrived).await;
            drop((permit, in_flight));
        });
        Ok(rx)
    }
    .await;
    unanswered.0 = None;
    if let Err(e) = &result {
        fe.metrics.failed(e);
    }
    result
}

#[tonic::async_trait]
impl Generate for GenerateService {
    type GenerateStream = ReceiverStream<Result<GenerateResponse, Status>>;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let trace = TraceContext::from_metadata(req.metadata());
        // The request's trace id on its answer, success or error (see `TRACE_ID`).
        let id = trace.trace_id().parse::<tonic::metadata::MetadataValue<_>>().ok();
        let tag = |m: &mut tonic::metadata::MetadataMap| {
            if let Some(v) = id.clone() {
                m.insert(handoff_proto::metadata::TRACE_ID, v);
            }
        };
        match start(&self.frontend, req.into_inner(), trace).await {
            Ok(rx) => {
                let mut answer = Response::new(ReceiverStream::new(rx));
                tag(answer.metadata_mut());
                Ok(answer)
            }
            Err(e) => {
                let mut refused = Status::from(e);
                tag(refused.metadata_mut());
                Err(refused)
            }
        }
    }
}

/// Serves Generate (and standard gRPC health) on `listener` until `shutdown` completes (over
/// TLS when the frontend's config has a public certificate). From when the frontend drains
/// ([`Frontend::start_draining`]) it tells its clients to go (HTTP/2 `GOAWAY`: a client
/// pinned to this frontend's connection reconnects, through its balancer, to another) and
/// takes no new connection, while its streams in flight go on until `shutdown`; then it
/// finishes what its connections serve for at most the shutdown grace (a stream whose
/// client no longer reads never finishes).
pub async fn serve(
    listener: TcpListener,
    frontend: Arc<Frontend>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), GrpcError> {
    let (limits, tls) = (frontend.cfg.http, frontend.cfg.public_tls.clone());
    frontend.mark_serving();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut stopping = stopped.clone();
    let fe = frontend.clone();
    let goaway = async move {
        tokio::select! {
            _ = fe.drained() => {}
            _ = stopping.wait_for(|s| *s) => {}
        }
    };
    // One connection may carry twice as many streams as the frontend serves at once: past
    // its bound a request is still refused at once (429), not held in the client.
    let max_streams =
        u32::try_from(frontend.cfg.max_concurrent.saturating_mul(2)).unwrap_or(u32::MAX);
    let bodies = handoff_proto::grpc::BoundBodies::new(limits.body_timeout, limits.receiving_bytes);
    let router = handoff_proto::grpc::public_server(max_streams, bodies)
        .add_service(GenerateService::new(frontend).into_server());
    let (max, quiet) = (limits.max_connections, limits.grpc_quiet);
    // Each its own connection type: plain connections are served as they are (see
    // `handoff_proto::grpc::cluster_incoming`).
    let serving: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = match tls {
        None => {
            let incoming = handoff_proto::grpc::placed_incoming(listener, max, quiet);
            Box::pin(router.serve_with_incoming_shutdown(incoming, goaway))
        }
        Some(tls) => {
            let incoming = handoff_proto::grpc::public_incoming_tls(listener, &tls, max, quiet);
            Box::pin(router.serve_with_incoming_shutdown(incoming, goaway))
        }
    };
    tokio::pin!(serving, shutdown);
    tokio::select! {
        served = &mut serving => return served.map_err(GrpcError::Serve),
        _ = &mut shutdown => {
            let _ = stop.send(true);
        }
    }
    match tokio::time::timeout(limits.shutdown_grace, serving).await {
        Ok(served) => served.map_err(GrpcError::Serve),
        Err(_) => {
            tracing::warn!("Generate connections not finished within the shutdown grace: cut");
            Ok(())
        }
    }
}
