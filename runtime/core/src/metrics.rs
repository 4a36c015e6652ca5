//! Prometheus metrics: a [`Registry`] of counters, gauges and histograms (plain or with
//! labels), rendered in the text exposition format. Updates are lock-free atomics; labelled
//! families take a read lock to find their series and are bounded ([`MAX_SERIES`]): label
//! values beyond the bound share one `"_other"` series instead of growing the table.

use std::collections::BTreeMap;

use key::{Key, Probe, Values};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Whether metrics are recorded (on unless switched off, as the overhead bench does).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Switches recording on or off for the whole process (off: updates and label lookups do
/// nothing). For measuring what the metrics cost; the process serves them either way.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Relaxed);
}

/// Whether metrics are recorded.
pub fn enabled() -> bool {
    ENABLED.load(Relaxed)
}

/// Series a labelled family holds before new label values share `"_other"`: a fleet of a
/// thousand instances, each with eight outcomes, fits (at 1,024, the scheduler's per-instance
/// outcomes covered 128 instances).
pub const MAX_SERIES: usize = 16_384;

/// Bucket bounds in seconds for request-path latencies: 100 µs to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// Bucket bounds in bytes for transfer sizes: 4 KiB to 1 GiB.
pub const BYTE_BUCKETS: &[f64] = &[
    4096.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
];

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        if enabled() {
            self.0.fetch_add(n, Relaxed);
        }
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A count kept elsewhere and copied in at scrape time: rendered as a counter.
#[derive(Debug, Default)]
pub struct Tally(AtomicU64);

impl Tally {
    /// Sets the count (it only ever grows where it is kept).
    pub fn set(&self, n: u64) {
        self.0.store(n, Relaxed);
    }

    /// Adds `n` to the count: a family set afresh at each scrape (cleared first) adds
    /// rather than sets, so label values sharing `"_other"` are summed there, not each
    /// overwriting the last.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }

    /// The count.
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A value that goes up and down (stored as f64 bits).
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// Sets the value.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }

    /// Adds `v` (see [`Tally::add`]).
    pub fn add(&self, v: f64) {
        let _ = self.0.fetch_update(Relaxed, Relaxed, |b| Some((f64::from_bits(b) + v).to_bits()));
    }

    /// The value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// A value counted up and down by whole steps (requests in flight, queue depth).
#[derive(Debug, Default)]
pub struct Level(AtomicI64);

impl Level {
    /// One more.
    pub fn inc(&self) {
        self.0.fetch_add(1, Relaxed);
    }

    /// One fewer.
    pub fn dec(&self) {
        self.0.fetch_sub(1, Relaxed);
    }

    /// The value.
    pub fn get(&self) -> i64 {
        self.0.load(Relaxed)
    }
}

/// Observations counted into fixed buckets, with their count and sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last is +Inf.
    counts: Box<[AtomicU64]>,
    /// The sum, as f64 bits.
    sum: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending upper bounds; +Inf is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Counts `v`.
    pub fn observe(&self, v: f64) {
        if !enabled() {
            return;
        }
        let v = if v.is_finite() { v } else { 0.0 };
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i].fetch_add(1, Relaxed);
        let mut old = self.sum.load(Relaxed);
        loop {
            let new = (f64::from_bits(old) + v).to_bits();
            match self.sum.compare_exchange_weak(old, new, Relaxed, Relaxed) {
                Ok(_) => break,
                Err(now) => old = now,
            }
        }
    }

    /// Counts a duration, in seconds.
    pub fn observe_duration(&self, d: Duration) {
        self.observe(d.as_secs_f64());
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// Their sum.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Relaxed))
    }
}

/// What a family of series renders.
trait Series: Send + Sync {
    const KIND: &'static str;
    /// Writes the series' lines; `labels` is `k="v",...` without braces (may be empty).
    fn write(&self, name: &str, labels: &str, out: &mut String);
}

/// A sample value as the text format spells it (`+Inf`, `-Inf`, `NaN`).
fn value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        v.to_string()
    }
}

fn braces(labels: &str) -> String {
    if labels.is_empty() { String::new() } else { format!("{{{labels}}}") }
}

impl Series for Counter {
    const KIND: &'static str = "counter";
    fn write(&self, name: &str, labels: &str, out: &mut String) {
        let _ = writeln!(out, "{name}{} {}", braces(labels), self.get());
    }
}

impl Series for Tally {
    const KIND: &'static str = "counter";
    fn write(&self, name: &str, labels: &str, out: &mut String) {
        let _ = writeln!(out, "{name}{} {}", braces(labels), self.get());
    }
}

impl Series for Gauge {
    const KIND: &'static str = "gauge";
    fn write(&self, name: &str, labels: &str, out: &mut String) {
        let _ = writeln!(out, "{name}{} {}", braces(labels), value(self.get()));
    }
}

impl Series for Level {
    const KIND: &'static str = "gauge";
    fn write(&self, name: &str, labels: &str, out: &mut String) {
        let _ = writeln!(out, "{name}{} {}", braces(labels), self.get());
    }
}

impl Series for Histogram {
    const KIND: &'static str = "histogram";
    fn write(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{} {}", braces(labels), value(self.sum()));
        let _ = writeln!(out, "{name}_count{} {cumulative}", braces(labels));
    }
}

/// Series of one metric told apart by label values, bounded by [`MAX_SERIES`].
pub struct Family<M> {
    labels: &'static [&'static str],
    make: Box<dyn Fn() -> M + Send + Sync>,
    series: RwLock<BTreeMap<Key, Arc<M>>>,
    /// Handed out while recording is off (never rendered).
    unrecorded: Arc<M>,
}

