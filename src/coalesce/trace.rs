//! The trace format: one coalescer call and its result as one line of text, written by the
//! recorder (`crate::api::trace`, `EXPSEG_TEST_TRACE`) and read by the replay
//! (`super::replay`, `expseg-replay`).
//!
//! A line is `T DEV MOVES OP ARGS... = RESULT`:
//! - `T`: nanoseconds since the first event (monotonic); `DEV`: the coalescer's device;
//!   `MOVES`: 1 where the call ran on the device's allocator thread
//!   ([`Coalescer::allow_moves`](super::Coalescer::allow_moves)), else 0;
//! - `OP` and its arguments (addresses, sizes and handles in hex; switches 0/1; `-` for none),
//!   as [`Call`] lists them;
//! - `RESULT`: `ok`, `ok 0xVALUE` (a handle, a flag, bytes) or `err CODE` (the decimal
//!   `CUresult`).
//!
//! Lines starting with `#` are comments; the recorder's first ones say the configuration
//! ([`Header`]).

use crate::gpu::{DrvResult, PageProps};
use std::borrow::Cow;
use std::fmt;

/// A call the api made on a coalescer, with its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call<'a> {
    /// `create SIZE SHAREABLE RDMA TAG`.
    Create { size: u64, props: PageProps },
    /// `release VH`.
    Release { vh: u64 },
    /// `map VA SIZE OFFSET VH`.
    Map {
        va: u64,
        size: u64,
        offset: u64,
        vh: u64,
    },
    /// `clear VA SIZE`: the program maps a handle of its own there (`clear_for_program`).
    Clear { va: u64, size: u64 },
    /// `unmap VA SIZE CALLER` (`unmap_from`; `-`: no caller device).
    Unmap {
        va: u64,
        size: u64,
        caller: Option<i32>,
    },
    /// `set_access VA SIZE DEV:FLAGS,...` (`-`: no descriptor).
    SetAccess {
        va: u64,
        size: u64,
        descs: Cow<'a, [(i32, u32)]>,
    },
    /// `export VH`.
    Export { vh: u64 },
    /// `bind VH`: the real handle and offset behind a page, for a multicast binding.
    Bind { vh: u64 },
    /// `share_run PTR` (`isolate_run PTR` in traces recorded before runs were shared
    /// without a split).
    ShareRun { ptr: u64 },
    /// `isolate_page PTR`.
    IsolatePage { ptr: u64 },
    /// `retain PTR`.
    Retain { ptr: u64 },
    /// `reserved VA SIZE`: the program's `cuMemAddressReserve` succeeded.
    Reserved { va: u64, size: u64 },
    /// `address_free VA SIZE`.
    AddressFree { va: u64, size: u64 },
    /// `drop_ahead`.
    DropAhead,
    /// `settle FORCE`.
    Settle { force: bool },
    /// `release_kept`, from a call of the program's.
    ReleaseKept,
    /// `releaser`: `release_kept` from the releaser thread, after the release delay's quiet.
    Releaser,
    /// `trim`.
    Trim,
    /// `trim_unmoved`.
    TrimUnmoved,
    /// `release_host`.
    ReleaseHost,
    /// `stranded_now` (the report's query, which records the peak).
    StrandedNow,
    /// `pause TAG DISCARD` (`-`: every tag).
    Pause { tag: Option<u32>, discard: bool },
    /// `resume TAG` (`-`: every tag).
    Resume { tag: Option<u32> },
}

/// What a call returned: a value where it returns one (a handle, a flag as 0/1, bytes), or
/// the failing call's `CUresult`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok(Option<u64>),
    Err(u32),
}

impl Outcome {
    /// A call that returns nothing.
    pub const DONE: Outcome = Outcome::Ok(None);

    pub fn is_ok(self) -> bool {
        matches!(self, Outcome::Ok(_))
    }
}

impl From<&DrvResult<()>> for Outcome {
    fn from(r: &DrvResult<()>) -> Self {
        match r {
            Ok(()) => Outcome::DONE,
            Err(e) => Outcome::Err(e.0),
        }
    }
}

impl From<&DrvResult<u64>> for Outcome {
    fn from(r: &DrvResult<u64>) -> Self {
        match r {
            Ok(v) => Outcome::Ok(Some(*v)),
            Err(e) => Outcome::Err(e.0),
        }
    }
}

impl From<&DrvResult<bool>> for Outcome {
    fn from(r: &DrvResult<bool>) -> Self {
        match r {
            Ok(b) => Outcome::Ok(Some(u64::from(*b))),
            Err(e) => Outcome::Err(e.0),
        }
    }
}

