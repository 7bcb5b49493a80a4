//! The exported `syscall`: one system call, `pidfd_getfd`, is looked at (`api::fdshare`:
//! PyTorch takes a producer's descriptors with it, and the kernel may deny that); every other
//! number goes straight on to glibc's `syscall` with the caller's registers and stack untouched.
//!
//! `syscall` is variadic and sits on hot paths (Rust's and others' futex calls), so the
//! exported symbol is a few instructions of assembly: compare the number, jump to glibc's
//! function. Where glibc's cannot be found, the jump goes to expseg's own system call (one
//! stderr line says so) and `pidfd_getfd` is left to the kernel: a `syscall()` never fails for
//! want of glibc's. x86-64 only; elsewhere nothing is interposed and PyTorch keeps the
//! kernel's answer.
#![cfg(target_arch = "x86_64")]

use libc::{c_long, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};

/// x86-64's number of `pidfd_getfd`.
const SYS_PIDFD_GETFD: c_long = 438;

/// glibc's `syscall`, read by the trampoline (null until first resolved); where glibc's cannot
/// be found, [`expseg_raw_syscall`].
static EXPSEG_REAL_SYSCALL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

type SyscallFn =
    unsafe extern "C" fn(c_long, c_long, c_long, c_long, c_long, c_long, c_long) -> c_long;

/// glibc's `syscall`, found with `dlvsym` (which makes no `syscall` call of its own), or where
/// it cannot be found, [`expseg_raw_syscall`].
fn real() -> SyscallFn {
    let mut p = EXPSEG_REAL_SYSCALL.load(Ordering::Acquire);
    if p.is_null() {
        let mut found = std::ptr::null_mut();
        for v in [c"GLIBC_2.2.5", c"GLIBC_2.34"] {
            // SAFETY: dlvsym with constant NUL-terminated strings.
            found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"syscall".as_ptr(), v.as_ptr()) };
            if !found.is_null() {
                break;
            }
        }
        p = chosen(found);
        EXPSEG_REAL_SYSCALL.store(p, Ordering::Release);
    }
    // SAFETY: glibc's `syscall(long, ...)` reads its arguments from the integer registers and
    // the stack as a function of seven longs would; it ignores `al`. `expseg_raw_syscall` is
    // such a function.
    unsafe { std::mem::transmute::<*mut c_void, SyscallFn>(p) }
}

/// What the trampoline jumps to: glibc's `syscall` as `found`, or, where it was not found,
/// expseg's own (with one stderr line): every `syscall()` of the process still reaches the
/// kernel (it never answers `ENOSYS` for want of glibc's), and `pidfd_getfd` is left to it.
fn chosen(found: *mut c_void) -> *mut c_void {
    if !found.is_null() {
        return found;
    }
    let line = b"expseg: glibc's syscall() was not found; expseg makes system calls itself and leaves pidfd_getfd to the kernel\n";
    // SAFETY: writes a constant buffer to stderr (no allocation, no lock: this may run at load).
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
    }
    expseg_raw_syscall as *mut c_void
}

/// Whether the trampoline reaches glibc's `syscall` (not expseg's own).
fn glibc_found() -> bool {
    real() as *const () != expseg_raw_syscall as *const ()
}

/// A system call made as glibc's `syscall` makes it, for a process where that cannot be found:
/// the number and six arguments in the kernel's registers, and a result from -4095 to -1 turned
/// into -1 with `errno` set.
extern "C" fn expseg_raw_syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let r: c_long;
    // SAFETY: the caller's own system call and arguments; the instruction overwrites rcx and
    // r11 only, and touches no memory of ours.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => r,
            in("rdi") a1,
            in("rsi") a2,
            in("rdx") a3,
            in("r10") a4,
            in("r8") a5,
            in("r9") a6,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        return -1;
    }
    r
}

