use thiserror::Error;

use crate::{AgentAddr, RegionId};

/// Errors of the transfer seam.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TransferError {
    /// A peer could not be reached or the connection broke.
    #[error("peer {peer}: {reason}")]
    Io {
        /// The peer.
        peer: AgentAddr,
        /// What went wrong.
        reason: String,
    },
    /// A connection to the peer could not be made: refused, no route to it, no answer to
    /// the connect within its time, or its certificate refused for what is its own (not
    /// valid for the name dialled, expired): the network or the peer; nothing was sent.
    #[error("peer {peer} unreachable: {reason}")]
    Unreachable {
        /// The peer.
        peer: AgentAddr,
        /// What the connect said.
        reason: String,
    },
    /// The peer refused this side's own certificate for what is this side's alone (expired
    /// or not yet valid, revoked, bad, none shown: [`handoff_core::tls::own_certificate_refused`]):
    /// this side's fault, not the peer's.
    #[error("peer {peer} refused this side's certificate: {reason}")]
    CertificateRefused {
        /// The peer.
        peer: AgentAddr,
        /// The alert it sent.
        reason: String,
    },
    /// A frame or request that violates the protocol.
    #[error("malformed: {0}")]
    Malformed(String),
    /// The peer refused: its answer says why.
    #[error("rejected by peer: {0}")]
    Rejected(String),
    /// A handshake without the configured token.
    #[error("unauthorized handshake")]
    Unauthorized,
    /// A connection that did not authenticate first, or a write or notice over a connection
    /// its region's sender is not bound to. Refused without touching the region; the
    /// connection is closed.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// A table is full.
    #[error("{0} table full")]
    Full(&'static str),
    /// No such region (never registered, expired or already taken).
    #[error("unknown region {0:?}")]
    UnknownRegion(RegionId),
    /// The room's transfer failed at verification or in flight.
    #[error("transfer failed: {0}")]
    Failed(String),
    /// A wait ran past its deadline.
    #[error("timed out {0}")]
    Timeout(String),
    /// A wait for KV ran past its deadline while its bytes were still arriving: the sender
    /// was sending, the link or this receiver too slow for the time given (see
    /// [`crate::inbox::ARRIVING`]).
    #[error("timed out while the KV was still arriving: {0}")]
    Late(String),
}

/// What a handoff listener answers a connection whose token is not its own.
pub(crate) const WRONG_TOKEN: &str = "wrong token";

impl TransferError {
    /// An I/O failure talking to `peer` (while `doing` something): the peer refusing this
    /// side's certificate (with TLS 1.3 its alert arrives at the first read after the
    /// handshake) is [`TransferError::CertificateRefused`], anything else `Io`.
    pub(crate) fn io(peer: &AgentAddr, doing: &str, e: &std::io::Error) -> Self {
        let (peer, reason) = (peer.clone(), format!("{doing}: {e}"));
        if handoff_core::tls::own_certificate_refused(e) {
            TransferError::CertificateRefused { peer, reason }
        } else {
            TransferError::Io { peer, reason }
        }
    }

    /// A peer's refusal, by its reason: a token refused (a tcp listener's [`WRONG_TOKEN`], a
    /// NIXL control port's [`TransferError::Unauthorized`]) is `Unauthorized`, another
    /// cluster token rather than the peer's fault; anything else `Rejected`.
    pub(crate) fn refused(reason: String) -> Self {
        if reason == WRONG_TOKEN || reason == TransferError::Unauthorized.to_string() {
            TransferError::Unauthorized
        } else {
            TransferError::Rejected(reason)
        }
    }

    /// The kind, as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            TransferError::Io { .. } => "io",
            TransferError::Unreachable { .. } => "unreachable",
            TransferError::CertificateRefused { .. } => "certificate_refused",
            TransferError::Malformed(_) => "malformed",
            TransferError::Rejected(_) => "rejected",
            TransferError::Unauthorized => "unauthorized",
            TransferError::Forbidden(_) => "forbidden",
            TransferError::Full(_) => "full",
            TransferError::UnknownRegion(_) => "unknown_region",
            TransferError::Failed(_) => "failed",
            TransferError::Timeout(_) => "timeout",
            TransferError::Late(_) => "late",
        }
    }
}