impl From<&DrvResult<Option<u64>>> for Outcome {
    fn from(r: &DrvResult<Option<u64>>) -> Self {
        match r {
            Ok(v) => Outcome::Ok(*v),
            Err(e) => Outcome::Err(e.0),
        }
    }
}

impl From<u64> for Outcome {
    fn from(v: u64) -> Self {
        Outcome::Ok(Some(v))
    }
}

/// One line: when, on which device, whether moves were allowed, the call and its result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event<'a> {
    pub t_ns: u64,
    pub dev: i32,
    pub moves: bool,
    pub call: Call<'a>,
    pub out: Outcome,
}

/// The recorder's first lines: the process and the coalescers' configuration, so that a replay
/// can tell whether it runs under the recorded policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub pid: u32,
    /// `EXPSEG_RELEASE_DELAY` as the coalescers ran it (0 without a releaser thread).
    pub release_delay_ms: u64,
    /// Every `key=value` of the configuration line, as written.
    pub config: Vec<(String, String)>,
    /// Each device's allocation granularity.
    pub granularity: Vec<(i32, u64)>,
}

/// The first word of a trace file.
pub const MAGIC: &str = "# expseg-trace 1";

impl Header {
    /// The header's lines for `cfg`, each ending in a newline.
    pub fn lines(
        pid: u32,
        cfg: &super::CoalesceConfig,
        keep_host: bool,
        granularity: &[(i32, u64)],
    ) -> String {
        let mut s = format!(
            "{MAGIC} pid={pid}\n# line: T_NS DEV MOVES OP ARGS... = ok [0xVALUE] | err CODE\n"
        );
        s += &format!("# config {}\n", config_words(cfg, keep_host));
        for (d, g) in granularity {
            s += &format!("# device {d} granularity={g:#x}\n");
        }
        s
    }

    #[cfg(any(test, feature = "test-switches"))]
    /// Take what a comment line says into the header (other comments are ignored).
    pub fn read_comment(&mut self, line: &str) {
        let words: Vec<&str> = line.trim_start_matches('#').split_whitespace().collect();
        let kv = |w: &str| {
            w.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        };
        match words.first() {
            Some(&"expseg-trace") => {
                if let Some(p) = words.iter().filter_map(|w| kv(w)).find(|(k, _)| k == "pid") {
                    self.pid = p.1.parse().unwrap_or(0);
                }
            }
            Some(&"config") => {
                self.config = words[1..].iter().filter_map(|w| kv(w)).collect();
                if let Some((_, v)) = self.config.iter().find(|(k, _)| k == "release_delay_ms") {
                    self.release_delay_ms = v.parse().unwrap_or(0);
                }
            }
            Some(&"device") => {
                let dev = words.get(1).and_then(|d| d.parse().ok());
                let gran = words
                    .get(2)
                    .and_then(|w| w.strip_prefix("granularity="))
                    .and_then(|g| hex(g).ok());
                if let (Some(d), Some(g)) = (dev, gran) {
                    self.granularity.push((d, g));
                }
            }
            _ => {}
        }
    }

    #[cfg(any(test, feature = "test-switches"))]
    /// The configuration's value of `key`, as written.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.config
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The coalescers' configuration as `key=value` words (the header's `# config` line).
pub fn config_words(cfg: &super::CoalesceConfig, keep_host: bool) -> String {
    format!(
        "max_handle={:#x} strand_max={:#x} margin={:#x} release_delay_ms={} ahead={:#x} peer_hold={:?} move_live={} split_tail={} learn_cuts={} keep_host={}",
        cfg.max_handle,
        cfg.strand_max,
        cfg.margin,
        cfg.release_delay.as_millis(),
        cfg.ahead,
        cfg.peer_hold,
        u8::from(cfg.move_live),
        u8::from(cfg.split_tail),
        u8::from(cfg.learn_cuts),
        u8::from(keep_host),
    )
}

fn opt_tag(f: &mut fmt::Formatter<'_>, tag: Option<u32>) -> fmt::Result {
    match tag {
        Some(t) => write!(f, " {t:#x}"),
        None => write!(f, " -"),
    }
}

