//! What the IPC calls remember: the tickets this process issued (and, for a while, the ones
//! gone stale), the runs of foreign memory it shared, and the memory it opened through
//! others' tickets.

use super::mirror::Mirror;
use crate::gpu::cuda::Imported;
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
    /// mirror needs no copy at the program's synchronizations, `EXPSEG_IPC_MIRROR_SYNC`).
    granted: std::collections::HashSet<u32>,
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
/// context as one more reference to the first: the same address, one close each.
pub(crate) struct Opened {
    pub(crate) imp: Imported,
    key: OpenKey,
    refs: u32,
}

/// What one `cudaIpcCloseMemHandle` of memory opened through a ticket leaves.
pub(crate) enum Closed {
    /// Other opens still use it.
    Kept,
    /// The last reference: unmap it.
    Last(Imported),
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

    /// Memory opened through tickets on device `dev`.
    pub(crate) fn opened_on(&self, dev: i32) -> impl Iterator<Item = &Imported> {
        self.opened
            .values()
            .map(|o| &o.imp)
            .filter(move |i| i.dev == dev)
    }

    /// The address of ticket `key` if it is open already: one reference more.
    pub(crate) fn reopen(&mut self, key: OpenKey) -> Option<u64> {
        let (va, o) = self.opened.iter_mut().find(|(_, o)| o.key == key)?;
        o.refs += 1;
        Some(*va)
    }

    /// Record memory just opened through ticket `key`. Another thread may have opened the
    /// same ticket meanwhile: then that mapping gets the reference and this one comes back to
    /// be unmapped.
    pub(crate) fn record_open(
        &mut self,
        key: OpenKey,
        imp: Imported,
    ) -> Result<u64, (u64, Imported)> {
        if let Some(va) = self.reopen(key) {
            return Err((va, imp));
        }
        let va = imp.addr();
        self.opened.insert(va, Opened { imp, key, refs: 1 });
        Ok(va)
    }

    /// One close of `va`; `None` if no ticket was opened there.
    pub(crate) fn close(&mut self, va: u64) -> Option<Closed> {
        let o = self.opened.get_mut(&va)?;
        if o.refs > 1 {
            o.refs -= 1;
            return Some(Closed::Kept);
        }
        self.opened.remove(&va).map(|o| Closed::Last(o.imp))
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

    /// The mapping opened through a ticket that contains `ptr`.
    pub(crate) fn opened_at(&self, ptr: u64) -> Option<&Imported> {
        let (va, o) = self.opened.range(..=ptr).next_back()?;
        (*va <= ptr && ptr < o.imp.va + o.imp.size).then_some(&o.imp)
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

    /// A consumer running expseg was granted ticket `id`.
    pub(super) fn note_granted(&mut self, id: u32) {
        if self.by_id.contains_key(&id) {
            self.granted.insert(id);
        }
    }

    /// Whether a consumer running expseg was granted the ticket of allocation `base` on `dev`.
    pub(super) fn granted_at(&self, dev: i32, base: u64) -> bool {
        self.by_alloc
            .get(&(dev, base))
            .is_some_and(|id| self.granted.contains(id))
    }

    /// The allocation was freed: its tickets are stale from now on.
    pub(crate) fn forget(&mut self, dev: i32, base: u64) {
        if let Some(id) = self.by_alloc.remove(&(dev, base)) {
            self.by_id.remove(&id);
            self.granted.remove(&id);
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
