//! What the IPC calls remember: the tickets this process issued (and, for a while, the ones
//! gone stale), the runs of foreign memory it shared, and the memory it opened through
//! others' tickets.

use super::mirror::Mirror;
use crate::gpu::views::Imported;
use crate::ipc::sockdir;
use crate::ipc::transport;
use crate::ipc::{random_u64, Ticket};
use crate::stats::GLOBAL;
use std::collections::HashMap;
use std::sync::Arc;

/// Tickets this process issued, and memory it opened through other processes' tickets.
#[derive(Default)]
pub(crate) struct IpcState {
    next_id: u32,
    /// ticket id -> (device, allocation base, nonce)
    pub(super) by_id: HashMap<u32, (i32, u64, u64)>,
    /// (device, base) -> ticket id: one ticket per allocation, so repeated requests return
    /// the same 64 bytes
    by_alloc: HashMap<(i32, u64), u32>,
    /// Tickets of the most recently freed allocations (at most [`FREED_KEPT`]): refused as
    /// stale, not as unknown; older ones are refused as unknown.
    pub(super) freed: std::collections::HashSet<u32>,
    freed_order: std::collections::VecDeque<u32>,
    /// Live tickets a consumer running expseg was granted (it maps the memory itself: the
    /// mirror needs no copy at the program's synchronizations, `EXPSEG_IPC_MIRROR_SYNC`),
    /// with the consumers of this process's own user that were (they may keep it mapped after
    /// they close it, and are told when it is freed: [`IpcState::take_to_tell`]).
    granted: HashMap<u32, Vec<u32>>,
    /// Freed tickets and the consumers to tell, waiting for a caller outside the lock.
    to_tell: Vec<(u32, Vec<u32>)>,
    /// Whether the ticket socket is serving (`None`: not tried yet).
    pub(super) server: Option<bool>,
    /// Why the socket could not serve.
    pub(super) server_error: Option<String>,
    /// Mirrors of VMM memory expseg does not own, by the start of the mapping.
    pub(crate) foreign: HashMap<u64, ForeignShare>,
    /// Imported mappings by the address `cudaIpcOpenMemHandle` returned.
    pub(super) opened: std::collections::BTreeMap<u64, Opened>,
}

/// Which ticket, opened on which device: (producer uid, pid, ticket id, nonce, device).
pub(crate) type OpenKey = (u32, u32, u32, u64, i32);

/// Memory opened through a ticket: the mapping, the ticket and device it came from, and how
/// many opens it stands for. CUDA counts a second `cudaIpcOpenMemHandle` of one handle in a
/// context as one more reference to the first: the same address, one close each. With no
/// reference left it may stay mapped, *kept* for the next open of the same ticket (`keep`:
/// the producer tells this process when it frees the memory), unseen by the program.
pub(crate) struct Opened {
    pub(crate) imp: Imported,
    key: OpenKey,
    refs: u32,
    keep: bool,
}

/// Most mappings kept after their last close; the oldest beyond go.
pub(super) const KEPT_MAX: usize = 1024;

/// What one `cudaIpcCloseMemHandle` of memory opened through a ticket leaves.
pub(crate) enum Closed {
    /// Other opens still use it.
    Kept,
    /// The last reference: unmap it.
    Last(Imported),
    /// The last reference, and the mapping (of process `producer`'s memory, on device
    /// `dev`) stays for the next open of its ticket; the mappings kept beyond [`KEPT_MAX`]
    /// come back to be unmapped (`over`).
    KeptMapped {
        producer: u32,
        dev: i32,
        over: Vec<Imported>,
    },
}

impl IpcState {
    /// The next ticket id: counting up from 1 and wrapping below the request ids
    /// (`transport::FIRST_REQUEST_ID`), past any id still live or remembered as stale.
    fn next_ticket_id(&mut self) -> u32 {
        loop {
            self.next_id = self.next_id % (transport::FIRST_REQUEST_ID - 1) + 1;
            let id = self.next_id;
            if !self.by_id.contains_key(&id) && !self.freed.contains(&id) {
                return id;
            }
        }
    }

    /// Memory opened through tickets on device `dev` (kept mappings included).
    pub(crate) fn opened_on(&self, dev: i32) -> impl Iterator<Item = &Imported> {
        self.opened
            .values()
            .map(|o| &o.imp)
            .filter(move |i| i.dev == dev)
    }

