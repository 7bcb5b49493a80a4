//! The IPC calls: `cudaIpcGetMemHandle` (producer), `cudaIpcOpenMemHandle` and
//! `cudaIpcCloseMemHandle` (consumer), and the producer's answers to tickets.
//!
//! By policy: pool memory asked for a handle ([`get`]: moved in place or mirrored), foreign
//! VMM memory ([`foreign`]), the mirrors both use ([`mirror`]) and how they are kept current
//! ([`current`]), the program's runs of such memory ([`runs`]), tickets and their socket
//! ([`tickets`]) and the one-time check whether they work ([`check`]), what is remembered
//! ([`shares`]), exports of coalesced pages through a copy ([`pages`]), the consumer's side
//! ([`open`]) and the mappings it keeps after a close ([`kept`]), whether this process shared or mapped
//! another's memory at all ([`sharing`]), and dma-bufs of its ranges ([`ranges`]).

mod check;
pub(crate) mod current;
mod foreign;
mod get;
mod kept;
mod mirror;
mod open;
pub mod pages;
mod ranges;
mod runs;
pub(super) mod shares;
pub mod sharing;
pub(super) mod tickets;

pub use foreign::mirror_foreign;
pub use get::cudaIpcGetMemHandle;
pub(crate) use kept::tell_freed;
pub use open::{
    allocation_range, cudaIpcCloseMemHandle, cudaIpcOpenMemHandle, pool_allocation_range,
};
pub use ranges::range_exported;
#[cfg(target_arch = "x86_64")]
pub(crate) use tickets::ensure_server;
#[doc(hidden)]
pub use tickets::serve_decisions_at;
