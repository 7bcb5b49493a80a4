//! The ticket transport: a Unix socket per producer process, one request per connection,
//! file descriptors passed with `SCM_RIGHTS`. This file makes the socket's system calls (the
//! peer's credentials, a bounded connect, descriptors sent and received), writes answers and
//! asks; `server` decides who is read and answered, and when. Only these two touch sockets.
//!
//! Request (16 bytes): ticket id (u32), zero (u32), nonce (u64).
//! Reply: status (u32, 0 = granted, [`GRANTED_WITH_LEAD`] = granted with a lead, else a
//! `Refusal`), chunk count (u32), allocation size (u64), with a lead then the lead (u64: where
//! the allocation starts inside the chunks), then one u64 per chunk (its size). A consumer of
//! an older release reads the lead's status as a refusal and opens the handle's mirror. Then
//! the descriptors, one per chunk in order, in
//! messages of at most [`BATCH`], each message a u32 (how many it carries) with the
//! descriptors attached, so neither side ever holds more than a batch of descriptors it has
//! not used yet. A refusal is the header alone: no chunks, and a size of 0 or, for a pause
//! or resume ([`Denial`]), the bytes done before the failure. Little-endian.
#![allow(unsafe_code)]

use super::ns::{self, PidNamespace};
use super::sockdir::dir_trusted;
use super::ticket::{Grant, Refusal};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Most chunks one grant carries (a foreign VMM run of 20 MiB pages: 1.25 TiB).
pub const MAX_CHUNKS: usize = 1 << 16;

/// The longest a ticket's request may take, from connecting to its last descriptor.
pub const TICKET_TIME: Duration = Duration::from_secs(10);

/// Most descriptors in one message.
pub const BATCH: usize = 64;

/// The status of a grant whose allocation starts `lead` bytes into its first chunk (a run of
/// coalesced pages shared whole, without a split); 0 is a grant without a lead.
pub const GRANTED_WITH_LEAD: u32 = 6;

/// Request ids from here up name requests, not tickets: `closed`'s `WATCH_ID` and `CLOSED_ID`, `control`'s
/// `SHARING_ID`, `QUERY_ID`, `RESUME_ID` and `PAUSE_ID`, `reclaim::RECLAIM_ID`, and
/// `fdshare`'s `GETFD_ID` (`u32::MAX`). Ticket ids stay below it.
pub const FIRST_REQUEST_ID: u32 = u32::MAX - 7;

/// Fill `buf` from the kernel's random source (`getrandom`, else `/dev/urandom`). Never from
/// anything guessable: without a random source there are no tickets.
pub fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    #[cfg(test)]
    if NO_RANDOM.with(|n| n.get()) {
        return Err(std::io::Error::other("no random source (test)"));
    }
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most the remaining length into `buf`.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            // No getrandom (very old kernels): urandom.
            let mut f = std::fs::File::open("/dev/urandom")?;
            return f.read_exact(&mut buf[done..]);
        }
        done += n as usize;
    }
    Ok(())
}

/// The uid and pid of the process at the other end of `s`, if it is a process of pid namespace `own`
/// (`ns::check_peer`); `Err` says why it is not, or cannot be told. Where the kernel gives a
/// pidfd of the peer (`SO_PEERPIDFD`, Linux 6.5), the process must still be alive after the
/// check: its pid was then not handed on to another process while `/proc` was read.
pub(super) fn peer_of(s: &UnixStream, own: PidNamespace) -> Result<(u32, u32), String> {
    let pidfd = peer_pidfd(s);
    let (uid, pid) = peer_cred(s).ok_or("no credentials on the connection")?;
    ns::check_peer(pid, own)?;
    if pidfd.is_some_and(|fd| !alive(&fd)) {
        return Err(format!("process {pid} exited before it could be checked"));
    }
    Ok((uid, pid))
}

