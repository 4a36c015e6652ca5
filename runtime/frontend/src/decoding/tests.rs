use std::time::Duration;

use super::*;

const S: Duration = Duration::from_secs(1);

#[test]
fn requests_up_to_the_capacity_are_admitted_whatever_a_slot_was_held() {
    let slots = DecodeSlots::new(2);
    slots.note_hold(100 * S, 1);
    let a = slots.admit(S, 2 * S, 0).unwrap();
    let _b = slots.admit(S, 2 * S, 0).unwrap();
    assert_eq!(slots.admitted(), 2);
    // The third waits for the first round of slots, held 100 s on average.
    let full = slots.admit(S, 2 * S, 0).unwrap_err();
    assert_eq!(full, DecodeFull::Slots { wait: Some(100 * S), allowed: S });
    drop(a);
    assert_eq!(slots.admitted(), 1);
    slots.admit(S, 2 * S, 0).unwrap();
}

#[test]
fn the_wait_counts_whole_rounds_and_must_leave_the_decode_its_time_or_half_the_time_left() {
    let slots = DecodeSlots::new(2);
    slots.note_hold(10 * S, 1);
    let mut held: Vec<_> = (0..2).map(|_| slots.admit(S, 60 * S, 0).unwrap()).collect();
    // The third and the fourth wait one round (10 s).
    assert!(slots.admit(4 * S, 13 * S, 0).is_err(), "13 s left leaves 9 s after a 4 s decode");
    held.push(slots.admit(4 * S, 15 * S, 0).expect("15 s left leaves 11 s"));
    held.push(slots.admit(4 * S, 15 * S, 0).expect("in the same round"));
    // The fifth waits two rounds.
    let full = slots.admit(6 * S, 25 * S, 0).unwrap_err();
    assert_eq!(full, DecodeFull::Slots { wait: Some(20 * S), allowed: 19 * S });
    // A decode longer than half the time left reserves only half of it.
    held.push(slots.admit(100 * S, 40 * S, 0).expect("40 s left leaves 20 s"));
    assert_eq!(slots.admitted(), held.len());
}

#[test]
fn until_a_sequence_ran_to_its_end_only_the_capacity_is_admitted() {
    let slots = DecodeSlots::new(2);
    let _held: Vec<_> = (0..2).map(|_| slots.admit(S, 100 * S, 0).unwrap()).collect();
    let full = slots.admit(S, 100 * S, 0).unwrap_err();
    assert_eq!(full, DecodeFull::Slots { wait: None, allowed: 99 * S });
    assert!(full.to_string().contains("no slot's hold measured yet"), "{full}");
}

#[tokio::test]
async fn only_a_sequence_that_ran_to_its_end_sets_the_hold() {
    let slots = DecodeSlots::new(1);
    let mut cut = slots.admit(S, S, 0).unwrap();
    cut.slot().await;
    drop(cut);
    let _a = slots.admit(S, 100 * S, 0).unwrap();
    assert_eq!(slots.admit(S, 100 * S, 0).unwrap_err().wait(), None, "a cut sequence says nothing");
    drop(_a);
    let mut ended = slots.admit(S, S, 0).unwrap();
    ended.slot().await;
    ended.ran_to_end(4);
    drop(ended);
    let _a = slots.admit(S, 100 * S, 0).unwrap();
    let wait = slots.admit(S, 100 * S, 0).expect("a hold of about nothing leaves time");
    drop(wait);
}

#[test]
fn the_hold_is_a_moving_average() {
    let slots = DecodeSlots::new(1);
    slots.note_hold(8 * S, 1);
    slots.note_hold(16 * S, 1);
    let _a = slots.admit(S, 100 * S, 0).unwrap();
    let full = slots.admit(S, 9 * S, 0).unwrap_err();
    assert_eq!(full.wait(), Some(9 * S), "(8 * 7 + 16) / 8");
}

#[test]
fn a_tokens_share_of_the_hold_prices_a_decode() {
    let slots = DecodeSlots::new(1);
    assert_eq!(slots.decode_time(100), Duration::ZERO, "nothing measured");
    slots.note_hold(8 * S, 4);
    assert_eq!(slots.decode_time(100), 200 * S);
}

#[test]
fn the_wait_adds_the_way_to_a_slot_to_the_rounds() {
    let slots = DecodeSlots::new(1);
    slots.note_hold(10 * S, 1);
    slots.note_lead(3 * S);
    let _a = slots.admit(S, 100 * S, 0).unwrap();
    assert_eq!(
        slots.admit(S, 10 * S, 0).unwrap_err().wait(),
        Some(13 * S),
        "a round and the prefill"
    );
}

#[tokio::test]
async fn slots_are_taken_in_arrival_order_and_given_back_with_the_ticket() {
    let slots = DecodeSlots::new(1);
    slots.note_hold(Duration::from_millis(1), 1);
    let mut first = slots.admit(S, S, 0).unwrap();
    let (mut second, mut third) = (slots.admit(S, S, 0).unwrap(), slots.admit(S, S, 0).unwrap());
    first.slot().await;
    assert_eq!(slots.decoding(), 1);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let t3 = tx.clone();
    let waiting = async move {
        tokio::join!(
            async move {
                second.slot().await;
                tx.send(2).unwrap();
                tokio::task::yield_now().await;
                drop(second);
            },
            async move {
                tokio::task::yield_now().await;
                third.slot().await;
                t3.send(3).unwrap();
            },
        )
    };
    let waiter = tokio::spawn(waiting);
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    assert!(rx.try_recv().is_err(), "no slot while the first holds it");
    drop(first);
    waiter.await.unwrap();
    assert_eq!((rx.recv().await, rx.recv().await), (Some(2), Some(3)));
    assert_eq!((slots.decoding(), slots.admitted()), (0, 0));
}

/// The requests admitted hold their prompts' KV until their decode ends (waiting for a slot
/// included): beyond the budget a request is refused at once, a slot free or not; one alone
/// is never refused for its size; a ticket's end gives its bytes back.
#[test]
fn the_kv_of_the_requests_admitted_stays_within_the_budget() {
    let slots = DecodeSlots::with_kv_budget(32, 100);
    let a = slots.admit(S, 100 * S, 60).unwrap();
    let full = slots.admit(S, 100 * S, 50).unwrap_err();
    assert_eq!(full, DecodeFull::Memory { held: 60, asked: 50, budget: 100 });
    assert!(full.to_string().contains("decode KV budget full"), "{full}");
    assert_eq!(full.retry_after(), S);
    let b = slots.admit(S, 100 * S, 40).expect("fits beside the first");
    assert_eq!(slots.kv_bytes(), 100);
    drop((a, b));
    assert_eq!(slots.kv_bytes(), 0);
    let _alone = slots.admit(S, 100 * S, 500).expect("alone, whatever its size");
}
