//! An OpenAI-compatible router across engine endpoints, choosing by a handoff scheduler's KV
//! index (see `handoff_examples::router`).
//!
//! ```text
//! handoff scheduler --http-listen 127.0.0.1:50053 \
//!     --engine id=vllm-a,events=tcp://10.0.0.5:5557,url=10.0.0.5:8000 \
//!     --engine id=vllm-b,events=tcp://10.0.0.6:5557,url=10.0.0.6:8000
//! HANDOFF_TOKEN=... cargo run -p handoff-examples --bin openai_router -- 127.0.0.1:9000 127.0.0.1:50053
//! curl -s 127.0.0.1:9000/v1/completions -d '{"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}'
//! ```

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(scheduler)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: openai_router LISTEN_ADDR SCHEDULER_JSON_API_ADDR");
    };
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "routing OpenAI requests on http://{} through {scheduler}",
            listener.local_addr()?
        )?;
    }
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    // The cluster's token, when the scheduler has one.
    let token = std::env::var("HANDOFF_TOKEN").ok().filter(|t| !t.is_empty());
    handoff_examples::router::serve(listener, scheduler, token, stop).await?;
    Ok(())
}
