//! The channel a streamed prefill hands its layers through: [`layer_channel`] makes a
//! [`LayerSink`] for the engine and [`LayerParts`] for whoever sends the KV on.
//!
//! The listener is woken once a part is due, not at every layer: when the layers gathered
//! hold at least the part's bytes, at the last layer but one, at the last, or when the sink
//! is gone (the compute ended, done or failed). A part takes every layer gathered by the
//! time the listener comes for it: the last layer goes alone (after the compute no more is
//! left to travel than at one part a layer) unless the listener was still busy with the
//! part before.
//!
//! Why: each wake-up of a listener parked on another core costs CPU that, on a host whose
//! cores all compute, is taken from the compute, and each part costs the transfer its own
//! frame, wake-up and ack. With parts of about a MiB, a prompt whose layers are small goes
//! in a few parts while one whose layers are large still goes layer by layer.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

/// One layer of a prompt's KV, handed on by [`crate::Engine::prefill_streamed`] as soon as it
/// is computed: [`crate::Kv::layer`] of the finished KV, every prompt token (cached prefix
/// included).
#[derive(Debug, Clone)]
pub struct LayerKv {
    /// The layer.
    pub layer: usize,
    /// Its K and V runs, canonical layout.
    pub bytes: bytes::Bytes,
}

/// A channel for a prompt of `layers` layers whose listener is woken once at least
/// `part_bytes` have gathered (0: at every layer), at each of the last two layers, or when
/// the sink is dropped.
pub fn layer_channel(layers: usize, part_bytes: usize) -> (LayerSink, LayerParts) {
    let shared = Arc::new(Shared { gathered: Mutex::default(), due: Notify::new() });
    let sink = LayerSink { shared: shared.clone(), layers, part_bytes };
    (sink, LayerParts { shared })
}

/// Where a streamed prefill hands its layers, in layer order (see the module docs).
#[derive(Debug)]
pub struct LayerSink {
    shared: Arc<Shared>,
    layers: usize,
    part_bytes: usize,
}

/// The listener's end: the layers, a part at a time (see the module docs).
#[derive(Debug)]
pub struct LayerParts {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    gathered: Mutex<Gathered>,
    /// Told once a part is due or the sink is gone; a telling nobody waits for is kept
    /// for the next wait.
    due: Notify,
}

#[derive(Debug, Default)]
struct Gathered {
    layers: Vec<LayerKv>,
    /// A part is due: the listener takes every layer gathered.
    due: bool,
    /// The sink is gone: nothing more comes.
    closed: bool,
    /// The listener is gone: nothing sent is read.
    unheard: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Gathered> {
        self.gathered.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl LayerSink {
    /// Hands on `layer`; back as `Err` when the listener is gone (the request ended), so the
    /// engine may stop handing on and only finish its compute.
    pub fn send(&self, layer: LayerKv) -> Result<(), LayerKv> {
        let mut g = self.shared.lock();
        if g.unheard {
            return Err(layer);
        }
        // The layers before the last go out without it, so that after the compute only
        // the last layer is left to travel, as when every layer was a part.
        let closing = layer.layer >= self.layers.saturating_sub(2);
        g.layers.push(layer);
        let gathered = || g.layers.iter().map(|l| l.bytes.len()).sum::<usize>();
        let now_due = !g.due && (closing || gathered() >= self.part_bytes);
        g.due |= now_due;
        drop(g);
        if now_due {
            self.shared.due.notify_one();
        }
        Ok(())
    }
}

impl Drop for LayerSink {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.due.notify_one();
    }
}

impl LayerParts {
    /// The next part: every layer gathered by the time one is due, in order; `None` once the
    /// sink is gone and every layer has been taken.
    pub async fn next_part(&mut self) -> Option<Vec<LayerKv>> {
        loop {
            {
                let mut g = self.shared.lock();
                if g.due || (g.closed && !g.layers.is_empty()) {
                    g.due = false;
                    return Some(std::mem::take(&mut g.layers));
                }
                if g.closed {
                    return None;
                }
            }
            self.shared.due.notified().await;
        }
    }
}

impl Drop for LayerParts {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        g.unheard = true;
        g.layers.clear();
    }
}

#[cfg(test)]
mod tests;
