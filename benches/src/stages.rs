//! [`Stages`]: where a frontend's requests spent their time, read from its `/metrics`
//! (`handoff_frontend_stage_seconds`, summed per stage), so a bench can say where the path's
//! latency goes between two moments.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The series read.
const SERIES: &str = "handoff_frontend_stage_seconds";

/// Seconds spent and times observed, per stage, since the frontend started.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stages(BTreeMap<String, (f64, u64)>);

impl Stages {
    /// Reads them from the frontend serving HTTP at `addr`.
    pub async fn read(addr: SocketAddr) -> anyhow::Result<Stages> {
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: frontend\r\n\r\n").await?;
        let mut text = String::new();
        conn.read_to_string(&mut text).await?;
        Ok(Stages::parse(&text))
    }

    /// Parses the text exposition format's `_sum` and `_count` lines of [`SERIES`].
    fn parse(text: &str) -> Stages {
        let mut stages = Stages::default();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(SERIES) else { continue };
            let Some((kind, rest)) = rest.split_once("{stage=\"") else { continue };
            let Some((stage, value)) = rest.split_once("\"}") else { continue };
            let Ok(value) = value.trim().parse::<f64>() else { continue };
            let entry = stages.0.entry(stage.to_owned()).or_default();
            match kind {
                "_sum" => entry.0 = value,
                "_count" => entry.1 = value as u64,
                _ => {}
            }
        }
        stages
    }

    /// Each stage's mean in microseconds between `before` and `self`, in path order
    /// (stages with nothing observed in between left out).
    pub fn mean_us_since(&self, before: &Stages) -> Vec<(String, f64)> {
        const ORDER: [&str; 7] = [
            "select",
            "resolve_topology",
            "resolve_rank",
            "register",
            "connect",
            "transfer",
            "consume",
        ];
        let rank = |s: &str| ORDER.iter().position(|o| *o == s).unwrap_or(ORDER.len());
        let mut means: Vec<(String, f64)> = self
            .0
            .iter()
            .filter_map(|(stage, &(sum, count))| {
                let (sum0, count0) = before.0.get(stage).copied().unwrap_or_default();
                let n = count.checked_sub(count0).filter(|n| *n > 0)?;
                Some((stage.clone(), (sum - sum0) / n as f64 * 1e6))
            })
            .collect();
        means.sort_by_key(|(s, _)| rank(s));
        means
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sums and counts of each stage are read, other series and bucket lines passed
    /// over, and means taken over what happened in between.
    #[test]
    fn stage_means_come_from_sums_and_counts() {
        let at = |sel: f64, n: u64| {
            Stages::parse(&format!(
                "# TYPE {SERIES} histogram\n\
                 {SERIES}_bucket{{stage=\"select\",le=\"0.001\"}} {n}\n\
                 {SERIES}_sum{{stage=\"select\"}} {sel}\n\
                 {SERIES}_count{{stage=\"select\"}} {n}\n\
                 {SERIES}_sum{{stage=\"connect\"}} 0.5\n\
                 {SERIES}_count{{stage=\"connect\"}} 10\n\
                 handoff_frontend_ttft_seconds_sum 9\n"
            ))
        };
        let (before, after) = (at(0.001, 10), at(0.003, 20));
        let means = after.mean_us_since(&before);
        // select: 2 ms over 10 more; connect: nothing new, left out.
        assert_eq!(means.len(), 1, "{means:?}");
        assert_eq!(means[0].0, "select");
        assert!((means[0].1 - 200.0).abs() < 1e-6, "{means:?}");
    }
}
