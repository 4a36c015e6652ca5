//! [`Report`]: a bench's output, printed as it always was and also kept as a JSON record
//! beside it: the bench, the git commit (and whether the tree had changes), the command line
//! and anything the bench adds (seeds, shapes), the machine, the time, and every Markdown
//! table it printed, each row an object keyed by the table's header (numbers as numbers).
//!
//! Records go to `$HANDOFF_BENCH_RECORDS` if set, else `target/bench-records/`, as
//! `<bench>-<unix seconds>-<pid>.json`; the path is printed on stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

/// A table as printed: its header, then its rows.
#[derive(Debug, Default)]
struct Table {
    header: Vec<String>,
    rows: Vec<Value>,
}

/// See the module docs. Write to it as to stdout; call [`Report::finish`] at the end.
#[derive(Debug)]
pub struct Report {
    bench: String,
    /// The commit and whether the tree had changes, when the bench started.
    git: (String, bool),
    started: SystemTime,
    clock: Instant,
    extra: Map<String, Value>,
    lines: Vec<String>,
    tables: Vec<Table>,
    /// Whether the last line printed was part of the last table.
    in_table: bool,
    pending: Vec<u8>,
}

impl Report {
    /// A report for bench `bench`.
    pub fn new(bench: &str) -> Self {
        Report {
            bench: bench.to_owned(),
            git: git(),
            started: SystemTime::now(),
            clock: Instant::now(),
            extra: Map::new(),
            lines: Vec::new(),
            tables: Vec::new(),
            in_table: false,
            pending: Vec::new(),
        }
    }

    /// Records `value` under `key` (seeds, shapes, settings the command line does not show).
    pub fn note(&mut self, key: &str, value: Value) {
        self.extra.insert(key.to_owned(), value);
    }

    fn line(&mut self, line: &str) {
        let cells = cells(line);
        match cells {
            Some(cells) if cells.iter().all(|c| c.chars().all(|ch| "-: ".contains(ch))) => {}
            Some(cells) if self.in_table => {
                let Some(table) = self.tables.last_mut() else { return };
                let row: Map<String, Value> =
                    table.header.iter().cloned().zip(cells.into_iter().map(value)).collect();
                table.rows.push(Value::Object(row));
            }
            Some(cells) => {
                self.tables.push(Table { header: cells, rows: Vec::new() });
                self.in_table = true;
            }
            None => {
                self.in_table = false;
                if !line.trim().is_empty() {
                    self.lines.push(line.to_owned());
                }
            }
        }
    }

    /// The record, as written.
    pub fn record(&self) -> Value {
        let started = self.started.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let tables: Vec<Value> =
            self.tables.iter().map(|t| json!({ "header": t.header, "rows": t.rows })).collect();
        let (commit, dirty) = &self.git;
        json!({
            "bench": self.bench,
            "commit": commit,
            "dirty": dirty,
            "argv": std::env::args().skip(1).collect::<Vec<_>>(),
            "config": self.extra,
            "machine": machine(),
            "started_unix": started,
            "seconds": self.clock.elapsed().as_secs_f64(),
            "tables": tables,
            "lines": self.lines,
        })
    }

    /// Flushes the output and writes the record (see the module docs); returns its path.
    pub fn finish(self) -> anyhow::Result<PathBuf> {
        let dir = std::env::var_os("HANDOFF_BENCH_RECORDS").map_or_else(
            || {
                let benches = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
                benches.parent().unwrap_or(benches).join("target/bench-records")
            },
            PathBuf::from,
        );
        self.finish_in(&dir)
    }

    fn finish_in(mut self, dir: &std::path::Path) -> anyhow::Result<PathBuf> {
        if !self.pending.is_empty() {
            let rest = String::from_utf8_lossy(&std::mem::take(&mut self.pending)).into_owned();
            self.line(&rest);
        }
        std::io::stdout().flush()?;
        std::fs::create_dir_all(dir)?;
        let started = self.started.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let path = dir.join(format!("{}-{started}-{}.json", self.bench, std::process::id()));
        let mut file = std::fs::File::create_new(&path)?;
        file.write_all(&serde_json::to_vec_pretty(&self.record())?)?;
        eprintln!("record: {}", path.display());
        Ok(path)
    }
}

impl Write for Report {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stdout().write_all(buf)?;
        self.pending.extend_from_slice(buf);
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            self.line(String::from_utf8_lossy(&line).trim_end());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stdout().flush()
    }
}

/// A Markdown table row's cells, or `None` for any other line.
fn cells(line: &str) -> Option<Vec<String>> {
    let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(|c| c.trim().to_owned()).collect())
}

/// A cell as a number when it is one (thousands separators allowed), else as text.
fn value(cell: String) -> Value {
    let plain = cell.replace(',', "");
    match plain.parse::<f64>() {
        Ok(n) if n.is_finite() => json!(n),
        _ => Value::String(cell),
    }
}

/// The checkout's commit and whether it had changes; "unknown" outside a git checkout.
fn git() -> (String, bool) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let commit = run(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    (commit, dirty)
}

/// Cores, memory, CPU model and kernel of this machine.
fn machine() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let field = |text: &str, key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
    };
    json!({
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "memory": field(&read("/proc/meminfo"), "MemTotal"),
        "cpu": field(&read("/proc/cpuinfo"), "model name"),
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_become_rows_keyed_by_their_header_and_the_record_is_written() {
        let mut r = Report::new("unit");
        r.note("seeds", json!([1, 2, 3]));
        writeln!(r, "prompt 16 tokens").unwrap();
        writeln!(r, "| concurrency | p50 (us) | path |").unwrap();
        writeln!(r, "|---:|---:|---|").unwrap();
        writeln!(r, "| 1 | 543.5 | tcp |").unwrap();
        write!(r, "| 64 | 3,475 |").unwrap();
        writeln!(r, " nixl |").unwrap();
        writeln!(r).unwrap();
        writeln!(r, "| a | b |").unwrap();
        writeln!(r, "| x | 2 |").unwrap();
        let v = r.record();
        assert_eq!(v["bench"], "unit");
        assert_eq!(v["config"]["seeds"], json!([1, 2, 3]));
        assert_eq!(v["lines"], json!(["prompt 16 tokens"]));
        let t = &v["tables"][0];
        assert_eq!(t["header"], json!(["concurrency", "p50 (us)", "path"]));
        assert_eq!(t["rows"][0], json!({"concurrency": 1.0, "p50 (us)": 543.5, "path": "tcp"}));
        assert_eq!(t["rows"][1]["p50 (us)"], json!(3475.0));
        assert_eq!(v["tables"][1]["rows"][0], json!({"a": "x", "b": 2.0}));
        assert!(v["machine"]["cores"].as_u64().unwrap() >= 1);
        assert_ne!(v["commit"], "", "{v}");
        let dir = std::env::temp_dir().join(format!("records-{}", std::process::id()));
        let path = r.finish_in(&dir).unwrap();
        let written: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(written["tables"], v["tables"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
