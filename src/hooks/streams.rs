//! The program's streams seen as it makes and destroys them (`gpu::streams`), so that a move
//! of live pages can hold every one of them first. The driver's call is made in any case and
//! its answer stands; expseg's part (one entry in a map) is inside the panic boundary.
//!
//! Exported under the driver's names (programs linked against `libcuda`), and handed out by
//! the lookups in slots as `order`'s functions are (runtimes, static ones too, make their
//! streams through the functions they fetch there).

use super::guard::contained;
use super::order::Slots;
use crate::gpu::streams::STREAMS;
use crate::real::next_driver;
use libc::{c_int, c_uint, c_void};

static CREATE: Slots = Slots::new();
static CREATE_PRIO: Slots = Slots::new();
static DESTROY: Slots = Slots::new();

type FnCreate = unsafe extern "C" fn(*mut usize, c_uint) -> u32;
type FnCreatePrio = unsafe extern "C" fn(*mut usize, c_uint, c_int) -> u32;
type FnDestroy = unsafe extern "C" fn(usize) -> u32;

/// After a creation: the new stream, in the calling thread's current context (where the
/// driver made it), remembered with its flags.
fn made(name: &str, r: u32, out: *mut usize, flags: c_uint) {
    if r != 0 || out.is_null() {
        return;
    }
    contained(name, "the stream is not held by moves", || {
        // SAFETY: the driver wrote the new stream there (success, not null: checked).
        let s = unsafe { *out };
        let Ok(t) = crate::real::driver() else { return };
        if let Some((ctx, dev)) = crate::real::primary::current_context_device(t) {
            STREAMS.made(s, ctx, dev, flags);
        }
    });
}

fn gone(name: &str, r: u32, s: usize) {
    if r == 0 {
        contained(name, "the stream stays in expseg's list", || {
            STREAMS.gone(s)
        });
    }
}

unsafe extern "C" fn create_slot<const I: usize>(out: *mut usize, flags: c_uint) -> u32 {
    // SAFETY: the slot holds the driver function of this signature that the lookup handed
    // out this forwarder for (`Slots::claim`).
    let f: FnCreate = unsafe { std::mem::transmute(CREATE.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(out, flags) };
    made("cuStreamCreate", r, out, flags);
    r
}

unsafe extern "C" fn create_prio_slot<const I: usize>(
    out: *mut usize,
    flags: c_uint,
    prio: c_int,
) -> u32 {
    // SAFETY: as `create_slot`.
    let f: FnCreatePrio = unsafe { std::mem::transmute(CREATE_PRIO.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(out, flags, prio) };
    made("cuStreamCreateWithPriority", r, out, flags);
    r
}

unsafe extern "C" fn destroy_slot<const I: usize>(s: usize) -> u32 {
    // SAFETY: as `create_slot`.
    let f: FnDestroy = unsafe { std::mem::transmute(DESTROY.get(I)) };
    // SAFETY: the program's own arguments, passed on unchanged.
    let r = unsafe { f(s) };
    gone("cuStreamDestroy", r, s);
    r
}

/// What a lookup of `name` hands out instead of `found`: the forwarder of the slot `found`
/// is kept in. None: not a stream function, or no slot left.
pub(super) fn for_lookup(name: &[u8], found: *mut c_void) -> Option<*mut c_void> {
    let (slots, fns) = match name {
        b"cuStreamCreate" => (&CREATE, slot_fns!(create_slot)),
        b"cuStreamCreateWithPriority" => (&CREATE_PRIO, slot_fns!(create_prio_slot)),
        b"cuStreamDestroy" | b"cuStreamDestroy_v2" => (&DESTROY, slot_fns!(destroy_slot)),
        _ => return None,
    };
    if fns.contains(&found) || found.is_null() {
        return None;
    }
    slots.claim(found as usize).map(|i| fns[i])
}

/// # Safety
/// As the driver's `cuStreamCreate`: `out` points to room for a stream.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut usize, flags: c_uint) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamCreate(out, flags) };
    made("cuStreamCreate", r, out, flags);
    r
}

/// # Safety
/// As the driver's `cuStreamCreateWithPriority`: `out` points to room for a stream.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut usize,
    flags: c_uint,
    prio: c_int,
) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamCreateWithPriority(out, flags, prio) };
    made("cuStreamCreateWithPriority", r, out, flags);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy(s: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamDestroy(s) };
    gone("cuStreamDestroy", r, s);
    r
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: usize) -> u32 {
    // SAFETY: the driver's own function, with the program's own arguments.
    let r = unsafe { next_driver::cuStreamDestroy_v2(s) };
    gone("cuStreamDestroy_v2", r, s);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_of_a_stream_function_gets_a_forwarder_once_per_variant() {
        let a = 0x1000 as *mut c_void;
        let f = for_lookup(b"cuStreamDestroy_v2", a).unwrap();
        assert_eq!(
            for_lookup(b"cuStreamDestroy", a),
            Some(f),
            "the same variant"
        );
        assert_eq!(for_lookup(b"cuStreamDestroy", f), None, "a forwarder stays");
        assert_eq!(for_lookup(b"cuStreamQuery", a), None);
    }
}
