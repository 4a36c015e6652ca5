//! Loading a Llama-architecture GGUF: hyperparameters from its metadata, weights as Q8_0
//! matrices. candle has SIMD kernels for Q8_0 but not for the file's Q4_1, so every Q4_1
//! matrix is requantized to Q8_0 at load (Q4_0 would be as fast and visibly worse).

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor, gguf_file};
use candle_core::{Device, Module, Tensor};

use crate::SmolError;

/// Shapes and constants of the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Hyper {
    pub(crate) layers: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) dim: usize,
    /// Rows of the gate and up projections.
    pub(crate) ffn: usize,
    pub(crate) vocab: usize,
    pub(crate) context: usize,
    pub(crate) eps: f32,
    pub(crate) rope_base: f32,
}

impl Hyper {
    /// Width of a token's keys (and of its values) over all KV heads.
    pub(crate) fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A weight matrix applied as `x @ W^T`.
pub(crate) struct Matrix(QMatMul);

impl Matrix {
    /// `rows` rows of `x` (row-major, `k` wide) times this matrix.
    pub(crate) fn apply(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, SmolError> {
        let k = x.len() / rows;
        let t = Tensor::from_slice(x, (rows, k), &Device::Cpu)?;
        Ok(self.0.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// One layer's weights. The projections that read the same input are one matrix, their
/// rows one after another (a row of the output is the query's, then the key's, then the
/// value's; the gate's, then the up projection's): one pass over the input instead of
/// three or two, each output the same as its own matrix's, Q8_0 blocks lying within rows.
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wqkv: Matrix,
    pub(crate) wo: Matrix,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) w_gate_up: Matrix,
    pub(crate) w_down: Matrix,
}

pub(crate) struct Weights {
    pub(crate) hp: Hyper,
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) out_norm: Vec<f32>,
    pub(crate) lm_head: Matrix,
    /// cos and sin per (position, frequency), for positions below `hp.context`.
    pub(crate) rope: (Vec<f32>, Vec<f32>),
}

fn meta<'a>(c: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, SmolError> {
    c.metadata.get(key).ok_or_else(|| SmolError::Format(format!("missing metadata {key}")))
}

pub(crate) fn hyper(c: &gguf_file::Content, max_context: usize) -> Result<Hyper, SmolError> {
    let u = |k: &str| -> Result<usize, SmolError> { Ok(meta(c, k)?.to_u32()? as usize) };
    let arch = meta(c, "general.architecture")?.to_string()?;
    if arch != "llama" {
        return Err(SmolError::Format(format!("architecture {arch:?}, expected llama")));
    }
    let (dim, heads) = (u("llama.embedding_length")?, u("llama.attention.head_count")?);
    let kv_heads = u("llama.attention.head_count_kv")?;
    if heads == 0 || kv_heads == 0 || dim % heads != 0 || heads % kv_heads != 0 {
        return Err(SmolError::Format(format!(
            "{heads} heads / {kv_heads} KV heads over dim {dim}"
        )));
    }
    Ok(Hyper {
        layers: u("llama.block_count")?,
        heads,
        kv_heads,
        head_dim: dim / heads,
        dim,
        ffn: u("llama.feed_forward_length")?,
        vocab: meta(c, "tokenizer.ggml.tokens")?.to_vec()?.len(),
        context: u("llama.context_length")?.min(max_context),
        eps: meta(c, "llama.attention.layer_norm_rms_epsilon")?.to_f32()?,
        rope_base: meta(c, "llama.rope.freq_base")
            .and_then(|v| Ok(v.to_f32()?))
            .unwrap_or(10_000.0),
    })
}

struct Reader<'a> {
    content: &'a gguf_file::Content,
    file: BufReader<File>,
}

