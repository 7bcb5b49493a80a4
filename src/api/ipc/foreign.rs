//! Foreign VMM memory (another allocator's: PyTorch's expandable segments, vLLM's cumem pool)
//! asked for a handle: the run of mappings gets a ticket, a mirror, or both.

use super::mirror::{make_mirror, refresh_mirror};
use super::runs::{read_run, run_of};
use super::shares::ForeignShare;
use super::tickets::{foreign_tickets_ready, peers_without_tickets};
use crate::api::state::{bypass, config, ensure_state, lock, UNKNOWN};
use crate::gpu::stream;
use crate::gpu::IpcHandle;
use crate::stats::GLOBAL;
use std::sync::Arc;

/// How many times a request starts over when another thread changed the share meanwhile.
const RACE_RETRIES: usize = 8;

/// `cudaIpcGetMemHandle` on VMM memory expseg does not own (PyTorch's expandable segments,
/// vLLM's cumem pool), after the runtime refused it. The handle stands for the run of
/// back-to-back mappings that starts with the one containing `ptr` (PyTorch maps a segment
/// 20 MiB at a time, so a tensor spans several): its base is that mapping's start, which is
/// what range queries answer. It carries a ticket for consumers running expseg (they map the
/// same pages: shared both ways) and, unless `EXPSEG_IPC_PEERS=expseg`, a mirror of the run
/// for plain consumers, refreshed at each request (one-way, point-in-time). `None`: not such
/// memory, keep the runtime's answer.
///
/// Every call it makes is allowed while another thread captures a CUDA graph (the calling
/// thread in relaxed capture mode, no device synchronize), so a share succeeds where it does
/// natively and leaves such a capture intact.
pub fn mirror_foreign(ptr: u64) -> Option<Result<IpcHandle, i32>> {
    if bypass() {
        return None;
    }
    let t = crate::real::driver().ok()?;
    stream::relaxed(t, || share_foreign(t, ptr))
}

fn share_foreign(t: &'static crate::real::DriverTable, ptr: u64) -> Option<Result<IpcHandle, i32>> {
    // The handles behind coalesced pages of the run never move again (paused ones resume
    // first): a consumer must map what stays the program's memory. Nothing moves now. Out of
    // memory to resume a paused page: the call fails, nothing changed that the program can
    // see.
    if let Err(e) = crate::api::vmm::share_run(ptr) {
        log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}) fails: a paused page of its run could not resume (CUresult {e}: no memory for it); it stays paused, nothing lost");
        return Some(Err(if e < 1000 { e as i32 } else { UNKNOWN }));
    }
    let c = config();
    for _ in 0..RACE_RETRIES {
        let (base, sizes, dev) = run_of(t, ptr)?;
        let size: u64 = sizes.iter().sum();
        let want_mirror = !c.ipc_peers_expseg;
        // What a plain consumer can reach from this base (asked of PyTorch, never under a lock).
        let extent = if want_mirror {
            mirror_extent(base, sizes[0], size)
        } else {
            size
        };
        if c.ipc_tickets {
            // Once per process, possibly slow (a child process): never under the lock.
            super::check::wait(dev);
        }
        if want_mirror {
            // Writes other devices queued through peer access go into the copy too.
            super::mirror::wait_for_peers(dev, base);
        }
        let mut st = ensure_state();
        let ticketed = c.ipc_tickets && foreign_tickets_ready(&mut st, dev);
        if c.ipc_peers_expseg && !ticketed {
            return Some(Err(peers_without_tickets(&st, ptr)));
        }
        // The share stands if its mirror still covers what a consumer can reach and no more
        // than is mapped (a mirror-less share: the same run). The run a ticket maps follows
        // the mappings.
        let same = st
            .ipc
            .foreign
            .get_mut(&base)
            .filter(|f| {
                f.dev == dev
                    && f.mirror.is_some() == want_mirror
                    && match &f.mirror {
                        Some(m) => m.size >= extent && m.size <= size,
                        None => f.size == size,
                    }
            })
            .map(|f| {
                f.size = size;
                f.mirror.clone()
            });
        let mirror = match same {
            Some(Some(m)) => {
                // Refresh without the lock; the reference keeps the buffer alive even if
                // another thread replaces or forgets the share meanwhile, and the registered
                // read holds back unmaps of the run until the copy is done.
                drop(st);
                let Some(reading) = read_run(t, base, m.size) else {
                    continue; // unmapped meanwhile: look again
                };
                let refreshed = refresh_mirror(dev, m.ptr, base, m.size);
                drop(reading);
                if let Err(e) = refreshed {
                    return Some(Err(e));
                }
                st = lock();
                let current = st
                    .ipc
                    .foreign
                    .get(&base)
                    .and_then(|f| f.mirror.as_ref())
                    .is_some_and(|cur| Arc::ptr_eq(cur, &m));
                if !current {
                    continue; // replaced while refreshing: its handle would die with it
                }
                Some(m)
            }
            Some(None) => None,
            None => {
                let old = st.ipc.foreign.remove(&base);
                drop(st);
                drop(old); // cudaFree outside the lock
                let Some(reading) = read_run(t, base, extent) else {
                    continue;
                };
                let made = want_mirror.then(|| make_mirror(dev, base, extent));
                drop(reading);
                let mirror = if let Some(made) = made {
                    match made {
                        Ok(m) => {
                            super::current::arm();
                            if extent < size {
                                GLOBAL.foreign_mirrors_bounded.add(1);
                                GLOBAL.foreign_mirror_bytes_spared.add(size - extent);
                            }
                            Some(Arc::new(m))
                        }
                        // A handle plain consumers could not open would fail in the consumer,
                        // far from the cause: fail here, saying why and what helps.
                        // Where tickets work, consumers running expseg need no mirror: the
                        // handle is issued with the ticket alone (a plain consumer's open of
                        // it fails, never maps wrong data), and the log says why.
                        Err(e) if ticketed => {
                            GLOBAL.ipc_ticket_only.add(1);
                            log::warn!(
                                "IPC: the handle of {base:#x} ({size} bytes of mappings) has no mirror: no device memory for one (error {e}). Consumers running expseg map the memory itself (both ways); a consumer without expseg fails to open it (free memory before asking, or run the consumer under expseg)"
                            );
                            None
                        }
                        Err(e) => {
                            log::error!(
                                "IPC: cudaIpcGetMemHandle({ptr:#x}) fails: no device memory for a mirror of the {size} bytes of mappings from {base:#x} on (error {e}), and no tickets here (consumers running expseg would map the memory itself)"
                            );
                            return Some(Err(e));
                        }
                    }
                } else {
                    None
                };
                st = lock();
                if st.ipc.foreign.contains_key(&base) {
                    continue; // another thread shared this base meanwhile: start over
                }
                let (level, once) = super::current::share_notice();
                log::log!(
                    level,
                    "IPC: {base:#x} ({size} bytes in {} mapping(s)) is VMM memory expseg does not own (expandable_segments or another VMM allocator); {}{once}",
                    sizes.len(),
                    match (ticketed, &mirror) {
                        (true, Some(m)) => format!("consumers running expseg share it both ways; others get a mirror of its first {} bytes at {:#x}, {}, and their writes do not reach this process", m.size, m.ptr, super::current::currency()),
                        (true, None) => "shared with consumers running expseg only (EXPSEG_IPC_PEERS=expseg, or no memory for a mirror): plain consumers cannot open its handle".to_string(),
                        (false, Some(m)) => format!("shared through a mirror of its first {} bytes at {:#x}, {}: consumers' writes do not reach this process", m.size, m.ptr, super::current::currency()),
                        (false, None) => unreachable!("no mirror only with tickets"),
                    }
                );
                crate::api::state::FOREIGN_SEEN.store(true, std::sync::atomic::Ordering::Release);
                st.ipc.foreign.insert(
                    base,
                    ForeignShare {
                        dev,
                        size,
                        mirror: mirror.clone(),
                    },
                );
                mirror
            }
        };
        let mut handle = mirror.map_or([0u8; 64], |m| m.handle);
        if ticketed {
            if let Some(t) = st.ipc.ticket(dev, base) {
                t.stamp(&mut handle);
            }
        }
        return Some(Ok(handle));
    }
    log::error!("IPC: cudaIpcGetMemHandle({ptr:#x}): the mappings kept changing under concurrent requests; giving up");
    Some(Err(UNKNOWN))
}

