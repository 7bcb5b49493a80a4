//! The books of PyTorch's mappings of other processes' pages (`torch.multiprocessing` of
//! expandable segments: a reservation, a page imported from the producer's descriptor and mapped
//! at a time, one access call, and on close the reverse), and of those kept mapped after the
//! program freed their reservation, so that the next open of the same pages is handed the same
//! reservation with its mappings and access in place. Pure bookkeeping: every answer says which
//! driver calls the caller makes.
//!
//! A page is known by its producer's pid and the number of the producer's descriptor it came
//! from ([`Id`]): the producer's expseg tells this process when that number stops naming that
//! page (released, or the number exported again for another page), before the number can reach
//! a consumer again; those views go ([`Views::gone`]).
//!
//! Which kept view a new reservation gets is a guess (the reservation comes before the pages):
//! the next one, in the order they were first opened, after the last that was opened again.
//! A wrong guess costs what the open costs without keeping: the view's mappings are unmapped
//! and the program's are made.

// Only the x86-64 `syscall` hook names producers: elsewhere nothing is ever kept.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::collections::{BTreeMap, HashMap};

/// A producer's page, as a consumer knows it: the producer's pid and descriptor number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Id {
    pub pid: u32,
    pub fd: i32,
}

/// A mapping in a view: `len` bytes of page `id`; `live` while the program has it mapped.
#[derive(Clone, Debug)]
struct Slot {
    len: u64,
    id: Id,
    live: bool,
}

/// Access set on a view: range (offset, length) and descriptors (device, flags).
type Access = (u64, u64, Vec<(i32, u32)>);

/// A reservation of the program's holding imported pages.
#[derive(Clone, Debug)]
pub struct View {
    pub va: u64,
    pub size: u64,
    /// When the view was first opened (its place in the guessing order).
    seq: u64,
    /// By offset in the reservation.
    slots: BTreeMap<u64, Slot>,
    /// The access the program set: range (offset, length) and descriptors.
    access: Option<Access>,
    /// May be kept when the program frees it: every mapping in it is a known page of one
    /// producer that tells this process.
    keep: bool,
    /// Handed back by a reservation and not yet matched by the program's maps.
    guessed: bool,
}

impl View {
    /// The mappings made in it (address, length): to unmap before freeing it.
    pub fn mappings(&self) -> Vec<(u64, u64)> {
        self.slots
            .iter()
            .map(|(off, s)| (self.va + off, s.len))
            .collect()
    }

    fn producer(&self) -> Option<u32> {
        self.slots.values().next().map(|s| s.id.pid)
    }
}

/// What a `cuMemMap` of the program's does.
#[derive(Debug, PartialEq, Eq)]
pub enum Map {
    /// The page is mapped there already (a kept view): nothing to do.
    Done,
    /// Unmap these first (a guessed view's mappings the program does not want), then map.
    Pass(Vec<(u64, u64)>),
}

/// What the program's `cuMemAddressFree` does.
#[derive(Debug)]
pub enum Free {
    /// Kept: nothing to do.
    Kept,
    /// Unmap these first (mappings the program unmapped while they were to be kept), then free.
    Pass(Vec<(u64, u64)>),
}

/// Most views kept, and most address space they may hold; beyond, the oldest opened goes
/// (each is a reservation of PyTorch's, ~158 GiB on a 141 GB GPU; a process has 128 TiB).
pub const KEPT_MAX: usize = 4096;
pub const KEPT_VA_MAX: u64 = 48 << 40;

#[derive(Default, Debug)]
pub struct Views {
    /// The program's reservations: start -> size.
    reservations: BTreeMap<u64, u64>,
    /// Imported handles whose page is known.
    handles: HashMap<u64, Id>,
    /// Views of reservations the program holds, by start.
    open: BTreeMap<u64, View>,
    /// Views kept after the program freed them, by `seq`.
    kept: BTreeMap<u64, View>,
    next_seq: u64,
    /// The `seq` of the view last opened again (the next guess follows it).
    cursor: u64,
}

