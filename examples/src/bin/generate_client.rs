//! A gRPC client of handoff's Generate API: sends a prompt, prints the streamed tokens, then
//! the request's evidence (room, instance, dp rank, stage timings).
//!
//! ```text
//! cargo run -p handoff-examples --bin generate_client -- http://127.0.0.1:50051 "the prompt"
//! ```

use std::io::Write;

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{GenerateRequest, SamplingParams};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "http://127.0.0.1:50051".into());
    let prompt =
        args.next().unwrap_or_else(|| "Disaggregated prefill hands the KV to decode".into());
    let mut client = GenerateClient::connect(addr).await?;
    let req = GenerateRequest {
        input: Some(Input::Text(prompt)),
        sampling: Some(SamplingParams { max_tokens: 12, ..Default::default() }),
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = std::io::stdout().lock();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(Event::Chunk(c)) => {
                write!(out, "{}", c.text)?;
                out.flush()?;
            }
            Some(Event::Complete(c)) => {
                writeln!(out)?;
                let usage = c.usage.unwrap_or_default();
                writeln!(
                    out,
                    "finish: {:?}, prompt {} tokens ({} cached), {} generated",
                    c.finish_reason(),
                    usage.prompt_tokens,
                    usage.cached_tokens,
                    usage.completion_tokens
                )?;
                if let Some(ev) = c.evidence {
                    writeln!(
                        out,
                        "room {} on {} dp rank {}, {} KV bytes verified",
                        ev.bootstrap_room, ev.instance_id, ev.dp_rank, ev.kv_bytes
                    )?;
                    if let Some(s) = ev.stages {
                        writeln!(
                            out,
                            "stages (us): resolve-topology {} resolve-rank {} register {} connect {} verify {} consume {}",
                            s.resolve_topology_us,
                            s.resolve_rank_us,
                            s.register_us,
                            s.connect_us,
                            s.verify_us,
                            s.consume_us
                        )?;
                    }
                    for a in ev.failed_attempts {
                        writeln!(
                            out,
                            "failed attempt: room {} on {}: {}",
                            a.bootstrap_room, a.instance_id, a.error
                        )?;
                    }
                }
            }
            None => {}
        }
    }
    Ok(())
}
