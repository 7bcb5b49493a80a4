//! Replaying a trace ([`super::trace`]) on the fake driver: one `Coalescer<FakeDriver>` per
//! device, under a configuration of the caller's choosing, so that a page-placement policy can
//! be measured on the CPU against the calls a program made on a GPU (`expseg-replay`).
//!
//! The program's handles (virtual handles) are numbered anew in the replay: recorded ones are
//! translated through a map filled by the replayed `create`s and `retain`s. The program's
//! reservations are made in the fake at their recorded addresses.
//!
//! Time: a coalescer reads the clock only to say how long the program has been quiet
//! ([`Coalescer::idle_for`]), which the releaser thread compares with the release delay. Under
//! the recorded delay the releaser's calls are replayed where they were recorded (`releaser`
//! lines); under another delay they are dropped and a kept handle goes back before the first
//! event that comes the delay or more after the device's last `create`, `unmap` or
//! `set_access` (the recorded times). The fake's clock, which says how old the driver's last
//! answer of free memory is (`free_recent`), reads the recorded time of each call. Nothing
//! else depends on the clock.
//!
//! The driver's free memory is not recorded: the fake has `capacity` bytes per device, and
//! only the replayed coalescer's handles use them (near that limit, pages are created at once).

use super::trace::{self, Call, Event, Header, Outcome};
use super::{CoalesceConfig, Coalescer};
use crate::gpu::fake::FakeDriver;
use crate::gpu::{Driver, DrvResult, Op};
use std::collections::{BTreeMap, HashMap};

/// PyTorch's pages come in multiples of 2 MiB, every NVIDIA GPU's granularity.
const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// Kept handles go back where the recorded releaser gave them back, or after the replay's
/// own delay of quiet on the recorded clock (decided at the first event, from the header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Releaser {
    Recorded,
    Quiet,
}

pub struct Replay {
    cfg: CoalesceConfig,
    keep_host: bool,
    capacity: u64,
    header: Header,
    releaser: Option<Releaser>,
    devs: BTreeMap<i32, Coalescer<FakeDriver>>,
    /// Recorded virtual handle -> the replay's.
    vhs: HashMap<u64, u64, super::books::BuildKeyHasher>,
    /// Per device, the recorded time of its last call that resets its quiet.
    last_call: BTreeMap<i32, u64>,
    lines: u64,
    t_ns: u64,
    stats: Counts,
}

/// What the replay itself counts.
#[derive(Clone, Debug, Default)]
struct Counts {
    events: u64,
    skipped: u64,
    first_skipped: Option<String>,
    mismatches: u64,
    first_mismatch: Option<String>,
    releases_simulated: u64,
    va_conflicts: u64,
}

/// Where the replay stands: its own counts and the coalescers' figures, summed over devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub events: u64,
    /// Lines that are not events (counted, never fatal).
    pub skipped: u64,
    pub first_skipped: Option<String>,
    /// Events whose replayed result differs from the recorded one (ok against an error, another
    /// error, another flag): the replay went where the program did not.
    pub mismatches: u64,
    pub first_mismatch: Option<String>,
    /// Recorded reservations the fake could not make at their address.
    pub va_conflicts: u64,
    /// Kept handles given back after the replay's delay of quiet (`Releaser::Quiet`).
    pub releases_simulated: u64,
    /// Whether the releaser's recorded calls were replayed (the recorded delay is the replay's).
    pub recorded_releaser: bool,
    /// The replay's configuration (`trace::config_words`).
    pub policy: String,
    pub devices: usize,
    /// The recorded time of the last event.
    pub t_ns: u64,
    pub peak_stranded: u64,
    pub peak_held: u64,
    pub peak_beyond: u64,
    pub final_stranded: u64,
    /// Physical bytes held at the end (handles behind pages and kept ones).
    pub final_held: u64,
    pub compactions: u64,
    pub compacted_bytes: u64,
    pub held_moves: u64,
    pub moves_declined: u64,
    pub phys_created: u64,
    pub phys_released: u64,
    /// Driver calls per operation (`Op::ALL` order, then `cuMemGetInfo`), as the coalescers
    /// count them for the exit report.
    pub calls: [u64; Op::ALL.len() + 1],
}

impl Replay {
    /// A replay under `cfg`, the fake having `capacity` bytes per device.
    pub fn new(cfg: CoalesceConfig, keep_host: bool, capacity: u64) -> Replay {
        Replay {
            cfg,
            keep_host,
            capacity,
            header: Header::default(),
            releaser: None,
            devs: BTreeMap::new(),
            vhs: HashMap::default(),
            last_call: BTreeMap::new(),
            lines: 0,
            t_ns: 0,
            stats: Counts::default(),
        }
    }

