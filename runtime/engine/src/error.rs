use thiserror::Error;

/// Errors of an engine.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The input cannot be served (empty prompt, too long, unknown token).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A KV buffer does not have the shape the engine expects.
    #[error("KV shape mismatch: {0}")]
    KvShape(String),
    /// The engine failed while computing.
    #[error("engine failure: {0}")]
    Internal(String),
}
