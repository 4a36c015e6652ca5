use std::collections::VecDeque;

use super::*;

/// A test body: its frames, then pending for ever (a client that stopped sending).
struct Frames(VecDeque<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.0.pop_front() {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
            None => Poll::Pending,
        }
    }
}

fn frames(sizes: &[usize]) -> Frames {
    Frames(sizes.iter().map(|&n| Bytes::from(vec![7u8; n])).collect())
}

async fn next<B: http_body::Body + Unpin>(b: &mut B) -> Option<Result<Frame<B::Data>, B::Error>> {
    std::future::poll_fn(|cx| Pin::new(&mut *b).poll_frame(cx)).await
}

/// The bodies being received share the budget: a frame past it is refused, and a body's
/// bytes are given back when it is dropped.
#[tokio::test]
async fn bodies_share_the_budget_until_dropped() {
    let budget = BodyBudget::new(1_000);
    let within = Duration::from_secs(60);
    let mut first = BoundedBody::new(frames(&[400, 200]), within, budget.clone());
    let mut second = BoundedBody::new(frames(&[300, 200, 100]), within, budget.clone());
    for _ in 0..2 {
        assert!(next(&mut first).await.unwrap().is_ok());
    }
    assert!(next(&mut second).await.unwrap().is_ok());
    assert_eq!(budget.held(), 900);
    let refused = next(&mut second).await.unwrap().unwrap_err();
    assert!(matches!(refused, BodyError::Refused(BodyRefused::Full { limit: 1_000 })));
    assert_eq!(refusal_in(&refused), Some(BodyRefused::Full { limit: 1_000 }));
    drop(first);
    assert_eq!(budget.held(), 300);
    assert!(next(&mut second).await.unwrap().is_ok(), "room again once the first went");
    drop(second);
    assert_eq!(budget.held(), 0);
}

/// A body that stops coming fails at its time, not before.
#[tokio::test]
async fn a_body_that_stops_coming_fails_at_its_time() {
    let within = Duration::from_millis(200);
    let start = tokio::time::Instant::now();
    let mut body = BoundedBody::new(frames(&[10]), within, BodyBudget::new(100));
    assert!(next(&mut body).await.unwrap().is_ok());
    let cut = tokio::time::timeout(Duration::from_secs(10), next(&mut body)).await;
    let e = cut.expect("never cut off").unwrap().unwrap_err();
    assert!(matches!(e, BodyError::Refused(BodyRefused::TooSlow(_))), "{e}");
    assert!(start.elapsed() >= within, "cut off after {:?}", start.elapsed());
}
