//! The edge every hook crosses: a re-entrancy guard (a hook called from inside expseg takes
//! the plain path) and the panic boundary (a panic becomes an error code and a log line,
//! never an unwind into C).

use crate::api::UNKNOWN;
use crate::stats::GLOBAL;
use libc::c_int;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Held while a thread is inside expseg; a nested hook call takes the plain path.
pub(super) struct Guard;

impl Guard {
    #[inline]
    pub(super) fn enter() -> Option<Guard> {
        INSIDE
            // No Guard may be built for a thread already inside: dropped at once, it would
            // clear the flag of the outer hook.
            .try_with(|i| if i.replace(true) { None } else { Some(Guard) })
            .ok()
            .flatten()
    }
}

impl Drop for Guard {
    #[inline]
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|i| i.set(false));
    }
}

/// Run `f`; a panic becomes `cudaErrorUnknown` and one log line instead of unwinding into C.
pub(super) fn boundary(name: &str, f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(code) => code,
        Err(_) => {
            GLOBAL.panics_caught.add(1);
            log::error!("{name}: internal error caught; returning cudaErrorUnknown");
            UNKNOWN
        }
    }
}

/// expseg's part of a call whose real call came first and stands whatever expseg's part meets
/// (a lookup's redirection): run inside the panic boundary only (a call nested in expseg does
/// its part too); `None` after a panic, counted and logged with `then`.
pub(crate) fn contained<T>(name: &str, then: &str, f: impl FnOnce() -> T) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => Some(v),
        Err(_) => {
            GLOBAL.panics_caught.add(1);
            log::error!("{name}: internal error caught; {then}");
            None
        }
    }
}

/// expseg's part of a call whose real call follows (or came before) in any case: run under
/// the re-entrancy guard (`None` inside expseg) and the panic boundary (`None` after a panic,
/// counted and logged with `then`, what happens instead).
pub(super) fn around_real<T>(name: &str, then: &str, f: impl FnOnce() -> T) -> Option<T> {
    let _g = Guard::enter()?;
    contained(name, then, f)
}
