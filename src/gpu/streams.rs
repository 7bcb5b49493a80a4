//! The program's streams, as it makes and destroys them (`cuStreamCreate`,
//! `cuStreamCreateWithPriority`, `cuStreamDestroy`, seen by `hooks::streams`): which context
//! and device each belongs to and whether it is non-blocking (it does not wait for the legacy
//! default stream, so a hold on that stream does not hold it). A move of live pages holds
//! every stream of its device first (`fence::hold_streams`), and makes no move while one of
//! them captures a CUDA graph. Streams of expseg's own are made through the driver table, not
//! the hooks, and never appear here.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// `CU_STREAM_NON_BLOCKING`.
pub const NON_BLOCKING: u32 = 1;

/// One stream of the program's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream {
    pub stream: usize,
    /// The context it was made in (current at its creation).
    pub ctx: usize,
    pub dev: i32,
    /// Made with `CU_STREAM_NON_BLOCKING`: the legacy stream's hold does not reach it.
    pub non_blocking: bool,
}

/// The program's live streams by handle.
pub struct Streams {
    live: Mutex<BTreeMap<usize, Stream>>,
}

/// The process's streams.
pub static STREAMS: Streams = Streams::new();

impl Streams {
    pub const fn new() -> Streams {
        Streams {
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Stream>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The program made `stream` in context `ctx` of device `dev` with `flags`. A handle seen
    /// before (destroyed without our seeing it, its handle reused) is replaced.
    pub fn made(&self, stream: usize, ctx: usize, dev: i32, flags: u32) {
        if stream == 0 {
            return;
        }
        let s = Stream {
            stream,
            ctx,
            dev,
            non_blocking: flags & NON_BLOCKING != 0,
        };
        self.lock().insert(stream, s);
    }

    /// The program destroyed `stream` (or a hold found it gone).
    pub fn gone(&self, stream: usize) {
        self.lock().remove(&stream);
    }

    /// The streams of device `dev`, every kind.
    pub fn on_device(&self, dev: i32) -> Vec<Stream> {
        self.lock()
            .values()
            .filter(|s| s.dev == dev)
            .copied()
            .collect()
    }

    /// How many streams the program has now.
    pub fn count(&self) -> usize {
        self.lock().len()
    }
}

impl Default for Streams {
    fn default() -> Self {
        Streams::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_kept_by_device_until_destroyed_and_a_reused_handle_is_the_new_one() {
        let s = Streams::new();
        s.made(0x10, 0xc0, 0, NON_BLOCKING);
        s.made(0x20, 0xc0, 0, 0);
        s.made(0x30, 0xc1, 1, NON_BLOCKING);
        s.made(0, 0xc0, 0, 0); // a failed creation leaves no handle
        let on0 = s.on_device(0);
        assert_eq!(on0.len(), 2);
        assert!(on0.iter().any(|x| x.stream == 0x10 && x.non_blocking));
        assert!(on0.iter().any(|x| x.stream == 0x20 && !x.non_blocking));
        s.gone(0x10);
        s.made(0x20, 0xc1, 1, NON_BLOCKING);
        assert!(s.on_device(0).is_empty());
        assert_eq!(s.on_device(1).len(), 2);
        assert_eq!(s.count(), 2);
    }
}
