//! Compaction: the live pages of a partly released handle move into new handles at the same
//! addresses (through device memory, else host memory), the old handle goes back; every step
//! before that has a way back. `settle` decides when.

use super::books::{Coalescer, INVALID};
use crate::config::PeerHold;
use crate::gpu::{ChunkHandle, Driver, DrvError, DrvResult, PageProps, PeerWait};

/// A move that may wait (giving back stranded bytes) was put off: a peer given access to its
/// pages could not be held (`EXPSEG_PEER_HOLD=1`), so its kernels queued meanwhile could write
/// them while they move. Nothing moved; the pages stay where they are (`CUDA_ERROR_NOT_READY`).
pub(super) const PUT_OFF: DrvError = DrvError(600);
/// A driver's answer where a stream of the program's captures a CUDA graph (`gpu::fence`):
/// no move is made.
const CAPTURING: u32 = 900;

/// A compaction that would move pages the program has mapped, with moving them off
/// (`CoalesceConfig::move_live`): nothing changed (`CUDA_ERROR_NOT_PERMITTED`).
pub(super) const STAYS: DrvError = DrvError(800);

/// Whether a compaction may move pages the program has mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Live {
    /// As configured (`move_live`): the stranded-byte compactions, ghosts in the way.
    AsConfigured,
    /// The program's sharing call needs the pages in handles of their own (an export, a
    /// run shared by IPC): they move whatever the setting.
    Sharing,
}

/// A run of a phys's live pages that moves to one new handle.
#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) off: u64,
    pub(super) len: u64,
    /// Where the new handle is mapped (the pages' address), or none for unmapped pages.
    pub(super) target: Option<u64>,
}

/// What a compaction holds while it is not yet committed.
#[derive(Default)]
pub(super) struct Work {
    /// New handles, and whether each was created (false: no room, host path).
    pub(super) new: Vec<(ChunkHandle, bool)>,
    /// Temporary mappings: (address, size) of a reservation with one handle mapped whole.
    pub(super) tmp: Vec<(u64, u64)>,
    /// The old handle's temporary mapping, when it was not mapped.
    pub(super) src_tmp: Option<(u64, u64)>,
    pub(super) host: Vec<Option<Vec<u8>>>,
    /// The driver's hold on the device's default stream while the pages move (dropped last).
    pub(super) held: crate::gpu::Held,
}

impl<D: Driver> Coalescer<D> {
    /// Wait for every other device in `access` (peers given access to this device's pages,
    /// whose kernels may be reading them), each once, before the pages move or go.
    pub(super) fn wait_for_peers(&mut self, access: &[(i32, u32)]) -> DrvResult<()> {
        let me = self.drv.device();
        let mut peers: Vec<i32> = access
            .iter()
            .map(|(d, _)| *d)
            .filter(|d| *d != me)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        for d in peers {
            self.drv.synchronize_peer(d)?;
        }
        Ok(())
    }

