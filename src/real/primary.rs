//! Primary contexts through the driver table: which device's is current, making one current,
//! pushing and popping it around a call, waiting for its work. Never creates one.

use super::driver::DriverTable;
use cudarc::driver::sys::CUcontext;

/// Primary contexts seen so far, per device (0: not known yet): a context found here is
/// checked with one `cuDevicePrimaryCtxGetState` instead of a retain and release.
static PRIMARY: [std::sync::atomic::AtomicUsize; 64] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 64];

/// The calling thread's current context and its device, whatever context it is; `None`
/// without one (or where the driver cannot say).
pub fn current_context_device(t: &DriverTable) -> Option<(usize, i32)> {
    let get_dev = t.cuCtxGetDevice?;
    let mut cur: CUcontext = std::ptr::null_mut();
    let mut dev = 0;
    // SAFETY: valid out-pointers.
    unsafe {
        if (t.cuCtxGetCurrent)(&mut cur) != 0 || cur.is_null() || get_dev(&mut dev) != 0 {
            return None;
        }
    }
    Some((cur as usize, dev))
}

/// The device whose *primary* context is current on the calling thread; `None` when there is
/// no current context, when it is another context (`cuCtxCreate`), or when the driver lacks
/// the calls to tell. Never creates a context: an inactive primary context is not retained.
pub fn primary_device(t: &DriverTable) -> Option<i32> {
    let (cur, dev) = current_context_device(t)?;
    let cur = cur as CUcontext;
    // An inactive primary context cannot be the current one (and retaining it would create it).
    if !primary_active(t, dev) {
        return None;
    }
    if cached_primary(dev) == Some(cur) {
        return Some(dev);
    }
    (find_primary(t, dev).ok()? == cur).then_some(dev)
}

/// [`primary_device`] for a caller that most likely runs in `dev`'s primary context (a
/// device's own allocator thread): one `cuCtxGetCurrent` when that context, seen before, is
/// the current one, as [`current_is_primary`] answers; the full check otherwise.
pub fn primary_device_likely(t: &DriverTable, dev: i32) -> Option<i32> {
    match current_is_cached_primary(t, dev) {
        true => Some(dev),
        false => primary_device(t),
    }
}

/// Whether `dev`'s primary context, seen before, is the current one: one `cuCtxGetCurrent`
/// (false where it was not seen yet).
fn current_is_cached_primary(t: &DriverTable, dev: i32) -> bool {
    let Some(c) = cached_primary(dev) else {
        return false;
    };
    let mut cur: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    unsafe { (t.cuCtxGetCurrent)(&mut cur) == 0 && cur == c }
}

/// Whether the calling thread's current context is `dev`'s primary context: `None` when it
/// has no context. One `cuCtxGetCurrent` where the primary context was seen before.
pub fn current_is_primary(t: &DriverTable, dev: i32) -> Option<bool> {
    let mut cur: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; an uninitialised driver answers an error.
    if unsafe { (t.cuCtxGetCurrent)(&mut cur) } != 0 || cur.is_null() {
        return None;
    }
    if cached_primary(dev) == Some(cur) {
        return Some(true);
    }
    Some(primary_device(t) == Some(dev))
}

/// The id of the calling thread's current context (`cuCtxGetId`, CUDA 12+): unique per
/// context for the process's life. A reset primary context keeps its pointer but gets a new
/// id once used again (H100, scripts/vmm-cost/reset_vmm.cu: 1, then 2). None without a
/// context or the function.
pub fn current_context_id(t: &DriverTable) -> Option<u64> {
    let get_id = t.cuCtxGetId?;
    let mut cur: CUcontext = std::ptr::null_mut();
    let mut id = 0u64;
    // SAFETY: valid out-pointers; the driver answers errors for a thread without a context.
    unsafe {
        if (t.cuCtxGetCurrent)(&mut cur) != 0 || cur.is_null() || get_id(cur, &mut id) != 0 {
            return None;
        }
    }
    Some(id)
}

/// `CUDA_ERROR_INVALID_CONTEXT`.
const INVALID_CONTEXT: u32 = 201;

/// Whether `dev`'s primary context exists (is active); false when the driver cannot tell.
fn primary_active(t: &DriverTable, dev: i32) -> bool {
    let Some(state) = t.cuDevicePrimaryCtxGetState else {
        return false;
    };
    let (mut flags, mut active) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { state(dev, &mut flags, &mut active) == 0 && active != 0 }
}

/// The primary context of `dev` last seen (see [`PRIMARY`]).
fn cached_primary(dev: i32) -> Option<CUcontext> {
    let slot = usize::try_from(dev).ok().and_then(|d| PRIMARY.get(d))?;
    match slot.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        c => Some(c as CUcontext),
    }
}

