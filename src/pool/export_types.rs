//! The vocabulary of IPC export (see `export`): how to export, what came of it, what went
//! wrong, and the mirror a block keeps.

use crate::gpu::{DrvError, IpcHandle};

/// A standard buffer that mirrors a block.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mirror {
    pub ptr: u64,
    pub size: u64,
    pub handle: IpcHandle,
}

/// The steps of a move in place, in order; a test can make any of them fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveStep {
    /// Wait for work that may still use the allocation.
    Sync,
    /// Reserve the temporary range.
    TempReserve,
    /// Map the chunks at the temporary range and give access.
    TempMap,
    /// Unmap the original range.
    Unmap,
    /// Release the original range.
    FreeRange,
    /// `cudaMalloc` of the same size.
    Alloc,
    /// The new memory landed on the original address.
    Placement,
    /// Copy the data into the new memory.
    Copy,
    /// Take the legacy handle.
    Handle,
}

impl MoveStep {
    pub const ALL: [MoveStep; 9] = [
        MoveStep::Sync,
        MoveStep::TempReserve,
        MoveStep::TempMap,
        MoveStep::Unmap,
        MoveStep::FreeRange,
        MoveStep::Alloc,
        MoveStep::Placement,
        MoveStep::Copy,
        MoveStep::Handle,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MoveStep::Sync => "sync",
            MoveStep::TempReserve => "temp_reserve",
            MoveStep::TempMap => "temp_map",
            MoveStep::Unmap => "unmap",
            MoveStep::FreeRange => "free_range",
            MoveStep::Alloc => "alloc",
            MoveStep::Placement => "placement",
            MoveStep::Copy => "copy",
            MoveStep::Handle => "handle",
        }
    }

    pub fn from_name(s: &str) -> Option<MoveStep> {
        MoveStep::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// How to export.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExportPolicy {
    /// Try moving in place allocations of at most this many bytes (0: never).
    pub move_max: u64,
    /// Tests: make this step of a move fail.
    pub fail_move_at: Option<MoveStep>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exported {
    /// The allocation is now standard memory at the same address; the handle is its own.
    Moved,
    /// The handle is a mirror's, refreshed by this request (`first`: just made).
    Mirror { ptr: u64, first: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Export {
    /// Start of the allocation that contains the requested pointer.
    pub base: u64,
    /// Its size as the program asked for it.
    pub size: u64,
    pub handle: IpcHandle,
    pub how: Exported,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportError {
    /// Not inside a live allocation of this pool.
    NotOwned,
    /// No memory for a mirror, even after giving the cache back.
    OutOfMemory,
    /// The driver or runtime failed; the allocation is unchanged.
    Driver(DrvError),
    /// The allocation is paused and could not be resumed for the export (out of memory: the
    /// driver's code); it stays paused, its host copy kept.
    Paused(DrvError),
    /// A move could not restore the original range (something else took the address). The
    /// data is safe at `kept`, still mapped, but the program's pointer no longer maps it.
    RangeLost { base: u64, kept: u64 },
}