    /// The recorded header, as far as it was read.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Replay one line of a trace: an event, a comment (the header's are read), or a line
    /// that is neither (skipped and counted). True if it was an event.
    pub fn line(&mut self, line: &str) -> bool {
        self.lines += 1;
        match trace::parse(line) {
            None => {
                if line.trim_start().starts_with('#') {
                    self.header.read_comment(line);
                }
                false
            }
            Some(Err(why)) => {
                self.stats.skipped += 1;
                if self.stats.first_skipped.is_none() {
                    self.stats.first_skipped = Some(format!("line {}: {why}", self.lines));
                }
                false
            }
            Some(Ok(e)) => {
                self.event(&e);
                true
            }
        }
    }

    /// Replay every line of `input` (bytes that are not UTF-8 are replaced, and such a line
    /// is skipped as any malformed one). With `every` = Some(n), `progress` gets the figures
    /// after every n events. Err: reading failed (what was read is replayed).
    pub fn read(
        &mut self,
        mut input: impl std::io::BufRead,
        every: Option<u64>,
        mut progress: impl FnMut(&Summary),
    ) -> std::io::Result<()> {
        let mut buf = Vec::new();
        loop {
            buf.clear();
            if input.read_until(b'\n', &mut buf)? == 0 {
                return Ok(());
            }
            let event = self.line(&String::from_utf8_lossy(&buf));
            if event && every.is_some_and(|n| n > 0 && self.stats.events.is_multiple_of(n)) {
                progress(&self.summary());
            }
        }
    }

    /// Replay one event.
    pub fn event(&mut self, e: &Event<'_>) {
        self.stats.events += 1;
        self.t_ns = self.t_ns.max(e.t_ns);
        let releaser = *self.releaser.get_or_insert_with(|| {
            let recorded = self.header.config.is_empty()
                || u128::from(self.header.release_delay_ms) == self.cfg.release_delay.as_millis();
            match recorded {
                true => Releaser::Recorded,
                false => Releaser::Quiet,
            }
        });
        if releaser == Releaser::Quiet {
            self.release_quiet(e.t_ns);
        }
        let got = self.apply(e, releaser);
        if let Some(got) = got {
            self.compare(e, got);
        }
        if matches!(
            e.call,
            Call::Create { .. } | Call::Unmap { .. } | Call::SetAccess { .. }
        ) {
            self.last_call.insert(e.dev, e.t_ns);
        }
    }

    /// `Releaser::Quiet`: what the releaser thread would have given back by `t_ns`.
    fn release_quiet(&mut self, t_ns: u64) {
        let delay = u64::try_from(self.cfg.release_delay.as_nanos()).unwrap_or(u64::MAX);
        if delay == 0 {
            return;
        }
        for (dev, c) in &mut self.devs {
            let quiet = t_ns.saturating_sub(self.last_call.get(dev).copied().unwrap_or(0));
            if c.kept_bytes() > 0 && quiet >= delay {
                c.allow_moves(false);
                c.release_kept();
                self.stats.releases_simulated += 1;
            }
        }
    }

    fn coalescer(&mut self, dev: i32) -> &mut Coalescer<FakeDriver> {
        let gran = self
            .header
            .granularity
            .iter()
            .find(|(d, _)| *d == dev)
            .map_or(DEFAULT_GRANULARITY, |(_, g)| *g);
        let (cfg, cap, keep_host) = (self.cfg, self.capacity, self.keep_host);
        self.devs.entry(dev).or_insert_with(|| {
            let mut c = Coalescer::new(FakeDriver::new(dev, gran, cap), cfg);
            c.keep_host(keep_host);
            c
        })
    }

