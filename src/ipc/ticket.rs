//! The ticket a handle carries (its leading 24 bytes), and what a producer answers to one:
//! a grant or a refusal.

/// Bytes 0..4 of a ticketed handle.
pub const MAGIC: [u8; 4] = *b"XSG1";

/// What bytes 0..24 of a ticketed handle say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// The producer's process id: names its socket.
    pub pid: u32,
    /// The producer's user id: names its socket directory.
    pub uid: u32,
    /// The producer's number for the shared allocation.
    pub id: u32,
    /// Random, checked by the producer: a ticket cannot be guessed from the others.
    pub nonce: u64,
}

impl Ticket {
    /// Write the ticket into the leading 24 bytes of `handle`.
    pub fn stamp(&self, handle: &mut [u8; 64]) {
        handle[0..4].copy_from_slice(&MAGIC);
        handle[4..8].copy_from_slice(&self.pid.to_le_bytes());
        handle[8..12].copy_from_slice(&self.uid.to_le_bytes());
        handle[12..16].copy_from_slice(&self.id.to_le_bytes());
        handle[16..24].copy_from_slice(&self.nonce.to_le_bytes());
    }

    /// The ticket in `handle`, if it carries one.
    pub fn read(handle: &[u8; 64]) -> Option<Ticket> {
        if handle[0..4] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(handle[i..i + 4].try_into().unwrap());
        Some(Ticket {
            pid: u32_at(4),
            uid: u32_at(8),
            id: u32_at(12),
            nonce: u64::from_le_bytes(handle[16..24].try_into().unwrap()),
        })
    }
}

/// Why a producer refused a ticket (sent on the wire as a number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such ticket, or the nonce does not match: forged or from another run.
    Unknown = 1,
    /// The allocation was freed.
    Stale = 2,
    /// The peer's user is not allowed.
    Forbidden = 3,
    /// The chunks could not be exported (or the control request failed).
    Failed = 4,
    /// No device memory for it (a resume: what is still paused stays paused).
    NoMemory = 5,
}

impl Refusal {
    pub fn from_code(c: u32) -> Refusal {
        match c {
            1 => Refusal::Unknown,
            2 => Refusal::Stale,
            3 => Refusal::Forbidden,
            5 => Refusal::NoMemory,
            _ => Refusal::Failed,
        }
    }
}

/// What a producer sends for an accepted ticket, besides the file descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The allocation's size as the program asked for it.
    pub size: u64,
    /// Size of each chunk, in mapping order (one descriptor each).
    pub chunks: Vec<u64>,
    /// Where the allocation starts inside the chunks mapped back to back: 0, or for a run of
    /// another allocator's pages whose first handle starts before it (coalesced pages shared
    /// without a split), the bytes of that handle before the run.
    pub lead: u64,
}

impl Grant {
    /// A grant of an allocation that starts at its first chunk's start.
    pub fn new(size: u64, chunks: Vec<u64>) -> Grant {
        Grant {
            size,
            chunks,
            lead: 0,
        }
    }
}