    /// The devices whose default streams a move of pages with `access` holds besides its
    /// own (`CoalesceConfig::peer_hold`): the other devices given access, or, as a test on
    /// one GPU, this device itself.
    fn peers_to_hold(&self, access: &[(i32, u32)]) -> Vec<i32> {
        let me = self.drv.device();
        let mut peers: Vec<i32> = match self.cfg.peer_hold {
            PeerHold::Off => Vec::new(),
            PeerHold::SelfTest => vec![me],
            PeerHold::On => access
                .iter()
                .filter(|(d, flags)| *d != me && *flags != 0)
                .map(|(d, _)| *d)
                .collect(),
        };
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// Compact partly released handles: all of them if `force`, else until the stranded bytes
    /// are within the bound. Failures leave memory stranded (and are counted), never lost.
    ///
    /// With moving live pages off (the default), only handles none of whose pages the
    /// program has mapped are compacted, and only where memory is asked for (`force`): the
    /// rest stay until their last page goes or new pages take their released bytes in place
    /// (`adopt_stranded`).
    pub fn settle(&mut self, force: bool) {
        self.deferred = None;
        self.retry_leftovers();
        if self.dirty.is_empty() {
            return;
        }
        if force {
            self.note_stranded();
        }
        if !self.cfg.move_live && !force {
            return;
        }
        // Bytes stranded in shared handles are not counted against the bound: those handles
        // never move (another process may map them whole); their released bytes go back with
        // their last page, or serve pages mapped there (`adopt_stranded`).
        let mut stranded = self.stranded() - self.stranded_shared();
        if !force && stranded <= self.cfg.strand_max {
            return;
        }
        let mut order: Vec<(u64, u64)> = self
            .dirty
            .iter()
            .filter(|p| {
                !self.shared_phys(**p) && (self.cfg.move_live || !self.has_mapped_page(**p))
            })
            .map(|p| (self.dead(*p), *p))
            .collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        for (dead, pid) in order {
            if !force && stranded <= self.cfg.strand_max {
                break;
            }
            // Memory asked for (a near-full allocation, a trim) is worth a patient wait.
            let wait = match force {
                true => PeerWait::Patient,
                false => PeerWait::Brief,
            };
            match self.compact_as(pid, false, Some(wait), Live::AsConfigured) {
                Ok(()) => stranded -= dead,
                Err(PUT_OFF) => {
                    // The peers' streams stay busy: later calls try again (one wait per call).
                    self.stats.moves_put_off += 1;
                    log::debug!("a move was put off: a peer's default stream could not be held");
                    break;
                }
                Err(e) => {
                    self.stats.compaction_failures += 1;
                    log::warn!("compaction of a partly released handle failed ({e}); its free pages stay held");
                }
            }
        }
    }

    /// Temporary mappings and handles the driver would not take down before: once more.
    pub(super) fn retry_leftovers(&mut self) {
        for (va, size) in std::mem::take(&mut self.stray) {
            self.drop_tmp(va, size);
        }
        for (h, size) in std::mem::take(&mut self.unreleased) {
            self.release_or_hold(h, size);
        }
    }

    /// A phys of pages that never move (exported: `single`) none of which the program has
    /// mapped, still mapped where they were (kept there while releases may go on): it leaves
    /// its address without a copy, and its handle is mapped where the program maps a page of
    /// it next (`map_phys`; a shared run's handle whole, with its unmapped and released
    /// pages). A copy would give the program a new handle while importers keep the old one.
    fn unmoved_ghost(&self, pid: u64) -> bool {
        let ph = &self.phys[&pid];
        ph.asleep.is_none()
            && !ph.slots.is_empty()
            && ph.slots.values().all(|v| {
                let p = &self.pages[v];
                p.single && p.va.is_none()
            })
    }

    fn unmap_ghost(&mut self, pid: u64) -> DrvResult<()> {
        let (base, size) = {
            let ph = &self.phys[&pid];
            (ph.base, ph.size)
        };
        if let Some(b) = base {
            self.drv.unmap(b, size)?;
            let ph = self.phys.get_mut(&pid).unwrap();
            ph.base = None;
            ph.granted.clear();
            self.bases.remove(&b);
        }
        Ok(())
    }

    /// Whether another process may map `pid` (its pages were shared: `single`): it never
    /// moves but where the program's own sharing call splits it (`Live::Sharing`).
    pub(super) fn shared_phys(&self, pid: u64) -> bool {
        self.phys[&pid].slots.values().any(|v| self.pages[v].single)
    }

    /// Released bytes held in shared handles ([`Coalescer::shared_phys`]): part of
    /// [`Coalescer::stranded`] that no compaction gives back.
    pub(super) fn stranded_shared(&self) -> u64 {
        self.dirty
            .iter()
            .filter(|p| self.shared_phys(**p))
            .map(|p| self.dead(*p))
            .sum()
    }

    /// The groups a phys's live pages move to.
    pub(super) fn groups(&self, pid: u64, singles: bool) -> Vec<Group> {
        let ph = &self.phys[&pid];
        let mut out: Vec<Group> = Vec::new();
        for (off, vh) in ph.slots.iter() {
            let p = &self.pages[vh];
            let target = p.va;
            let join = !singles && !p.single;
            if let Some(g) = out.last_mut() {
                let adjacent = g.off + g.len == *off;
                let continues = match (g.target, target) {
                    (Some(t), Some(v)) => t + g.len == v,
                    _ => false,
                };
                if join && adjacent && continues && g.len + p.size <= self.cfg.max_handle {
                    g.len += p.size;
                    continue;
                }
            }
            out.push(Group {
                off: *off,
                len: p.size,
                target,
            });
        }
        out
    }

    /// Move the live pages of `pid` into new handles at the same addresses and release it.
    /// Device path: every step before the release has a restore path, so a failure leaves
    /// data and mappings as they were. Host path (no room for a copy on the device): the old
    /// handle is released before the new one is created; if that create fails (another
    /// process took the memory in between) it is retried, and otherwise the data is lost and
    /// said so loudly: the one step without a way back.
    /// Pages the program has mapped move only where `CoalesceConfig::move_live` says so
    /// ([`STAYS`] otherwise, nothing changed).
    pub(super) fn compact(&mut self, pid: u64, singles: bool) -> DrvResult<()> {
        self.compact_as(pid, singles, None, Live::AsConfigured)
    }

    /// [`Coalescer::compact`] for the program's sharing calls: pages it has mapped move too
    /// (a consumer maps what it imports whole, page by page).
    pub(super) fn compact_for_sharing(&mut self, pid: u64) -> DrvResult<()> {
        self.compact_as(pid, true, None, Live::Sharing)
    }

    /// [`Coalescer::compact`]; `put_off: Some(wait)`: the move only gives stranded bytes back,
    /// so where a peer given access to the pages cannot be held (`EXPSEG_PEER_HOLD=1`) within
    /// `wait` it is put off ([`PUT_OFF`]) rather than made unheld. `None`: the program's call
    /// needs the move (its mapping, an export): the holds are waited for patiently, and one
    /// that never starts is let go and the move made as without the hold.
    fn compact_as(
        &mut self,
        pid: u64,
        singles: bool,
        put_off: Option<PeerWait>,
        live: Live,
    ) -> DrvResult<()> {
        let mut groups = self.groups(pid, singles);
        if groups.is_empty() {
            return self.release_idle(pid);
        }
        if self.unmoved_ghost(pid) {
            return self.unmap_ghost(pid);
        }
        let (handle, size, base) = {
            let ph = &self.phys[&pid];
            (ph.handle, ph.size, ph.base)
        };
        let moves_mapped = base.is_some() && groups.iter().any(|g| g.target.is_some());
        // A shared handle (another process may map it whole) never moves for its stranded
        // bytes, whatever the setting.
        if moves_mapped
            && live == Live::AsConfigured
            && (!self.cfg.move_live || self.shared_phys(pid))
        {
            self.stats.moves_declined += 1;
            return Err(STAYS);
        }
        if base.is_none() {
            // Not mapped yet: the new handles are mapped when access is set.
            for g in &mut groups {
                g.target = None;
            }
        }
        let own = vec![(self.drv.device(), 3u32)];
        let acc = match &self.phys[&pid].access {
            a if a.is_empty() => own.clone(),
            a => a.clone(),
        };
        let props = self.phys[&pid]
            .slots
            .values()
            .next()
            .map(|v| self.pages[v].props)
            .unwrap_or_default();
        let me = self.drv.device();
        log::debug!(
            "device {me}: compacting handle {handle:#x} ({size:#x} bytes at {base:?}) into {} groups, access {acc:?}",
            groups.len()
        );
        // Kernels of other devices given access (PyTorch's peers) may be reading the live
        // pages: they finish before the pages move, as this device's do in copy_out.
        self.wait_for_peers(&acc)?;
        let peers = self.peers_to_hold(&acc);
        let can_wait = put_off.is_some();
        let put_off = put_off.filter(|_| self.cfg.peer_hold == PeerHold::On && !peers.is_empty());
        let mut w = Work::default();
        let out = self.copy_out(
            handle, size, base, &groups, props, &own, &peers, put_off, &mut w,
        );
        if let Err(e) = out {
            self.undo(&mut w);
            // A capture in progress: a move that can wait is put off, one made for stranded
            // bytes declined (as where live moves are off); a share's fails with the code.
            if e.0 == CAPTURING {
                self.stats.moves_refused_capture += 1;
                return Err(match (can_wait, live) {
                    (true, _) => PUT_OFF,
                    (false, Live::AsConfigured) => STAYS,
                    _ => e,
                });
            }
            return Err(e);
        }
        // Commit point: the old handle leaves its address; the device copies take its place.
        if let Some(b) = base {
            if let Err(e) = self.drv.unmap(b, size) {
                self.undo(&mut w);
                return Err(e);
            }
        }
        let mut placed = Vec::new();
        let mut failure = None;
        for (i, g) in groups.iter().enumerate() {
            let (h, on_device) = w.new[i];
            let Some(t) = g.target.filter(|_| on_device) else {
                continue;
            };
            if let Err(e) = self.drv.map(t, g.len, h) {
                failure = Some(e);
                break;
            }
            placed.push((t, g.len));
            if let Err(e) = self.drv.set_access_flags(t, g.len, &acc) {
                failure = Some(e);
                break;
            }
        }
        // The old handle goes back to the driver (off its temporary mapping first). The host
        // path's new handles are made of its memory: if it will not go, nothing has been
        // lost yet, and the compaction is undone instead.
        let mut held = None;
        if failure.is_none() {
            if let Some((t, sz)) = w.src_tmp.take() {
                self.drop_tmp(t, sz);
            }
            if let Err(e) = self.drv.release(handle) {
                match w.new.iter().any(|(_, on_device)| !on_device) {
                    true => failure = Some(e),
                    false => held = Some(e),
                }
            }
        }
        if let Some(e) = failure {
            for (t, len) in placed {
                self.drop_mapping(t, len);
            }
            if let Some(b) = base {
                let remapped = self.drv.map(b, size, handle);
                let mapped = remapped.is_ok();
                let back = remapped.and_then(|_| self.drv.set_access_flags(b, size, &acc));
                let ph = self.phys.get_mut(&pid).unwrap();
                match back {
                    Ok(()) => ph.granted = acc.clone(),
                    Err(e2) => {
                        // Not granted (access is set again with the pages'); not mapped, the
                        // books say so: the next cuMemSetAccess of its pages maps it again.
                        ph.granted.clear();
                        if !mapped {
                            ph.base = None;
                            self.bases.remove(&b);
                        }
                        log::error!("restoring a handle after a failed compaction failed ({e2}); its data is intact in the handle, {} until access is set again", if mapped { "without access" } else { "unmapped" });
                    }
                }
            }
            self.undo(&mut w);
            return Err(e);
        }
        // Committed.
        if let Some(b) = base {
            self.bases.remove(&b);
        }
        if let Some(e) = held {
            self.hold(handle, size, e);
        }
        let members: Vec<(u64, u64)> = self.phys[&pid]
            .slots
            .iter()
            .map(|(o, v)| (*o, *v))
            .collect();
        self.remove_phys(pid);
        self.dirty.remove(&pid);
        self.stats.phys_released += 1;
        self.stats.compactions += 1;
        let mut result = Ok(());
        for (i, g) in groups.iter().enumerate() {
            let (mut h, on_device) = w.new[i];
            if !on_device {
                match self.fill_from_host(g, props, &acc, &own, w.host[i].as_deref().unwrap_or(&[]))
                {
                    Ok(nh) => h = nh,
                    Err(e) => {
                        log::error!(
                            "compaction through host memory: no device memory came back for {} bytes at {:#x} ({e}); their contents are lost",
                            g.len,
                            g.target.unwrap_or(0)
                        );
                        self.stats.compaction_failures += 1;
                        for (o, v) in &members {
                            if *o >= g.off && *o < g.off + g.len {
                                let p = self.pages.get_mut(v).unwrap();
                                p.slot = None;
                                if p.refs > 0 {
                                    self.pending_bytes += p.size;
                                }
                            }
                        }
                        result = Err(e);
                        continue;
                    }
                }
            }
            let npid = self.add_phys(h, g.len, g.target, acc.clone());
            self.stats.compacted_bytes += g.len;
            for (o, v) in &members {
                if *o >= g.off && *o < g.off + g.len {
                    self.pages.get_mut(v).unwrap().slot = None;
                    self.attach_moved(*v, npid, o - g.off);
                }
            }
        }
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).collect();
        for (t, sz) in tmp {
            self.drop_tmp(t, sz);
        }
        result
    }