    /// Make the call on the device's coalescer: what it returned (None: not made).
    fn apply(&mut self, e: &Event<'_>, releaser: Releaser) -> Option<Outcome> {
        let vhs = &self.vhs;
        let tr = |v: u64| vhs.get(&v).copied().unwrap_or(v);
        let (vh_in, mut conflicts) = match &e.call {
            Call::Release { vh }
            | Call::Map { vh, .. }
            | Call::Export { vh }
            | Call::Bind { vh } => (tr(*vh), 0),
            _ => (0, 0),
        };
        let c = self.coalescer(e.dev);
        c.allow_moves(e.moves);
        // How old an answer of free memory is: on the recorded clock.
        c.driver_mut().set_clock(e.t_ns);
        let bytes = |r: DrvResult<u64>| Outcome::from(&r);
        let got = match &e.call {
            Call::Create { size, props } => Outcome::from(&c.create(*size, *props)),
            Call::Release { .. } => Outcome::from(&c.release(vh_in)),
            Call::Map {
                va, size, offset, ..
            } => Outcome::from(&c.map(*va, *size, *offset, vh_in)),
            Call::Clear { va, size } => {
                c.clear_for_program(*va, *size);
                Outcome::DONE
            }
            Call::Unmap { va, size, caller } => Outcome::from(&c.unmap_from(*va, *size, *caller)),
            Call::SetAccess { va, size, descs } => Outcome::from(&c.set_access(*va, *size, descs)),
            Call::Export { .. } => Outcome::from(&c.export(vh_in)),
            Call::Bind { .. } => Outcome::from(&c.bind_handle(vh_in).map(|(h, _)| h)),
            Call::ShareRun { ptr } => Outcome::from(&c.share_run(*ptr, usize::MAX)),
            Call::IsolatePage { ptr } => Outcome::from(&c.isolate_page(*ptr)),
            Call::Retain { ptr } => Outcome::from(&c.retain(*ptr)),
            Call::Reserved { va, size } => {
                // The program's reservation, in the fake at the recorded address.
                match c.driver_mut().reserve_at(*va, *size) {
                    Ok(at) if at == *va => {}
                    Ok(at) => {
                        let _ = c.driver_mut().free_va(at, *size);
                        conflicts += 1;
                    }
                    Err(_) => conflicts += 1,
                }
                c.reserved(*va, *size);
                Outcome::DONE
            }
            Call::AddressFree { va, size } => {
                let r = c.address_free(*va, *size);
                if r.is_ok() && e.out.is_ok() {
                    // The program's cuMemAddressFree then ran.
                    let _ = c.driver_mut().free_va(*va, *size);
                }
                Outcome::from(&r)
            }
            Call::DropAhead => {
                c.drop_ahead();
                Outcome::DONE
            }
            Call::Settle { force } => {
                c.settle(*force);
                Outcome::DONE
            }
            Call::ReleaseKept => {
                c.release_kept();
                Outcome::DONE
            }
            Call::Releaser => match releaser {
                Releaser::Recorded => {
                    c.release_kept();
                    Outcome::DONE
                }
                Releaser::Quiet => return None,
            },
            Call::Trim => Outcome::from(c.trim()),
            Call::TrimUnmoved => Outcome::from(c.trim_unmoved()),
            Call::ReleaseHost => Outcome::from(c.release_host()),
            Call::StrandedNow => Outcome::from(c.stranded_now()),
            Call::Pause { tag, discard } => {
                let (tag, discard) = (*tag, *discard);
                let choose = move |t: u32| (tag.is_none() || tag == Some(t)).then_some(discard);
                bytes(c.pause(&choose).map(|p| p.bytes))
            }
            Call::Resume { tag } => {
                let tag = *tag;
                bytes(c.resume(&move |t: u32| tag.is_none() || tag == Some(t)))
            }
        };
        self.stats.va_conflicts += conflicts;
        // The program's handles, as the replay numbers them.
        if let (
            Call::Create { .. } | Call::Retain { .. },
            Outcome::Ok(Some(rec)),
            Outcome::Ok(Some(v)),
        ) = (&e.call, e.out, got)
        {
            self.vhs.entry(rec).or_insert(v);
        }
        Some(got)
    }

    /// Count a result that differs from the recorded one where the program could tell: ok or
    /// which error, and the flags of `unmap` and `set_access` (whether the range was ours).
    fn compare(&mut self, e: &Event<'_>, got: Outcome) {
        let differs = match (e.out, got) {
            (Outcome::Err(a), Outcome::Err(b)) => a != b,
            (Outcome::Ok(a), Outcome::Ok(b)) => {
                matches!(e.call, Call::Unmap { .. } | Call::SetAccess { .. }) && a != b
            }
            _ => true,
        };
        if differs {
            self.stats.mismatches += 1;
            if self.stats.first_mismatch.is_none() {
                self.stats.first_mismatch =
                    Some(format!("line {}: {e} (replayed: {got})", self.lines));
            }
        }
    }