impl Views {
    /// The program imported handle `h` of page `id`.
    pub fn imported(&mut self, h: u64, id: Id) {
        self.handles.insert(h, id);
    }

    /// The program released handle `h` (its mapping, if any, keeps the page).
    pub fn released(&mut self, h: u64) {
        self.handles.remove(&h);
    }

    /// The program asks for a reservation of `size` bytes: a kept view of at least that size, if any
    /// (the one after the last opened again, in the order first opened).
    pub fn reserve(&mut self, size: u64) -> Option<u64> {
        let pick = self
            .kept
            .range(self.cursor + 1..)
            .chain(self.kept.range(..=self.cursor))
            .find(|(_, v)| v.size >= size)
            .map(|(s, _)| *s)?;
        let mut v = self.kept.remove(&pick)?;
        v.guessed = true;
        let va = v.va;
        self.reservations.insert(va, v.size);
        self.open.insert(va, v);
        Some(va)
    }

    /// The driver reserved `[va, va+size)` for the program.
    pub fn reserved(&mut self, va: u64, size: u64) {
        self.reservations.insert(va, size);
    }

    fn reservation_of(&self, va: u64) -> Option<(u64, u64)> {
        let (s, n) = self.reservations.range(..=va).next_back()?;
        (va < s + n).then_some((*s, *n))
    }

    /// The program maps `len` bytes of handle `h` at `va` (from offset `off` of it).
    pub fn map(&mut self, va: u64, len: u64, off: u64, h: u64) -> Map {
        let id = self.handles.get(&h).copied().filter(|_| off == 0);
        let Some((base, size)) = self.reservation_of(va) else {
            return Map::Pass(Vec::new());
        };
        let at = va - base;
        if let Some(v) = self.open.get_mut(&base) {
            if v.guessed {
                let same = v
                    .slots
                    .get(&at)
                    .is_some_and(|s| !s.live && s.len == len && Some(s.id) == id);
                if same {
                    if let Some(s) = v.slots.get_mut(&at) {
                        s.live = true;
                    }
                    self.cursor = v.seq;
                    return Map::Done;
                }
                // A wrong guess: the view's mappings the program has not claimed go; what it
                // claimed stays (the same pages, mapped).
                let gone = v.take_unclaimed();
                v.guessed = false;
                v.access = None;
                v.add(at, len, id);
                // The next guess follows the kept view that starts with this page, if one
                // does (the program opens in another order from here).
                if let Some(id) = id {
                    let start = |k: &View| k.slots.values().next().is_some_and(|s| s.id == id);
                    if let Some((seq, _)) = self.kept.iter().find(|(_, k)| start(k)) {
                        self.cursor = *seq;
                    }
                }
                return Map::Pass(gone);
            }
            v.add(at, len, id);
            return Map::Pass(Vec::new());
        }
        if let Some(id) = id {
            self.next_seq += 1;
            let mut v = View {
                va: base,
                size,
                seq: self.next_seq,
                slots: BTreeMap::new(),
                access: None,
                keep: true,
                guessed: false,
            };
            v.add(at, len, Some(id));
            self.open.insert(base, v);
        }
        Map::Pass(Vec::new())
    }

    /// The program sets access on `[va, va+len)`: `(done, unmap_first)`: whether the access
    /// is already so (a kept view opened again whole), and mappings of a guessed view the
    /// program did not claim, to unmap (its pages are all mapped by now).
    pub fn access(&mut self, va: u64, len: u64, descs: &[(i32, u32)]) -> (bool, Vec<(u64, u64)>) {
        let Some((base, _)) = self.reservation_of(va) else {
            return (false, Vec::new());
        };
        let Some(v) = self.open.get_mut(&base) else {
            return (false, Vec::new());
        };
        let at = va - base;
        let mut extra = Vec::new();
        if v.guessed {
            v.guessed = false;
            extra = v.take_unclaimed();
            // Every page the program mapped was there (a mismatch ends the guess): if they are
            // the range the access was set on, with the same access, it stands.
            let same = v
                .access
                .as_ref()
                .is_some_and(|(o, n, d)| *o == at && *n == len && d == descs);
            if same && v.covers(at, len) {
                return (true, extra);
            }
        }
        v.access = Some((at, len, descs.to_vec()));
        (false, extra)
    }

