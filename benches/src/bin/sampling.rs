//! What sampling costs the real model's decode: tokens per second with each sampling shape
//! beside greedy decoding of the same chats in the same round (greedy picks the largest
//! logit, one pass over the vocabulary: the ceiling a sampler can reach).
//!
//! ```text
//! cargo run --release -p handoff-benches --bin sampling -- [model.gguf] [rounds]
//! ```
//!
//! Each round decodes 64 tokens of 1 and of 4 concurrent streams per shape, the shapes in
//! turn, seeds varying by round; the table gives each shape's median over the rounds, its
//! ratio to greedy's in the same rounds, and the time per token it adds to greedy's.

use std::io::Write;
use std::time::Instant;

use handoff_engine::{ChatMessage, Engine, Sampling};
use handoff_smollm::{SmolConfig, SmolLm};

const STEPS: usize = 64;

/// The chats decoded: real text, so the logits are shaped as a user's would be.
const CHATS: [&str; 4] = [
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "List three uses of a paperclip.",
    "Explain how a bicycle stays upright.",
];

fn shapes() -> [(&'static str, Sampling); 5] {
    let t = |temperature, top_p, top_k| Sampling { temperature, top_p, top_k, seed: 0 };
    [
        ("greedy", t(0.0, 1.0, 0)),
        ("temperature 1 (the HTTP API's default)", t(1.0, 1.0, 0)),
        ("temperature 0.7, top_p 0.9", t(0.7, 0.9, 0)),
        ("temperature 1, top_k 40", t(1.0, 1.0, 40)),
        ("temperature 1, top_p 0.99, top_k 1000", t(1.0, 0.99, 1000)),
    ]
}

/// Tokens per second of `streams` concurrent decodes of `STEPS` tokens each.
async fn rate(e: &SmolLm, streams: usize, s: &Sampling) -> anyhow::Result<f64> {
    let mut decoders = Vec::new();
    for i in 0..streams {
        let chat = [ChatMessage { role: "user".into(), content: CHATS[i % CHATS.len()].into() }];
        let tokens = e.tokenize_chat(&chat)?;
        let p = e.prefill(&tokens, None, s).await?;
        decoders.push(e.decoder(p.kv, p.first_token, s)?);
    }
    let t = Instant::now();
    let runs = decoders.iter_mut().map(|d| async move {
        for _ in 0..STEPS {
            d.step().await?;
        }
        Ok::<_, handoff_engine::EngineError>(())
    });
    for r in futures::future::join_all(runs).await {
        r?;
    }
    Ok((streams * STEPS) as f64 / t.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/handoff/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let rounds: usize = args.next().map_or(Ok(5), |r| r.parse())?;
    let mut out = handoff_benches::record::Report::new("sampling");
    let e = SmolLm::load(&SmolConfig::new(&path))?;
    rate(&e, 1, &shapes()[0].1).await?; // warm-up
    for streams in [1, 4] {
        // rates[shape][round]
        let mut rates = vec![Vec::new(); shapes().len()];
        for round in 0..rounds {
            for (i, (_, s)) in shapes().iter().enumerate() {
                let s = Sampling { seed: 1 + round as u64, ..*s };
                rates[i].push(rate(&e, streams, &s).await?);
            }
        }
        writeln!(
            out,
            "\n{streams} stream(s), {STEPS} tokens each, {rounds} rounds\n\n| sampling | tok/s (median) | min | max | / greedy (median of rounds) | us per token over greedy |\n|---|---:|---:|---:|---:|---:|"
        )?;
        let greedy = rates[0].clone();
        for (i, (name, _)) in shapes().iter().enumerate() {
            let r = &rates[i];
            let ratio = median(r.iter().zip(&greedy).map(|(a, g)| a / g).collect());
            let over = median(r.iter().zip(&greedy).map(|(a, g)| 1e6 / a - 1e6 / g).collect());
            let lo = r.iter().copied().fold(f64::MAX, f64::min);
            let hi = r.iter().copied().fold(0.0, f64::max);
            writeln!(
                out,
                "| {name} | {:.1} | {lo:.1} | {hi:.1} | {ratio:.3} | {over:.0} |",
                median(r.clone())
            )?;
        }
    }
    out.finish()?;
    Ok(())
}
