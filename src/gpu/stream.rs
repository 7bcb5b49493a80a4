//! Copies beside the program's work, and calls another thread's graph capture allows: the
//! calling thread in relaxed capture mode, copies ordered after the legacy default stream or
//! on a stream of expseg's own or the program's, and whether a stream is capturing.
#![allow(unsafe_code)]

use super::{check, DrvError, DrvResult};
use crate::real::DriverTable;
use cudarc::driver::sys::CUstream;

/// `CUDA_ERROR_NOT_FOUND`: an optional driver function is missing.
const NOT_FOUND: u32 = super::cuda::NOT_FOUND;

/// `CU_STREAM_LEGACY`: the device's legacy default stream, ordered after every blocking
/// stream's work (PyTorch's default stream).
const LEGACY_STREAM: usize = 0x1;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_RELAXED: libc::c_uint = 2;

/// Run `f` with the calling thread in relaxed stream-capture mode, then give the thread its
/// own mode back. While another thread captures a CUDA graph in global mode (PyTorch's
/// default), a thread in global mode that allocates, copies or waits on an event invalidates
/// that capture; in relaxed mode it may, but for a device or context synchronize, which fails
/// and invalidates the capture in either mode (`scripts/vmm-cost/capture_calls.cu`).
pub fn relaxed<T>(t: &DriverTable, f: impl FnOnce() -> T) -> T {
    let Some(exchange) = t.cuThreadExchangeStreamCaptureMode else {
        return f();
    };
    let mut mode = CAPTURE_RELAXED;
    // SAFETY: valid in/out pointer; the mode is the calling thread's own.
    let swapped = unsafe { exchange(&mut mode) } == 0;
    let r = f();
    if swapped {
        // SAFETY: as above: the thread's own mode, as it was.
        unsafe { exchange(&mut mode) };
    }
    r
}

/// Wait until the current context's legacy default stream has run everything queued on it
/// (and so on every blocking stream) so far. Unlike a device synchronize it leaves a capture
/// on a non-blocking stream (PyTorch's) alone; call it in [`relaxed`] mode.
pub fn wait_legacy(t: &DriverTable) -> DrvResult<()> {
    let sync = t.cuStreamSynchronize.ok_or(DrvError(NOT_FOUND))?;
    // SAFETY: the legacy stream's handle is valid in any context.
    check(unsafe { sync(LEGACY_STREAM as CUstream) })
}

/// Copy `size` bytes from `src` to `dst` on the current context's legacy default stream (after
/// the work queued there and on blocking streams) and wait for the copy; call it in
/// [`relaxed`] mode (see [`wait_legacy`]).
pub fn copy_on_legacy(t: &DriverTable, dst: u64, src: u64, size: u64) -> DrvResult<()> {
    let copy = t.cuMemcpyDtoDAsync_v2.ok_or(DrvError(NOT_FOUND))?;
    // SAFETY: both ranges are device memory the caller keeps mapped until the wait below.
    check(unsafe { copy(dst, src, size as usize, LEGACY_STREAM as CUstream) })?;
    wait_legacy(t)
}

/// Streams of expseg's own, one a device (made in its primary context on first use).
static ASIDE: [std::sync::atomic::AtomicUsize; 64] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 64];

/// Copy `size` bytes from `src` to `dst` on a non-blocking stream of expseg's own on `dev`
/// (the current context's device) and wait for that copy alone: it reads the memory as it is
/// now, without waiting for the program's queued work. Call it in [`relaxed`] mode.
pub fn copy_aside(t: &DriverTable, dev: i32, dst: u64, src: u64, size: u64) -> DrvResult<()> {
    /// `CU_STREAM_NON_BLOCKING`.
    const NON_BLOCKING: libc::c_uint = 1;
    /// `CUDA_ERROR_INVALID_HANDLE`, `CUDA_ERROR_CONTEXT_IS_DESTROYED`: a stream of a context
    /// that was reset since.
    const STALE: [u32; 2] = [400, 709];
    let (create, copy, sync) = (
        t.cuStreamCreate.ok_or(DrvError(NOT_FOUND))?,
        t.cuMemcpyDtoDAsync_v2.ok_or(DrvError(NOT_FOUND))?,
        t.cuStreamSynchronize.ok_or(DrvError(NOT_FOUND))?,
    );
    let slot = ASIDE.get(dev as usize).ok_or(DrvError(NOT_FOUND))?;
    for _ in 0..2 {
        let mut s = slot.load(std::sync::atomic::Ordering::Acquire) as CUstream;
        if s.is_null() {
            // SAFETY: valid out-pointer; the stream lives in the current (primary) context.
            check(unsafe { create(&mut s, NON_BLOCKING) })?;
            if let Err(other) = slot.compare_exchange(
                0,
                s as usize,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            ) {
                // Another thread made one first: use it (this one stays, unused).
                s = other as CUstream;
            }
        }
        // SAFETY: both ranges are device memory the caller keeps mapped until the wait.
        let r = unsafe { copy(dst, src, size as usize, s) };
        let r = if r == 0 { unsafe { sync(s) } } else { r };
        if STALE.contains(&r) {
            slot.store(0, std::sync::atomic::Ordering::Release);
            continue;
        }
        return check(r);
    }
    Err(DrvError(STALE[0]))
}

/// Queue a copy of `size` bytes from `src` to `dst` on the program's `stream` (after its work
/// there, before what it queues next), without waiting. Call it in [`relaxed`] mode.
pub fn copy_on(t: &DriverTable, stream: usize, dst: u64, src: u64, size: u64) -> DrvResult<()> {
    let copy = t.cuMemcpyDtoDAsync_v2.ok_or(DrvError(NOT_FOUND))?;
    // SAFETY: device memory the caller owns; the stream is the program's, valid in its call.
    check(unsafe { copy(dst, src, size as usize, stream as CUstream) })
}

/// Whether the program's `stream` is capturing a CUDA graph (false where the driver cannot
/// say: then not).
pub fn capturing(t: &DriverTable, stream: usize) -> bool {
    let Some(f) = t.cuStreamIsCapturing else {
        return false;
    };
    let mut status: libc::c_uint = 0;
    // SAFETY: valid out-pointer; the stream is the program's.
    unsafe { f(stream as CUstream, &mut status) == 0 && status != 0 }
}
