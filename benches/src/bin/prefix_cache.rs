//! The prefill's prefix cache on its own: the time of `PrefixCache::store` per prompt and of
//! a hit's `lookup`, next to the copy a store used to make (every new page copied into its
//! own allocation, timed on the same KV in the same loop). Two KV shapes (the mock's 1 KiB a
//! token, which the overhead bench moves, and SmolLM2's 45 KiB), three prompt mixes (every
//! prompt new; a quarter new behind one of 8 shared system prompts; every prompt new and of
//! a length between a quarter of the prompt and twice it), two budgets (64 prompts' KV, and
//! 64.3: a budget that is not a whole number of prompts makes stores cut buffers), so that
//! stores evict once it is full, and 3 seeds each. "store / page copies" is not new against
//! old: the store's side also frees what it lets go and keeps its books; build this bench
//! against an older cache for that.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin prefix_cache
//! cargo run --release -p handoff-benches --bin prefix_cache -- --tokens 1024 --prompts 2000
//! ```

use std::io::Write;
use std::time::{Duration, Instant};

// The allocator the prefill runs on (declared in the `handoff` library): the cache's cost is
// mostly allocating, copying and freeing buffers.
use handoff as _;
use handoff_benches::parse_flags;
use handoff_benches::path::{pct, us};
use handoff_core::block_hashes;
use handoff_engine::{Kv, KvShape};
use handoff_prefill::PrefixCache;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PAGE: usize = 16;
/// The budgets, in tenths of a prompt's KV.
const BUDGETS: [usize; 2] = [640, 643];
const SYSTEMS: usize = 8;
/// A hit is on the prompt stored this many prompts before.
const HIT_BACK: usize = 8;

struct Args {
    tokens: usize,
    prompts: usize,
}

#[derive(Clone, Copy)]
enum Mix {
    /// Every prompt new.
    Distinct,
    /// One of [`SYSTEMS`] system prompts (three quarters of the prompt), then a new quarter.
    Shared,
    /// Every prompt new, of a length between a quarter of the prompt and twice it: stores
    /// cut buffers at their half mark, and their survivors are copied.
    Mixed,
}

/// One shape's timings, each sorted.
struct Timed {
    store: Vec<Duration>,
    page_copies: Vec<Duration>,
    lookup: Vec<Duration>,
    held: usize,
}

fn prompt(rng: &mut StdRng, mix: Mix, systems: &[Vec<u32>], tokens: usize) -> Vec<u32> {
    let mut p = match mix {
        Mix::Distinct | Mix::Mixed => Vec::new(),
        Mix::Shared => systems[rng.random_range(0..systems.len())].clone(),
    };
    let len = match mix {
        Mix::Mixed => rng.random_range(tokens / 4..=tokens * 2),
        Mix::Distinct | Mix::Shared => tokens,
    };
    while p.len() < len {
        p.push(rng.random_range(0..50_000));
    }
    p
}

