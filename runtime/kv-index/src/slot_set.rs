//! A set of worker slots: a bitset whose first 64 slots live inline (a small fleet's sets
//! never touch the heap) and the rest in a vector, so a node held by a thousand workers
//! costs 128 bytes and is walked a word at a time.

/// Worker slots, as bits.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SlotSet {
    /// Slots 0..64.
    low: u64,
    /// Slots 64.., 64 a word, without trailing zero words (so equal sets are equal fields).
    high: Vec<u64>,
}

impl SlotSet {
    /// The set holding only `slot`.
    pub(crate) fn one(slot: u32) -> Self {
        let mut s = SlotSet::default();
        s.insert(slot);
        s
    }

    fn word_mut(&mut self, w: usize) -> &mut u64 {
        if w == 0 {
            return &mut self.low;
        }
        if w > self.high.len() {
            self.high.resize(w, 0);
        }
        &mut self.high[w - 1]
    }

    fn word(&self, w: usize) -> u64 {
        if w == 0 { self.low } else { self.high.get(w - 1).copied().unwrap_or(0) }
    }

    /// Adds `slot`; whether it was new.
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        let bit = 1u64 << (slot % 64);
        let word = self.word_mut(slot as usize / 64);
        let new = *word & bit == 0;
        *word |= bit;
        new
    }

    /// Drops `slot`; whether it was there.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let w = slot as usize / 64;
        if self.word(w) == 0 {
            return false;
        }
        let bit = 1u64 << (slot % 64);
        let word = self.word_mut(w);
        let had = *word & bit != 0;
        *word &= !bit;
        while self.high.last() == Some(&0) {
            self.high.pop();
        }
        had
    }

    /// Whether `slot` is in.
    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.word(slot as usize / 64) & (1u64 << (slot % 64)) != 0
    }

    /// Whether `slot` is the only one in.
    pub(crate) fn is_only(&self, slot: u32) -> bool {
        let w = slot as usize / 64;
        let bit = 1u64 << (slot % 64);
        if w == 0 {
            self.low == bit && self.high.is_empty()
        } else {
            self.low == 0
                && self.high.len() == w
                && self.high[w - 1] == bit
                && self.high[..w - 1].iter().all(|&x| x == 0)
        }
    }

    /// Whether no slot is in.
    pub(crate) fn is_empty(&self) -> bool {
        self.low == 0 && self.high.is_empty()
    }

    /// Calls `f` with every slot in, ascending.
    #[inline]
    pub(crate) fn for_each(&self, mut f: impl FnMut(usize)) {
        let words = std::iter::once(&self.low).chain(&self.high);
        for (w, &word) in words.enumerate() {
            let mut bits = word;
            while bits != 0 {
                f(w * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        }
    }
}
