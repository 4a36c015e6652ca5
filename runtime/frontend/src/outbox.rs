//! A stream's messages the client has not taken yet: the decode runs ahead of a slow reader
//! rather than at its pace. A client that reads slowly, or not at all, would otherwise hold
//! its decode slot and its KV until the request's deadline (one stalled stream per slot
//! keeps every other request waiting, then refused). What waits here is the text of tokens,
//! not their KV, and a bounded number of them (the stream's decode waits for its client
//! beyond); the slot and the decoder go at the decode's end, and the messages follow as the
//! client takes them, until the deadline.

use std::collections::VecDeque;

use tokio::sync::mpsc;

/// What could not be queued: the client left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gone;

/// The messages not yet taken by `tx`'s client, in order.
#[derive(Debug)]
pub(crate) struct Outbox<T> {
    waiting: VecDeque<T>,
}

impl<T> Outbox<T> {
    pub(crate) fn new() -> Self {
        Outbox { waiting: VecDeque::new() }
    }

    /// Messages waiting for room in the client's stream.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Hands `msg` to `tx` behind whatever waits, at once: what finds no room waits here.
    /// Never waits for the client; `Err` only once it left. With nothing waiting (a client
    /// that keeps up: every token) the message goes straight to `tx`.
    pub(crate) fn push(&mut self, tx: &mpsc::Sender<T>, msg: T) -> Result<(), Gone> {
        if !self.waiting.is_empty() {
            self.waiting.push_back(msg);
            return self.flush(tx);
        }
        match tx.try_send(msg) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(Gone),
            Err(mpsc::error::TrySendError::Full(msg)) => {
                self.waiting.push_back(msg);
                Ok(())
            }
        }
    }

    /// Moves what fits into `tx`, oldest first.
    pub(crate) fn flush(&mut self, tx: &mpsc::Sender<T>) -> Result<(), Gone> {
        while let Some(msg) = self.waiting.pop_front() {
            match tx.try_send(msg) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(Gone),
                Err(mpsc::error::TrySendError::Full(msg)) => {
                    self.waiting.push_front(msg);
                    break;
                }
            }
        }
        Ok(())
    }

    /// The oldest message waiting, taken out to be sent (waiting for room).
    pub(crate) fn next(&mut self) -> Option<T> {
        self.waiting.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_finds_no_room_waits_in_order_and_follows_as_room_comes() {
        let (tx, mut rx) = mpsc::channel(2);
        let mut out = Outbox::new();
        for i in 0..5 {
            out.push(&tx, i).unwrap();
        }
        assert_eq!(out.len(), 3, "two in the stream, three waiting");
        assert_eq!(rx.try_recv().unwrap(), 0);
        out.flush(&tx).unwrap();
        assert_eq!(out.len(), 2);
        let mut got = vec![];
        while let Ok(m) = rx.try_recv() {
            got.push(m);
            out.flush(&tx).unwrap();
        }
        assert_eq!(got, [1, 2, 3, 4]);
        assert_eq!(out.len(), 0);
    }

    #[test]
    fn a_client_gone_is_said_at_once() {
        let (tx, rx) = mpsc::channel(1);
        let mut out = Outbox::new();
        out.push(&tx, 0).unwrap();
        out.push(&tx, 1).unwrap();
        drop(rx);
        assert_eq!(out.push(&tx, 2), Err(Gone));
    }
}