    /// The address of ticket `key` if it is open already, or kept mapped since its last
    /// close: one reference more.
    pub(crate) fn reopen(&mut self, key: OpenKey) -> Option<u64> {
        let (va, o) = self.opened.iter_mut().find(|(_, o)| o.key == key)?;
        if o.refs == 0 {
            GLOBAL.ipc_kept_reopened.add(1);
        }
        o.refs += 1;
        Some(*va)
    }

    /// Record memory just opened through ticket `key`; `keep`: it may stay mapped after its
    /// last close. Another thread may have opened the same ticket meanwhile: then that
    /// mapping gets the reference and this one comes back to be unmapped.
    pub(crate) fn record_open(
        &mut self,
        key: OpenKey,
        imp: Imported,
        keep: bool,
    ) -> Result<u64, (u64, Imported)> {
        if let Some(va) = self.reopen(key) {
            return Err((va, imp));
        }
        let va = imp.addr();
        let refs = 1;
        self.opened.insert(
            va,
            Opened {
                imp,
                key,
                refs,
                keep,
            },
        );
        Ok(va)
    }

    /// One close of `va`; `None` if no ticket was opened there (or it is kept, closed).
    pub(crate) fn close(&mut self, va: u64) -> Option<Closed> {
        let o = self.opened.get_mut(&va).filter(|o| o.refs > 0)?;
        if o.refs > 1 {
            o.refs -= 1;
            return Some(Closed::Kept);
        }
        if o.keep {
            o.refs = 0;
            let (producer, dev) = (o.key.1, o.imp.dev);
            GLOBAL.ipc_kept_closed.add(1);
            let over = self.over_kept();
            return Some(Closed::KeptMapped {
                producer,
                dev,
                over,
            });
        }
        self.opened.remove(&va).map(|o| Closed::Last(o.imp))
    }

    /// Kept mappings beyond [`KEPT_MAX`], out of the books (lowest addresses first: one
    /// reservation after another, the oldest usually).
    fn over_kept(&mut self) -> Vec<Imported> {
        let kept: Vec<u64> = self
            .opened
            .iter()
            .filter(|(_, o)| o.refs == 0)
            .map(|(va, _)| *va)
            .collect();
        let over = kept.len().saturating_sub(KEPT_MAX);
        self.take_kept(kept.into_iter().take(over))
    }

    fn take_kept(&mut self, vas: impl Iterator<Item = u64>) -> Vec<Imported> {
        let gone: Vec<Imported> = vas
            .filter_map(|va| self.opened.remove(&va).map(|o| o.imp))
            .collect();
        GLOBAL.ipc_kept_dropped.add(gone.len() as u64);
        gone
    }

    /// Producer `pid` freed ticket `id` (`ipc::closed`): its kept mapping comes back to be
    /// unmapped; one still open is not kept after its last close (natively the memory stays
    /// while the consumer has it open).
    pub(crate) fn producer_freed(&mut self, pid: u32, id: u32) -> Vec<Imported> {
        self.producer_gone(|k| k.1 == pid && k.2 == id)
    }

    /// Producer `pid` exited: every kept mapping of its memory comes back to be unmapped.
    pub(crate) fn producer_exited(&mut self, pid: u32) -> Vec<Imported> {
        self.producer_gone(|k| k.1 == pid)
    }

    fn producer_gone(&mut self, of: impl Fn(&OpenKey) -> bool) -> Vec<Imported> {
        let mut kept = Vec::new();
        for (va, o) in self.opened.iter_mut().filter(|(_, o)| of(&o.key)) {
            o.keep = false;
            if o.refs == 0 {
                kept.push(*va);
            }
        }
        self.take_kept(kept.into_iter())
    }

