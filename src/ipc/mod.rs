//! IPC tickets: two-way sharing of pool memory with consumers that run expseg.
//!
//! A mirror's legacy handle (see `pool::export`) opens with the plain driver, but the consumer
//! then sees a copy. Its first 24 bytes, which the opener ignores on the drivers measured
//! (docs/ipc-handle.md), carry a *ticket*. A consumer running expseg recognises it in
//! `cudaIpcOpenMemHandle`, asks the producer over a Unix socket, receives the allocation's
//! physical chunks as POSIX file descriptors (`SCM_RIGHTS`), and maps the original memory:
//! producer and consumer then share it both ways, as with native IPC.
//!
//! Security: the socket lives in a directory only the user can enter (0700, checked), the
//! producer checks the peer's pid namespace (its own only: `ns`) and uid (`SO_PEERCRED`; same
//! user, or `EXPSEG_IPC_ALLOW_UIDS`), and
//! every ticket carries a random nonce the producer checks. A forged, stale (freed) or foreign
//! ticket gets an error, never memory.

pub mod control;
pub mod ns;
pub mod reclaim;
pub mod server;
pub mod sockdir;
#[cfg(test)]
mod socket_tests;
mod ticket;
pub mod transport;

pub use ticket::{Grant, Refusal, Ticket, MAGIC};

/// Check that a ticketed copy of `handle` (a legacy handle of standard memory whose first
/// bytes are `pattern`) still opens with the plain runtime at `runtime_lib`, in a child process
/// without expseg: the helper `expseg-ipc-check` at `helper` opens it and reads it back.
pub fn check_ticketed_handle(
    helper: &std::path::Path,
    runtime_lib: &str,
    mut handle: [u8; 64],
    pattern: &[u8],
    dev: i32,
) -> Result<(), String> {
    if !helper.exists() {
        return Err(format!("the helper {} is missing", helper.display()));
    }
    Ticket {
        pid: 0,
        uid: 0,
        id: 0,
        nonce: random_u64().ok_or("no random source for ticket nonces")?,
    }
    .stamp(&mut handle);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut child = std::process::Command::new(helper)
        .args([runtime_lib, &hex(&handle), &hex(pattern), &dev.to_string()])
        .env_remove("LD_PRELOAD")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", helper.display()))?;
    for _ in 0..600 {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return if status.success() {
                Ok(())
            } else {
                Err(format!(
                    "a ticketed handle did not open in a child process ({status})"
                ))
            };
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    Err("the check in a child process timed out".into())
}

/// A 64-bit random number from the kernel (the nonce source).
/// A random 64-bit value, or `None` where the kernel has no random source.
pub fn random_u64() -> Option<u64> {
    let mut b = [0u8; 8];
    transport::fill_random(&mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_round_trip_and_leave_the_validated_bytes_alone() {
        let mut h = [0xEEu8; 64];
        let t = Ticket {
            pid: 4242,
            uid: 1000,
            id: 7,
            nonce: 0x0123_4567_89ab_cdef,
        };
        t.stamp(&mut h);
        assert_eq!(Ticket::read(&h), Some(t));
        assert!(
            h[24..].iter().all(|b| *b == 0xEE),
            "bytes 24..64 are the driver's"
        );
        assert_eq!(Ticket::read(&[0u8; 64]), None);
    }

    #[test]
    fn nonces_differ() {
        let a: Vec<u64> = (0..16).map(|_| random_u64().unwrap()).collect();
        let mut b = a.clone();
        b.sort_unstable();
        b.dedup();
        assert_eq!(a.len(), b.len());
    }
}
