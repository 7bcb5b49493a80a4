//! torch_memory_saver beside expseg: its preload hook (`torch_memory_saver_hook_mode_preload`)
//! serves `cudaMalloc` itself inside its regions (`torch_memory_saver.region()`), so that its
//! pause can give that memory back. Whether the calling thread is in such a region, as the
//! hook itself answers (`tms_get_interesting_region`, found once among the loaded objects).

use super::lookup;
use once_cell::sync::OnceCell;

type Region = unsafe extern "C" fn() -> bool;

/// The hook's region query, where its library is loaded globally (as `LD_PRELOAD` loads it).
fn region_query() -> Option<Region> {
    static F: OnceCell<Option<Region>> = OnceCell::new();
    *F.get_or_init(|| {
        // SAFETY: a lookup in the global scope with a constant name.
        let p = unsafe { lookup::real(std::ptr::null_mut(), c"tms_get_interesting_region") };
        // SAFETY: torch_memory_saver's `bool tms_get_interesting_region()`.
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut libc::c_void, Region>(p) })
    })
}

/// Whether torch_memory_saver's hook is loaded.
pub fn present() -> bool {
    region_query().is_some()
}

/// Whether the calling thread is in a torch_memory_saver region: its `cudaMalloc` is the
/// hook's to serve.
pub fn in_region() -> bool {
    // SAFETY: the hook's own query of a thread-local flag; no arguments.
    region_query().is_some_and(|f| unsafe { f() })
}

/// Whether `LD_PRELOAD` names torch_memory_saver's hook (at load time, before any lookup).
pub fn preloaded() -> bool {
    std::env::var("LD_PRELOAD").is_ok_and(|v| v.contains("torch_memory_saver"))
}