    /// Producers whose memory is kept mapped here, closed.
    pub(crate) fn kept_producers(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .opened
            .values()
            .filter(|o| o.refs == 0)
            .map(|o| o.key.1)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Every mapping opened through a ticket on `dev`, whatever its references, taken out of
    /// the books (a device reset ends them, as it ends memory opened with legacy IPC).
    pub(crate) fn take_opened_on(&mut self, dev: i32) -> Vec<Imported> {
        let vas: Vec<u64> = self
            .opened
            .iter()
            .filter(|(_, o)| o.imp.dev == dev)
            .map(|(va, _)| *va)
            .collect();
        vas.into_iter()
            .filter_map(|va| self.opened.remove(&va).map(|o| o.imp))
            .collect()
    }

    /// The mapping opened through a ticket that contains `ptr` (not one kept, closed).
    pub(crate) fn opened_at(&self, ptr: u64) -> Option<&Imported> {
        let (va, o) = self.opened.range(..=ptr).next_back()?;
        (*va <= ptr && ptr < o.imp.va + o.imp.size && o.refs > 0).then_some(&o.imp)
    }

    /// The ticket of allocation `base` on `dev`, issued on first use; `None` without a random
    /// source for its nonce (the handle then carries no ticket).
    pub(super) fn ticket(&mut self, dev: i32, base: u64) -> Option<Ticket> {
        let id = match self.by_alloc.get(&(dev, base)) {
            Some(id) => *id,
            None => {
                let Some(nonce) = random_u64() else {
                    log::error!("IPC: no random source for a ticket's nonce; no ticket");
                    return None;
                };
                let id = self.next_ticket_id();
                self.by_id.insert(id, (dev, base, nonce));
                GLOBAL.ipc_tickets_issued.add(1);
                self.by_alloc.insert((dev, base), id);
                id
            }
        };
        Some(Ticket {
            pid: std::process::id(),
            uid: sockdir::current_uid(),
            id,
            nonce: self.by_id[&id].2,
        })
    }

    /// A consumer running expseg was granted ticket `id`; `keeper`: its pid, where it is of
    /// this process's own user (it may keep the memory mapped after it closes it).
    pub(super) fn note_granted(&mut self, id: u32, keeper: Option<u32>) {
        if self.by_id.contains_key(&id) {
            let pids = self.granted.entry(id).or_default();
            if let Some(pid) = keeper.filter(|p| !pids.contains(p)) {
                pids.push(pid);
            }
        }
    }

    /// Whether a consumer running expseg was granted the ticket of allocation `base` on `dev`.
    pub(super) fn granted_at(&self, dev: i32, base: u64) -> bool {
        self.by_alloc
            .get(&(dev, base))
            .is_some_and(|id| self.granted.contains_key(id))
    }

    /// Freed tickets and the consumers to tell (`ipc::closed`), taken to be told outside
    /// the lock.
    pub(crate) fn take_to_tell(&mut self) -> Vec<(u32, Vec<u32>)> {
        TO_TELL.store(false, std::sync::atomic::Ordering::Release);
        std::mem::take(&mut self.to_tell)
    }

    /// The allocation was freed: its tickets are stale from now on, and the consumers that
    /// may keep it mapped are to be told.
    pub(crate) fn forget(&mut self, dev: i32, base: u64) {
        if let Some(id) = self.by_alloc.remove(&(dev, base)) {
            self.by_id.remove(&id);
            if let Some(pids) = self.granted.remove(&id).filter(|p| !p.is_empty()) {
                self.to_tell.push((id, pids));
                TO_TELL.store(true, std::sync::atomic::Ordering::Release);
            }
            if self.freed.insert(id) {
                self.freed_order.push_back(id);
            }
            while self.freed_order.len() > FREED_KEPT {
                if let Some(old) = self.freed_order.pop_front() {
                    self.freed.remove(&old);
                }
            }
        }
    }

    /// The program unmapped `[va, va+size)`: shares of runs that start there end (their
    /// tickets go stale; returned, to be dropped outside the lock: a mirror is freed), and a
    /// run cut short after its start stands for its part before the cut from now on, so its
    /// ticket never exports pages mapped there later.
    pub(crate) fn unmapped(&mut self, va: u64, size: u64) -> Vec<ForeignShare> {
        let end = va.saturating_add(size);
        let gone: Vec<u64> = self
            .foreign
            .keys()
            .filter(|b| (va..end).contains(*b))
            .copied()
            .collect();
        let mut dropped = Vec::new();
        for base in gone {
            if let Some(f) = self.foreign.remove(&base) {
                self.forget(f.dev, base);
                dropped.push(f);
            }
        }
        for (b, f) in self.foreign.iter_mut() {
            if *b < va && va < b.saturating_add(f.size) {
                f.size = va - b;
            }
        }
        dropped
    }
}

/// Whether freed tickets wait to be told to their consumers (read without the lock by every
/// free and unmap that may have freed one).
pub(crate) static TO_TELL: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// How many freed tickets are remembered as stale.
const FREED_KEPT: usize = 4096;

/// VMM memory of another allocator that was asked for a handle: the run of mappings the
/// handle stands for, and its mirror (none when only expseg consumers are served).
pub(crate) struct ForeignShare {
    pub(crate) dev: i32,
    pub(super) size: u64,
    pub(super) mirror: Option<Arc<Mirror>>,
}

/// Most mappings a foreign run covers (20 MiB pages: 1.25 TiB).
pub(super) const MAX_RUN: usize = transport::MAX_CHUNKS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_random_source_no_ticket_is_issued() {
        use crate::ipc::transport::NO_RANDOM;
        NO_RANDOM.with(|n| n.set(true));
        let mut s = IpcState::default();
        let t = s.ticket(0, 1 << 21);
        let r = crate::ipc::random_u64();
        NO_RANDOM.with(|n| n.set(false));
        assert!(t.is_none(), "no guessable nonce");
        assert!(r.is_none());
        assert!(s.by_id.is_empty());
    }

