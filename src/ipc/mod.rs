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

pub mod closed;
pub mod control;
pub mod ns;
pub mod reclaim;
pub mod server;
pub mod sockdir;
#[cfg(test)]
mod socket_tests;
mod ticket;
pub mod transport;
pub mod watch;

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

/// A 64-bit random number from the kernel (the nonce source), or `None` where the kernel has
/// no random source.
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
    fn the_ticket_and_the_refusal_codes_are_as_docs_ipc_handle_md_lays_them_out() {
        let doc = include_str!("../../docs/ipc-handle.md");
        let t = Ticket {
            pid: 0x1111_2222,
            uid: 0x3333_4444,
            id: 0x5555_6666,
            nonce: 0x7777_8888_9999_aaaa,
        };
        let mut h = [0u8; 64];
        t.stamp(&mut h);
        let table = &doc[doc.find("### Ticket layout").unwrap()..];
        let rows: Vec<(usize, usize, &str)> = table
            .lines()
            .skip_while(|l| !l.starts_with("| bytes |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                let (a, b) = cells[0].split_once('–').unwrap();
                (a.parse().unwrap(), b.parse().unwrap(), cells[1])
            })
            .collect();
        assert_eq!(rows.len(), 5, "the table's rows: {rows:?}");
        for (from, to, field) in rows {
            let want: Vec<u8> = if field.starts_with("magic `XSG1`") {
                MAGIC.to_vec()
            } else if field.starts_with("producer pid") {
                t.pid.to_le_bytes().to_vec()
            } else if field.starts_with("producer uid") {
                t.uid.to_le_bytes().to_vec()
            } else if field.starts_with("ticket id") {
                t.id.to_le_bytes().to_vec()
            } else if field.starts_with("nonce") {
                t.nonce.to_le_bytes().to_vec()
            } else {
                panic!("a field the code does not write: {field}")
            };
            assert_eq!(h[from..=to], want[..], "bytes {from}-{to} ({field})");
        }
        let said: String = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        let codes = "(1 unknown, 2 stale, 3 forbidden, 4 failed, 5 no memory)";
        assert!(said.contains(codes), "docs/ipc-handle.md lists {codes}");
        for (code, r) in [
            (1, Refusal::Unknown),
            (2, Refusal::Stale),
            (3, Refusal::Forbidden),
            (4, Refusal::Failed),
            (5, Refusal::NoMemory),
        ] {
            assert_eq!(r as u32, code);
            assert_eq!(Refusal::from_code(code), r);
        }
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
