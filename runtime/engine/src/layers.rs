//! The channel a streamed prefill hands its layers through: [`layer_channel`] makes a
//! [`LayerSink`] for the engine and [`LayerParts`] for whoever sends the KV on.
//!
//! The listener is woken once a part is due, not at every layer: when the layers gathered
//! hold at least the part's bytes, at the last layer but one (so the last goes alone, and
//! after the compute no more is left to travel than at one part a layer), at the last, or
//! when the sink is gone (the compute ended, done or failed). Each wake-up of a listener parked on another core costs
//! CPU that, on a host whose cores all compute, is taken from the compute, and each part
//! costs the transfer its own frame, wake-up and ack; with parts of about a MiB, a prompt
//! whose layers are small goes in a few parts while one whose layers are large still goes
//! layer by layer.

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
    bytes: usize,
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
        let closing = layer.layer + 2 >= self.layers;
        g.bytes += layer.bytes.len();
        g.layers.push(layer);
        let now_due = !g.due && (closing || g.bytes >= self.part_bytes);
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
                    g.bytes = 0;
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
mod tests {
    use futures::FutureExt;

    use super::{LayerKv, layer_channel};

    fn layer(layer: usize, len: usize) -> LayerKv {
        LayerKv { layer, bytes: bytes::Bytes::from(vec![layer as u8; len]) }
    }

    fn numbers(part: Option<Vec<LayerKv>>) -> Option<Vec<usize>> {
        part.map(|p| p.iter().map(|l| l.layer).collect())
    }

    #[test]
    fn a_part_is_due_once_its_bytes_have_gathered_and_the_last_layer_goes_alone() {
        let (sink, mut parts) = layer_channel(7, 1000);
        sink.send(layer(0, 400)).unwrap();
        sink.send(layer(1, 400)).unwrap();
        assert!(parts.next_part().now_or_never().is_none(), "800 bytes: not due");
        sink.send(layer(2, 400)).unwrap();
        assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(vec![0, 1, 2]));
        sink.send(layer(3, 400)).unwrap();
        assert!(parts.next_part().now_or_never().is_none(), "the count starts again");
        sink.send(layer(4, 10)).unwrap();
        assert!(parts.next_part().now_or_never().is_none(), "410 bytes: not due");
        sink.send(layer(5, 10)).unwrap();
        assert_eq!(
            numbers(parts.next_part().now_or_never().unwrap()),
            Some(vec![3, 4, 5]),
            "the last layer but one closes a part"
        );
        sink.send(layer(6, 10)).unwrap();
        assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(vec![6]));
        assert!(parts.next_part().now_or_never().is_none(), "the sink may still send");
        drop(sink);
        assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), None);
    }

    #[test]
    fn with_no_part_size_every_layer_is_due() {
        let (sink, mut parts) = layer_channel(3, 0);
        for l in 0..3 {
            sink.send(layer(l, 8)).unwrap();
            assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(vec![l]));
        }
    }

    #[test]
    fn a_sink_dropped_early_hands_on_what_it_gathered_and_then_ends() {
        let (sink, mut parts) = layer_channel(30, 1 << 20);
        sink.send(layer(0, 8)).unwrap();
        drop(sink); // the compute failed after one layer
        assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(vec![0]));
        assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), None);
    }

    #[test]
    fn a_sink_whose_listener_is_gone_gives_the_layer_back() {
        let (sink, parts) = layer_channel(2, 0);
        drop(parts);
        assert_eq!(sink.send(layer(0, 8)).unwrap_err().layer, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listener_parked_before_the_part_is_due_is_woken_by_it() {
        let (sink, mut parts) = layer_channel(4, 100);
        let listener = tokio::spawn(async move {
            let mut got = Vec::new();
            while let Some(p) = parts.next_part().await {
                got.push(p.iter().map(|l| l.layer).collect::<Vec<_>>());
            }
            got
        });
        let sender = std::thread::spawn(move || {
            for l in 0..4 {
                sink.send(layer(l, 60)).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        sender.join().unwrap();
        let got = listener.await.unwrap();
        assert_eq!(got.concat(), [0, 1, 2, 3], "every layer once, in order");
        assert!(got.iter().all(|p| !p.is_empty()));
    }
}
