//! `expseg pause|resume` from outside: the request a user sends to the expseg processes of
//! their own user over the per-user socket (`transport`), and its answer.
//!
//! A request is 16 bytes like a ticket's: the id says which ([`PAUSE_ID`], [`RESUME_ID`],
//! [`QUERY_ID`], [`SHARING_ID`]), the nonce carries the tag (low 32 bits, 0: every tag) and, for a pause,
//! whether to discard (bit 32). The answer is a grant of no chunks whose size is the bytes
//! paused, resumed or paused now; a refusal says why not ([`Refusal::NoMemory`]: a resume
//! found no memory, what is still paused stays paused). Only a process's own user is served
//! (not the other users `EXPSEG_IPC_ALLOW_UIDS` admits for tickets), and the asker only talks
//! to a socket served by the process its name says, of its own uid.

use super::sockdir;
use super::transport::{self, AskError};
use std::time::Duration;

pub const PAUSE_ID: u32 = u32::MAX - 2;
pub const RESUME_ID: u32 = u32::MAX - 3;
pub const QUERY_ID: u32 = u32::MAX - 4;
pub const SHARING_ID: u32 = u32::MAX - 5;

/// Bit of the nonce that asks a pause to discard instead of offloading.
const DISCARD: u64 = 1 << 32;

/// A pause of tens of GiB page-locks host memory and copies it: answers may take long.
pub const TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Pause {
        tag: Option<u32>,
        discard: bool,
    },
    Resume {
        tag: Option<u32>,
    },
    /// Bytes paused now.
    Query,
    /// Whether the process shared memory or mapped another's by IPC (`api::sharing`'s bits).
    Sharing,
}

impl Control {
    /// The request as (id, nonce).
    pub fn encode(self) -> (u32, u64) {
        let tag = |t: Option<u32>| t.unwrap_or(0) as u64;
        match self {
            Control::Pause { tag: t, discard } => {
                (PAUSE_ID, tag(t) | if discard { DISCARD } else { 0 })
            }
            Control::Resume { tag: t } => (RESUME_ID, tag(t)),
            Control::Query => (QUERY_ID, 0),
            Control::Sharing => (SHARING_ID, 0),
        }
    }

    /// The control request in (id, nonce), if it is one.
    pub fn of(id: u32, nonce: u64) -> Option<Control> {
        let tag = match nonce as u32 {
            0 => None,
            t => Some(t),
        };
        match id {
            PAUSE_ID => Some(Control::Pause {
                tag,
                discard: nonce & DISCARD != 0,
            }),
            RESUME_ID => Some(Control::Resume { tag }),
            QUERY_ID => Some(Control::Query),
            SHARING_ID => Some(Control::Sharing),
            _ => None,
        }
    }
}

/// Send `c` to process `pid` of `uid`: the bytes it paused, resumed, or holds paused.
pub fn ask(uid: u32, pid: u32, c: Control, timeout: Duration) -> Result<u64, AskError> {
    let (id, nonce) = c.encode();
    let path = sockdir::socket_path(uid, pid).map_err(AskError::Untrusted)?;
    transport::ask_plain(&path, uid, pid, id, nonce, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_other_ids_are_not_control() {
        for c in [
            Control::Pause {
                tag: None,
                discard: false,
            },
            Control::Pause {
                tag: Some(77),
                discard: true,
            },
            Control::Resume {
                tag: Some(u32::MAX),
            },
            Control::Resume { tag: None },
            Control::Query,
            Control::Sharing,
        ] {
            let (id, nonce) = c.encode();
            assert_eq!(Control::of(id, nonce), Some(c));
        }
        assert_eq!(Control::of(super::super::reclaim::RECLAIM_ID, 0), None);
        assert_eq!(Control::of(5, 0), None);
    }
}
