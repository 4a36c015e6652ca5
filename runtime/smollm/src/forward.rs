//! The forward pass, with our own KV cache and attention.
//!
//! Every step is row-local or computed one query row at a time: RMSNorm and RoPE per row,
//! the projections through candle's Q8_0 matmul (which quantizes and dots each input row on
//! its own), attention per (row, head) over exactly the keys at or before the row's position
//! with a fixed summation order. So a row's result does not depend on how many other rows
//! share its pass: a cached prefix plus a computed suffix gives the same KV and logits as a
//! one-shot prefill, and decode steps batched across sequences equal steps run alone.

use std::ops::ControlFlow;

use handoff_engine::{Kv, KvShape};
use rayon::prelude::*;

use crate::SmolError;
use crate::weights::{Hyper, Weights};

/// One sequence's KV: per (layer, KV head) a `[token][head_dim]` run of keys and one of
/// values. Imported KV (a decode's, or a prefill's cached prefix) is read where it arrived:
/// its runs are the canonical layout's, this machine's own f32s, so each run's imported
/// tokens are a view of `base`, and only the tokens computed here are appended to owned
/// runs. Not `Clone`: a sequence's computed runs are its own, and nothing needs two.
#[derive(Debug)]
pub(crate) struct Seq {
    pub(crate) len: usize,
    /// The imported KV, if any (its runs checked to read as f32s).
    base: Option<Kv>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Seq {
    pub(crate) fn new(hp: &Hyper) -> Self {
        let n = hp.layers * hp.kv_heads;
        Seq { len: 0, base: None, k: vec![Vec::new(); n], v: vec![Vec::new(); n] }
    }

    pub(crate) fn shape(hp: &Hyper) -> KvShape {
        KvShape { layers: hp.layers, kv_heads: hp.kv_heads, head_bytes: hp.head_dim * 4 }
    }

    /// Imports KV in the canonical layout (f32, little-endian) without copying it. The
    /// canonical layout's little-endian f32s are this machine's own (the crate builds only
    /// where they are); only bytes that do not start on a 4-byte boundary, which no
    /// allocator here hands out, are copied into runs of their own.
    pub(crate) fn from_kv(hp: &Hyper, kv: Kv) -> Result<Self, SmolError> {
        if kv.shape() != Self::shape(hp) {
            return Err(SmolError::Shape(format!(
                "KV of shape {:?}, model needs {:?}",
                kv.shape(),
                Self::shape(hp)
            )));
        }
        let mut s = Seq::new(hp);
        s.len = kv.tokens();
        if kv.layers().iter().all(|l| bytemuck::try_cast_slice::<u8, f32>(l).is_ok()) {
            s.base = Some(kv);
            return Ok(s);
        }
        let floats = bytemuck::pod_collect_to_vec::<u8, f32>;
        for l in 0..hp.layers {
            for h in 0..hp.kv_heads {
                s.k[l * hp.kv_heads + h] = floats(kv.run(l, 0, h));
                s.v[l * hp.kv_heads + h] = floats(kv.run(l, 1, h));
            }
        }
        Ok(s)
    }

    /// The imported part of run `kind` (0: keys, 1: values) of (layer `l`, KV head `h`):
    /// empty without an import.
    fn base_run(&self, l: usize, kind: usize, h: usize) -> &[f32] {
        // Checked to read as f32s when imported (`from_kv`), and never changed since.
        self.base.as_ref().map_or(&[], |kv| bytemuck::cast_slice(kv.run(l, kind, h)))
    }

    /// Keys and values of (layer `l`, KV head `h`), each as its imported part and the part
    /// computed here, in token order.
    fn runs(&self, l: usize, h: usize, kv_heads: usize) -> [(&[f32], &[f32]); 2] {
        let c = l * kv_heads + h;
        [(self.base_run(l, 0, h), &self.k[c]), (self.base_run(l, 1, h), &self.v[c])]
    }

    /// Layer `l`'s K and V in the canonical layout (`Kv::layer`) in a buffer of its own: every
    /// token this sequence holds for that layer, each run's f32s appended as their bytes (the
    /// buffer is never zeroed first).
    pub(crate) fn layer_kv(&self, hp: &Hyper, l: usize) -> Vec<u8> {
        // During a forward pass `len` still counts the tokens before it: the runs say how
        // many the layer holds.
        let runs = || {
            (0..2).flat_map(move |kind| {
                (0..hp.kv_heads).map(move |h| self.runs(l, h, hp.kv_heads)[kind])
            })
        };
        let floats: usize =
            runs().map(|(imported, computed)| imported.len() + computed.len()).sum();
        let mut out = Vec::with_capacity(floats * size_of::<f32>());
        for (imported, computed) in runs() {
            out.extend_from_slice(bytemuck::cast_slice(imported));
            out.extend_from_slice(bytemuck::cast_slice(computed));
        }
        out
    }
}

/// The token rows (`hd` floats each) of a run held as its imported and its computed part.
fn token_rows<'a>(
    (imported, computed): (&'a [f32], &'a [f32]),
    hd: usize,
) -> impl Iterator<Item = &'a [f32]> {
    imported.chunks_exact(hd).chain(computed.chunks_exact(hd))
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = dot(row, row) / w.len() as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(a, b)| a * scale * b));
    }
    out
}

