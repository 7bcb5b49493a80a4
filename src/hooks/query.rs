//! Driver queries that must describe the allocation the program made, not one chunk's
//! mapping: `cuMemGetAddressRange`, `cuPointerGetAttribute(s)` at pool memory, ticket
//! mappings and coalesced pages answer as the driver does natively for what the program
//! allocated or mapped (measured: `scripts/vmm-cost/range_unmapped.cu`), with one exception
//! kept for IPC: the range attributes of VMM memory (coalesced pages, and another allocator's
//! mappings) name the mapping, not its reservation (`Range::Page`); anything else is the
//! driver's own answer.

use super::guard::Guard;
use crate::api;
use crate::real::next_driver;
use libc::{c_int, c_uint, c_void, size_t};
use std::panic::catch_unwind;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`, `..._DEVICE_ORDINAL`,
/// `..._IS_LEGACY_CUDA_IPC_CAPABLE`, `..._RANGE_START_ADDR`, `..._RANGE_SIZE`, `..._MAPPED`.
const MEMORY_TYPE: c_int = 2;
const DEVICE_ORDINAL: c_int = 9;
const LEGACY_IPC: c_int = 10;
const RANGE_START_ADDR: c_int = 11;
const RANGE_SIZE: c_int = 12;
const MAPPED: c_int = 13;
/// `CUDA_ERROR_INVALID_VALUE` and `CUDA_ERROR_NOT_FOUND`: the driver's answers at an address
/// with no mapping (measured: `scripts/vmm-cost/range_unmapped.cu`).
const DRV_INVALID_VALUE: u32 = 1;
const NOT_FOUND: u32 = 500;

/// What the range hooks answer at an address of expseg's.
enum Range {
    /// Pool memory or a ticket mapping: the allocation `(start, size)`, to every range query.
    Allocation(u64, u64),
    /// A coalesced page: every range query reports the program's mapping (the driver would
    /// report the larger handle behind a run of pages). Natively the pointer attributes name
    /// the reservation (measured, H100), but programs that share memory by raw IPC (vLLM's
    /// custom all-reduce) ask `cudaIpcGetMemHandle` of the `RANGE_START_ADDR` they get and
    /// add `ptr - RANGE_START_ADDR` in the consumer: with the reservation's start, the handle
    /// names the reservation's first page and a plain consumer's mirror, bounded by PyTorch's
    /// blocks over that page, lies short of the tensor (wrong bytes, measured: RESULTS.md),
    /// and unbounded it would be the whole reservation. IPC of VMM memory fails
    /// natively, so no native program relies on the reservation here for IPC.
    Page((u64, u64)),
    /// Only expseg's memory is mapped here (grown ahead, released pages not given back yet):
    /// natively nothing is, and the queries say so.
    Hidden,
}

fn ours(ptr: u64) -> Option<Range> {
    use crate::coalesce::Seen;
    let _g = Guard::enter()?;
    catch_unwind(|| match api::allocation_range(ptr) {
        Some((b, s)) => Some(Range::Allocation(b, s)),
        None => api::vmm::program_mapping(ptr).map(|seen| match seen {
            Seen::Page { page, .. } => Range::Page(page),
            Seen::Hidden { .. } => Range::Hidden,
        }),
    })
    .ok()
    .flatten()
}

/// After the driver answered `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE` for `ptr` into
/// `data`: a pool allocation says yes, as the `cuMemAlloc` memory it stands for does (the
/// driver says no to VMM memory; expseg's `cuIpcGetMemHandle` serves it). The driver's value
/// is 0 or 1 in little-endian; setting its first byte to 1 is right for a caller's `bool` and
/// `int` alike. Memory opened through a ticket keeps the driver's answer, as memory opened
/// by `cuIpcOpenMemHandle` does.
unsafe fn legacy_ipc_capable(data: *mut c_void, ptr: u64) {
    if data.is_null() {
        return;
    }
    let pooled = Guard::enter().and_then(|_g| {
        catch_unwind(|| api::pool_allocation_range(ptr))
            .ok()
            .flatten()
    });
    if pooled.is_some() {
        // SAFETY: the caller's answer for this attribute (not null: checked above), at least a
        // byte.
        unsafe { *(data as *mut u8) = 1 };
    }
}

/// # Safety
/// As CUDA's `cuMemGetAddressRange_v2`: `base`, `size` must be valid for what that call reads
/// and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut u64,
    size: *mut size_t,
    ptr: u64,
) -> u32 {
    let (answer, (b, s)) = match ours(ptr) {
        Some(Range::Allocation(b, s)) | Some(Range::Page((b, s))) => (0, (b, s)),
        // Natively: nothing mapped, 0 and 0 written.
        Some(Range::Hidden) => (NOT_FOUND, (0, 0)),
        // The driver's own, found by name: it answers even where the VMM table cannot load.
        // SAFETY: the driver's own function, with the program's own arguments.
        None => return unsafe { next_driver::cuMemGetAddressRange_v2(base, size, ptr) },
    };
    // SAFETY (both writes): the caller's out-pointers, each written only where not null.
    if !base.is_null() {
        unsafe { *base = b };
    }
    if !size.is_null() {
        unsafe { *size = s as size_t };
    }
    answer
}

/// VMM memory that is not expseg's (another allocator's mappings; PyTorch's pages with
/// coalescing off): the mapping containing `ptr`, where the driver's range attributes name a
/// larger reservation around it. expseg's IPC handle of such memory starts at that mapping
/// (`crate::gpu::cuda::run_from`), so the attributes name it too, as for a coalesced page.
fn foreign_mapping(ptr: u64) -> Option<(u64, u64)> {
    let _g = Guard::enter()?;
    if catch_unwind(|| api::config().disabled || api::forked()).unwrap_or(true) {
        return None;
    }
    let (mut b, mut s) = (0u64, 0 as size_t);
    // SAFETY (the three driver calls): out-pointers to locals of the types the calls write.
    if unsafe { next_driver::cuMemGetAddressRange_v2(&mut b, &mut s, ptr) } != 0 || s == 0 {
        return None;
    }
    let (mut rb, mut rs) = (0u64, 0u64);
    let start = unsafe {
        next_driver::cuPointerGetAttribute((&mut rb as *mut u64).cast(), RANGE_START_ADDR, ptr)
    };
    let size = unsafe {
        next_driver::cuPointerGetAttribute((&mut rs as *mut u64).cast(), RANGE_SIZE, ptr)
    };
    let mapping = (b, s as u64);
    let inside = rb <= b && b.saturating_add(s as u64) <= rb.saturating_add(rs);
    (start == 0 && size == 0 && (rb, rs) != mapping && inside).then_some(mapping)
}

/// # Safety
/// As CUDA's `cuPointerGetAttribute`: `data` must be valid for what that call reads and writes
/// through it (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(data: *mut c_void, attr: c_int, ptr: u64) -> u32 {
    if matches!(attr, RANGE_START_ADDR | RANGE_SIZE | MEMORY_TYPE) && !data.is_null() {
        let range = match ours(ptr) {
            Some(Range::Allocation(b, s)) | Some(Range::Page((b, s))) => Some((b, s)),
            Some(Range::Hidden) => return DRV_INVALID_VALUE,
            None if attr != MEMORY_TYPE => foreign_mapping(ptr),
            None => None,
        };
        if let Some((b, s)) = range.filter(|_| attr != MEMORY_TYPE) {
            // SAFETY: the caller's answer for a range attribute, 64 bits (not null: checked).
            unsafe { *(data as *mut u64) = if attr == RANGE_START_ADDR { b } else { s } };
            return 0;
        }
    }
    // SAFETY: the driver's own function, with the program's own arguments.
    let e = unsafe { next_driver::cuPointerGetAttribute(data, attr, ptr) };
    if e == 0 && attr == LEGACY_IPC {
        // SAFETY: the caller's answer for that attribute, which the driver just wrote.
        unsafe { legacy_ipc_capable(data, ptr) };
    }
    e
}

/// `cuPointerGetAttributes` (plural; the runtime's `cudaPointerGetAttributes` asks it): the
/// driver's answers, with the two range attributes describing the allocation, as the singular
/// call answers them.
///
/// # Safety
/// As CUDA's `cuPointerGetAttributes`: `attrs`, `data` must be valid for what that call reads
/// and writes through them (or null where CUDA allows null).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attrs: *const c_int,
    data: *mut *mut c_void,
    ptr: u64,
) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let e = unsafe { next_driver::cuPointerGetAttributes(count, attrs, data, ptr) };
    if e != 0 || attrs.is_null() || data.is_null() {
        return e;
    }
    // SAFETY: `attrs` and `data` hold `count` entries each (the call's contract, which the
    // driver's answer just relied on).
    let attr_at = |i: usize| unsafe { *attrs.add(i) };
    let asks_range =
        (0..count as usize).any(|i| matches!(attr_at(i), RANGE_START_ADDR | RANGE_SIZE));
    let (range, hidden) = match ours(ptr) {
        Some(Range::Allocation(b, s)) | Some(Range::Page((b, s))) => (Some((b, s)), false),
        Some(Range::Hidden) => (None, true),
        None if asks_range => match foreign_mapping(ptr) {
            Some(m) => (Some(m), false),
            None => return e,
        },
        None => return e,
    };
    for i in 0..count as usize {
        // SAFETY: as above, entry `i` of `data`.
        let slot = unsafe { *data.add(i) };
        if slot.is_null() {
            continue;
        }
        // SAFETY (each arm): `slot` is the caller's answer for attribute `i`, of that
        // attribute's size (not null: checked).
        match (attr_at(i), range) {
            (RANGE_START_ADDR, Some((b, _))) => unsafe { *(slot as *mut u64) = b },
            (RANGE_SIZE, Some((_, s))) => unsafe { *(slot as *mut u64) = s },
            (LEGACY_IPC, _) => unsafe { legacy_ipc_capable(slot, ptr) },
            // Natively, at an address with nothing mapped (the range attributes still name
            // the reservation, as the driver's answer here does): measured.
            (MEMORY_TYPE, _) if hidden => unsafe { *(slot as *mut u32) = 0 },
            (DEVICE_ORDINAL, _) if hidden => unsafe { *(slot as *mut i32) = -2 },
            (MAPPED, _) if hidden => unsafe { *(slot as *mut u8) = 0 },
            _ => {}
        }
    }
    e
}