    /// The program unmaps `[va, va+len)`: `true` if it is a mapping of a view that may be
    /// kept (nothing to do: it stays mapped); `may_keep(pid)`: whether producer `pid` tells
    /// this process of its pages.
    pub fn unmap(&mut self, va: u64, len: u64, may_keep: impl Fn(u32) -> bool) -> bool {
        let Some((base, _)) = self.reservation_of(va) else {
            return false;
        };
        let Some(v) = self.open.get_mut(&base) else {
            return false;
        };
        let at = va - base;
        let keep = v.keep && v.producer().is_some_and(&may_keep);
        match v.slots.get_mut(&at) {
            Some(s) if s.live && s.len == len && keep => {
                s.live = false;
                true
            }
            Some(s) if s.len == len => {
                v.slots.remove(&at);
                v.keep = false;
                false
            }
            _ => {
                // Another shape of unmap than the maps: not a view to keep.
                let gone: Vec<u64> = v
                    .slots
                    .range(at..at.saturating_add(len))
                    .map(|(o, _)| *o)
                    .collect();
                for o in gone {
                    v.slots.remove(&o);
                }
                v.keep = false;
                false
            }
        }
    }

    /// The program frees its reservation at `va`: kept (with its mappings and access), or
    /// passed on after unmapping what was left mapped for keeping. Views beyond
    /// [`KEPT_MAX`] come back to be dropped.
    pub fn address_free(&mut self, va: u64) -> (Free, Vec<View>) {
        self.reservations.remove(&va);
        let Some(v) = self.open.remove(&va) else {
            return (Free::Pass(Vec::new()), Vec::new());
        };
        let all_closed = v.slots.values().all(|s| !s.live);
        if v.keep && all_closed && !v.slots.is_empty() && !v.guessed {
            self.kept.insert(v.seq, v);
            let mut over = Vec::new();
            while self.kept.len() > KEPT_MAX || self.kept_va() > KEPT_VA_MAX {
                if let Some((_, old)) = self.kept.pop_first() {
                    over.push(old);
                }
            }
            return (Free::Kept, over);
        }
        // Live slots are the program's to have unmapped (or not: the driver says); the ones
        // kept virtually are ours to unmap.
        let ours = v
            .slots
            .iter()
            .filter(|(_, s)| !s.live)
            .map(|(o, s)| (va + o, s.len))
            .collect();
        (Free::Pass(ours), Vec::new())
    }

    /// Producer `pid`'s descriptor `fd` no longer names the page it named (or, `fd` `None`,
    /// the producer exited): its kept views come back to be dropped; open views holding it
    /// are not kept when freed.
    pub fn gone(&mut self, pid: u32, fd: Option<i32>) -> Vec<View> {
        let hit = |s: &Slot| s.id.pid == pid && fd.is_none_or(|f| s.id.fd == f);
        for v in self.open.values_mut() {
            if v.slots.values().any(hit) {
                v.keep = false;
            }
        }
        let seqs: Vec<u64> = self
            .kept
            .iter()
            .filter(|(_, v)| v.slots.values().any(hit))
            .map(|(s, _)| *s)
            .collect();
        self.handles
            .retain(|_, id| !(id.pid == pid && fd.is_none_or(|f| id.fd == f)));
        seqs.into_iter()
            .filter_map(|s| self.kept.remove(&s))
            .collect()
    }