/// How many bytes from `base` a mirror must copy: what a consumer of the handle can reach.
/// The handle's base is the start of the page `base` begins (the consumer's offset is taken
/// from there), so the consumer reads inside a tensor that starts on that page, and a
/// tensor ends inside its PyTorch block: the end of the furthest live block over the page
/// bounds it (`EXPSEG_IPC_EXTENT=torch`, asked of the process's PyTorch). At least the page
/// (legacy semantics give a consumer the whole allocation: the mapping, natively), at most
/// the run. Without PyTorch's answer: the run.
fn mirror_extent(base: u64, page: u64, run: u64) -> u64 {
    if !config().ipc_extent_torch {
        return run;
    }
    match crate::real::python::torch_block_extent(base, base + page) {
        Some(end) => bound_extent(base, page, run, end),
        None => run,
    }
}

/// The mirror's size for a run of `run` bytes from `base`, its first page `page` bytes, when
/// PyTorch's live blocks over that page end at `end`.
fn bound_extent(base: u64, page: u64, run: u64, end: u64) -> u64 {
    end.saturating_sub(base).max(page).min(run)
}

#[cfg(test)]
mod tests {
    use super::bound_extent;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_mirror_covers_the_page_and_the_blocks_over_it_within_the_run() {
        let base = 1 << 40;
        // A 1.2 GB tensor from the page on, in a 40 GB run: to its end.
        assert_eq!(
            bound_extent(base, 20 * MIB, 40_000 * MIB, base + 1172 * MIB),
            1172 * MIB
        );
        // Small tensors inside the page: the whole page still (the allocation, natively).
        assert_eq!(
            bound_extent(base, 20 * MIB, 40_000 * MIB, base + 3 * MIB),
            20 * MIB
        );
        // A block said to run past the mappings: only what is mapped.
        assert_eq!(
            bound_extent(base, 20 * MIB, 60 * MIB, base + 90 * MIB),
            60 * MIB
        );
        // An answer before the base (not over the page): the page.
        assert_eq!(bound_extent(base, 20 * MIB, 60 * MIB, base - MIB), 20 * MIB);
    }
}