/// A pidfd of the process at the other end of `s` (`None` before Linux 6.5).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn peer_pidfd(s: &UnixStream) -> Option<OwnedFd> {
    const SO_PEERPIDFD: libc::c_int = 77;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` and `len` are valid for the size given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    // SAFETY: a descriptor the kernel just made for us.
    (r == 0 && fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn peer_pidfd(_: &UnixStream) -> Option<OwnedFd> {
    None
}

/// Whether the process of `pidfd` still runs (signal 0: `EPERM` also means it does).
fn alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal with signal 0 and no siginfo only checks.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The uid and pid of the process at the other end of `s` (as it was at connect time).
pub(crate) fn peer_cred(s: &UnixStream) -> Option<(u32, u32)> {
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for the size given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((cred.uid, cred.pid as u32))
}

/// The descriptors of a grant, produced one at a time in chunk order (the producer exports
/// each just before it is sent).
pub type FdSource = Box<dyn FnMut() -> std::io::Result<OwnedFd> + Send>;

/// What the producer decides for a request: a grant with its descriptors, or a refusal.
pub type Decision = Result<(Grant, FdSource), Refusal>;

/// A refusal as sent: why, and what the request did before it failed (the bytes a pause or
/// resume did anyway, in the answer's size field; 0 for everything else).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Denial {
    pub why: Refusal,
    pub done: u64,
}

impl From<Refusal> for Denial {
    fn from(why: Refusal) -> Denial {
        Denial { why, done: 0 }
    }
}

/// What [`serve`](super::server::serve)'s `decide` answers: a [`Decision`] whose refusal may say what was done.
pub type Reply = Result<(Grant, FdSource), Denial>;

/// A source that hands out already exported descriptors.
pub fn fds_of(fds: Vec<OwnedFd>) -> FdSource {
    let mut it = fds.into_iter();
    Box::new(move || {
        it.next()
            .ok_or_else(|| std::io::Error::other("fewer descriptors than chunks"))
    })
}

/// Connect to the socket at `path`, waiting at most `timeout` (`std`'s connect waits without a
/// bound while the server's backlog is full: a stopped process's socket). Linux bounds a Unix
/// socket's connect by its send timeout; past it the answer is `TimedOut`.
pub(crate) fn connect_within(path: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: a zeroed sockaddr_un is valid; the path fits with its terminating NUL (checked).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *b as libc::c_char;
    }
    // SAFETY: a new socket; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just made and is ours alone.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let t = timeout.max(Duration::from_micros(1)); // zero would mean no bound at all
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: a valid option value of its own size, on our socket.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `addr` is a filled sockaddr_un of the size given.
    let r = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINPROGRESS) => {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
            }
            _ => e,
        });
    }
    Ok(UnixStream::from(owned))
}

pub(super) fn reply(s: &mut UnixStream, decision: Reply) -> std::io::Result<()> {
    let (grant, mut fds) = match decision {
        Ok(g) => g,
        Err(d) => {
            let mut msg = [0u8; 16];
            msg[0..4].copy_from_slice(&(d.why as u32).to_le_bytes());
            msg[8..16].copy_from_slice(&d.done.to_le_bytes());
            return s.write_all(&msg);
        }
    };
    let mut msg = Vec::with_capacity(24 + 8 * grant.chunks.len());
    let status = match grant.lead {
        0 => 0u32,
        _ => GRANTED_WITH_LEAD,
    };
    msg.extend_from_slice(&status.to_le_bytes());
    msg.extend_from_slice(&(grant.chunks.len() as u32).to_le_bytes());
    msg.extend_from_slice(&grant.size.to_le_bytes());
    if grant.lead != 0 {
        msg.extend_from_slice(&grant.lead.to_le_bytes());
    }
    for c in &grant.chunks {
        msg.extend_from_slice(&c.to_le_bytes());
    }
    s.write_all(&msg)?;
    let mut left = grant.chunks.len();
    while left > 0 {
        let n = left.min(BATCH);
        let batch = (0..n)
            .map(|_| fds())
            .collect::<std::io::Result<Vec<OwnedFd>>>()?;
        let raw: Vec<RawFd> = batch.iter().map(|f| f.as_raw_fd()).collect();
        send_with_fds(s.as_raw_fd(), &(n as u32).to_le_bytes(), &raw)?;
        left -= n;
        // `batch` drops here: the producer's copies are closed once sent.
    }
    Ok(())
}

fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u8; space.max(1)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header with `fds.len()` descriptors.
        unsafe {
            let h = libc::CMSG_FIRSTHDR(&msg);
            (*h).cmsg_level = libc::SOL_SOCKET;
            (*h).cmsg_type = libc::SCM_RIGHTS;
            (*h).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(h).cast(), fds.len());
        }
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != data.len() {
        return Err(std::io::Error::other("short send"));
    }
    Ok(())
}

/// Time left until `deadline`, or `TimedOut` where none is.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer in time",
        )),
    }
}

/// `read_exact`, each read bounded by what is left until `deadline`: a peer that trickles its
/// answer a byte at a time cannot stretch the request past it.
pub(super) fn read_exact_by(
    s: &mut UnixStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.set_read_timeout(Some(left(deadline)?))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all`, bounded as [`read_exact_by`].