    /// A page the program has unmapped (not released) and maps elsewhere, whose handle still
    /// holds live pages where they are: the page alone gets a handle of its own with a copy
    /// of its bytes (nothing uses them: it is mapped nowhere), and its old bytes are released
    /// pages of that handle. Nothing changes on failure.
    pub(super) fn detach(&mut self, vh: u64) -> DrvResult<()> {
        let (size, props) = (self.pages[&vh].size, self.pages[&vh].props);
        let (pid, off) = self.pages[&vh].slot.ok_or(INVALID)?;
        let base = self.phys[&pid].base.ok_or(INVALID)?;
        let own = vec![(self.drv.device(), 3u32)];
        let mut w = Work::default();
        let copied = self.create_room(size, props).and_then(|h| {
            w.new.push((h, true));
            let t = self.temp_map(h, size, &own, &mut w)?;
            self.drv.synchronize()?;
            self.drv.copy(t, base + off, size)
        });
        if let Err(e) = copied {
            self.undo(&mut w);
            return Err(e);
        }
        for (t, sz) in std::mem::take(&mut w.tmp) {
            self.drop_tmp(t, sz);
        }
        let h = w.new[0].0;
        self.unslot(vh);
        self.dirty.insert(pid);
        let npid = self.add_phys(h, size, None, Vec::new());
        self.attach_moved(vh, npid, 0);
        self.stats.compacted_bytes += size;
        self.note_stranded();
        Ok(())
    }