fn set_errno(e: i32) {
    // SAFETY: the calling thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// First call of any other number (glibc's function not known yet): find it, then call it.
extern "C" fn expseg_syscall_first(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let f = catch_unwind(real).unwrap_or(expseg_raw_syscall);
    // SAFETY: the caller's own arguments, passed on unchanged.
    unsafe { f(n, a1, a2, a3, a4, a5, a6) }
}

/// `pidfd_getfd(pidfd, fd, flags)`: the kernel's answer, and where it is `EPERM`, the
/// producer's expseg's.
extern "C" fn expseg_pidfd_getfd(
    n: c_long,
    pidfd: c_long,
    fd: c_long,
    flags: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    // A descriptor of another process's (PyTorch's expandable segments are shared so): this
    // process is about to map another's memory.
    crate::api::sharing::note_imported();
    // A producer that tells this process when its descriptor numbers stop naming their pages
    // (asked before the first is taken): PyTorch's mappings of its pages may be kept mapped
    // after PyTorch frees them (api::imports).
    let told = match (i32::try_from(pidfd), i32::try_from(fd)) {
        (Ok(p), Ok(f)) if flags == 0 && crate::vmm_hooks::import_handed() => {
            crate::hooks::guard::contained("pidfd_getfd", "nothing is kept of its pages", || {
                (!crate::api::config().disabled)
                    .then(|| crate::api::imports::before_getfd(p, crate::api::ensure_server))
                    .flatten()
                    .map(|pid| (pid, f))
            })
            .flatten()
        }
        _ => None,
    };
    let r = expseg_syscall_first(n, pidfd, fd, flags, a4, a5, a6);
    if r >= 0 {
        if let Some((pid, f)) = told {
            got_fd(r as i32, pid, f);
        }
        return r;
    }
    // SAFETY: the calling thread's errno.
    let e = unsafe { *libc::__errno_location() };
    if e != libc::EPERM || flags != 0 || !catch_unwind(glibc_found).unwrap_or(false) {
        return r;
    }
    let (Ok(pidfd), Ok(fd)) = (i32::try_from(pidfd), i32::try_from(fd)) else {
        return r;
    };
    let asked = catch_unwind(AssertUnwindSafe(|| {
        (!crate::api::config().disabled)
            .then(|| crate::api::fdshare::ask(pidfd, fd))
            .flatten()
    }));
    match asked {
        Ok(Some(f)) => {
            use std::os::fd::IntoRawFd;
            let mine = f.into_raw_fd();
            if let Some((pid, f)) = told {
                got_fd(mine, pid, f);
            }
            mine as c_long
        }
        _ => {
            set_errno(libc::EPERM);
            -1
        }
    }
}

/// `mine` is a copy of producer `pid`'s descriptor `fd` (api::imports), inside the panic
/// boundary.
fn got_fd(mine: i32, pid: u32, fd: i32) {
    crate::hooks::guard::contained("pidfd_getfd", "nothing is kept of its pages", || {
        crate::api::imports::got_fd(mine, pid, fd)
    });
}

/// The exported `syscall`.
///
/// # Safety
/// As `syscall(2)`.
#[unsafe(naked)]
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn syscall(n: c_long) -> c_long {
    std::arch::naked_asm!(
        "cmp rdi, {getfd_nr}",
        "je 3f",
        "mov rax, qword ptr [rip + {real}@GOTPCREL]",
        "mov rax, qword ptr [rax]",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "jmp {first}@PLT",
        "3:",
        "jmp {getfd}@PLT",
        getfd_nr = const SYS_PIDFD_GETFD,
        real = sym EXPSEG_REAL_SYSCALL,
        first = sym expseg_syscall_first,
        getfd = sym expseg_pidfd_getfd,
    )
}

/// Load time: find glibc's `syscall` now, so that no later first call (from a signal handler,
/// a vfork child) has to run `dlvsym`.
extern "C" fn resolve_at_load() {
    let _ = catch_unwind(real);
}

#[used]
#[link_section = ".init_array"]
static RESOLVE_SYSCALL_AT_LOAD: extern "C" fn() = resolve_at_load;

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> i32 {
        // SAFETY: the calling thread's errno.
        unsafe { *libc::__errno_location() }
    }

    #[test]
    fn without_glibcs_syscall_every_call_still_reaches_the_kernel() {
        let own = chosen(std::ptr::null_mut());
        // SAFETY: as `real`: a function of seven longs.
        let f = unsafe { std::mem::transmute::<*mut c_void, SyscallFn>(own) };
        // SAFETY: getpid and close take these arguments; close(-1) touches nothing.
        unsafe {
            assert_eq!(
                f(libc::SYS_getpid, 0, 0, 0, 0, 0, 0),
                libc::getpid() as c_long
            );
            set_errno(0);
            assert_eq!(f(libc::SYS_close, -1, 0, 0, 0, 0, 0), -1);
        }
        assert_eq!(
            errno(),
            libc::EBADF,
            "the kernel's error, as glibc reports it"
        );
        // With glibc's found, the trampoline goes there, as before.
        assert!(glibc_found());
        // SAFETY: as above.
        unsafe {
            assert_eq!(
                real()(libc::SYS_getpid, 0, 0, 0, 0, 0, 0),
                libc::getpid() as c_long
            )
        };
    }
}
