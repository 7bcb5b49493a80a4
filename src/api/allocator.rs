//! Whose thread may move a device's live pages: the thread of the program's last VMM call on
//! that device (its allocator's thread: PyTorch's caller, or the autograd worker of that
//! device). Another thread (a monitor's `cudaMemGetInfo`, a library's `cudaMalloc` that found
//! no memory, the allocator's thread of another device) may be running while that thread
//! launches work on the pages, so from there only what goes back without moving a live page
//! goes back, and the rest at the device's next call (`Coalescer::trim_unmoved`).

use std::sync::atomic::{AtomicU64, Ordering};

/// Devices with a thread of their own; a higher ordinal has none (never moved from outside
/// its own calls: treated as any other thread's).
const DEVICES: usize = 64;

/// Per device, the number of its allocator's thread; 0: none yet.
static THREAD_OF: [AtomicU64; DEVICES] = [const { AtomicU64::new(0) }; DEVICES];
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_NO: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// This thread's number (0 while its thread-locals are being torn down).
fn thread_no() -> u64 {
    THREAD_NO.try_with(|n| *n).unwrap_or(0)
}

fn slot(dev: i32) -> Option<&'static AtomicU64> {
    usize::try_from(dev).ok().and_then(|d| THREAD_OF.get(d))
}

/// A VMM call of the program on `dev`'s pages: its thread is `dev`'s allocator's.
pub fn call_on(dev: i32) {
    if let Some(s) = slot(dev) {
        let me = thread_no();
        // Stored only when it changes: one thread per device keeps its line unshared.
        if s.load(Ordering::Relaxed) != me {
            s.store(me, Ordering::Relaxed);
        }
    }
}

/// Whether the calling thread is `dev`'s allocator's: live pages of `dev` may move here.
pub fn may_move(dev: i32) -> bool {
    let me = thread_no();
    me != 0 && slot(dev).is_some_and(|s| s.load(Ordering::Relaxed) == me)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_device_has_its_own_allocator_thread() {
        call_on(3);
        assert!(may_move(3));
        assert!(!may_move(4), "no call on device 4 yet");
        std::thread::spawn(|| {
            assert!(!may_move(3), "another thread");
            call_on(4);
            assert!(may_move(4));
        })
        .join()
        .unwrap();
        assert!(
            may_move(3),
            "device 4's thread changed nothing for device 3"
        );
        assert!(!may_move(4));
        call_on(-1);
        call_on(1000);
        assert!(!may_move(-1) && !may_move(1000));
    }
}
