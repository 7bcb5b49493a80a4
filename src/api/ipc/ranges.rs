//! A dma-buf of a range (`cuMemGetHandleForAddressRange`: how NCCL's network plugins, UCX and
//! NIXL register GPU memory for RDMA): a device outside this process may read and write that
//! memory until the descriptor closes, behind expseg's back. So, as for memory shared by IPC,
//! it never moves or pauses again: the pool's allocations in the range are shared, PyTorch's
//! pages behind it are shared whole (`vmm::share_run`: never split, moved or paused), and a
//! whole-process pause is refused (`sharing`, a registration the driver's restore would leave
//! pointing at memory that is no longer the program's).

use super::sharing;
use crate::api::state::{bypass, lock, STATE_STARTED};
use std::sync::atomic::Ordering;

/// A dma-buf of `[ptr, ptr+size)` is asked for (before the driver's call).
pub fn range_exported(ptr: u64, size: u64) {
    sharing::note_shared();
    if bypass() || size == 0 {
        return;
    }
    if STATE_STARTED.load(Ordering::Acquire) {
        let mut st = lock();
        let n: usize = st.open_pools().map(|(_, p)| p.share_range(ptr, size)).sum();
        if n > 0 {
            log::debug!("a dma-buf of {ptr:#x}+{size:#x}: {n} allocations of the pool never move or pause from now on");
            return;
        }
    }
    if let Err(e) = crate::api::vmm::share_run(ptr) {
        log::warn!("a dma-buf of {ptr:#x}+{size:#x} was made, but its pages could not be kept from moving or pausing (error {e})");
    }
}
