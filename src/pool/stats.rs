//! The counters of one pool. Plain fields: they live under the pool's lock.

use crate::gpu::Op;
use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct PoolStats {
    pub allocs: u64,
    pub frees: u64,
    /// Allocations served by a cached block of the same size, with no driver call.
    pub cache_hits: u64,
    /// Allocations that reused cached chunks in a new reservation.
    pub stitched: u64,
    /// Allocations that got a cached chunk larger than needed because the driver had no memory.
    pub over_commits: u64,
    /// Allocations refused for lack of memory.
    pub ooms: u64,
    pub driver_errors: u64,
    /// Bytes the application asked for, live now.
    pub live_user_bytes: u64,
    /// Physical bytes behind live allocations.
    pub live_bytes: u64,
    /// Physical bytes freed by the application and kept for reuse.
    pub cached_bytes: u64,
    pub peak_live_user_bytes: u64,
    /// Peak of live plus cached: the most the driver had given this pool at once.
    pub peak_held_bytes: u64,
    pub created_bytes: u64,
    pub released_bytes: u64,
    /// IPC exports that moved the allocation into standard memory at the same address.
    pub ipc_moved: u64,
    /// Moves whose address was recovered from the runtime's heap by plugging it.
    pub ipc_plugged: u64,
    /// Moves that failed and were rolled back (the export then used a mirror).
    pub ipc_move_failures: u64,
    /// IPC exports served by a mirror (first requests and refreshes).
    pub ipc_mirrored: u64,
    /// Bytes of standard memory held by mirrors now.
    pub mirror_bytes: u64,
    /// Physical bytes of live allocations that are paused (given back to the driver).
    pub paused_bytes: u64,
    /// Calls and nanoseconds per driver operation, in `Op::ALL` order.
    pub driver_calls: [u64; Op::ALL.len()],
    pub driver_ns: [u64; Op::ALL.len()],
}

impl PoolStats {
    /// Physical bytes the driver has given this pool: live (less paused) and cached.
    pub fn held_bytes(&self) -> u64 {
        self.live_bytes + self.cached_bytes - self.paused_bytes
    }

    pub(super) fn count_driver(&mut self, op: Op, t: Duration) {
        self.driver_calls[op.index()] += 1;
        self.driver_ns[op.index()] += t.as_nanos() as u64;
    }

    pub(super) fn on_alloc(&mut self, user: u64, size: u64) {
        self.allocs += 1;
        self.live_user_bytes += user;
        self.live_bytes += size;
        self.peak_live_user_bytes = self.peak_live_user_bytes.max(self.live_user_bytes);
        self.peak_held_bytes = self.peak_held_bytes.max(self.held_bytes());
    }

    pub(super) fn on_free(&mut self, user: u64, size: u64) {
        self.frees += 1;
        self.live_user_bytes -= user;
        self.live_bytes -= size;
    }

    /// An allocation left the pool as standard memory; its chunks went back to the driver.
    pub(super) fn on_moved(&mut self, user: u64, size: u64) {
        self.ipc_moved += 1;
        self.live_user_bytes -= user;
        self.live_bytes -= size;
        self.released_bytes += size;
    }

    pub(super) fn on_created(&mut self, size: u64) {
        self.created_bytes += size;
    }

    pub(super) fn on_released(&mut self, size: u64) {
        self.released_bytes += size;
    }
}