impl<M> std::fmt::Debug for Family<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family").field("labels", &self.labels).finish_non_exhaustive()
    }
}

impl<M: Send + Sync> Family<M> {
    fn new(labels: &'static [&'static str], make: impl Fn() -> M + Send + Sync + 'static) -> Self {
        Family {
            labels,
            unrecorded: Arc::new(make()),
            make: Box::new(make),
            series: RwLock::default(),
        }
    }

    /// The series for `values` (one per label name, in order), made on first use.
    pub fn with(&self, values: &[&str]) -> Arc<M> {
        debug_assert_eq!(values.len(), self.labels.len(), "one value per label");
        if !enabled() {
            return self.unrecorded.clone();
        }
        // Found without allocating: the hot path of every series after its first use.
        let probe = Probe(values);
        let probe: &dyn Values = &probe;
        if let Some(m) = self.series.read().unwrap_or_else(|e| e.into_inner()).get(probe) {
            return m.clone();
        }
        let mut map = self.series.write().unwrap_or_else(|e| e.into_inner());
        let mut key = Key::of(values);
        if map.len() >= MAX_SERIES && !map.contains_key(probe) {
            key = Key(vec!["_other".to_owned(); self.labels.len()]);
        }
        map.entry(key).or_insert_with(|| Arc::new((self.make)())).clone()
    }

    /// Drops the series for `values` (an instance that left).
    pub fn remove(&self, values: &[&str]) {
        let probe = Probe(values);
        self.series.write().unwrap_or_else(|e| e.into_inner()).remove(&probe as &dyn Values);
    }

    /// Drops every series (before setting gauges afresh from current state).
    pub fn clear(&self) {
        self.series.write().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Escapes a label value for the text format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

trait Rendered: Send + Sync {
    fn render(&self, name: &str, help: &str, out: &mut String);
}

struct FamilyOf<M>(Arc<Family<M>>);

impl<M: Series> Rendered for FamilyOf<M> {
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {}", M::KIND);
        let map = self.0.series.read().unwrap_or_else(|e| e.into_inner());
        for (values, m) in map.iter() {
            let labels: Vec<String> = self
                .0
                .labels
                .iter()
                .zip(&values.0)
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            m.write(name, &labels.join(","), out);
        }
    }
}

struct Entry {
    name: String,
    help: String,
    metric: Box<dyn Rendered>,
}

/// The metrics of one process, rendered at `/metrics`. Names are given once each.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<Vec<Entry>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.entries.lock().map_or(0, |e| e.len());
        f.debug_struct("Registry").field("metrics", &n).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Registry::default())
    }

    fn add(&self, name: &str, help: &str, metric: Box<dyn Rendered>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        debug_assert!(entries.iter().all(|e| e.name != name), "metric {name} registered twice");
        entries.push(Entry { name: name.to_owned(), help: help.to_owned(), metric });
    }

    /// A new counter named `name`.
    pub fn counter(&self, name: &str, help: &str) -> Arc<Counter> {
        let c = Arc::new(Counter::default());
        self.add(name, help, Box::new(SharedSeries(c.clone())));
        c
    }

    /// A new gauge named `name`.
    pub fn gauge(&self, name: &str, help: &str) -> Arc<Gauge> {
        let g = Arc::new(Gauge::default());
        self.add(name, help, Box::new(SharedSeries(g.clone())));
        g
    }

    /// A new level (an integer gauge moved by steps) named `name`.
    pub fn level(&self, name: &str, help: &str) -> Arc<Level> {
        let l = Arc::new(Level::default());
        self.add(name, help, Box::new(SharedSeries(l.clone())));
        l
    }

    /// A new histogram named `name` over `bounds`.
    pub fn histogram(&self, name: &str, help: &str, bounds: &'static [f64]) -> Arc<Histogram> {
        let h = Arc::new(Histogram::new(bounds));
        self.add(name, help, Box::new(SharedSeries(h.clone())));
        h
    }

    /// A new counter family named `name` with `labels`.
    pub fn counters(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Counter>> {
        let f = Arc::new(Family::new(labels, Counter::default));
        self.add(name, help, Box::new(FamilyOf(f.clone())));
        f
    }

    /// A new gauge family named `name` with `labels`.
    pub fn gauges(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Gauge>> {
        let f = Arc::new(Family::new(labels, Gauge::default));
        self.add(name, help, Box::new(FamilyOf(f.clone())));
        f
    }

    /// A new family of counts kept elsewhere ([`Tally`]) named `name` with `labels`.
    pub fn tallies(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
    ) -> Arc<Family<Tally>> {
        let f = Arc::new(Family::new(labels, Tally::default));
        self.add(name, help, Box::new(FamilyOf(f.clone())));
        f
    }

    /// A new histogram family named `name` with `labels`, over `bounds`.
    pub fn histograms(
        &self,
        name: &str,
        help: &str,
        labels: &'static [&'static str],
        bounds: &'static [f64],
    ) -> Arc<Family<Histogram>> {
        let f = Arc::new(Family::new(labels, move || Histogram::new(bounds)));
        self.add(name, help, Box::new(FamilyOf(f.clone())));
        f
    }

    /// Every metric in the text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::with_capacity(entries.len() * 128);
        for e in entries.iter() {
            e.metric.render(&e.name, &e.help, &mut out);
        }
        out
    }
}

struct SharedSeries<M>(Arc<M>);

impl<M: Series> Rendered for SharedSeries<M> {
    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {}", M::KIND);
        self.0.write(name, "", out);
    }
}

mod key;

#[cfg(test)]
mod tests;