    /// Take a temporary mapping down; one that will not go is retried at the next settle.
    pub(super) fn drop_tmp(&mut self, va: u64, size: u64) {
        let unmapped = self
            .drv
            .unmap(va, size)
            .or_else(|_| self.drv.unmap(va, size));
        let freed = unmapped.and_then(|_| {
            self.drv
                .free_va(va, size)
                .or_else(|_| self.drv.free_va(va, size))
        });
        if freed.is_err() {
            self.stray.push((va, size));
        }
    }

    /// Steps of a compaction that change nothing the program sees: wait for the device,
    /// create the new handles, and copy the live pages out (to device memory where the
    /// driver had room, else to the host). Mapped pages copied on the device are held from
    /// the copies on (the device's default stream, and `peers`' where they are asked).
    /// `put_off: Some(wait)`: where a peer's hold did not start within `wait` or was let go,
    /// nothing is changed and the answer is [`PUT_OFF`] (the copies made are undone with the
    /// new handles). Pages copied through the host (no room on the device) hold nothing, the
    /// device's own stream included: they are waited for, as without the option (putting
    /// them off would keep stranded bytes exactly when memory runs short).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_out(
        &mut self,
        handle: ChunkHandle,
        size: u64,
        base: Option<u64>,
        groups: &[Group],
        props: PageProps,
        own: &[(i32, u32)],
        peers: &[i32],
        put_off: Option<PeerWait>,
        w: &mut Work,
    ) -> DrvResult<()> {
        for g in groups {
            match self.create_room(g.len, props) {
                Ok(h) => w.new.push((h, true)),
                Err(e) if e.is_oom() => w.new.push((0, false)),
                Err(e) => return Err(e),
            }
        }
        if let (Some(b), true) = (base, w.new.iter().all(|(_, on_device)| *on_device)) {
            // Mapped pages, all copied on the device: the copies and the hold on the default
            // stream in one (another thread's kernels queued meanwhile run after the move).
            let mut copies = Vec::with_capacity(groups.len());
            for (i, g) in groups.iter().enumerate() {
                let t = self.temp_map(w.new[i].0, g.len, own, w)?;
                copies.push((t, b + g.off, g.len));
                w.host.push(None);
            }
            // Patient for real peers of a move the call needs; the self test on one GPU keeps
            // the brief wait it was measured with.
            let wait = match (put_off, self.cfg.peer_hold) {
                (Some(wait), _) => wait,
                (None, PeerHold::On) => PeerWait::Patient,
                (None, _) => PeerWait::Brief,
            };
            w.held = self.drv.copy_and_hold(&copies, peers, wait)?;
            if w.held.holds() {
                self.stats.held_moves += 1;
            }
            self.stats.peer_holds += w.held.peers_held as u64;
            self.stats.peer_holds_let_go += w.held.peers_let_go as u64;
            if put_off.is_some() && w.held.peers_let_go > 0 {
                return Err(PUT_OFF);
            }
            return Ok(());
        }
        self.drv.synchronize()?;
        let src = match base {
            Some(b) => b,
            None => {
                let t = self.temp_map(handle, size, own, w)?;
                w.src_tmp = w.tmp.pop();
                t
            }
        };
        for (i, g) in groups.iter().enumerate() {
            let (h, on_device) = w.new[i];
            if on_device {
                let t = self.temp_map(h, g.len, own, w)?;
                self.drv.copy(t, src + g.off, g.len)?;
                w.host.push(None);
            } else {
                self.stats.host_copies += 1;
                w.host.push(Some(self.drv.save(src + g.off, g.len)?));
            }
        }
        Ok(())
    }

    /// Map `h` at a fresh reservation for copying; recorded in `w.tmp`.
    pub(super) fn temp_map(
        &mut self,
        h: ChunkHandle,
        size: u64,
        own: &[(i32, u32)],
        w: &mut Work,
    ) -> DrvResult<u64> {
        let t = self.drv.reserve(size)?;
        if let Err(e) = self.drv.map(t, size, h) {
            let _ = self.drv.free_va(t, size);
            return Err(e);
        }
        w.tmp.push((t, size));
        self.drv.set_access_flags(t, size, own)?;
        Ok(t)
    }

    /// Host path, after the old handle's release: a new handle, mapped, filled. Nothing can
    /// restore the old handle from here, so the whole step is tried three times.
    pub(super) fn fill_from_host(
        &mut self,
        g: &Group,
        props: PageProps,
        acc: &[(i32, u32)],
        own: &[(i32, u32)],
        data: &[u8],
    ) -> DrvResult<ChunkHandle> {
        let mut last = INVALID;
        for attempt in 0..3 {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            match self.fill_once(g, props, acc, own, data) {
                Ok(h) => return Ok(h),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub(super) fn fill_once(
        &mut self,
        g: &Group,
        props: PageProps,
        acc: &[(i32, u32)],
        own: &[(i32, u32)],
        data: &[u8],
    ) -> DrvResult<ChunkHandle> {
        let h = self.create_room(g.len, props)?;
        let mut w = Work::default();
        let r = match g.target {
            Some(t) => self.drv.map(t, g.len, h).and_then(|_| {
                self.drv
                    .set_access_flags(t, g.len, acc)
                    .and_then(|_| self.drv.load(t, data))
                    .inspect_err(|_| self.drop_mapping(t, g.len))
            }),
            None => self
                .temp_map(h, g.len, own, &mut w)
                .and_then(|t| self.drv.load(t, data)),
        };
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).collect();
        for (t, sz) in tmp {
            self.drop_tmp(t, sz);
        }
        match r {
            Ok(()) => Ok(h),
            Err(e) => {
                let _ = self.drv.release(h);
                Err(e)
            }
        }
    }

    /// Unmap a mapping of ours, once more if the first try fails.
    pub(super) fn drop_mapping(&mut self, va: u64, size: u64) {
        if self.drv.unmap(va, size).is_err() {
            let _ = self.drv.unmap(va, size);
        }
    }

    /// Release a phys none of whose pages is live.
    pub(super) fn release_idle(&mut self, pid: u64) -> DrvResult<()> {
        let ph = &self.phys[&pid];
        log::debug!(
            "device {}: handle {:#x} released ({:#x} bytes, was at {:?})",
            self.drv.device(),
            ph.handle,
            ph.size,
            ph.base
        );
        if let Some(b) = ph.base {
            self.drv.unmap(b, ph.size)?;
            self.bases.remove(&b);
            self.phys.get_mut(&pid).unwrap().base = None;
        }
        self.drv.release(self.phys[&pid].handle)?;
        self.remove_phys(pid);
        self.dirty.remove(&pid);
        self.stats.phys_released += 1;
        Ok(())
    }

    /// Undo an uncommitted compaction: temporary mappings and new handles go away.
    pub(super) fn undo(&mut self, w: &mut Work) {
        let tmp: Vec<(u64, u64)> = w.tmp.drain(..).chain(w.src_tmp.take()).collect();
        for (va, sz) in tmp {
            self.drop_tmp(va, sz);
        }
        for (h, on_device) in w.new.drain(..) {
            if on_device {
                let _ = self.drv.release(h);
            }
        }
    }
}