    /// Whether page `id` is mapped in a view (kept, or handed back and not yet matched): an
    /// import of it may wait until a map needs the driver's handle.
    pub fn holds(&self, id: Id) -> bool {
        let has = |v: &View| v.slots.values().any(|s| s.id == id);
        self.kept.values().any(has) || self.open.values().filter(|v| v.guessed).any(has)
    }

    /// Address space kept (PyTorch reserves ~1.1x the device's memory a tensor).
    fn kept_va(&self) -> u64 {
        self.kept.values().map(|v| v.size).sum()
    }

    /// Every kept view, taken out: where the driver has no address space left for a
    /// reservation, they go first.
    pub fn take_kept(&mut self) -> Vec<View> {
        std::mem::take(&mut self.kept).into_values().collect()
    }

    /// Producers whose pages are kept here.
    pub fn kept_producers(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self.kept.values().filter_map(View::producer).collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    #[cfg(test)]
    pub fn kept_len(&self) -> usize {
        self.kept.len()
    }
}

impl View {
    /// The mappings of a handed-back view the program has not claimed, out of it: to unmap.
    fn take_unclaimed(&mut self) -> Vec<(u64, u64)> {
        let stale: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| !s.live)
            .map(|(o, _)| *o)
            .collect();
        stale
            .into_iter()
            .filter_map(|o| self.slots.remove(&o).map(|s| (self.va + o, s.len)))
            .collect()
    }

    fn add(&mut self, at: u64, len: u64, id: Option<Id>) {
        match id {
            Some(id) if self.producer().is_none_or(|p| p == id.pid) => {
                self.slots.insert(
                    at,
                    Slot {
                        len,
                        id,
                        live: true,
                    },
                );
            }
            // Not a known page of this view's producer: the program's to unmap; not kept.
            _ => self.keep = false,
        }
    }

