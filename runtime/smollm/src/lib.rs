//! The `smollm` engine: a Llama-architecture model (SmolLM2-135M-Instruct) read from a GGUF
//! file and run on CPU with candle, with its KV cache ours to export and import.
//!
//! - [`weights`] — GGUF metadata and weights; Q4_1 requantized to Q8_0 at load.
//! - [`tokenizer`] — byte-level BPE and ChatML from the GGUF metadata.
//! - [`forward`] — the forward pass: row-local steps and per-row attention, so prefill is
//!   chunk-invariant and batched decode equals single decode.
//! - [`sampling`] — greedy and seeded temperature / top-k / top-p.
//! - [`worker`] — [`SmolLm`]: the engine handle; one owned compute thread per handle runs
//!   prefills and batches the decode steps of every sequence that is ready.

// KV crosses the seam as its f32s' own bytes (see `forward::Seq`), which are the canonical
// layout's little-endian ones only on a little-endian machine.
#[cfg(not(target_endian = "little"))]
compile_error!("smollm exports and imports its KV as its own f32 memory: little-endian only");

mod forward;
mod sampling;
mod tokenizer;
mod weights;
mod worker;

use thiserror::Error;

pub use worker::{SmolConfig, SmolLm};

/// Errors of the smollm engine.
#[derive(Debug, Error)]
pub enum SmolError {
    /// The model file could not be read.
    #[error("model file: {0}")]
    Io(String),
    /// The model file is not what the engine expects.
    #[error("model format: {0}")]
    Format(String),
    /// candle failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// Bad input.
    #[error("{0}")]
    Input(String),
    /// KV of the wrong shape.
    #[error("{0}")]
    Shape(String),
    /// The compute thread is gone.
    #[error("engine stopped")]
    Stopped,
    /// Nobody waits for the prefill any more: its compute stopped between two layers.
    #[error("the prefill was cancelled")]
    Cancelled,
}

impl From<SmolError> for handoff_engine::EngineError {
    fn from(e: SmolError) -> Self {
        use handoff_engine::EngineError;
        match e {
            SmolError::Input(s) => EngineError::InvalidInput(s),
            SmolError::Shape(s) => EngineError::KvShape(s),
            e => EngineError::Internal(e.to_string()),
        }
    }
}
