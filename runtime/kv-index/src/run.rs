//! [`Run`]: the result of a match, leading blocks held per slot, kept between queries so that
//! the next query resets only the slots this one touched (a miss costs one map lookup, not a
//! pass over every slot).

use crate::Slot;

/// Leading prompt blocks held, per slot (see [`crate::KvIndex::overlaps_into`]).
#[derive(Debug, Default, Clone)]
pub struct Run {
    per_slot: Vec<u32>,
    /// Slots whose entry is not zero (each once).
    touched: Vec<u32>,
}

impl Run {
    /// An empty run.
    pub fn new() -> Self {
        Self::default()
    }

    /// The run of every slot, indexed by [`Slot::index`]; one entry per slot the index had
    /// at the query.
    pub fn as_slice(&self) -> &[u32] {
        &self.per_slot
    }

    /// Leading blocks held by the worker in `slot` (0 for slots past the end).
    pub fn at(&self, slot: Slot) -> u32 {
        self.per_slot.get(slot.index()).copied().unwrap_or(0)
    }

    /// Raises `slot`'s run to at least `n` (for what a caller knows beyond the index, such
    /// as prefixes being computed). Slots past the end are ignored.
    pub fn raise(&mut self, slot: Slot, n: u32) {
        let Some(r) = self.per_slot.get_mut(slot.index()) else { return };
        if *r == 0 && n > 0 {
            self.touched.push(slot.index() as u32);
        }
        *r = (*r).max(n);
    }

    /// The slots holding at least the first block, with their runs.
    pub fn held(&self) -> impl Iterator<Item = (Slot, u32)> + '_ {
        self.touched.iter().map(|&s| (Slot(s), self.per_slot[s as usize]))
    }

    /// Zeroes what the last query touched and sizes the run for `slots` slots.
    pub(crate) fn reset(&mut self, slots: usize) {
        for s in self.touched.drain(..) {
            self.per_slot[s as usize] = 0;
        }
        self.per_slot.resize(slots, 0);
    }

    /// The entries and the touched list, for the tree's walk: a slot set from zero must be
    /// pushed onto the list.
    pub(crate) fn parts_mut(&mut self) -> (&mut [u32], &mut Vec<u32>) {
        (&mut self.per_slot, &mut self.touched)
    }
}
