//! Whether this process has shared GPU memory with another process, or mapped memory another
//! process shared with it, at any time of its life: what `expseg pause` asks before it pauses a
//! whole process, since the driver does not restore a checkpointed process that maps another's
//! memory (it stays checkpointed: docs/failed-approaches.md).

use std::sync::atomic::{AtomicBool, Ordering};

static SHARED: AtomicBool = AtomicBool::new(false);
static IMPORTED: AtomicBool = AtomicBool::new(false);

/// Bit of [`state`]: memory of this process's was shared (an IPC handle, a descriptor export).
pub const SHARED_BIT: u64 = 1;
/// Bit of [`state`]: this process mapped memory of another's (an IPC open, a descriptor taken
/// from another process or imported).
pub const IMPORTED_BIT: u64 = 2;

/// Memory of this process was shared with others (a handle made, a descriptor exported).
pub fn note_shared() {
    SHARED.store(true, Ordering::Relaxed);
}

/// This process mapped, or is about to map, memory another process shared.
pub fn note_imported() {
    IMPORTED.store(true, Ordering::Relaxed);
}

/// [`SHARED_BIT`] and [`IMPORTED_BIT`], as they stand.
pub fn state() -> u64 {
    let s = if SHARED.load(Ordering::Relaxed) {
        SHARED_BIT
    } else {
        0
    };
    let i = if IMPORTED.load(Ordering::Relaxed) {
        IMPORTED_BIT
    } else {
        0
    };
    s | i
}
