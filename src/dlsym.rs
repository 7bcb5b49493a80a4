//! `dlsym` interposition: programs that fetch CUDA functions through a library handle —
//! `dlsym(dlopen("libcudart.so.13"), "cudaIpcGetMemHandle")`, as Python's
//! `ctypes.CDLL("libcudart.so.13").cudaIpcGetMemHandle` does in vLLM — would get the runtime's
//! own function, because a handle lookup searches that library, not the preloaded ones. The
//! exported `dlsym` gives them expseg's hook instead, for exactly the functions expseg
//! interposes and only on a `libcudart`/`libcuda` handle.
//!
//! Every other lookup must behave as if expseg were not there, including `RTLD_NEXT`, whose
//! meaning depends on the caller's address. So `dlsym` is a few instructions of assembly: ask
//! [`expseg_dlsym_redirect`] (which never calls `dlsym`), return its answer if there is one,
//! else *jump* to the real `dlsym` with the caller's arguments and return address untouched.
//! x86-64 only; on other architectures nothing is interposed (programs then reach expseg only
//! through the dynamic linker).
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use crate::real::lookup::{real_ptr, EXPSEG_REAL_DLSYM};
#[cfg(target_arch = "x86_64")]
use libc::{c_char, c_void};
#[cfg(target_arch = "x86_64")]
use std::ffi::CStr;

// The redirect below serves the x86_64 trampoline only (the exported `dlsym` is x86_64
// assembly); other architectures build without it.
#[cfg(target_arch = "x86_64")]
extern "C" {
    fn dlinfo(handle: *mut c_void, request: libc::c_int, arg: *mut c_void) -> libc::c_int;
}
#[cfg(target_arch = "x86_64")]
const RTLD_DI_LINKMAP: libc::c_int = 2;

#[cfg(target_arch = "x86_64")]
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
}

/// expseg's replacement for `name` looked up in `handle` by code at `caller` (the `dlsym`
/// call's return address), or null for "ask the real dlsym". Called by the trampoline for
/// every `dlsym` in the process: it makes no `dlsym` call and allocates nothing; only a
/// driver allocation function looked up on a driver handle costs a `dladdr` of the caller
/// (a shared runtime gets the driver's own, see `hooks::driver_lookup_allowed`).
#[cfg(target_arch = "x86_64")]
extern "C" fn expseg_dlsym_redirect(
    handle: *mut c_void,
    name: *const c_char,
    caller: usize,
) -> *mut c_void {
    // A panic (none is expected) asks the real dlsym, as for any name expseg does not serve.
    std::panic::catch_unwind(|| redirect(handle, name, caller)).unwrap_or(std::ptr::null_mut())
}

#[cfg(target_arch = "x86_64")]
fn redirect(handle: *mut c_void, name: *const c_char, caller: usize) -> *mut c_void {
    if real_ptr().is_null() {
        return std::ptr::null_mut();
    }
    if handle.is_null() || handle == libc::RTLD_NEXT || name.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `name` is the caller's NUL-terminated symbol name.
    let name = unsafe { CStr::from_ptr(name) }.to_bytes();
    let Some(replacement) = crate::hooks::replacement(name) else {
        return std::ptr::null_mut();
    };
    let mut lm: *const LinkMap = std::ptr::null();
    // SAFETY: `handle` is the caller's dlopen handle, as the real dlsym would read it.
    if unsafe {
        dlinfo(
            handle,
            RTLD_DI_LINKMAP,
            (&mut lm as *mut *const LinkMap).cast(),
        )
    } != 0
        || lm.is_null()
    {
        return std::ptr::null_mut();
    }
    // SAFETY: the link map of a loaded object; l_name is a NUL-terminated path ("" for the
    // main program).
    let path = unsafe {
        let n = (*lm).l_name;
        if n.is_null() {
            return std::ptr::null_mut();
        }
        CStr::from_ptr(n).to_bytes()
    };
    let file = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
    // Wheels ship the runtime under hashed names too (`libcudart-1a2b3c.so.12`).
    let runtime = crate::real::is_shared_runtime_file(file);
    let driver = file.starts_with(b"libcuda.so");
    if (runtime && name.starts_with(b"cuda"))
        || (driver
            && name.starts_with(b"cu")
            && !name.starts_with(b"cuda")
            && crate::hooks::driver_lookup_allowed(name, caller))
    {
        replacement
    } else {
        std::ptr::null_mut()
    }
}

/// The exported `dlsym`: the redirect check, then a jump to the real one.
///
/// # Safety
/// As `dlsym(3)`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        // The caller's return address, for the redirect to know who asks.
        "mov rdx, qword ptr [rsp]",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {redirect}@PLT",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "ret",
        "2:",
        "mov rax, qword ptr [rip + {real}@GOTPCREL]",
        "mov rax, qword ptr [rax]",
        // glibc's dlsym not found: null, never a jump to address 0.
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        "3:",
        "ret",
        redirect = sym expseg_dlsym_redirect,
        real = sym EXPSEG_REAL_DLSYM,
    )
}

/// Load time: find glibc's `dlsym` now (and say so if it cannot be found), so that no later
/// first lookup has to.
#[cfg(target_arch = "x86_64")]
extern "C" fn resolve_dlsym_at_load() {
    let _ = std::panic::catch_unwind(real_ptr);
}

#[cfg(target_arch = "x86_64")]
#[used]
#[link_section = ".init_array"]
static RESOLVE_DLSYM_AT_LOAD: extern "C" fn() = resolve_dlsym_at_load;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn without_glibcs_dlsym_lookups_answer_null_and_never_jump_to_zero() {
        // SAFETY: fork; the child only stores atomics, looks a name up and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            crate::real::lookup::forget_real_dlsym();
            // SAFETY: RTLD_DEFAULT and a NUL-terminated name, as for dlsym(3).
            let p = unsafe { dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(if p.is_null() { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the lookup ended the child ({status:#x}): a jump to address 0?"
        );
        // Here, glibc's is found and answers.
        // SAFETY: as above.
        assert!(!unsafe { dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) }.is_null());
    }
}