impl fmt::Display for Call<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Call::Create { size, props } => write!(
                f,
                "create {size:#x} {} {} {:#x}",
                u8::from(props.shareable),
                u8::from(props.rdma),
                props.tag
            ),
            Call::Release { vh } => write!(f, "release {vh:#x}"),
            Call::Map {
                va,
                size,
                offset,
                vh,
            } => write!(f, "map {va:#x} {size:#x} {offset:#x} {vh:#x}"),
            Call::Clear { va, size } => write!(f, "clear {va:#x} {size:#x}"),
            Call::Unmap { va, size, caller } => {
                write!(f, "unmap {va:#x} {size:#x} ")?;
                match caller {
                    Some(d) => write!(f, "{d}"),
                    None => write!(f, "-"),
                }
            }
            Call::SetAccess { va, size, descs } => {
                write!(f, "set_access {va:#x} {size:#x} ")?;
                if descs.is_empty() {
                    return write!(f, "-");
                }
                for (i, (d, fl)) in descs.iter().enumerate() {
                    let sep = if i == 0 { "" } else { "," };
                    write!(f, "{sep}{d}:{fl}")?;
                }
                Ok(())
            }
            Call::Export { vh } => write!(f, "export {vh:#x}"),
            Call::Bind { vh } => write!(f, "bind {vh:#x}"),
            Call::ShareRun { ptr } => write!(f, "share_run {ptr:#x}"),
            Call::IsolatePage { ptr } => write!(f, "isolate_page {ptr:#x}"),
            Call::Retain { ptr } => write!(f, "retain {ptr:#x}"),
            Call::Reserved { va, size } => write!(f, "reserved {va:#x} {size:#x}"),
            Call::AddressFree { va, size } => write!(f, "address_free {va:#x} {size:#x}"),
            Call::DropAhead => write!(f, "drop_ahead"),
            Call::Settle { force } => write!(f, "settle {}", u8::from(*force)),
            Call::ReleaseKept => write!(f, "release_kept"),
            Call::Releaser => write!(f, "releaser"),
            Call::Trim => write!(f, "trim"),
            Call::TrimUnmoved => write!(f, "trim_unmoved"),
            Call::ReleaseHost => write!(f, "release_host"),
            Call::StrandedNow => write!(f, "stranded_now"),
            Call::Pause { tag, discard } => {
                write!(f, "pause")?;
                opt_tag(f, *tag)?;
                write!(f, " {}", u8::from(*discard))
            }
            Call::Resume { tag } => {
                write!(f, "resume")?;
                opt_tag(f, *tag)
            }
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ok(None) => write!(f, "ok"),
            Outcome::Ok(Some(v)) => write!(f, "ok {v:#x}"),
            Outcome::Err(c) => write!(f, "err {c}"),
        }
    }
}

impl fmt::Display for Event<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {} = {}",
            self.t_ns,
            self.dev,
            u8::from(self.moves),
            self.call,
            self.out
        )
    }
}

/// A hexadecimal number, with or without `0x`.
#[cfg(any(test, feature = "test-switches"))]
fn hex(w: &str) -> Result<u64, String> {
    let digits = w.strip_prefix("0x").unwrap_or(w);
    u64::from_str_radix(digits, 16).map_err(|_| format!("not a hex number: {w:?}"))
}

#[cfg(any(test, feature = "test-switches"))]
fn switch(w: &str) -> Result<bool, String> {
    match w {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("not 0 or 1: {w:?}")),
    }
}

#[cfg(any(test, feature = "test-switches"))]
fn dev_or_none(w: &str) -> Result<Option<i32>, String> {
    match w {
        "-" => Ok(None),
        d => d
            .parse()
            .map(Some)
            .map_err(|_| format!("not a device: {w:?}")),
    }
}

#[cfg(any(test, feature = "test-switches"))]
fn tag_or_none(w: &str) -> Result<Option<u32>, String> {
    match w {
        "-" => Ok(None),
        t => hex(t)
            .and_then(|v| u32::try_from(v).map_err(|_| format!("tag too large: {t:?}")))
            .map(Some),
    }
}

#[cfg(any(test, feature = "test-switches"))]
fn descs(w: &str) -> Result<Vec<(i32, u32)>, String> {
    if w == "-" {
        return Ok(Vec::new());
    }
    w.split(',')
        .map(|d| {
            let (dev, flags) = d
                .split_once(':')
                .ok_or_else(|| format!("not DEV:FLAGS: {d:?}"))?;
            let dev = dev.parse().map_err(|_| format!("not a device: {dev:?}"))?;
            let flags = flags.parse().map_err(|_| format!("not flags: {flags:?}"))?;
            Ok((dev, flags))
        })
        .collect()
}