    /// The figures so far. Reads only: taking them does not change the replay.
    pub fn summary(&self) -> Summary {
        let mut s = Summary {
            events: self.stats.events,
            skipped: self.stats.skipped,
            first_skipped: self.stats.first_skipped.clone(),
            mismatches: self.stats.mismatches,
            first_mismatch: self.stats.first_mismatch.clone(),
            va_conflicts: self.stats.va_conflicts,
            releases_simulated: self.stats.releases_simulated,
            recorded_releaser: self.releaser != Some(Releaser::Quiet),
            policy: trace::config_words(&self.cfg, self.keep_host),
            devices: self.devs.len(),
            t_ns: self.t_ns,
            ..Summary::default()
        };
        for c in self.devs.values() {
            s.add(c);
        }
        s
    }
}

/// A string as a JSON string.
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            c if (c as u32) < 0x20 => out += &format!("\\u{:04x}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Summary {
    /// Add a coalescer's figures (a replayed one, or in tests the live one it replays).
    pub fn add<D: Driver>(&mut self, c: &Coalescer<D>) {
        let st = c.stats();
        self.peak_stranded += st.peak_stranded;
        self.peak_held += st.peak_held;
        self.peak_beyond += st.peak_beyond;
        self.final_stranded += c.stranded();
        self.final_held += c.physical_bytes();
        self.compactions += st.compactions;
        self.compacted_bytes += st.compacted_bytes;
        self.held_moves += st.held_moves;
        self.moves_declined += st.moves_declined;
        self.phys_created += st.phys_created;
        self.phys_released += st.phys_released;
        for (i, (n, _)) in c.driver_calls().iter().enumerate() {
            self.calls[i] += n;
        }
    }

    /// The driver calls of `op`.
    pub fn calls_of(&self, op: Op) -> u64 {
        self.calls[op.index()]
    }

    /// `cuMemGetInfo` calls.
    pub fn meminfo_calls(&self) -> u64 {
        self.calls[Op::ALL.len()]
    }

    /// Peak stranded bytes over peak held bytes (0 when nothing was held).
    pub fn stranded_ratio(&self) -> f64 {
        match self.peak_held {
            0 => 0.0,
            h => self.peak_stranded as f64 / h as f64,
        }
    }

    /// One line of JSON: the trace `file` it replays, whether the trace has ended, the figures.
    pub fn json(&self, file: Option<&str>, at_end: bool) -> String {
        let opt = |s: Option<&str>| s.map_or("null".to_string(), json_str);
        format!(
            concat!(
                "{{\"file\":{},\"at_end\":{},\"policy\":{},",
                "\"events\":{},\"skipped\":{},\"mismatches\":{},\"va_conflicts\":{},",
                "\"devices\":{},\"t_ns\":{},",
                "\"peak_stranded_bytes\":{},\"peak_held_bytes\":{},\"peak_beyond_bytes\":{},",
                "\"stranded_over_held\":{:.6},\"final_stranded_bytes\":{},\"final_held_bytes\":{},",
                "\"compactions\":{},\"compacted_bytes\":{},\"held_moves\":{},\"moves_declined\":{},",
                "\"handles_created\":{},\"handles_released\":{},",
                "\"calls\":{{\"create\":{},\"release\":{},\"map\":{},\"unmap\":{},",
                "\"set_access\":{},\"copy\":{},\"sync\":{},\"reserve\":{},\"free_va\":{},\"meminfo\":{}}},",
                "\"releaser\":\"{}\",\"releases_simulated\":{},",
                "\"first_skipped\":{},\"first_mismatch\":{}}}"
            ),
            opt(file),
            at_end,
            json_str(&self.policy),
            self.events,
            self.skipped,
            self.mismatches,
            self.va_conflicts,
            self.devices,
            self.t_ns,
            self.peak_stranded,
            self.peak_held,
            self.peak_beyond,
            self.stranded_ratio(),
            self.final_stranded,
            self.final_held,
            self.compactions,
            self.compacted_bytes,
            self.held_moves,
            self.moves_declined,
            self.phys_created,
            self.phys_released,
            self.calls_of(Op::Create),
            self.calls_of(Op::Release),
            self.calls_of(Op::Map),
            self.calls_of(Op::Unmap),
            self.calls_of(Op::SetAccess),
            self.calls_of(Op::Copy),
            self.calls_of(Op::Sync),
            self.calls_of(Op::Reserve),
            self.calls_of(Op::FreeVa),
            self.meminfo_calls(),
            match self.recorded_releaser {
                true => "recorded",
                false => "quiet",
            },
            self.releases_simulated,
            opt(self.first_skipped.as_deref()),
            opt(self.first_mismatch.as_deref()),
        )
    }
}

#[cfg(test)]
mod tests;
