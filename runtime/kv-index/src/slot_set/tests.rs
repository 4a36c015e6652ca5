use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// The set holding `slots`, inserted in the order given.
fn of(slots: impl IntoIterator<Item = u32>) -> SlotSet {
    let mut s = SlotSet::default();
    for x in slots {
        s.insert(x);
    }
    s
}

fn members(s: &SlotSet) -> Vec<u32> {
    let mut v = Vec::new();
    s.for_each(|x| v.push(x as u32));
    v
}

/// Checks `s` against the model `m`: the same members in order, the same answers, one form
/// whatever the history, and the heap only when the slots span more than one word.
fn agrees(s: &SlotSet, m: &BTreeSet<u32>, probes: &[u32]) {
    let want: Vec<u32> = m.iter().copied().collect();
    assert_eq!(members(s), want);
    assert_eq!(s.is_empty(), m.is_empty());
    for &p in probes {
        assert_eq!(s.contains(p), m.contains(&p), "contains({p}) of {want:?}");
        assert_eq!(s.is_only(p), want == [p], "is_only({p}) of {want:?}");
    }
    assert_eq!(*s, of(want.iter().copied()), "{want:?} has two forms");
    assert_eq!(*s, of(want.iter().rev().copied()), "{want:?} has two forms");
    let words: BTreeSet<u32> = m.iter().map(|x| x / 64).collect();
    assert_eq!(s.spilled.is_empty(), words.len() <= 1, "{want:?} spilled: {s:?}");
}

#[test]
fn a_set_answers_as_a_set_of_slots_in_one_form_and_spills_only_across_words() {
    let mut rng = StdRng::seed_from_u64(7);
    for round in 0..400 {
        // Slots near one word's edges, over a few words, or over a big fleet.
        let span: u32 = [64, 130, 300, 1100][round % 4];
        let from: u32 = if round % 3 == 0 { rng.random_range(0..4) * 64 } else { 0 };
        let probes: Vec<u32> = (0..12).map(|_| from + rng.random_range(0..span + 64)).collect();
        let (mut s, mut m) = (SlotSet::default(), BTreeSet::new());
        for _ in 0..60 {
            let x = from + rng.random_range(0..span);
            if rng.random_bool(0.55) {
                assert_eq!(s.insert(x), m.insert(x), "insert({x})");
            } else {
                assert_eq!(s.remove(x), m.remove(&x), "remove({x})");
            }
            agrees(&s, &m, &probes);
        }
        for x in m.clone() {
            assert!(s.remove(x));
            m.remove(&x);
            agrees(&s, &m, &probes);
        }
        assert_eq!(s, SlotSet::default());
    }
}

#[test]
fn a_set_of_one_word_far_from_slot_zero_is_inline() {
    let mut s = SlotSet::one(1000);
    assert!(s.insert(1023) && s.insert(960) && !s.insert(1000));
    assert!(s.spilled.is_empty());
    assert_eq!(members(&s), [960, 1000, 1023]);
    assert!(s.insert(5));
    assert_eq!(s.spilled.len(), 16);
    assert_eq!(members(&s), [5, 960, 1000, 1023]);
    assert!(s.remove(960) && s.remove(1000) && s.remove(1023));
    assert!(s.spilled.is_empty() && s.is_only(5));
    assert_eq!(s, SlotSet::one(5));
}

#[test]
fn the_highest_slots_stay_inline_alone() {
    let mut s = SlotSet::one(u32::MAX);
    assert!(s.contains(u32::MAX) && !s.contains(u32::MAX - 64) && s.is_only(u32::MAX));
    assert!(s.insert(u32::MAX - 1) && s.spilled.is_empty());
    assert_eq!(members(&s), [u32::MAX - 1, u32::MAX]);
    assert!(s.remove(u32::MAX) && s.remove(u32::MAX - 1) && s.is_empty());
    assert_eq!(s, SlotSet::default());
}