    #[test]
    fn ticket_ids_wrap_below_the_request_ids_and_past_live_ones() {
        use crate::ipc::{control, reclaim};
        for request in [
            control::SHARING_ID,
            control::QUERY_ID,
            control::RESUME_ID,
            control::PAUSE_ID,
            reclaim::RECLAIM_ID,
            crate::api::fdshare::record::GETFD_ID,
            crate::ipc::closed::CLOSED_ID,
            crate::ipc::closed::WATCH_ID,
        ] {
            assert!(request >= transport::FIRST_REQUEST_ID);
        }
        let mut s = IpcState::default();
        let live = s.ticket(0, 1 << 21).unwrap().id;
        assert_eq!(live, 1);
        s.next_id = transport::FIRST_REQUEST_ID - 3;
        let ids: Vec<u32> = (2..6).map(|b| s.ticket(0, b << 21).unwrap().id).collect();
        assert_eq!(
            ids,
            vec![
                transport::FIRST_REQUEST_ID - 2,
                transport::FIRST_REQUEST_ID - 1,
                2, // 1 is still live
                3
            ]
        );
        // A stale one (freed, still remembered) is not given again either.
        s.forget(0, 4 << 21);
        s.next_id = 1;
        assert_eq!(s.ticket(0, 9 << 21).unwrap().id, 4);
    }

    #[test]
    fn an_unmap_ends_the_runs_it_starts_in_and_cuts_the_one_it_splits() {
        const MIB: u64 = 1 << 20;
        let mut s = IpcState::default();
        let share = |size| ForeignShare {
            dev: 0,
            size,
            mirror: None,
        };
        for (base, size) in [(0, 100 * MIB), (200 * MIB, 40 * MIB), (300 * MIB, 20 * MIB)] {
            s.foreign.insert(base, share(size));
            s.ticket(0, base).unwrap();
        }
        // The tail of the first run and the whole second one.
        let dropped = s.unmapped(60 * MIB, 180 * MIB);
        assert_eq!(dropped.len(), 1, "the second run started in the range");
        assert!(!s.foreign.contains_key(&(200 * MIB)));
        assert_eq!(
            s.foreign[&0].size,
            60 * MIB,
            "the first stands for what is left"
        );
        assert_eq!(
            s.foreign[&(300 * MIB)].size,
            20 * MIB,
            "the third untouched"
        );
        assert!(
            s.by_alloc.contains_key(&(0, 0)),
            "the first run's ticket stands"
        );
        assert!(
            !s.by_alloc.contains_key(&(0, 200 * MIB)),
            "the second's is stale"
        );
    }