    /// Whether live slots cover `[at, at+len)` without a gap.
    fn covers(&self, at: u64, len: u64) -> bool {
        let mut next = at;
        for (o, s) in self.slots.range(..at.saturating_add(len)) {
            if !s.live || o + s.len <= next {
                continue;
            }
            if *o > next {
                return false;
            }
            next = o + s.len;
        }
        next >= at.saturating_add(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 20 << 20;
    const RES: u64 = 1 << 40;
    const RW: [(i32, u32); 1] = [(0, 3)];

    fn id(fd: i32) -> Id {
        Id { pid: 77, fd }
    }

    /// PyTorch's `fromShared` of pages `fds` at a fresh or handed-back reservation: the
    /// reservation, whether each map and the access call were needed.
    fn open(v: &mut Views, fds: &[i32], h0: u64) -> (u64, Vec<bool>, bool, usize) {
        let va = match v.reserve(RES) {
            Some(va) => va,
            None => {
                let va = (h0 + 1) * 4 * RES;
                v.reserved(va, RES);
                va
            }
        };
        let mut maps = Vec::new();
        let mut unmapped = 0;
        for (i, fd) in fds.iter().enumerate() {
            let h = h0 + i as u64;
            v.imported(h, id(*fd));
            match v.map(va + i as u64 * PAGE, PAGE, 0, h) {
                Map::Done => maps.push(false),
                Map::Pass(u) => {
                    unmapped += u.len();
                    maps.push(true)
                }
            }
        }
        let (done, extra) = v.access(va, fds.len() as u64 * PAGE, &RW);
        (va, maps, !done, unmapped + extra.len())
    }

    fn close(v: &mut Views, va: u64, n: usize, h0: u64) -> (Vec<bool>, bool) {
        let unmaps = (0..n)
            .map(|i| !v.unmap(va + i as u64 * PAGE, PAGE, |p| p == 77))
            .collect();
        for i in 0..n {
            v.released(h0 + i as u64);
        }
        (unmaps, matches!(v.address_free(va).0, Free::Kept))
    }

    #[test]
    fn tensors_opened_again_in_the_same_order_get_their_reservations_with_nothing_to_do() {
        let mut v = Views::default();
        let tensors: [&[i32]; 3] = [&[10, 11], &[12], &[13, 14]];
        let mut vas = Vec::new();
        for (k, t) in tensors.iter().enumerate() {
            let (va, maps, access, _) = open(&mut v, t, 100 * k as u64);
            assert!(maps.iter().all(|m| *m) && access, "first open: real calls");
            vas.push(va);
        }
        for (k, t) in tensors.iter().enumerate() {
            let (unmaps, kept) = close(&mut v, vas[k], t.len(), 100 * k as u64);
            assert!(unmaps.iter().all(|u| !u) && kept, "kept mapped");
        }
        assert_eq!(v.kept_len(), 3);
        for round in 0..3 {
            for (k, t) in tensors.iter().enumerate() {
                let (va, maps, access, unmapped) = open(&mut v, t, 1000 + 100 * k as u64);
                assert_eq!(va, vas[k], "round {round}: the same reservation");
                assert!(maps.iter().all(|m| !m) && !access && unmapped == 0);
            }
            for (k, t) in tensors.iter().enumerate() {
                close(&mut v, vas[k], t.len(), 1000 + 100 * k as u64);
            }
        }
    }

    #[test]
    fn a_wrong_guess_unmaps_the_views_pages_and_maps_the_programs_and_the_next_guess_follows() {
        let mut v = Views::default();
        let tensors: [&[i32]; 3] = [&[10], &[11, 12], &[13]];
        let vas: Vec<u64> = tensors
            .iter()
            .enumerate()
            .map(|(k, t)| open(&mut v, t, 10 * k as u64).0)
            .collect();
        for (k, t) in tensors.iter().enumerate() {
            close(&mut v, vas[k], t.len(), 10 * k as u64);
        }
        // The second tensor comes first now: it gets the first's reservation (a guess), whose
        // page goes; its own pages are mapped there for real.
        let (va, maps, access, unmapped) = open(&mut v, tensors[1], 500);
        assert_eq!(va, vas[0]);
        assert_eq!((maps, access, unmapped), (vec![true, true], true, 1));
        // The third follows the first in the guessing order: its own view, nothing to do.
        let (va3, maps3, access3, _) = open(&mut v, tensors[2], 600);
        assert_eq!(va3, vas[2]);
        assert!(maps3.iter().all(|m| !m) && !access3);
    }

    #[test]
    fn a_smaller_tensor_in_a_kept_view_leaves_the_pages_it_does_not_use_to_be_unmapped() {
        let mut v = Views::default();
        let (va, ..) = open(&mut v, &[10, 11], 0);
        close(&mut v, va, 2, 0);
        let (va2, maps, access, unmapped) = open(&mut v, &[10], 50);
        assert_eq!(va2, va);
        assert_eq!(maps, vec![false], "its page is there");
        assert_eq!(unmapped, 1, "the other page goes at the access call");
        assert!(access, "a different range: access is set");
    }

    #[test]
    fn a_page_the_producer_let_go_takes_its_kept_views_with_it_and_open_ones_are_not_kept() {
        let mut v = Views::default();
        let (a, ..) = open(&mut v, &[10], 0);
        let (b, ..) = open(&mut v, &[11], 10);
        close(&mut v, a, 1, 0);
        let gone = v.gone(77, Some(10));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].mappings(), vec![(a, PAGE)]);
        // Open view b: the number is reused (told while b is open): b is not kept at its close.
        assert!(v.gone(77, Some(11)).is_empty());
        let (unmaps, kept) = close(&mut v, b, 1, 10);
        assert_eq!((unmaps, kept), (vec![true], false));
        // A kept view of an exited producer goes too.
        let (c, ..) = open(&mut v, &[12], 20);
        close(&mut v, c, 1, 20);
        assert_eq!(v.kept_producers(), vec![77]);
        assert_eq!(v.gone(77, None).len(), 1);
        assert!(v.kept_producers().is_empty());
    }

