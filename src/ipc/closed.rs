//! The producer's word that a ticket's memory was freed: sent to each consumer of the
//! producer's own user that was granted the ticket, so a consumer that keeps memory it closed
//! mapped (for the next open of the same ticket) lets it go before the producer's free
//! returns, and the memory is back on the GPU as it would be natively.
//!
//! The request is 16 bytes like a ticket's: id [`CLOSED_ID`], the ticket's id as the nonce, or
//! [`FD`] and a descriptor number: the producer's descriptor of that number no longer names the
//! page it named (released, or the number given to another page's export), for consumers that
//! keep PyTorch's mappings of the producer's pages (`api::imports`) and asked to be told
//! ([`WATCH_ID`], answered by a producer that records its exported descriptors).
//! The consumer takes the producer's pid from the connection (`SO_PEERCRED`), never from the
//! request, and answers a grant of no chunks whose size is the bytes it unmapped. A request
//! from any other process of the user only makes the consumer drop a mapping nobody uses.

use super::sockdir;
use super::transport::{self, AskError};
use std::time::Duration;

pub const CLOSED_ID: u32 = u32::MAX - 6;
pub const WATCH_ID: u32 = u32::MAX - 7;

/// The nonce's bit that says it carries a descriptor number.
pub const FD: u64 = 1 << 63;

/// How long a producer waits for each consumer's answer (a consumer that is stopped or hung
/// keeps the memory mapped until it answers, and the producer says so).
pub const TIMEOUT: Duration = Duration::from_millis(500);

/// Tell consumer `pid` of `uid` that ticket `ticket` of this process was freed: the bytes it
/// unmapped.
pub fn tell(uid: u32, pid: u32, ticket: u32) -> Result<u64, AskError> {
    let path = sockdir::socket_path(uid, pid).map_err(AskError::Untrusted)?;
    transport::ask_plain(&path, uid, pid, CLOSED_ID, ticket as u64, TIMEOUT)
}

/// Tell consumer `pid` of `uid` that this process's descriptor `fd` no longer names the page it
/// named: the bytes it unmapped.
pub fn tell_fd(uid: u32, pid: u32, fd: i32) -> Result<u64, AskError> {
    let path = sockdir::socket_path(uid, pid).map_err(AskError::Untrusted)?;
    transport::ask_plain(&path, uid, pid, CLOSED_ID, FD | fd as u32 as u64, TIMEOUT)
}

/// Ask producer `pid` of `uid` to tell this process when its exported descriptors stop naming
/// their pages.
pub fn watch(uid: u32, pid: u32) -> Result<u64, AskError> {
    let path = sockdir::socket_path(uid, pid).map_err(AskError::Untrusted)?;
    transport::ask_plain(&path, uid, pid, WATCH_ID, 0, TIMEOUT)
}
