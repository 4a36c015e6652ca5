//! A region's completion: each sender's notice verified, or its part finished by a
//! protocol's own status message (SGLang's).

use super::{Inbox, lock};
use crate::{ConnId, KvPoll, Notice, RegionId, SenderId, TransferError};

impl Inbox {
    /// Verifies a notice, arrived over `conn`. A notice whose room, byte count or checksum
    /// does not match fails the region (`bootstrap_room mismatch`, `short transfer`,
    /// `checksum mismatch`); one over a connection its sender is not bound to is refused.
    pub fn on_notice(&self, id: RegionId, conn: ConnId, n: Notice) -> Result<(), TransferError> {
        let region = self.region(id)?;
        let mut r = lock(&region);
        r.open(id)?;
        if r.expected.contains_key(&n.sender) {
            r.bind(id, n.sender, conn)?;
        }
        let reason = if n.room != r.room {
            Some(format!("bootstrap_room mismatch: expected {}, got {}", r.room, n.room))
        } else if r.notices.iter().any(|m| m.sender == n.sender) {
            Some(format!("duplicate notice from {:?}", n.sender))
        } else {
            match r.expected.get(&n.sender) {
                None => Some(format!("notice from unexpected sender {:?}", n.sender)),
                Some(p) => {
                    let (w, got, sum) = (p.total(), p.bytes, p.checksum);
                    if let Some(gap) = p.first_gap() {
                        Some(format!(
                            "short transfer from {:?}: gap, bytes [{}, {}) of its ranges never written ({got} of {w} bytes written)",
                            n.sender, gap.start, gap.end
                        ))
                    } else if got != w || n.bytes != w {
                        Some(format!(
                            "short transfer from {:?}: expected {w} bytes, received {got}, notice says {}",
                            n.sender, n.bytes
                        ))
                    } else if sum != n.checksum {
                        Some(format!(
                            "checksum mismatch from {:?}: computed {sum:016x}, notice says {:016x}",
                            n.sender, n.checksum
                        ))
                    } else {
                        None
                    }
                }
            }
        };
        if let Some(reason) = reason {
            r.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        r.notices.push(n);
        if r.notices.len() == r.expected.len() {
            r.advance(KvPoll::Success);
        }
        Ok(())
    }

    /// Completes `sender`'s part of a region without a notice, for protocols whose
    /// completion is a status message of their own (SGLang's): every byte of its ranges must
    /// have been written exactly once (a gap fails the region, named). The room is the
    /// caller's to check, from the bytes (SGLang carries it in the metadata row).
    pub fn finish(&self, id: RegionId, sender: SenderId) -> Result<(), TransferError> {
        let region = self.region(id)?;
        let mut r = lock(&region);
        r.open(id)?;
        let Some(p) = r.expected.get(&sender) else {
            return Err(TransferError::Failed(format!("{sender:?} is not a sender of {id:?}")));
        };
        if let Some(gap) = p.first_gap() {
            let reason = format!(
                "short transfer from {sender:?}: gap, bytes [{}, {}) of its ranges never written",
                gap.start, gap.end
            );
            r.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        let notice = Notice {
            room: r.room,
            sender,
            first_token: 0,
            tokens: 0,
            cached_tokens: 0,
            bytes: p.bytes,
            checksum: p.checksum,
        };
        if r.notices.iter().any(|m| m.sender == sender) {
            return Err(TransferError::Failed(format!("{sender:?} already finished")));
        }
        r.notices.push(notice);
        if r.notices.len() == r.expected.len() {
            r.advance(KvPoll::Success);
        }
        Ok(())
    }
}
