//! expseg: a CUDA VMM expandable pool behind `cudaMalloc`/`cudaFree`, loaded with `LD_PRELOAD`
//! into programs nobody changes.
//!
//! # Architecture
//!
//! One call travels down these floors, and imports point down only
//! (`scripts/check-module-cycles.py`, run by CI, fails on a new import circle):
//!
//! hooks → api → pool / coalesce / ipc → gpu → real → lookup
//!
//! | floor | module | what it adds |
//! | --- | --- | --- |
//! | hooks | [`hooks`] | every exported C symbol, a few lines each: re-entrancy guard, panic boundary, call [`api`] |
//! | hooks | [`vmm_hooks`] | the VMM entry points handed to PyTorch's `libc10_cuda` (never exported) and the load-time PyTorch default |
//! | hooks | [`dlsym`] | the exported `dlsym`: lookups on a runtime or driver handle reach the hooks |
//! | hooks | [`syscall_hook`] | the exported `syscall`: a `pidfd_getfd` the kernel denies is asked of the producer's expseg ([`api::fdshare`]) |
//! | hooks | [`pyapi`] | C functions for the Python module: the live report as JSON |
//! | api | [`api`] | one safe function per hooked call, same name: policy (pool or pass-through), device and context handling; its IPC calls in `api::ipc` (by policy: get, foreign, open, tickets, shares, mirror), the coalescer policy in [`api::vmm`], what they share in `api::state` |
//! | pool | [`pool`] | safe pool logic: reservations, physical chunks, the cache, accounting, IPC export |
//! | coalesce | [`coalesce`] | safe logic behind PyTorch's VMM pages: virtual handles, one physical handle per run, compaction, reuse |
//! | ipc | [`ipc`] | tickets: two-way sharing with consumers that run expseg (Unix socket, `SCM_RIGHTS`) |
//! | gpu | [`gpu`] | the small [`gpu::Driver`] trait the pool talks to, its CUDA implementation (with [`gpu::fence`], the hold on the default stream while live pages move) and a fake for tests |
//! | real | [`real`] | the next runtime's functions, the driver's function table (`real::driver`), primary contexts ([`real::primary`]), the hosting Python's PyTorch allocator ([`real::python`]) |
//! | lookup | [`real::lookup`] | the only `dlsym`/`dlvsym` code: glibc's own `dlsym`, never redirected |
//! | beside | [`config`] | the `EXPSEG_*` table |
//! | beside | [`stats`] | counters and the exit report |
//! | beside | [`clock`] | the clock hook calls are timed with (the CPU's time-stamp counter, read from a register) |
//! | beside | [`elf`] | the glibc requirement of an ELF file |
//! | beside | [`hostmem`] | host memory the process can take without the OOM killer (meminfo, cgroup limits) |
//!
//! So "where is cudaMalloc handled?" is answered by `grep 'fn cudaMalloc'`: the hook in
//! `hooks/mod.rs`, the policy in `api/mod.rs`; the pool behind it runs under `cargo test` against
//! [`gpu::fake::FakeDriver`].
//!
//! `unsafe` is denied crate-wide and allowed only in the modules that touch C: `hooks`,
//! `vmm_hooks`, `dlsym`, `syscall_hook`, `real` (with `real::lookup`, `real::driver`,
//! `real::primary` and `real::python`), `pyapi`, `gpu::cuda`, `gpu::fence`, `ipc::transport` and
//! `clock` (`rdtsc` and its load-time constructor, item by item)
//! (and, in test builds, `test_alloc`, the counting allocator).
#![deny(unsafe_code)]
// Each unsafe operation in an `unsafe fn` sits in a block of its own that says why it is
// sound.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod api;
pub mod clock;
pub mod coalesce;
pub mod config;
pub mod dlsym;
pub mod elf;
pub mod gpu;
#[allow(unsafe_code)]
pub mod hooks;
pub mod hostcopy;
pub mod hostmem;
pub mod ipc;
pub mod pool;
#[allow(unsafe_code)]
pub mod pyapi;
#[allow(unsafe_code)]
pub mod real;
pub mod stats;
#[allow(unsafe_code)]
pub mod syscall_hook;
#[cfg(test)]
#[allow(unsafe_code)]
mod test_alloc;
#[cfg(test)]
mod test_rng;
#[allow(unsafe_code)]
pub mod vmm_hooks;
