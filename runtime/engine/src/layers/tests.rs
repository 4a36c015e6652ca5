use std::time::Duration;

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
fn a_part_takes_every_layer_gathered_by_the_time_the_listener_comes() {
    let (sink, mut parts) = layer_channel(30, 1000);
    for l in 0..30 {
        sink.send(layer(l, 400)).unwrap();
    }
    let all: Vec<usize> = (0..30).collect();
    assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(all));
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
fn one_layer_is_due_alone_and_no_layers_end_at_once() {
    let (sink, mut parts) = layer_channel(1, 1 << 20);
    sink.send(layer(0, 8)).unwrap();
    assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), Some(vec![0]));
    let (sink, mut parts) = layer_channel(0, 1 << 20);
    drop(sink);
    assert_eq!(numbers(parts.next_part().now_or_never().unwrap()), None);
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

/// A listener already waiting is woken by the part falling due (the sink still alive, so
/// nothing else can wake it), and by the sink going with nothing gathered; the limit only
/// bounds a failure.
#[tokio::test]
async fn a_waiting_listener_is_woken_by_a_part_falling_due_and_by_the_sink_going() {
    let limit = Duration::from_secs(10);
    let (sink, mut parts) = layer_channel(4, 100);
    let mut next = Box::pin(parts.next_part());
    assert!(futures::poll!(&mut next).is_pending(), "nothing gathered yet");
    sink.send(layer(0, 60)).unwrap();
    assert!(futures::poll!(&mut next).is_pending(), "60 bytes: not due");
    sink.send(layer(1, 60)).unwrap();
    let part = tokio::time::timeout(limit, next).await.expect("woken by the part");
    assert_eq!(numbers(part), Some(vec![0, 1]));
    let mut end = Box::pin(parts.next_part());
    assert!(futures::poll!(&mut end).is_pending(), "the sink may still send");
    drop(sink);
    let end = tokio::time::timeout(limit, end).await.expect("woken by the sink going");
    assert_eq!(numbers(end), None);
}