    #[test]
    fn views_of_unknown_pages_or_producers_that_do_not_tell_are_not_kept() {
        let mut v = Views::default();
        // A page of the program's own (not imported) mapped in the reservation.
        v.reserved(RES * 2, RES);
        v.imported(1, id(10));
        assert_eq!(v.map(RES * 2, PAGE, 0, 1), Map::Pass(vec![]));
        assert_eq!(v.map(RES * 2 + PAGE, PAGE, 0, 999), Map::Pass(vec![]));
        v.access(RES * 2, 2 * PAGE, &RW);
        assert!(!v.unmap(RES * 2, PAGE, |_| true));
        assert!(matches!(v.address_free(RES * 2).0, Free::Pass(_)));
        // A producer that does not tell this process.
        let (va, ..) = open(&mut v, &[20], 5);
        assert!(!v.unmap(va, PAGE, |_| false));
        assert!(matches!(v.address_free(va).0, Free::Pass(ref u) if u.is_empty()));
        assert_eq!(v.kept_len(), 0);
    }

    /// A model of the driver's mappings: address -> (descriptor number, the page's generation:
    /// a number the producer gives to another page names a new generation).
    #[derive(Default)]
    struct Driver {
        maps: BTreeMap<u64, (i32, u32)>,
    }

    impl Driver {
        fn unmap(&mut self, at: u64, what: &str) {
            assert!(
                self.maps.remove(&at).is_some(),
                "{what}: unmap of nothing at {at:#x}"
            );
        }
    }

