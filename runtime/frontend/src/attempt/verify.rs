//! The verify stage: the KV of every region, bound to the room and the prompt.

use futures::future::try_join_all;
use handoff_core::Room;
use handoff_transfer::{Inbox, Received, TransferError};
use tokio::time::Instant;

use super::{RegionGuard, call};
use crate::{Cause, FrontendError};

/// The regions' KV, when the handshakes were done, and what the notices agree on.
pub(super) struct Verified {
    /// Each region's bytes and notices, in the order of the regions.
    pub received: Vec<Received>,
    /// When the handshakes were acknowledged (at once when they rode in the call).
    pub connected_at: Instant,
    /// The first generated token.
    pub first_token: u32,
    /// Prompt tokens the prefill took from its cache.
    pub cached_tokens: u32,
    /// KV bytes verified.
    pub kv_bytes: u64,
}

/// prefill and verify: waits for every region's KV, while the handshakes (`connected`) and
/// the call go on. The attempt goes on once the KV is verified (its notices carry the first
/// token), not when the call answers (see `call`). A call that fails first (a refusal, an
/// error) fails the attempt, unless the handshakes fail too: theirs then names the failure
/// (a prefill this frontend cannot reach fails both, and `reach` counts connect failures).
pub(super) async fn receive(
    inbox: &Inbox,
    regions: &[RegionGuard],
    call: &mut call::PrefillCall,
    connected: impl std::future::Future<Output = Result<Instant, FrontendError>>,
    room: Room,
    tokens: usize,
    deadline: Instant,
) -> Result<Verified, FrontendError> {
    let waits = async {
        // A region still arriving at the deadline waits for the others' word (they end at the
        // same deadline): one silent or failed is the answer, not the one still arriving.
        let w = regions.iter().map(|g| async {
            match inbox.wait(g.id, deadline).await {
                Err(late @ TransferError::Late(_)) => Ok(Err(late)),
                r => r.map(Ok),
            }
        });
        let all = try_join_all(w).await.map_err(|e| FrontendError::transfer("verify", e))?;
        all.into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| FrontendError::transfer("verify", e))
    };
    tokio::pin!(connected, waits);
    let mut connected_at = None;
    let received = loop {
        tokio::select! {
            c = &mut connected, if connected_at.is_none() => connected_at = Some(c?),
            w = &mut waits => break w?,
            a = call.answer(), if call.is_out() => match a {
                // The call ran out of the attempt's time with the waits, which end now too:
                // theirs says whether the KV was still arriving (slow, not silent).
                Err(e) if e.cause() == Some(Cause::Deadline) && Instant::now() >= deadline => {}
                Err(e) => {
                    if connected_at.is_none() {
                        (&mut connected).await?;
                    }
                    return Err(e);
                }
                Ok(()) => {}
            },
        }
    };
    let connected_at = match connected_at {
        Some(at) => at,
        None => (&mut connected).await?,
    };
    // verify: every notice of every region names our room and our prompt, and all agree
    // on the first token and the cached prefix.
    let ((first_token, cached_tokens), kv_bytes) = agreed_notices(&received, room, tokens)?;
    Ok(Verified { received, connected_at, first_token, cached_tokens, kv_bytes })
}

/// Checks that every notice of `received` names `room` and `tokens` tokens and that all say
/// the same first token and cached prefix: those, and the bytes verified.
fn agreed_notices(
    received: &[Received],
    room: Room,
    tokens: usize,
) -> Result<((u32, u32), u64), FrontendError> {
    let mut said = None;
    let mut kv_bytes = 0;
    for rec in received {
        for n in &rec.notices {
            if n.room != room || rec.room != room {
                return Err(FrontendError::at(
                    "verify",
                    format!("bootstrap_room mismatch: expected {room}, got {}", n.room),
                ));
            }
            if n.tokens as usize != tokens {
                return Err(FrontendError::at(
                    "verify",
                    format!("a notice says {} tokens, the prompt has {tokens}", n.tokens),
                ));
            }
            let this = (n.first_token, n.cached_tokens);
            if *said.get_or_insert(this) != this {
                return Err(FrontendError::at(
                    "verify",
                    format!(
                        "notices disagree: first token and cached prefix {said:?}, then {this:?}"
                    ),
                ));
            }
            kv_bytes += n.bytes;
        }
    }
    let said = said.ok_or_else(|| FrontendError::at("verify", "no notice"))?;
    Ok((said, kv_bytes))
}

#[cfg(test)]
mod tests {
    use handoff_transfer::{Notice, SenderId};

    use super::*;

    fn notice(room: Room, first_token: u32, cached_tokens: u32) -> Notice {
        Notice {
            room,
            sender: SenderId::new(0, 0),
            first_token,
            tokens: 4,
            cached_tokens,
            bytes: 10,
            checksum: 0,
        }
    }

    fn received(room: Room, notices: Vec<Notice>) -> Vec<Received> {
        vec![Received { room, buf: Vec::new(), notices }]
    }

    #[test]
    fn the_notices_must_name_the_room_and_prompt_and_agree() {
        let room = Room::mint();
        let ok = received(room, vec![notice(room, 7, 2), notice(room, 7, 2)]);
        assert_eq!(agreed_notices(&ok, room, 4).unwrap(), ((7, 2), 20));
        let disagree = received(room, vec![notice(room, 7, 2), notice(room, 8, 2)]);
        assert!(agreed_notices(&disagree, room, 4).unwrap_err().to_string().contains("disagree"));
        let cached_differs = received(room, vec![notice(room, 7, 2), notice(room, 7, 3)]);
        assert!(agreed_notices(&cached_differs, room, 4).is_err(), "the cached prefix too");
        let other = Room::mint();
        let foreign = received(room, vec![notice(other, 7, 2)]);
        let err = agreed_notices(&foreign, room, 4).unwrap_err().to_string();
        assert!(err.contains("bootstrap_room mismatch"), "{err}");
        assert!(agreed_notices(&ok, room, 5).is_err(), "another prompt length");
        assert!(agreed_notices(&received(room, vec![]), room, 4).is_err(), "no notice");
    }
}