/// Rotates each `head_dim` chunk of `row` by position `pos` (interleaved pairs, as the GGUF
/// conversion of Llama weights expects).
fn rope(row: &mut [f32], head_dim: usize, pos: usize, table: &(Vec<f32>, Vec<f32>)) {
    let half = head_dim / 2;
    let (cos, sin) =
        (&table.0[pos * half..(pos + 1) * half], &table.1[pos * half..(pos + 1) * half]);
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = a * cos[i] - b * sin[i];
            head[2 * i + 1] = a * sin[i] + b * cos[i];
        }
    }
}

/// Positions attended over, summed over a pass's rows, from which the rows are shared out
/// on the compute pool: below it, handing them over costs more than it saves (a decode
/// step's few rows of a short context).
pub(crate) const PARALLEL_ATTENTION_FROM: usize = 4096;

/// Runs `rows` (sequence index, token) through the model: rows of one sequence must be
/// consecutive and in order, and are appended at its end. Returns the logits of the rows
/// listed in `logits_for` (indices into `rows`), in that order. `layer_done(l, seqs[0])` runs
/// as soon as layer `l`'s KV is appended, before its attention: a prefill streams its layers
/// from there, and stops the pass ([`SmolError::Cancelled`]) by breaking.
pub(crate) fn forward(
    w: &Weights,
    seqs: &mut [&mut Seq],
    rows: &[(usize, u32)],
    logits_for: &[usize],
    layer_done: &mut dyn FnMut(usize, &Seq) -> ControlFlow<()>,
) -> Result<Vec<Vec<f32>>, SmolError> {
    let hp = &w.hp;
    let (n, dim, hd) = (rows.len(), hp.dim, hp.head_dim);
    let kv_dim = hp.kv_dim();
    let qkv_width = dim + 2 * kv_dim;
    let group = hp.heads / hp.kv_heads;
    // Positions: each sequence continues from its current length.
    let mut next: Vec<usize> = seqs.iter().map(|s| s.len).collect();
    let mut pos = Vec::with_capacity(n);
    for &(si, tok) in rows {
        if tok as usize >= hp.vocab {
            return Err(SmolError::Input(format!(
                "token {tok} outside the vocabulary of {}",
                hp.vocab
            )));
        }
        if next[si] >= hp.context {
            return Err(SmolError::Input(format!(
                "position {} beyond the context of {}",
                next[si], hp.context
            )));
        }
        pos.push(next[si]);
        next[si] += 1;
    }
    let mut x = Vec::with_capacity(n * dim);
    for &(_, tok) in rows {
        x.extend_from_slice(&w.embed[tok as usize * dim..(tok as usize + 1) * dim]);
    }
    let scale = 1.0 / (hd as f32).sqrt();
    for (li, layer) in w.layers.iter().enumerate() {
        let h = rms_norm(&x, &layer.attn_norm, hp.eps);
        // Each row: its query, then its key, then its value.
        let mut qkv = layer.wqkv.apply(&h, n)?;
        for (r, row) in qkv.chunks_exact_mut(qkv_width).enumerate() {
            let (q, kv) = row.split_at_mut(dim);
            let (k, v) = kv.split_at_mut(kv_dim);
            rope(q, hd, pos[r], &w.rope);
            rope(k, hd, pos[r], &w.rope);
            let seq = &mut seqs[rows[r].0];
            for kh in 0..hp.kv_heads {
                let c = li * hp.kv_heads + kh;
                seq.k[c].extend_from_slice(&k[kh * hd..(kh + 1) * hd]);
                seq.v[c].extend_from_slice(&v[kh * hd..(kh + 1) * hd]);
            }
        }
        if let Some(first) = seqs.first()
            && layer_done(li, first).is_break()
        {
            return Err(SmolError::Cancelled);
        }
        // Rows on the compute pool when there are enough positions to attend over, each
        // computed as alone (the same sums in the same order): the result does not depend on
        // how rows are shared out.
        let mut attn = vec![0f32; n * dim];
        let seqs_read: &[&mut Seq] = seqs;
        let row = |scores: &mut Vec<f32>, (r, out): (usize, &mut [f32])| {
            let seq = &seqs_read[rows[r].0];
            let upto = pos[r] + 1;
            for head in 0..hp.heads {
                let [keys, vals] = seq.runs(li, head / group, hp.kv_heads);
                let qh = &qkv[r * qkv_width + head * hd..r * qkv_width + (head + 1) * hd];
                scores.clear();
                scores.extend(token_rows(keys, hd).take(upto).map(|key| dot(qh, key) * scale));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let out = &mut out[head * hd..(head + 1) * hd];
                for (p, value) in scores.iter().zip(token_rows(vals, hd)) {
                    let p = p / sum;
                    for (o, vv) in out.iter_mut().zip(value) {
                        *o += p * vv;
                    }
                }
            }
        };
        if pos.iter().map(|p| p + 1).sum::<usize>() >= PARALLEL_ATTENTION_FROM {
            attn.par_chunks_mut(dim).enumerate().for_each_init(Vec::new, row);
        } else {
            let mut scores = Vec::new();
            attn.chunks_mut(dim).enumerate().for_each(|r| row(&mut scores, r));
        }
        let o = layer.wo.apply(&attn, n)?;
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h2 = rms_norm(&x, &layer.ffn_norm, hp.eps);
        // Each row: its gate, then its up projection.
        let gate_up = layer.w_gate_up.apply(&h2, n)?;
        let ffn = gate_up.len() / n / 2;
        let mut a = Vec::with_capacity(n * ffn);
        for row in gate_up.chunks_exact(2 * ffn) {
            let (g, u) = row.split_at(ffn);
            a.extend(g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u));
        }
        let d = layer.w_down.apply(&a, n)?;
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
    }
    for (si, s) in seqs.iter_mut().enumerate() {
        s.len = next[si];
    }
    if logits_for.is_empty() {
        return Ok(Vec::new());
    }
    let mut last = Vec::with_capacity(logits_for.len() * dim);
    for &r in logits_for {
        last.extend_from_slice(&x[r * dim..(r + 1) * dim]);
    }
    let normed = rms_norm(&last, &w.out_norm, hp.eps);
    let logits = w.lm_head.apply(&normed, logits_for.len())?;
    Ok(logits.chunks_exact(hp.vocab).map(<[f32]>::to_vec).collect())
}

#[cfg(test)]
mod tests;