fn write_all_by(s: &mut UnixStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    let mut put = 0;
    while put < buf.len() {
        s.set_write_timeout(Some(left(deadline)?))?;
        match s.write(&buf[put..]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => put += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Connect to `path` and check that process `pid` of `uid` serves it. Where it is not served
/// so (a process of another pid namespace may hold the usual name first) or cannot be
/// reached, the producer's other names in the same directory ([`sockdir::socket_names`]) that
/// exist are tried in order; the first one's error stands where none is the producer's.
fn connect_served_by(
    path: &Path,
    uid: u32,
    pid: u32,
    deadline: Instant,
) -> Result<UnixStream, AskError> {
    let one = |p: &Path| -> Result<UnixStream, AskError> {
        let timeout = left(deadline).map_err(AskError::Unreachable)?;
        let s = connect_within(p, timeout).map_err(AskError::Unreachable)?;
        match peer_cred(&s) {
            Some(c) if c == (uid, pid) => Ok(s),
            Some((u, q)) => Err(AskError::Untrusted(format!(
                "{} is served by process {q} of uid {u}, not by process {pid} of uid {uid}",
                p.display()
            ))),
            None => Err(AskError::Untrusted("no credentials on the socket".into())),
        }
    };
    let first = match one(path) {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    let usual = path.file_name().and_then(|n| n.to_str()) == Some(&format!("{pid}.sock"));
    if let (true, Some(dir)) = (usual, path.parent()) {
        for other in super::sockdir::socket_names(pid).skip(1) {
            let p = dir.join(other);
            if std::fs::symlink_metadata(&p).is_ok() {
                if let Ok(s) = one(&p) {
                    return Ok(s);
                }
            }
        }
    }
    Err(first)
}

/// Connect to `path`, check that process `pid` of `uid` serves it, send request `id` with
/// `nonce` and read the answer's header: the stream and the header of an accepted request
/// (a refusal is `AskError::Refused`). The whole request, connecting included, ends by
/// `deadline`.
fn request(
    path: &Path,
    uid: u32,
    pid: u32,
    id: u32,
    nonce: u64,
    deadline: Instant,
) -> Result<(UnixStream, [u8; 16]), AskError> {
    let mut s = connect_served_by(path, uid, pid, deadline)?;
    let mut req = [0u8; 16];
    req[0..4].copy_from_slice(&id.to_le_bytes());
    req[8..16].copy_from_slice(&nonce.to_le_bytes());
    write_all_by(&mut s, &req, deadline).map_err(AskError::Unreachable)?;
    // The header carries no descriptors; exact reads never reach into the first batch.
    let mut head = [0u8; 16];
    read_exact_by(&mut s, &mut head, deadline).map_err(AskError::Unreachable)?;
    let status = u32::from_le_bytes(head[0..4].try_into().unwrap());
    if status != 0 && status != GRANTED_WITH_LEAD {
        let done = u64::from_le_bytes(head[8..16].try_into().unwrap());
        return Err(AskError::Refused(Refusal::from_code(status), done));
    }
    Ok((s, head))
}

/// Send request `id` with `nonce` to process `pid` of `uid` at `path` and read an answer
/// that carries no chunks (reclaims, pause and resume): its size field. The socket must be
/// served by that very process of that very user, and the answer come within `timeout`.
pub fn ask_plain(
    path: &Path,
    uid: u32,
    pid: u32,
    id: u32,
    nonce: u64,
    timeout: Duration,
) -> Result<u64, AskError> {
    let (_, head) = request(path, uid, pid, id, nonce, Instant::now() + timeout)?;
    if head[0..8] != [0; 8] {
        return Err(AskError::Protocol("this answer carries no chunks"));
    }
    Ok(u64::from_le_bytes(head[8..16].try_into().unwrap()))
}

/// Why a request did not get memory.
#[derive(Debug)]
pub enum AskError {
    /// No producer socket or no answer: the producer is gone or out of reach.
    Unreachable(std::io::Error),
    /// The producer answered no, and what the request did before it failed (the bytes a
    /// pause or resume did anyway; 0 for tickets, reclaims and descriptors).
    Refused(Refusal, u64),
    /// A malformed answer.
    Protocol(&'static str),
    /// The socket is not the producer's: its directory belongs to someone else, or another
    /// process serves it.
    Untrusted(String),
}

/// The descriptors of a grant as they arrive, by the request's deadline.
pub struct Incoming {
    s: UnixStream,
    left: usize,
    deadline: Instant,
}

impl Incoming {
    /// The next descriptors in chunk order (at most [`BATCH`]); empty once all have arrived.
    pub fn next_batch(&mut self) -> Result<Vec<OwnedFd>, AskError> {
        if self.left == 0 {
            return Ok(Vec::new());
        }
        let mut n = [0u8; 4];
        left(self.deadline)
            .and_then(|d| self.s.set_read_timeout(Some(d)))
            .map_err(AskError::Unreachable)?;
        let (got, fds) =
            recv_with_fds(self.s.as_raw_fd(), &mut n).map_err(AskError::Unreachable)?;
        let want = u32::from_le_bytes(n) as usize;
        if got != 4 || want == 0 || want > self.left.min(BATCH) || fds.len() != want {
            return Err(AskError::Protocol("a batch does not match its descriptors"));
        }
        self.left -= want;
        Ok(fds)
    }
}

/// Ask the producer behind `path` for ticket (`id`, `nonce`): the grant, and its descriptors
/// to be received batch by batch. The producer must be who the ticket says: the socket's
/// directory is `uid`'s and closed to others, and the process serving it is `uid`'s process
/// `pid`; anything else is [`AskError::Untrusted`], and nothing is sent or received.
pub fn ask(
    path: &Path,
    uid: u32,
    pid: u32,
    id: u32,
    nonce: u64,
) -> Result<(Grant, Incoming), AskError> {
    if let Some(dir) = path.parent() {
        if dir.exists() || std::fs::symlink_metadata(dir).is_ok() {
            dir_trusted(dir, uid).map_err(AskError::Untrusted)?;
        }
    }
    let deadline = Instant::now() + TICKET_TIME;
    let (mut s, head) = request(path, uid, pid, id, nonce, deadline)?;
    let count = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
    let size = u64::from_le_bytes(head[8..16].try_into().unwrap());
    if count == 0 || count > MAX_CHUNKS {
        return Err(AskError::Protocol("bad chunk count"));
    }
    let mut lead = 0u64;
    if head[0..4] == GRANTED_WITH_LEAD.to_le_bytes() {
        let mut b = [0u8; 8];
        read_exact_by(&mut s, &mut b, deadline).map_err(AskError::Unreachable)?;
        lead = u64::from_le_bytes(b);
    }
    let mut sizes = vec![0u8; 8 * count];
    read_exact_by(&mut s, &mut sizes, deadline).map_err(AskError::Unreachable)?;
    let chunks: Vec<u64> = sizes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    // Nothing the producer says is trusted blindly: every chunk a whole number of 2 MiB pages
    // (VMM granularity), their total without overflow, the allocation inside them, starting
    // inside the first chunk on a page.
    const PAGE: u64 = 2 << 20;
    let total = chunks.iter().try_fold(0u64, |t, c| {
        (*c > 0 && c % PAGE == 0)
            .then(|| t.checked_add(*c))
            .flatten()
    });
    let fits = (lead.is_multiple_of(PAGE) && lead < chunks[0])
        .then(|| lead.checked_add(size))
        .flatten();
    match (total, fits) {
        (Some(t), Some(end)) if size > 0 && end <= t => {}
        _ => {
            return Err(AskError::Protocol(
                "chunk sizes that do not hold the allocation",
            ))
        }
    }
    let incoming = Incoming {
        s,
        left: count,
        deadline,
    };
    Ok((Grant { size, chunks, lead }, incoming))
}

/// One message: its bytes into `data`, and the descriptors attached to it.
fn recv_with_fds(sock: RawFd, data: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let max_fd_bytes = (BATCH * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: pure computation.
    let space = unsafe { libc::CMSG_SPACE(max_fd_bytes) } as usize;
    let mut cbuf = vec![0u8; space];
    let mut got = 0;
    let mut fds = Vec::new();
    // The message may arrive in pieces; descriptors come with the first.
    while got < data.len() {
        let mut iov = libc::iovec {
            iov_base: data[got..].as_mut_ptr().cast(),
            iov_len: data.len() - got,
        };
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at live buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: walking the control messages the kernel wrote into `cbuf`.
        unsafe {
            let mut h = libc::CMSG_FIRSTHDR(&msg);
            while !h.is_null() {
                if (*h).cmsg_level == libc::SOL_SOCKET && (*h).cmsg_type == libc::SCM_RIGHTS {
                    let count = ((*h).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / std::mem::size_of::<RawFd>();
                    let p = libc::CMSG_DATA(h) as *const RawFd;
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                    }
                }
                h = libc::CMSG_NXTHDR(&msg, h);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(std::io::Error::other("descriptors truncated"));
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    Ok((got, fds))
}

#[cfg(test)]
thread_local! {
    /// Makes `fill_random` fail on this thread, as on a system without a random source.
    pub(crate) static NO_RANDOM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::server::serve;
    use crate::ipc::sockdir::current_uid;
    use crate::ipc::socket_tests::{counting_server, helper};
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixListener;

    #[test]
    fn a_connect_to_a_socket_that_accepts_nothing_ends_within_its_bound() {
        // A stopped process's socket: its backlog fills, and std's connect would wait for ever.
        let dir = std::env::temp_dir().join(format!("expseg-connect-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let mut queued = Vec::new();
        let started = std::time::Instant::now();
        let err = loop {
            match connect_within(&path, Duration::from_millis(100)) {
                Ok(s) => queued.push(s),
                Err(e) => break e,
            }
            assert!(queued.len() < 10_000, "the backlog never filled");
        };
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(!queued.is_empty(), "connects succeed while there is room");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_grant_carries_its_descriptors_and_refusals_carry_none() {
        let dir = std::env::temp_dir().join(format!("expseg-transport-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.sock");
        serve(
            &path,
            false,
            |_| true,
            |id, nonce, peer: super::super::server::Peer| {
                // The asker is this very process: its uid and pid, as the connection tells.
                if peer.uid != current_uid() || peer.pid != std::process::id() {
                    return Err(Refusal::Forbidden.into());
                }
                if id == 7 {
                    return Err(Denial {
                        why: Refusal::NoMemory,
                        done: nonce,
                    });
                }
                if id == 4 {
                    // A run shared whole: it starts 4 MiB into its first 8 MiB chunk.
                    let source: FdSource =
                        Box::new(|| Ok(std::fs::File::open("/dev/null").unwrap().into()));
                    return Ok((
                        Grant {
                            size: 6 << 20,
                            chunks: vec![8 << 20, 2 << 20],
                            lead: 4 << 20,
                        },
                        source,
                    ));
                }
                if id != 3 || nonce != 99 {
                    return Err(Refusal::Unknown.into());
                }
                // 150 chunks: three batches (64, 64, 22), made one at a time.
                let n = 150;
                let source: FdSource =
                    Box::new(|| Ok(std::fs::File::open("/dev/null").unwrap().into()));
                Ok((
                    Grant {
                        size: 5 << 20,
                        chunks: (0..n).map(|i| (i + 1) << 21).collect(),
                        lead: 0,
                    },
                    source,
                ))
            },
        )
        .unwrap();
        let me = (current_uid(), std::process::id());
        let (g, mut incoming) = ask(&path, me.0, me.1, 3, 99).unwrap();
        assert_eq!(g.size, 5 << 20);
        assert_eq!(g.chunks.len(), 150);
        assert_eq!(g.chunks[149], 150 << 21);
        let mut batches = Vec::new();
        loop {
            let b = incoming.next_batch().unwrap();
            if b.is_empty() {
                break;
            }
            batches.push(b.len());
        }
        assert_eq!(batches, vec![64, 64, 22]);
        assert_eq!(g.lead, 0);
        let (g, mut incoming) = ask(&path, me.0, me.1, 4, 1).unwrap();
        assert_eq!(
            (g.size, g.lead, g.chunks),
            (6 << 20, 4 << 20, vec![8 << 20, 2 << 20])
        );
        assert_eq!(incoming.next_batch().unwrap().len(), 2);
        assert!(matches!(
            ask(&path, me.0, me.1, 3, 98),
            Err(AskError::Refused(Refusal::Unknown, 0))
        ));
        // A refusal that says what was done before it (a pause or resume): its size field.
        assert!(matches!(
            ask_plain(&path, me.0, me.1, 7, 32 << 20, Duration::from_secs(5)),
            Err(AskError::Refused(Refusal::NoMemory, 33554432))
        ));
        assert!(matches!(
            ask(&dir.join("none.sock"), me.0, me.1, 3, 99),
            Err(AskError::Unreachable(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_peer_that_trickles_its_answer_is_cut_off_at_the_requests_deadline() {
        // A same-uid socket answering one byte every 150 ms: each read would come in time, the
        // whole answer (16 bytes, 2.4 s) would not. The request ends at its deadline.
        let dir = std::env::temp_dir().join(format!("expseg-trickle-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.sock");
        let l = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut req = [0u8; 16];
            c.read_exact(&mut req).unwrap();
            for _ in 0..16 {
                if c.write_all(&[0]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        });
        let me = (current_uid(), std::process::id());
        let t0 = Instant::now();
        let r = ask_plain(&path, me.0, me.1, 7, 0, Duration::from_millis(400));
        let took = t0.elapsed();
        assert!(matches!(r, Err(AskError::Unreachable(_))), "{r:?}");
        assert!(
            took < Duration::from_millis(1000),
            "one deadline for the request: {took:?}"
        );
        server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_peers_pidfd_tells_whether_it_still_runs() {
        let dir = std::env::temp_dir().join(format!("expseg-pidfd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.sock");
        let l = UnixListener::bind(&path).unwrap();
        let mut child = helper("poke_helper", false, ("EXPSEG_TEST_POKE", &path)).unwrap();
        let (s, _) = l.accept().unwrap();
        let Some(pidfd) = peer_pidfd(&s) else {
            eprintln!("skipped: no SO_PEERPIDFD (Linux before 6.5)");
            let _ = child.kill();
            let _ = child.wait();
            return;
        };
        assert!(alive(&pidfd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!alive(&pidfd), "gone: its pid may be another process's now");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_consumer_asks_only_the_process_and_directory_the_ticket_names() {
        let (path, seen) = counting_server("who", |_| true);
        let me = (current_uid(), std::process::id());
        // Another pid (the server is this process): nothing is sent.
        assert!(matches!(
            ask(&path, me.0, me.1 + 1, 7, 1),
            Err(AskError::Untrusted(_))
        ));
        // Another uid.
        assert!(matches!(
            ask(&path, me.0 + 1, me.1, 7, 1),
            Err(AskError::Untrusted(_))
        ));
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 0);
        // A directory others can write.
        let dir = path.parent().unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            ask(&path, me.0, me.1, 7, 1),
            Err(AskError::Untrusted(_))
        ));
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(ask(&path, me.0, me.1, 7, 1).is_ok());
        // A directory of another user (as root only: chown).
        if me.0 == 0 {
            std::os::unix::fs::chown(dir, Some(65534), None).unwrap();
            assert!(matches!(
                ask(&path, me.0, me.1, 7, 1),
                Err(AskError::Untrusted(_))
            ));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn forged_sizes_from_a_producer_are_refused() {
        let dir = std::env::temp_dir().join(format!("expseg-forged-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let me = (current_uid(), std::process::id());
        const M: u64 = 1 << 20;
        let cases: [(u64, Vec<u64>, u64); 8] = [
            (1 << 40, vec![2 * M], 0), // a 1 TiB allocation in one 2 MiB chunk
            (2 * M, vec![0], 0),       // an empty chunk
            (2 * M, vec![3 * M], 0),   // not whole pages
            (2 * M, vec![u64::MAX - 1, 4 * M], 0), // a total that overflows
            (2 * M, vec![8 * M], M),   // a lead inside a page
            (2 * M, vec![8 * M, 2 * M], 8 * M), // a lead past the first chunk
            (6 * M, vec![8 * M], 4 * M), // the allocation past the chunks' end
            (2 * M, vec![8 * M], u64::MAX - M + 1), // a lead that overflows
        ];
        for (i, (size, chunks, lead)) in cases.into_iter().enumerate() {
            let path = dir.join(format!("{i}.sock"));
            let l = UnixListener::bind(&path).unwrap();
            let reply = std::thread::spawn(move || {
                let (mut c, _) = l.accept().unwrap();
                let mut req = [0u8; 16];
                c.read_exact(&mut req).unwrap();
                let mut msg = Vec::new();
                let status = if lead == 0 { 0 } else { GRANTED_WITH_LEAD };
                msg.extend_from_slice(&status.to_le_bytes());
                msg.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
                msg.extend_from_slice(&size.to_le_bytes());
                if lead != 0 {
                    msg.extend_from_slice(&lead.to_le_bytes());
                }
                for c in &chunks {
                    msg.extend_from_slice(&c.to_le_bytes());
                }
                let _ = c.write_all(&msg);
            });
            assert!(
                matches!(ask(&path, me.0, me.1, 1, 1), Err(AskError::Protocol(_))),
                "case {i}"
            );
            reply.join().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