// The reading side, for the replay and the tests: not in the shipped library.
#[cfg(any(test, feature = "test-switches"))]
/// Parse one line. `None`: a comment or a blank line; `Some(Err(why))`: a line that is not an
/// event (the replay skips it and counts it).
pub fn parse(line: &str) -> Option<Result<Event<'static>, String>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    Some(parse_event(line))
}

#[cfg(any(test, feature = "test-switches"))]
fn parse_event(line: &str) -> Result<Event<'static>, String> {
    let (call_part, out_part) = line
        .split_once(" = ")
        .ok_or_else(|| "no ' = ' before the result".to_string())?;
    let w: Vec<&str> = call_part.split_whitespace().collect();
    if w.len() < 4 {
        return Err("fewer than 4 words before the result".into());
    }
    let t_ns = w[0]
        .parse()
        .map_err(|_| format!("not a time: {:?}", w[0]))?;
    let dev = w[1]
        .parse()
        .map_err(|_| format!("not a device: {:?}", w[1]))?;
    let moves = switch(w[2])?;
    let (op, args) = (w[3], &w[4..]);
    let want = |n: usize| -> Result<(), String> {
        match args.len() == n {
            true => Ok(()),
            false => Err(format!("{op} takes {n} arguments, not {}", args.len())),
        }
    };
    let h = |i: usize| hex(args[i]);
    let call = match op {
        "create" => {
            want(4)?;
            Call::Create {
                size: h(0)?,
                props: PageProps {
                    shareable: switch(args[1])?,
                    rdma: switch(args[2])?,
                    tag: tag_or_none(args[3])?.unwrap_or(0),
                },
            }
        }
        "release" => {
            want(1)?;
            Call::Release { vh: h(0)? }
        }
        "map" => {
            want(4)?;
            Call::Map {
                va: h(0)?,
                size: h(1)?,
                offset: h(2)?,
                vh: h(3)?,
            }
        }
        "clear" => {
            want(2)?;
            Call::Clear {
                va: h(0)?,
                size: h(1)?,
            }
        }
        "unmap" => {
            want(3)?;
            Call::Unmap {
                va: h(0)?,
                size: h(1)?,
                caller: dev_or_none(args[2])?,
            }
        }
        "set_access" => {
            want(3)?;
            Call::SetAccess {
                va: h(0)?,
                size: h(1)?,
                descs: Cow::Owned(descs(args[2])?),
            }
        }
        "export" => {
            want(1)?;
            Call::Export { vh: h(0)? }
        }
        "bind" => {
            want(1)?;
            Call::Bind { vh: h(0)? }
        }
        "share_run" | "isolate_run" => {
            want(1)?;
            Call::ShareRun { ptr: h(0)? }
        }
        "isolate_page" => {
            want(1)?;
            Call::IsolatePage { ptr: h(0)? }
        }
        "retain" => {
            want(1)?;
            Call::Retain { ptr: h(0)? }
        }
        "reserved" => {
            want(2)?;
            Call::Reserved {
                va: h(0)?,
                size: h(1)?,
            }
        }
        "address_free" => {
            want(2)?;
            Call::AddressFree {
                va: h(0)?,
                size: h(1)?,
            }
        }
        "settle" => {
            want(1)?;
            Call::Settle {
                force: switch(args[0])?,
            }
        }
        "pause" => {
            want(2)?;
            Call::Pause {
                tag: tag_or_none(args[0])?,
                discard: switch(args[1])?,
            }
        }
        "resume" => {
            want(1)?;
            Call::Resume {
                tag: tag_or_none(args[0])?,
            }
        }
        bare => {
            want(0)?;
            match bare {
                "drop_ahead" => Call::DropAhead,
                "release_kept" => Call::ReleaseKept,
                "releaser" => Call::Releaser,
                "trim" => Call::Trim,
                "trim_unmoved" => Call::TrimUnmoved,
                "release_host" => Call::ReleaseHost,
                "stranded_now" => Call::StrandedNow,
                other => return Err(format!("unknown call {other:?}")),
            }
        }
    };
    let o: Vec<&str> = out_part.split_whitespace().collect();
    let out = match o.as_slice() {
        ["ok"] => Outcome::Ok(None),
        ["ok", v] => Outcome::Ok(Some(hex(v)?)),
        ["err", c] => Outcome::Err(c.parse().map_err(|_| format!("not a code: {c:?}"))?),
        _ => return Err(format!("not a result: {out_part:?}")),
    };
    Ok(Event {
        t_ns,
        dev,
        moves,
        call,
        out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_call() -> Vec<Call<'static>> {
        let props = PageProps {
            shareable: true,
            rdma: false,
            tag: 0xab,
        };
        vec![
            Call::Create {
                size: 20 << 20,
                props,
            },
            Call::Release {
                vh: 0xe5e5 << 48 | 7,
            },
            Call::Map {
                va: 0x7f00_0000_0000,
                size: 20 << 20,
                offset: 0,
                vh: 0xe5e5 << 48 | 7,
            },
            Call::Clear {
                va: 1 << 30,
                size: 2 << 20,
            },
            Call::Unmap {
                va: 1 << 30,
                size: 2 << 20,
                caller: Some(1),
            },
            Call::Unmap {
                va: 1 << 30,
                size: 2 << 20,
                caller: None,
            },
            Call::SetAccess {
                va: 1 << 30,
                size: 40 << 20,
                descs: Cow::Owned(vec![(0, 3), (1, 0)]),
            },
            Call::SetAccess {
                va: 1 << 30,
                size: 40 << 20,
                descs: Cow::Owned(Vec::new()),
            },
            Call::Export { vh: 9 },
            Call::Bind { vh: 9 },
            Call::ShareRun { ptr: 0x1234_0000 },
            Call::IsolatePage { ptr: 0x1234_0000 },
            Call::Retain { ptr: 0x1234_5678 },
            Call::Reserved {
                va: 1 << 30,
                size: 1 << 30,
            },
            Call::AddressFree {
                va: 1 << 30,
                size: 1 << 30,
            },
            Call::DropAhead,
            Call::Settle { force: true },
            Call::ReleaseKept,
            Call::Releaser,
            Call::Trim,
            Call::TrimUnmoved,
            Call::ReleaseHost,
            Call::StrandedNow,
            Call::Pause {
                tag: Some(0xdead_beef),
                discard: true,
            },
            Call::Pause {
                tag: None,
                discard: false,
            },
            Call::Resume { tag: None },
            Call::Resume { tag: Some(5) },
        ]
    }

    #[test]
    fn every_call_reads_back_as_written() {
        let outs = [
            Outcome::DONE,
            Outcome::Ok(Some(0)),
            Outcome::Ok(Some(0xe5e5 << 48 | 1)),
            Outcome::Err(2),
        ];
        for (i, call) in every_call().into_iter().enumerate() {
            let e = Event {
                t_ns: 1_000_000 + i as u64,
                dev: (i % 3) as i32,
                moves: i % 2 == 0,
                call,
                out: outs[i % outs.len()],
            };
            let line = e.to_string();
            assert_eq!(parse(&line), Some(Ok(e.clone())), "{line}");
        }
    }

    #[test]
    fn malformed_lines_are_errors_and_comments_nothing() {
        assert_eq!(parse("# a comment"), None);
        assert_eq!(parse("   "), None);
        for bad in [
            "garbage",
            "1 0 1 create 0x1400000 1 0 = ok",
            "1 0 1 create 0x1400000 1 0 0x0 = maybe",
            "1 0 1 create 0x1400000 1 0 0x0 =",
            "1 0 2 release 0x1 = ok",
            "x 0 1 release 0x1 = ok",
            "1 zero 1 release 0x1 = ok",
            "1 0 1 release 0xzz = ok",
            "1 0 1 frobnicate = ok",
            "1 0 1 trim 0x5 = ok",
            "1 0 1 set_access 0x0 0x0 0:3,1 = ok",
            "1 0 1 unmap 0x0 0x0 dev = ok",
            "1 0 1 release 0x1 = err two",
            "1 0 1 release 0x1 = ok 0x1 0x2",
            "1 0 1 pause 0x100000000 0 = ok",
            "1 0 1 release 0x1",
            "\u{fffd}\u{0} = ok",
        ] {
            assert!(matches!(parse(bad), Some(Err(_))), "{bad:?}");
        }
    }

    #[test]
    fn the_header_says_the_configuration() {
        let cfg = super::super::CoalesceConfig {
            release_delay: std::time::Duration::from_millis(2),
            ..Default::default()
        };
        let text = Header::lines(42, &cfg, true, &[(0, 2 << 20), (1, 2 << 20)]);
        let mut h = Header::default();
        for l in text.lines() {
            assert!(l.starts_with('#'), "{l}");
            assert_eq!(parse(l), None);
            h.read_comment(l);
        }
        assert_eq!(h.pid, 42);
        assert_eq!(h.release_delay_ms, 2);
        assert_eq!(h.get("split_tail"), Some("1"));
        assert_eq!(h.get("keep_host"), Some("1"));
        assert_eq!(h.granularity, vec![(0, 2 << 20), (1, 2 << 20)]);
    }
}