fn run(shape: KvShape, mix: Mix, budget: usize, a: &Args, seed: u64) -> anyhow::Result<Timed> {
    let whole = shape.token_bytes() * a.tokens;
    let mut cache = PrefixCache::new(whole * budget / 10, PAGE);
    let mut rng = StdRng::seed_from_u64(seed);
    let systems: Vec<Vec<u32>> = (0..SYSTEMS)
        .map(|_| (0..a.tokens * 3 / 4).map(|_| rng.random_range(0..50_000)).collect())
        .collect();
    // The bytes do not matter to the cache; fresh buffers each time, as an engine's are.
    let bytes: Vec<u8> = (0..2 * whole).map(|i| i as u8).collect();
    let mut earlier = std::collections::VecDeque::new();
    let mut t = Timed { store: vec![], page_copies: vec![], lookup: vec![], held: 0 };
    for _ in 0..a.prompts {
        let p = prompt(&mut rng, mix, &systems, a.tokens);
        let hashes = block_hashes(&p, PAGE);
        let kv = Kv::from_bytes(shape, p.len(), bytes[..shape.token_bytes() * p.len()].to_vec())?;
        let same = kv.clone();
        let started = Instant::now();
        let delta = cache.store(&p, &hashes, kv);
        t.store.push(started.elapsed());
        // What the store used to copy: each page it stored, into an allocation of its own.
        let stored: Vec<usize> =
            (0..hashes.len()).filter(|i| delta.stored.contains(&hashes[*i])).collect();
        let started = Instant::now();
        let pages: Vec<Kv> =
            stored.iter().map(|i| same.slice_tokens(i * PAGE..(i + 1) * PAGE)).collect();
        t.page_copies.push(started.elapsed());
        drop(pages);
        // A hit on a prompt stored a few prompts ago, as a later request's would be: its KV
        // no longer in the CPU's cache (stores since have gone through more than its caches).
        // Its full pages and one token more.
        let mut asked = p[..hashes.len() * PAGE].to_vec();
        asked.push(0);
        earlier.push_back((asked, hashes));
        if earlier.len() > HIT_BACK {
            let (asked, hashes) = earlier.pop_front().unwrap_or_default();
            let started = Instant::now();
            let hit = cache.lookup(&asked, &hashes);
            t.lookup.push(started.elapsed());
            anyhow::ensure!(hit.map(|k| k.tokens()) == Some(hashes.len() * PAGE), "a full hit");
        }
    }
    t.held = cache.used_bytes();
    for v in [&mut t.store, &mut t.page_copies, &mut t.lookup] {
        v.sort_unstable();
    }
    Ok(t)
}

/// One row of the table: `label`'s cells, then `t`'s.
fn row(out: &mut impl Write, label: &str, t: &Timed) -> anyhow::Result<()> {
    let (s50, c50) = (us(pct(&t.store, 0.5)), us(pct(&t.page_copies, 0.5)));
    writeln!(
        out,
        "| {label} | {s50:.1} | {:.1} | {c50:.1} | {:.1} | {:.2} | {:.1} | {:.1} |",
        us(pct(&t.store, 0.99)),
        us(pct(&t.page_copies, 0.99)),
        s50 / c50,
        us(pct(&t.lookup, 0.5)),
        t.held as f64 / (1 << 20) as f64,
    )?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut a = Args { tokens: 256, prompts: 1000 };
    parse_flags(|flag, val| {
        match flag {
            "--tokens" => a.tokens = val.parse()?,
            "--prompts" => a.prompts = val.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
        Ok(())
    })?;
    anyhow::ensure!(a.tokens >= 4 * PAGE, "at least {} tokens: the new quarter a page", 4 * PAGE);
    anyhow::ensure!(a.prompts > 2 * BUDGETS[1] / 10, "too few prompts: stores would not evict");
    let shapes = [
        ("mock, 1 KiB/token", KvShape { layers: 4, kv_heads: 4, head_bytes: 32 }),
        ("SmolLM2, 45 KiB/token", KvShape { layers: 30, kv_heads: 3, head_bytes: 256 }),
    ];
    let mut out = handoff_benches::record::Report::new("prefix_cache");
    out.note("seeds", serde_json::json!([1, 2, 3]));
    writeln!(
        out,
        "{} prompts of {} tokens, pages of {PAGE} tokens; \"page copies\" is what a store used \
         to copy (each stored page into its own allocation), timed on the same KV in the same \
         loop; a hit is on the prompt stored {HIT_BACK} prompts before",
        a.prompts, a.tokens
    )?;
    writeln!(
        out,
        "| KV | mix | budget (prompts) | seed | store p50 (us) | store p99 (us) | page copies p50 (us) | page copies p99 (us) | store / page copies (p50) | hit p50 (us) | held (MiB) |"
    )?;
    writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let mixes = [
        ("all new", Mix::Distinct),
        ("a quarter new", Mix::Shared),
        ("all new, mixed lengths", Mix::Mixed),
    ];
    for (name, shape) in shapes {
        for (mix_name, mix) in mixes {
            for budget in BUDGETS {
                for seed in 1..=3 {
                    let t = run(shape, mix, budget, &a, seed)?;
                    let label =
                        format!("{name} | {mix_name} | {:.1} | {seed}", budget as f64 / 10.0);
                    row(&mut out, &label, &t)?;
                }
            }
        }
    }
    out.finish()?;
    Ok(())
}
