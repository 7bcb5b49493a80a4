//! The exported `syscall`: one system call, `pidfd_getfd`, is looked at (`api::fdshare`:
//! PyTorch takes a producer's descriptors with it, and the kernel may deny that); every other
//! number goes straight on to glibc's `syscall` with the caller's registers and stack untouched.
//!
//! `syscall` is variadic and sits on hot paths (Rust's and others' futex calls), so the
//! exported symbol is a few instructions of assembly: compare the number, jump to glibc's
//! function. x86-64 only; elsewhere nothing is interposed and PyTorch keeps the kernel's answer.
#![cfg(target_arch = "x86_64")]

use libc::{c_long, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};

/// x86-64's number of `pidfd_getfd`.
const SYS_PIDFD_GETFD: c_long = 438;

/// glibc's `syscall`, read by the trampoline (null until first resolved).
static EXPSEG_REAL_SYSCALL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

type SyscallFn =
    unsafe extern "C" fn(c_long, c_long, c_long, c_long, c_long, c_long, c_long) -> c_long;

/// glibc's `syscall`, found with `dlvsym` (which makes no `syscall` call of its own).
fn real() -> Option<SyscallFn> {
    let mut p = EXPSEG_REAL_SYSCALL.load(Ordering::Acquire);
    if p.is_null() {
        for v in [c"GLIBC_2.2.5", c"GLIBC_2.34"] {
            // SAFETY: dlvsym with constant NUL-terminated strings.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"syscall".as_ptr(), v.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        EXPSEG_REAL_SYSCALL.store(p, Ordering::Release);
    }
    // SAFETY: glibc's `syscall(long, ...)` reads its arguments from the integer registers and
    // the stack as a function of seven longs would; it ignores `al`.
    Some(unsafe { std::mem::transmute::<*mut c_void, SyscallFn>(p) })
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
    match catch_unwind(real).ok().flatten() {
        // SAFETY: the caller's own arguments, passed on unchanged.
        Some(f) => unsafe { f(n, a1, a2, a3, a4, a5, a6) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
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
    let r = expseg_syscall_first(n, pidfd, fd, flags, a4, a5, a6);
    if r >= 0 {
        return r;
    }
    // SAFETY: the calling thread's errno.
    let e = unsafe { *libc::__errno_location() };
    if e != libc::EPERM || flags != 0 {
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
            f.into_raw_fd() as c_long
        }
        _ => {
            set_errno(libc::EPERM);
            -1
        }
    }
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