    #[test]
    fn random_opens_closes_and_renumbered_pages_never_reuse_a_mapping_of_another_page() {
        let mut rng = crate::test_rng::Rng::from_env("random views test");
        let seed = rng.seed();
        let mut below = |n: u64| rng.below(n);
        const FDS: i32 = 6;
        for round in 0..30 {
            let mut v = Views::default();
            let mut d = Driver::default();
            let mut gen = [0u32; FDS as usize];
            let mut next_res = 1u64;
            let mut h = 0u64;
            // Open tensors: reservation -> (pages by descriptor, their handles).
            let mut open: Vec<(u64, Vec<i32>, Vec<u64>)> = Vec::new();
            for step in 0..400 {
                let what = format!("seed {seed} round {round} step {step}");
                match below(10) {
                    0..=4 if open.len() < 6 => {
                        let n = 1 + below(2) as usize;
                        let fds: Vec<i32> = (0..n).map(|_| below(FDS as u64) as i32).collect();
                        let va = match v.reserve(RES) {
                            Some(va) => va,
                            None => {
                                next_res += 1;
                                let va = next_res * 4 * RES;
                                v.reserved(va, RES);
                                va
                            }
                        };
                        let mut hs = Vec::new();
                        for (i, fd) in fds.iter().enumerate() {
                            h += 1;
                            v.imported(h, id(*fd));
                            hs.push(h);
                            let at = va + i as u64 * PAGE;
                            match v.map(at, PAGE, 0, h) {
                                Map::Done => assert_eq!(
                                    d.maps.get(&at),
                                    Some(&(*fd, gen[*fd as usize])),
                                    "{what}: a page found in place must be the page asked for"
                                ),
                                Map::Pass(stale) => {
                                    for (a, _) in stale {
                                        d.unmap(a, &what);
                                    }
                                    assert!(!d.maps.contains_key(&at), "{what}: mapped over");
                                    d.maps.insert(at, (*fd, gen[*fd as usize]));
                                }
                            }
                        }
                        let (done, extra) = v.access(va, n as u64 * PAGE, &RW);
                        for (a, _) in extra {
                            d.unmap(a, &what);
                        }
                        if done {
                            for (i, fd) in fds.iter().enumerate() {
                                let at = va + i as u64 * PAGE;
                                assert_eq!(
                                    d.maps.get(&at),
                                    Some(&(*fd, gen[*fd as usize])),
                                    "{what}"
                                );
                            }
                        }
                        // What the program reads: its own pages, each the current generation.
                        for (i, fd) in fds.iter().enumerate() {
                            let at = va + i as u64 * PAGE;
                            assert_eq!(
                                d.maps.get(&at),
                                Some(&(*fd, gen[*fd as usize])),
                                "{what}: read"
                            );
                        }
                        open.push((va, fds, hs));
                    }
                    0..=7 if !open.is_empty() => {
                        let k = below(open.len() as u64) as usize;
                        let (va, fds, hs) = open.swap_remove(k);
                        for i in 0..fds.len() {
                            let at = va + i as u64 * PAGE;
                            if !v.unmap(at, PAGE, |_| true) {
                                d.unmap(at, &what);
                            }
                        }
                        for h in hs {
                            v.released(h);
                        }
                        let (free, over) = v.address_free(va);
                        if let Free::Pass(ours) = free {
                            for (a, _) in ours {
                                d.unmap(a, &what);
                            }
                            assert!(
                                d.maps.range(va..va + RES).next().is_none(),
                                "{what}: a freed reservation holds a mapping"
                            );
                        }
                        for o in over {
                            for (a, _) in o.mappings() {
                                d.unmap(a, &what);
                            }
                        }
                    }
                    _ => {
                        // The producer gives a number to another page (or releases it).
                        let fd = below(FDS as u64) as i32;
                        for gone in v.gone(77, Some(fd)) {
                            for (a, _) in gone.mappings() {
                                d.unmap(a, &what);
                            }
                        }
                        gen[fd as usize] += 1;
                    }
                }
                // Every kept view maps exactly what the books say, all of current generations
                // or stale ones the books no longer name.
                for k in v.kept.values() {
                    for (off, s) in &k.slots {
                        assert!(!s.live, "{what}: a kept view with a live slot");
                        let m = d.maps.get(&(k.va + off));
                        assert_eq!(m.map(|m| m.0), Some(s.id.fd), "{what}: kept slot unmapped");
                        assert_eq!(
                            m.map(|m| m.1),
                            Some(gen[s.id.fd as usize]),
                            "{what}: a stale page kept"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn kept_views_are_bounded_by_address_space_too() {
        let mut v = Views::default();
        let big = 16 << 40; // 16 TiB each: three fit in the bound
        let mut dropped = Vec::new();
        for k in 0..4u64 {
            let va = ((k + 1) * 64) << 40;
            v.reserved(va, big);
            v.imported(k, id(k as i32));
            v.map(va, PAGE, 0, k);
            v.access(va, PAGE, &RW);
            v.unmap(va, PAGE, |_| true);
            let (_, over) = v.address_free(va);
            dropped.extend(over.into_iter().map(|o| o.va));
        }
        assert_eq!(dropped, vec![64 << 40]);
        assert_eq!(v.take_kept().len(), 3);
        assert_eq!(v.reserve(PAGE), None, "none left");
    }

    #[test]
    fn kept_views_are_bounded_oldest_first() {
        let mut v = Views::default();
        let mut dropped = Vec::new();
        for k in 0..(KEPT_MAX + 2) {
            let va = (k as u64 + 1) * 4 * RES;
            v.reserved(va, 4 * PAGE);
            v.imported(k as u64, id(k as i32));
            v.map(va, PAGE, 0, k as u64);
            v.access(va, PAGE, &RW);
            v.unmap(va, PAGE, |_| true);
            let (f, over) = v.address_free(va);
            assert!(matches!(f, Free::Kept));
            dropped.extend(over.into_iter().map(|o| o.va));
        }
        assert_eq!(dropped, vec![4 * RES, 8 * RES], "the first two opened");
        assert_eq!(v.kept_len(), KEPT_MAX);
    }
}