/// `dev`'s active primary context, found with one retain and release and remembered in
/// [`PRIMARY`]. The caller checked that it is active: the retain creates nothing.
fn find_primary(t: &DriverTable, dev: i32) -> Result<CUcontext, u32> {
    let (Some(retain), Some(release)) =
        (t.cuDevicePrimaryCtxRetain, t.cuDevicePrimaryCtxRelease_v2)
    else {
        return Err(INVALID_CONTEXT);
    };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: the primary context is active; the release gives back the reference just taken
    // (the context stays alive: it is active).
    unsafe {
        let r = retain(&mut c, dev);
        if r != 0 {
            return Err(r);
        }
        release(dev);
    }
    if let Some(s) = usize::try_from(dev).ok().and_then(|d| PRIMARY.get(d)) {
        s.store(c as usize, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(c)
}

/// Make `dev`'s primary context current on the calling thread, if it is active (never creates
/// one: `CUDA_ERROR_INVALID_CONTEXT` otherwise). For processes without a shared runtime, where
/// switching devices is switching primary contexts.
pub fn make_primary_current(t: &DriverTable, dev: i32) -> u32 {
    let Some(set) = t.cuCtxSetCurrent.filter(|_| primary_active(t, dev)) else {
        return INVALID_CONTEXT;
    };
    let c = match cached_primary(dev) {
        Some(c) => c,
        None => match find_primary(t, dev) {
            Ok(c) => c,
            Err(e) => return e,
        },
    };
    // SAFETY: an active primary context.
    unsafe { set(c) }
}

/// Make `dev`'s primary context current for a while, from whatever context the calling thread
/// has (none, another device's, or one of the program's own): `Ok(true)` if it was pushed
/// (undo with [`pop_primary`]), `Ok(false)` if it is current already, `Err` if it cannot be
/// (not active: it is never created here; or the driver lacks the calls).
pub fn push_primary(t: &DriverTable, dev: i32) -> Result<bool, u32> {
    // The common case first, for one `cuCtxGetCurrent`: the primary context seen before is
    // the current one.
    if current_is_cached_primary(t, dev) {
        return Ok(false);
    }
    if primary_device(t) == Some(dev) {
        return Ok(false);
    }
    if !primary_active(t, dev) {
        return Err(INVALID_CONTEXT);
    }
    let push = t.cuCtxPushCurrent_v2.ok_or(INVALID_CONTEXT)?;
    let c = find_primary(t, dev)?;
    // SAFETY: an active primary context; the caller pops it.
    match unsafe { push(c) } {
        0 => Ok(true),
        e => Err(e),
    }
}

/// Undo a [`push_primary`] that answered `Ok(true)`.
pub fn pop_primary(t: &DriverTable) {
    if let Some(pop) = t.cuCtxPopCurrent_v2 {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; pops the context push_primary pushed.
        unsafe { pop(&mut popped) };
    }
}

/// Run `f` with `dev`'s primary context current, then give the thread its own context back.
/// Where that context cannot be made current, `f` runs in the thread's context.
pub fn with_primary<T>(t: &DriverTable, dev: i32, f: impl FnOnce() -> T) -> T {
    let pushed = push_primary(t, dev) == Ok(true);
    let r = f();
    if pushed {
        pop_primary(t);
    }
    r
}

/// Wait for the work queued on the legacy default stream of `dev`'s primary context (what the
/// runtime's stream 0 is), not for other streams: the wait the program meant to make before
/// freeing memory of `dev` (see `Driver::wait_default_stream`). Returns the driver's code; an
/// inactive primary context has no work: 0.
pub fn synchronize_primary_default_stream(t: &DriverTable, dev: i32) -> u32 {
    const CU_STREAM_LEGACY: usize = 0x1;
    let Some(sync) = t.cuStreamSynchronize else {
        return synchronize_primary(t, dev);
    };
    match push_primary(t, dev) {
        Ok(pushed) => {
            // SAFETY: CU_STREAM_LEGACY names the current context's (dev's primary) legacy stream.
            let r = unsafe { sync(CU_STREAM_LEGACY as _) };
            if pushed {
                pop_primary(t);
            }
            r
        }
        Err(_) if !primary_active(t, dev) => 0,
        Err(e) => e,
    }
}

/// Wait for the work of `dev`'s primary context (the driver's `cuCtxSynchronize`), from
/// whatever context the calling thread has: the primary context is pushed for the wait if it
/// is not current (an inactive one has no work: 0). Returns the driver's code.
pub fn synchronize_primary(t: &DriverTable, dev: i32) -> u32 {
    let Some(sync) = t.cuCtxSynchronize else {
        return 0;
    };
    match push_primary(t, dev) {
        Ok(pushed) => {
            // SAFETY: no arguments; waits for the current context, dev's primary one.
            let r = unsafe { sync() };
            if pushed {
                pop_primary(t);
            }
            r
        }
        Err(_) if !primary_active(t, dev) => 0,
        Err(e) => e,
    }
}
