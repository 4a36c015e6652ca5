//! A set of worker slots as bits, 64 to a word. A set whose slots all lie in one aligned
//! word of 64 (any word: most nodes of a big fleet's tree are held by one worker, or by a few
//! whose slots share a word) keeps that word inline and never touches the heap; a wider set
//! is a bitset from slot 0 on the heap (its size set by its highest slot), so a node held by
//! a thousand workers costs 128 bytes and is walked a word at a time.

/// Worker slots, as bits. Each set has one form (so equal sets are equal fields): inline
/// while its slots lie in one word, else spilled.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SlotSet {
    /// Which word `word` is (slots `base * 64 ..`); 0 when spilled or empty.
    base: u32,
    /// The set's one word when inline; 0 when spilled or empty.
    word: u64,
    /// When spilled: every word from slot 0, without trailing zero words, at least two of
    /// them not zero. Empty otherwise.
    spilled: Box<[u64]>,
}

/// The word `slot` lies in, and its bit there.
fn split(slot: u32) -> (usize, u64) {
    (slot as usize / 64, 1u64 << (slot % 64))
}

impl SlotSet {
    /// The set holding only `slot`.
    pub(crate) fn one(slot: u32) -> Self {
        let (w, bit) = split(slot);
        SlotSet { base: w as u32, word: bit, spilled: Box::default() }
    }

    fn word(&self, w: usize) -> u64 {
        if self.spilled.is_empty() {
            if self.base as usize == w { self.word } else { 0 }
        } else {
            self.spilled.get(w).copied().unwrap_or(0)
        }
    }

    /// Adds `slot`; whether it was new.
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        if self.word(w) & bit != 0 {
            return false;
        }
        if self.spilled.is_empty() && (self.word == 0 || self.base as usize == w) {
            self.base = w as u32;
            self.word |= bit;
            return true;
        }
        if let Some(word) = self.spilled.get_mut(w) {
            *word |= bit;
            return true;
        }
        let mut words = std::mem::take(&mut self.spilled).into_vec();
        if words.is_empty() {
            words.resize(self.base as usize + 1, 0);
            words[self.base as usize] = self.word;
            (self.base, self.word) = (0, 0);
        }
        if words.len() <= w {
            words.resize(w + 1, 0);
        }
        words[w] |= bit;
        self.spilled = words.into_boxed_slice();
        true
    }

    /// Drops `slot`; whether it was there.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        if self.word(w) & bit == 0 {
            return false;
        }
        if self.spilled.is_empty() {
            self.word &= !bit;
            if self.word == 0 {
                self.base = 0;
            }
            return true;
        }
        let mut words = std::mem::take(&mut self.spilled).into_vec();
        words[w] &= !bit;
        while words.last() == Some(&0) {
            words.pop();
        }
        let mut set = words.iter().enumerate().filter(|&(_, &x)| x != 0);
        match (set.next(), set.next()) {
            (Some((at, &x)), None) => (self.base, self.word) = (at as u32, x),
            _ => self.spilled = words.into_boxed_slice(),
        }
        true
    }

    /// Whether `slot` is in.
    pub(crate) fn contains(&self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        self.word(w) & bit != 0
    }

    /// Whether `slot` is the only one in.
    pub(crate) fn is_only(&self, slot: u32) -> bool {
        let (w, bit) = split(slot);
        self.spilled.is_empty() && self.base as usize == w && self.word == bit
    }

    /// Whether no slot is in.
    pub(crate) fn is_empty(&self) -> bool {
        self.word == 0 && self.spilled.is_empty()
    }

    /// Calls `f` with every slot in, ascending.
    #[inline]
    pub(crate) fn for_each(&self, mut f: impl FnMut(usize)) {
        let mut each = |w: usize, mut bits: u64| {
            while bits != 0 {
                f(w * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        };
        if self.spilled.is_empty() {
            each(self.base as usize, self.word);
        } else {
            for (w, &bits) in self.spilled.iter().enumerate() {
                each(w, bits);
            }
        }
    }
}

#[cfg(test)]
mod tests;
