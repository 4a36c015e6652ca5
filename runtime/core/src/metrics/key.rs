//! [`Key`]: a series' label values as a family stores them, looked up by `&[&str]` without
//! allocating (through [`Values`], which both a stored key and a [`Probe`] of borrowed values
//! present, compared the same way).

use std::borrow::Borrow;
use std::cmp::Ordering;

/// Label values, one per label name, in order.
pub(super) trait Values {
    fn value(&self, i: usize) -> Option<&str>;
}

impl PartialEq for dyn Values + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for dyn Values + '_ {}

impl PartialOrd for dyn Values + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn Values + '_ {
    /// Value by value; a shorter list first when it is a prefix of the other.
    fn cmp(&self, other: &Self) -> Ordering {
        for i in 0.. {
            match (self.value(i), other.value(i)) {
                (None, None) => return Ordering::Equal,
                (a, b) if a != b => return a.cmp(&b),
                _ => {}
            }
        }
        Ordering::Equal
    }
}

/// A stored key.
#[derive(Debug, Clone)]
pub(super) struct Key(pub(super) Vec<String>);

impl Values for Key {
    fn value(&self, i: usize) -> Option<&str> {
        self.0.get(i).map(String::as_str)
    }
}

impl<'a> Borrow<dyn Values + 'a> for Key {
    fn borrow(&self) -> &(dyn Values + 'a) {
        self
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn Values) == (other as &dyn Values)
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        (self as &dyn Values).cmp(other as &dyn Values)
    }
}

/// Borrowed label values, to look a key up with.
pub(super) struct Probe<'a>(pub(super) &'a [&'a str]);

impl Values for Probe<'_> {
    fn value(&self, i: usize) -> Option<&str> {
        self.0.get(i).copied()
    }
}

impl Key {
    /// The owned key of `values`.
    pub(super) fn of(values: &[&str]) -> Key {
        Key(values.iter().map(|v| (*v).to_owned()).collect())
    }
}
