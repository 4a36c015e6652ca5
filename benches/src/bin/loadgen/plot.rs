//! The loadgen's plot: per policy, TTFT p50 as a bar (left axis), the prefix cache hit rate
//! as a dot with its spread over the seeds, and the hit rate's ceiling as a dash (right axis).

use std::fmt::Write as _;

use super::Summary;

pub(crate) fn svg(rows: &[Summary]) -> String {
    let (w, h, pad) = (720.0, 360.0, 60.0);
    let p50 = |r: &Summary| r.spread(|x| x.ttft[0].as_secs_f64()).0;
    let max_ttft = rows.iter().map(p50).fold(0.0, f64::max).max(1e-3);
    let bw = (w - 2.0 * pad) / rows.len().max(1) as f64;
    // Height of a hit rate (0..=1) on the right axis.
    let y = |rate: f64| h - pad - (h - 2.0 * pad) * rate;
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\n"
    );
    let _ = writeln!(
        s,
        "<text x='{pad}' y='20'>TTFT p50 (bars, left axis); hit rate (dots: mean, whiskers: min to max over seeds) and its ceiling (dashes), right axis</text>"
    );
    for (i, r) in rows.iter().enumerate() {
        let x = pad + i as f64 * bw;
        let mid = x + bw / 2.0;
        let bh = (h - 2.0 * pad) * p50(r) / max_ttft;
        let _ = writeln!(
            s,
            "<rect x='{:.1}' y='{:.1}' width='{:.1}' height='{bh:.1}' fill='#4a7bd0'/>",
            x + bw * 0.2,
            h - pad - bh,
            bw * 0.6
        );
        let _ = writeln!(
            s,
            "<text x='{mid:.1}' y='{:.1}' text-anchor='middle'>{:.0} ms</text>",
            h - pad - bh - 4.0,
            p50(r) * 1e3
        );
        let (hit, lo, hi) = r.spread(|x| x.hit);
        let _ = writeln!(
            s,
            "<line x1='{mid:.1}' y1='{:.1}' x2='{mid:.1}' y2='{:.1}' stroke='#d0504a'/>",
            y(lo),
            y(hi)
        );
        let _ = writeln!(
            s,
            "<circle cx='{mid:.1}' cy='{:.1}' r='5' fill='#d0504a'/><text x='{:.1}' y='{:.1}' fill='#d0504a'>{:.0} %</text>",
            y(hit),
            mid + 8.0,
            y(hit) + 4.0,
            hit * 100.0
        );
        let ceiling = r.spread(|x| x.ceiling).0;
        let _ = writeln!(
            s,
            "<line x1='{:.1}' y1='{c:.1}' x2='{:.1}' y2='{c:.1}' stroke='black' stroke-width='2' stroke-dasharray='4 3'/>",
            x + bw * 0.15,
            x + bw * 0.85,
            c = y(ceiling)
        );
        let _ = writeln!(
            s,
            "<text x='{mid:.1}' y='{:.1}' text-anchor='middle'>{}</text>",
            h - pad + 18.0,
            r.policy
        );
    }
    let _ = writeln!(
        s,
        "<line x1='{pad}' y1='{}' x2='{}' y2='{}' stroke='black'/>",
        h - pad,
        w - pad,
        h - pad
    );
    s.push_str("</svg>\n");
    s
}
