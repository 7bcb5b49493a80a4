//! The pages inside one physical handle, by offset, with their bytes summed: a sorted ring
//! of (offset, page, size) instead of a B-tree, so that the pages of a handle lie in one
//! block of memory (an access call attaches a run of them in order, and the release loop of
//! `empty_cache()` takes them off the front in order) and the bytes no page holds are known
//! without looking at the pages.

use std::collections::VecDeque;
use std::ops::{Bound, RangeBounds};

#[derive(Debug, Default)]
pub(super) struct Slots {
    /// (offset, page, size), by offset; offsets are unique.
    v: VecDeque<(u64, u64, u64)>,
    /// The sizes summed.
    live: u64,
}

impl Slots {
    /// Where `off` is, or would be inserted.
    fn find(&self, off: u64) -> Result<usize, usize> {
        self.v.binary_search_by(|e| e.0.cmp(&off))
    }

    /// Page `vh` of `size` bytes at `off` (replacing the page there, if any).
    pub(super) fn insert(&mut self, off: u64, vh: u64, size: u64) {
        match self.find(off) {
            Ok(i) => {
                self.live = self.live - self.v[i].2 + size;
                self.v[i] = (off, vh, size);
            }
            Err(i) => {
                self.live += size;
                self.v.insert(i, (off, vh, size));
            }
        }
    }

    /// The page at `off` leaves: it, if there was one.
    pub(super) fn remove(&mut self, off: &u64) -> Option<u64> {
        let i = self.find(*off).ok()?;
        let (_, vh, size) = self.v.remove(i)?;
        self.live -= size;
        Some(vh)
    }

    /// Room for `n` more pages (an access call attaches a run at once).
    pub(super) fn reserve(&mut self, n: usize) {
        self.v.reserve(n);
    }

    pub(super) fn contains_key(&self, off: &u64) -> bool {
        self.find(*off).is_ok()
    }

    pub(super) fn len(&self) -> usize {
        self.v.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.v.is_empty()
    }

    /// The bytes of the pages.
    pub(super) fn live(&self) -> u64 {
        self.live
    }

    /// (offset, page), by offset.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = (&u64, &u64)> + '_ {
        self.v.iter().map(|(o, v, _)| (o, v))
    }

    /// The pages, by offset.
    pub(super) fn values(&self) -> impl DoubleEndedIterator<Item = &u64> + '_ {
        self.v.iter().map(|(_, v, _)| v)
    }

    /// (offset, page) with the offset in `r`, by offset.
    pub(super) fn range(
        &self,
        r: impl RangeBounds<u64>,
    ) -> impl DoubleEndedIterator<Item = (&u64, &u64)> + '_ {
        let lo = match r.start_bound() {
            Bound::Included(s) => self.v.partition_point(|e| e.0 < *s),
            Bound::Excluded(s) => self.v.partition_point(|e| e.0 <= *s),
            Bound::Unbounded => 0,
        };
        let hi = match r.end_bound() {
            Bound::Included(e) => self.v.partition_point(|x| x.0 <= *e),
            Bound::Excluded(e) => self.v.partition_point(|x| x.0 < *e),
            Bound::Unbounded => self.v.len(),
        };
        self.v.range(lo..hi.max(lo)).map(|(o, v, _)| (o, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random inserts, removes and range queries agree with a B-tree, and the summed bytes
    /// with the pages there.
    #[test]
    fn slots_answer_as_a_btree_does() {
        let mut s = Slots::default();
        let mut m: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000u64 {
            let off = next() % 64 * 2;
            match next() % 3 {
                0 | 1 => {
                    let size = 1 + next() % 4;
                    s.insert(off, i, size);
                    m.insert(off, (i, size));
                }
                _ => assert_eq!(s.remove(&off), m.remove(&off).map(|e| e.0)),
            }
            let (a, b) = (next() % 130, next() % 130);
            let got: Vec<(u64, u64)> = s.range(a..b).map(|(o, v)| (*o, *v)).collect();
            let want: Vec<(u64, u64)> = match a <= b {
                true => m.range(a..b).map(|(o, e)| (*o, e.0)).collect(),
                false => Vec::new(),
            };
            assert_eq!(got, want);
            assert_eq!(
                s.range(..=a).next_back().map(|(o, v)| (*o, *v)),
                m.range(..=a).next_back().map(|(o, e)| (*o, e.0))
            );
            assert_eq!(
                s.range(..b).next_back().map(|(o, v)| (*o, *v)),
                m.range(..b).next_back().map(|(o, e)| (*o, e.0))
            );
            assert_eq!(
                s.range(a..).next().map(|(o, v)| (*o, *v)),
                m.range(a..).next().map(|(o, e)| (*o, e.0))
            );
            assert_eq!(s.live(), m.values().map(|e| e.1).sum::<u64>());
            assert_eq!(s.len(), m.len());
            assert_eq!(s.contains_key(&off), m.contains_key(&off));
        }
        let all: Vec<u64> = s.values().copied().collect();
        assert_eq!(all, m.values().map(|e| e.0).collect::<Vec<_>>());
    }
}
