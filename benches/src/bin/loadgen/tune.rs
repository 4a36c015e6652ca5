//! `--tune W1,W2,..`: kv_aware's load weight chosen on the chat shape, on seeds of its own
//! (1000 and up, never the evaluation's 42 and up): of the weights with the fewest failed
//! requests, the one with the lowest mean TTFT p50 (a weight that fails requests does not
//! win by their absence).
//! The run then reports every policy with that weight on the chat shape and on the eviction
//! shape, which the choice never saw.

use std::time::Duration;

use handoff_proto::v1::Policy;

use crate::table::{Summary, row_of};
use crate::{Args, Shape, run_policy};

/// First seed of the tuning runs.
const TUNING_SEED: u64 = 1000;

/// The weight chosen among `weights`, and the lines that show the choice.
pub(crate) async fn tune(a: &Args, weights: &[f64]) -> anyhow::Result<(f64, Vec<String>)> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut lines = vec![
        format!(
            "kv_aware's load weight, chosen on the chat shape (seeds {TUNING_SEED}..{}), by mean TTFT p50:\n",
            TUNING_SEED + a.seeds - 1
        ),
        "| load weight | hit rate % | TTFT p50 (ms) | p50 min | p50 max | TTFT p95 (ms) | requests | errors |".into(),
        "|---:|---:|---:|---:|---:|---:|---:|---:|".into(),
    ];
    let mut best = ((usize::MAX, f64::INFINITY), weights[0]);
    for &w in weights {
        let mut args = Shape::Chat.apply(a);
        args.load_weight = w;
        let mut runs = Vec::new();
        for k in 0..a.seeds {
            runs.push(row_of(run_policy(&args, Policy::KvAware, TUNING_SEED + k).await?));
        }
        let s = Summary { policy: "kv_aware", runs };
        let p50 = s.spread(|x| ms(x.ttft[0]));
        let requests: usize = s.runs.iter().map(|x| x.requests).sum();
        let errors: usize = s.runs.iter().map(|x| x.errors).sum();
        lines.push(format!(
            "| {w} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {requests} | {errors} |",
            s.spread(|x| x.hit * 100.0).0,
            p50.0,
            p50.1,
            p50.2,
            s.spread(|x| ms(x.ttft[1])).0
        ));
        // Nothing answered is no evidence for the weight.
        let score = if requests == 0 { (usize::MAX, f64::INFINITY) } else { (errors, p50.0) };
        if score.0 < best.0.0 || (score.0 == best.0.0 && score.1 < best.0.1) {
            best = (score, w);
        }
    }
    lines.push(format!(
        "\nchosen: load weight {} (the default is {}); below, every policy with it on the chat shape and on the eviction shape, which the choice never saw\n",
        best.1,
        handoff_scheduler::policy::KvAwareWeights::default().load
    ));
    Ok((best.1, lines))
}