    #[test]
    fn a_kept_mapping_serves_the_next_open_until_its_producer_frees_it_or_exits() {
        const MIB: u64 = 1 << 20;
        let mut s = IpcState::default();
        let key = |pid, id| (1000, pid, id, 7, 0);
        let open = |s: &mut IpcState, va, pid, id, keep| {
            s.record_open(key(pid, id), Imported::for_test(va, 32 * MIB, 0), keep)
                .map_err(|_| ())
                .unwrap()
        };
        assert_eq!(open(&mut s, 100 * MIB, 50, 1, true), 100 * MIB);
        // The last close keeps it mapped, unseen by range queries; a second close is not ours.
        assert!(matches!(
            s.close(100 * MIB),
            Some(Closed::KeptMapped { producer: 50, dev: 0, ref over }) if over.is_empty()
        ));
        assert!(
            s.opened_at(100 * MIB + 5).is_none(),
            "closed: not the program's"
        );
        assert!(s.close(100 * MIB).is_none());
        assert_eq!(s.kept_producers(), vec![50]);
        // The next open of the same ticket is the same mapping.
        assert_eq!(s.reopen(key(50, 1)), Some(100 * MIB));
        assert!(s.opened_at(100 * MIB + 5).is_some());
        assert!(s.kept_producers().is_empty());
        // The producer frees it while it is open: kept no more; the close unmaps.
        assert!(s.producer_freed(50, 1).is_empty(), "in use: stays");
        assert!(matches!(s.close(100 * MIB), Some(Closed::Last(_))));
        // Kept, then freed: it comes back to be unmapped; another producer's stays.
        open(&mut s, 200 * MIB, 50, 2, true);
        open(&mut s, 300 * MIB, 51, 2, true);
        s.close(200 * MIB);
        s.close(300 * MIB);
        let gone = s.producer_freed(50, 2);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].va, 200 * MIB);
        assert_eq!(s.reopen(key(50, 2)), None, "gone");
        // Its producer exits: every mapping kept of it goes.
        assert_eq!(s.producer_exited(51).len(), 1);
        assert!(s.kept_producers().is_empty() && s.opened.is_empty());
        // Not to keep (another user's memory, or EXPSEG_IPC_KEEP_CLOSED=0): the close unmaps.
        open(&mut s, 400 * MIB, 52, 1, false);
        assert!(matches!(s.close(400 * MIB), Some(Closed::Last(_))));
    }

    #[test]
    fn kept_mappings_beyond_the_bound_go_lowest_first() {
        let mut s = IpcState::default();
        let mut over = Vec::new();
        for i in 0..(KEPT_MAX as u64 + 2) {
            let va = (i + 1) << 30;
            s.record_open(
                (0, 9, i as u32 + 1, 1, 0),
                Imported::for_test(va, 1 << 20, 0),
                true,
            )
            .map_err(|_| ())
            .unwrap();
            if let Some(Closed::KeptMapped { over: o, .. }) = s.close(va) {
                over.extend(o.into_iter().map(|i| i.va));
            }
        }
        assert_eq!(over, vec![1 << 30, 2 << 30]);
        assert_eq!(s.opened.len(), KEPT_MAX);
    }

    #[test]
    fn a_freed_ticket_is_told_to_the_consumers_of_the_own_user_it_was_granted_to() {
        let mut s = IpcState::default();
        let t = s.ticket(0, 1 << 21).unwrap();
        s.note_granted(t.id, Some(40));
        s.note_granted(t.id, Some(40));
        s.note_granted(t.id, None); // another user's consumer: not told
        s.note_granted(t.id, Some(41));
        assert!(s.granted_at(0, 1 << 21));
        let other = s.ticket(0, 2 << 21).unwrap();
        s.note_granted(other.id, None);
        s.forget(0, 2 << 21);
        assert!(s.take_to_tell().is_empty(), "nobody who keeps");
        s.forget(0, 1 << 21);
        assert_eq!(s.take_to_tell(), vec![(t.id, vec![40, 41])]);
        assert!(s.take_to_tell().is_empty(), "told once");
    }

    #[test]
    fn freed_tickets_are_remembered_within_a_bound() {
        let mut s = IpcState::default();
        for base in 0..(3 * FREED_KEPT as u64) {
            s.ticket(0, base << 21);
            s.forget(0, base << 21);
        }
        assert_eq!(s.freed.len(), FREED_KEPT);
        assert_eq!(s.freed_order.len(), FREED_KEPT);
        assert!(s.by_id.is_empty() && s.by_alloc.is_empty());
        // The newest is stale, the oldest forgotten.
        assert!(s.freed.contains(&(3 * FREED_KEPT as u32)));
        assert!(!s.freed.contains(&1));
    }
}