impl Reader<'_> {
    fn tensor(&mut self, name: &str) -> Result<QTensor, SmolError> {
        Ok(self.content.tensor(&mut self.file, name, &Device::Cpu)?)
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>, SmolError> {
        Ok(self.tensor(name)?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn matrix(&mut self, name: &str) -> Result<Matrix, SmolError> {
        Ok(Matrix(QMatMul::from_qtensor(self.q8(name)?)?))
    }

    /// Tensor `name` as Q8_0.
    fn q8(&mut self, name: &str) -> Result<QTensor, SmolError> {
        let t = self.tensor(name)?;
        Ok(match t.dtype() {
            GgmlDType::Q8_0 => t,
            _ => QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?,
        })
    }

    /// The matrices `names`, of `rows` rows each and as wide as one another, as one, their
    /// rows one after another: each one's Q8_0 blocks as [`Reader::matrix`] makes them.
    fn stacked(&mut self, names: &[String], rows: &[usize]) -> Result<Matrix, SmolError> {
        let (mut width, mut blocks) = (None, Vec::new());
        for (name, &want) in names.iter().zip(rows) {
            let q = self.q8(name)?;
            let (r, k) = q.shape().dims2()?;
            if r != want || width.is_some_and(|w| w != k) {
                return Err(SmolError::Format(format!(
                    "{name} is {r} x {k}, not {want} rows as wide as the others ({width:?})"
                )));
            }
            width = Some(k);
            blocks.extend_from_slice(&q.data()?);
        }
        let rows = rows.iter().sum::<usize>();
        let storage = QStorage::from_data(blocks.into(), &Device::Cpu, GgmlDType::Q8_0)?;
        let q = QTensor::new(storage, (rows, width.unwrap_or(0)))?;
        Ok(Matrix(QMatMul::from_qtensor(q)?))
    }
}

/// The fingerprint of the model file's bytes (xxh3-64 of all of them, read once more at
/// load): two files of the same shape but other weights differ.
pub(crate) fn fingerprint(path: &Path) -> Result<u64, SmolError> {
    use std::io::Read;
    let io = |e: std::io::Error| SmolError::Io(format!("{}: {e}", path.display()));
    let mut file = File::open(path).map_err(io)?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 4 << 20];
    loop {
        match file.read(&mut buf).map_err(io)? {
            0 => return Ok(h.digest().max(1)),
            n => h.update(&buf[..n]),
        }
    }
}

/// Reads the model at `path`, with context capped at `max_context`.
pub(crate) fn load(
    path: &Path,
    max_context: usize,
) -> Result<(Weights, gguf_file::Content), SmolError> {
    let mut file = BufReader::new(
        File::open(path).map_err(|e| SmolError::Io(format!("{}: {e}", path.display())))?,
    );
    let content = gguf_file::Content::read(&mut file)?;
    let hp = hyper(&content, max_context)?;
    let mut r = Reader { content: &content, file };
    let mut layers = Vec::with_capacity(hp.layers);
    let kv = hp.kv_dim();
    for i in 0..hp.layers {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        layers.push(Layer {
            attn_norm: r.vector(&n("attn_norm"))?,
            wqkv: r.stacked(&[n("attn_q"), n("attn_k"), n("attn_v")], &[hp.dim, kv, kv])?,
            wo: r.matrix(&n("attn_output"))?,
            ffn_norm: r.vector(&n("ffn_norm"))?,
            w_gate_up: r.stacked(&[n("ffn_gate"), n("ffn_up")], &[hp.ffn, hp.ffn])?,
            w_down: r.matrix(&n("ffn_down"))?,
        });
    }
    let embed = r.vector("token_embd.weight")?;
    if embed.len() != hp.vocab * hp.dim {
        return Err(SmolError::Format(format!(
            "token_embd has {} values, expected {}",
            embed.len(),
            hp.vocab * hp.dim
        )));
    }
    let out_norm = r.vector("output_norm.weight")?;
    // Tied embeddings: models without `output.weight` reuse `token_embd`.
    let has_output = content.tensor_infos.contains_key("output.weight");
    let lm_head = r.matrix(if has_output { "output.weight" } else { "token_embd.weight" })?;
    let rope = rope_table(&hp);
    Ok((Weights { hp, embed, layers, out_norm, lm_head, rope }, content))
}

fn rope_table(hp: &Hyper) -> (Vec<f32>, Vec<f32>) {
    let half = hp.head_dim / 2;
    let mut cos = Vec::with_capacity(hp.context * half);
    let mut sin = Vec::with_capacity(hp.context * half);
    for pos in 0..hp.context {
        for i in 0..half {
            let freq = f64::from(hp.rope_base).powf(-((2 * i) as f64) / hp.head_dim as f64);
            let a = pos as f64 * freq;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests;
