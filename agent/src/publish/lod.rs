//! `lod`: level of detail for timeline answers, as trace viewers summarize
//! (Perfetto's and Chrome tracing's): the client says how long one of its
//! pixels is (`?width=PIXELS` over the window, or `?resolution=µs`), and on
//! each track (a thread, a tensor of a rank) the slices shorter than a
//! pixel are merged into summary slices that say what fraction of their
//! time went to each state or activity. Slices a pixel long or longer stay
//! as they are, so zooming in gives full detail back.
//!
//! Pixels are laid on a grid fixed to the trace's clock (multiples of the
//! pixel's length), not to the window's start, so the live view's answers
//! a second apart summarize the same way. Per track an answer then holds at
//! most about two events per pixel (one summary and one long slice), and
//! adjacent summaries whose fractions agree to a tenth are merged again: a
//! thread that does the same thing for a minute is one slice. The cost of
//! an answer follows the pixels (and the tracks), not the events.
//!
//! Pure: a [`Track`] is fed one track's slices in time order and returns
//! [`Piece`]s; the callers (`live`, `timeline`) write them as events.

use std::collections::HashMap;

use serde::Serialize;
use serde::ser::SerializeMap;

/// The level of detail a query asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Detail {
    /// Every slice (the default).
    #[default]
    Full,
    /// The client draws the window on this many pixels.
    Width(u32),
    /// One pixel is this many µs.
    Resolution(f64),
}

impl Detail {
    /// Most pixels a client may ask for (a wall of 8K screens).
    pub const MAX_WIDTH: u32 = 100_000;

    /// One pixel's length in µs for the window `[from_us, to_us]`; `None`
    /// for full detail (or a window with no length to divide).
    pub fn pixel_us(self, from_us: f64, to_us: f64) -> Option<f64> {
        let us = match self {
            Self::Full => return None,
            Self::Resolution(us) => us,
            Self::Width(pixels) => (to_us - from_us) / f64::from(pixels.max(1)),
        };
        (us.is_finite() && us > 0.0).then_some(us)
    }
}

/// A run of slices shorter than a pixel, merged: where it lies (its
/// pixels, less what longer slices of its track cover), how many slices it
/// stands for and how its time splits between names (the rest is gaps).
#[derive(Debug, Clone, PartialEq)]
pub struct Summary<N> {
    /// Start of the first slice (µs).
    pub start_us: f64,
    /// End of the last slice (µs).
    pub end_us: f64,
    /// Slices merged.
    pub slices: u32,
    /// Time per name (µs), in the order the names were first seen.
    pub time: Vec<(N, f64)>,
    /// A sum the caller carries along (bytes of fused cycles; 0 if none).
    pub total: f64,
    first_pixel: i64,
    last_pixel: i64,
}

impl<N: Clone + PartialEq> Summary<N> {
    fn new(pixel: i64, name: N, start_us: f64, dur_us: f64, weight: f64) -> Self {
        Self {
            start_us,
            end_us: start_us + dur_us,
            slices: 1,
            time: vec![(name, dur_us)],
            total: weight,
            first_pixel: pixel,
            last_pixel: pixel,
        }
    }

    fn add(&mut self, name: N, start_us: f64, dur_us: f64, weight: f64) {
        self.start_us = self.start_us.min(start_us);
        self.end_us = self.end_us.max(start_us + dur_us);
        self.slices += 1;
        self.total += weight;
        match self.time.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => *t += dur_us,
            None => self.time.push((name, dur_us)),
        }
    }

    /// Its length (µs).
    pub fn dur_us(&self) -> f64 {
        (self.end_us - self.start_us).max(0.0)
    }

    /// The name with the most time.
    pub fn dominant(&self) -> &N {
        let mut best = &self.time[0];
        for entry in &self.time[1..] {
            if entry.1 > best.1 {
                best = entry;
            }
        }
        &best.0
    }

    /// Each name's share of the summary's length, 0 to 1 (nested slices
    /// of one track can add up to more than 1 between them).
    pub fn fractions(&self) -> impl Iterator<Item = (&N, f64)> {
        let span = self.dur_us();
        self.time.iter().map(move |(name, t)| {
            let f = if span > 0.0 { (t / span).min(1.0) } else { 1.0 };
            (name, f)
        })
    }

    /// Whether `other` splits its time like this one, to a tenth per name.
    fn looks_like(&self, other: &Self) -> bool {
        let tenths = |s: &Self, name: &N| -> i64 {
            s.fractions()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, f)| (f * 10.0).round() as i64)
        };
        self.time
            .iter()
            .chain(&other.time)
            .all(|(name, _)| tenths(self, name) == tenths(other, name))
    }

    fn absorb(&mut self, other: Self) {
        self.start_us = self.start_us.min(other.start_us);
        self.end_us = self.end_us.max(other.end_us);
        self.slices += other.slices;
        self.total += other.total;
        self.last_pixel = other.last_pixel;
        for (name, t) in other.time {
            match self.time.iter_mut().find(|(n, _)| *n == name) {
                Some((_, mine)) => *mine += t,
                None => self.time.push((name, t)),
            }
        }
    }
}

/// What a track's answer holds: a slice as it was, or a summary.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece<T, N> {
    /// A slice a pixel long or longer, or alone in its pixel.
    Keep(T),
    /// Slices shorter than a pixel, merged.
    Summary(Summary<N>),
}

/// The summary being built: its first slice is kept aside, so that a
/// pixel with one short slice answers with that slice itself.
#[derive(Debug)]
struct Open<T, N> {
    summary: Summary<N>,
    first: T,
}

/// One track's slices at one level of detail. Feed them in time order
/// (by start) with [`Track::push`], then take [`Track::finish`].
#[derive(Debug)]
pub struct Track<T, N> {
    pixel_us: f64,
    open: Option<Open<T, N>>,
    pieces: Vec<Piece<T, N>>,
    /// Where the last piece ended: a summary starts no earlier.
    last_end_us: f64,
}

impl<T, N: Clone + PartialEq> Track<T, N> {
    /// A track whose pixels are `pixel_us` long (positive, finite: see
    /// [`Detail::pixel_us`]).
    pub fn new(pixel_us: f64) -> Self {
        Self {
            pixel_us,
            open: None,
            pieces: Vec::new(),
            last_end_us: f64::NEG_INFINITY,
        }
    }

    fn pixel(&self, us: f64) -> i64 {
        (us / self.pixel_us).floor() as i64
    }

    /// The next slice: `item`, named `name`, over `[start_us, start_us +
    /// dur_us]`, carrying `weight` into a summary's total.
    pub fn push(&mut self, item: T, name: N, start_us: f64, dur_us: f64, weight: f64) {
        if dur_us >= self.pixel_us {
            self.close(start_us);
            self.last_end_us = self.last_end_us.max(start_us + dur_us);
            self.pieces.push(Piece::Keep(item));
            return;
        }
        let pixel = self.pixel(start_us);
        match &mut self.open {
            Some(open) if open.summary.last_pixel == pixel => {
                open.summary.add(name, start_us, dur_us, weight);
            }
            _ => {
                self.close(start_us);
                self.open = Some(Open {
                    summary: Summary::new(pixel, name, start_us, dur_us, weight),
                    first: item,
                });
            }
        }
    }

    /// Ends the open pixel, the next piece starting at `next_us`: its one
    /// slice as it was, or its summary over the pixel (less what the
    /// pieces before and after it cover), merged into the previous summary
    /// when that one ends in the pixel before and splits its time alike.
    fn close(&mut self, next_us: f64) {
        let Some(open) = self.open.take() else {
            return;
        };
        if open.summary.slices == 1 {
            self.last_end_us = self.last_end_us.max(open.summary.end_us);
            self.pieces.push(Piece::Keep(open.first));
            return;
        }
        let mut summary = open.summary;
        // The pixel's time: its fractions are of the pixel, gaps included.
        let pixel_start = summary.first_pixel as f64 * self.pixel_us;
        let pixel_end = (summary.last_pixel + 1) as f64 * self.pixel_us;
        summary.start_us = summary.start_us.min(pixel_start.max(self.last_end_us));
        summary.end_us = summary.end_us.max(pixel_end.min(next_us));
        self.last_end_us = self.last_end_us.max(summary.end_us);
        if let Some(Piece::Summary(last)) = self.pieces.last_mut()
            && last.last_pixel + 1 == summary.first_pixel
            && last.looks_like(&summary)
        {
            last.absorb(summary);
            return;
        }
        self.pieces.push(Piece::Summary(summary));
    }

    /// The track's pieces, in time order.
    pub fn finish(mut self) -> Vec<Piece<T, N>> {
        self.close(f64::INFINITY);
        self.pieces
    }
}

/// A summary as a Chrome-trace `X` event: named after the state or
/// activity with the most time, on the track it summarizes; `args.summary`
/// is the number of slices it stands for, then each name's fraction of its
/// length (3 decimals), and `bytes` where the slices carried a total.
#[derive(Debug, Serialize)]
pub struct SummaryEvent<'a, P: Serialize, I: Serialize> {
    ph: &'static str,
    cat: &'a str,
    name: &'a str,
    pid: P,
    tid: I,
    ts: f64,
    dur: f64,
    args: SummaryArgs<'a>,
}

impl<'a, P: Serialize, I: Serialize> SummaryEvent<'a, P, I> {
    /// The event of `summary` on track (`pid`, `tid`) of category `cat`.
    pub fn new<N: AsRef<str> + Clone + PartialEq>(
        cat: &'a str,
        pid: P,
        tid: I,
        summary: &'a Summary<N>,
    ) -> Self {
        Self {
            ph: "X",
            cat,
            name: summary.dominant().as_ref(),
            pid,
            tid,
            ts: summary.start_us,
            dur: summary.dur_us(),
            args: SummaryArgs {
                slices: summary.slices,
                fractions: summary
                    .fractions()
                    .map(|(n, f)| (n.as_ref(), (f * 1000.0).round() / 1000.0))
                    .collect(),
                total: summary.total,
            },
        }
    }
}

/// A summary's `args`.
#[derive(Debug)]
struct SummaryArgs<'a> {
    slices: u32,
    fractions: Vec<(&'a str, f64)>,
    total: f64,
}

impl Serialize for SummaryArgs<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("summary", &self.slices)?;
        for (name, fraction) in &self.fractions {
            map.serialize_entry(name, fraction)?;
        }
        if self.total > 0.0 {
            map.serialize_entry("bytes", &self.total)?;
        }
        map.end()
    }
}

/// What `metadata.detail` says of an answer at a level of detail.
pub fn detail_note(
    pixel_us: f64,
    slices_in: usize,
    summaries: usize,
    kept: usize,
) -> serde_json::Value {
    serde_json::json!({
        "pixel_us": pixel_us,
        "slices_in_range": slices_in,
        "summary_slices": summaries,
        "slices_kept": kept,
        "how": "slices shorter than a pixel are merged per track into summary slices (args.summary: how many; args.<name>: the fraction of the summary's time in that state or activity); zoom in (a shorter window, or a finer resolution) for every slice",
    })
}

/// What the overview (`view=overview`) puts in place of a process's threads
/// and a job rank's tensors: per pixel, how many of its threads were
/// running and waiting for a CPU (on average), and what share of the pixel
/// its job's activities covered, by class (the union over its tensors), as
/// two counter tracks of the process (`threads`, `activity`). A sample is
/// written where a value changes (to 2 decimals), so a steady process costs
/// a few samples, and any costs at most one per pixel.
#[derive(Debug)]
pub struct Overview {
    pixel_us: f64,
    first_pixel: i64,
    pixels: usize,
    /// The processes, in the order first seen, and where each key is.
    procs: Vec<OverviewProcess>,
    slots: HashMap<String, usize>,
}

/// The classes of job activity the overview tells apart, by Horovod's
/// activity names (the first that matches).
pub const ACTIVITY_CLASSES: [(&str, &[&str]); 4] = [
    (
        "collective",
        &[
            "ALLREDUCE",
            "ALLGATHER",
            "BROADCAST",
            "ALLTOALL",
            "REDUCESCATTER",
            "NCCL",
            "MPI_",
            "RING_",
            "HIERARCHICAL_",
        ],
    ),
    ("fusion", &["MEMCPY"]),
    ("negotiate", &["NEGOTIATE"]),
    ("queued", &["QUEUE", "WAIT"]),
];

/// The class of an activity name, if the overview counts it.
pub fn activity_class(name: &str) -> Option<usize> {
    ACTIVITY_CLASSES
        .iter()
        .position(|(_, prefixes)| prefixes.iter().any(|p| name.starts_with(p)))
}

/// A thread state as the overview counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadState {
    /// On a CPU.
    Running,
    /// Ready, waiting for a CPU.
    Runnable,
    /// Off-CPU (not counted).
    Off,
}

impl ThreadState {
    /// By the timeline's state names.
    pub fn of_name(name: &str) -> Option<Self> {
        match name {
            "running" => Some(Self::Running),
            "runnable" | "waiting on run queue" => Some(Self::Runnable),
            "blocked" | "sleeping" | "uninterruptible" | "iowait" => Some(Self::Off),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct OverviewProcess {
    key: String,
    pid: serde_json::Value,
    running: Vec<f64>,
    runnable: Vec<f64>,
    /// Where whole pixels start and stop adding (a difference array per
    /// lane: running, runnable).
    diff: [Vec<f64>; 2],
    has_states: bool,
    /// Per class, the intervals of its activities (µs).
    activities: [Vec<(f64, f64)>; 4],
}

impl Overview {
    /// Most pixels an overview keeps per process: finer resolutions over a
    /// long window get coarser pixels.
    pub const MAX_PIXELS: usize = 20_000;

    /// An overview of `[from_us, to_us]` in pixels of `pixel_us`.
    pub fn new(pixel_us: f64, from_us: f64, to_us: f64) -> Self {
        let span = (to_us - from_us).max(0.0);
        let pixel_us = pixel_us.max(span / Self::MAX_PIXELS as f64).max(1e-3);
        let first_pixel = (from_us / pixel_us).floor() as i64;
        let last_pixel = (to_us / pixel_us).floor() as i64;
        let pixels = usize::try_from(last_pixel - first_pixel + 1)
            .unwrap_or(1)
            .clamp(1, Self::MAX_PIXELS + 2);
        Self {
            pixel_us,
            first_pixel,
            pixels,
            procs: Vec::new(),
            slots: HashMap::new(),
        }
    }

    /// Where process `key` (written as `pid()`) is counted: pass it to
    /// [`Overview::add_state_at`] to skip the lookup per slice.
    pub fn slot(&mut self, key: &str, pid: impl FnOnce() -> serde_json::Value) -> usize {
        if let Some(&slot) = self.slots.get(key) {
            return slot;
        }
        let pixels = self.pixels;
        self.procs.push(OverviewProcess {
            key: key.to_owned(),
            pid: pid(),
            running: vec![0.0; pixels],
            runnable: vec![0.0; pixels],
            diff: [vec![0.0; pixels + 1], vec![0.0; pixels + 1]],
            has_states: false,
            activities: Default::default(),
        });
        self.slots.insert(key.to_owned(), self.procs.len() - 1);
        self.procs.len() - 1
    }

    fn process(
        &mut self,
        key: &str,
        pid: impl FnOnce() -> serde_json::Value,
    ) -> &mut OverviewProcess {
        let slot = self.slot(key, pid);
        &mut self.procs[slot]
    }

    /// Counts a thread state of process `key` (written as `pid()`).
    pub fn add_state(
        &mut self,
        key: &str,
        pid: impl FnOnce() -> serde_json::Value,
        state: ThreadState,
        start_us: f64,
        dur_us: f64,
    ) {
        let slot = self.slot(key, pid);
        self.add_state_at(slot, state, start_us, dur_us);
    }

    /// Counts a thread state of the process at `slot` (from [`Overview::slot`]).
    pub fn add_state_at(&mut self, slot: usize, state: ThreadState, start_us: f64, dur_us: f64) {
        let (origin, pixel_us, pixels) = (
            self.first_pixel as f64 * self.pixel_us,
            self.pixel_us,
            self.pixels,
        );
        let process = &mut self.procs[slot];
        process.has_states = true;
        let lane = match state {
            ThreadState::Running => 0,
            ThreadState::Runnable => 1,
            ThreadState::Off => return,
        };
        let bins = if lane == 0 {
            &mut process.running
        } else {
            &mut process.runnable
        };
        add_span(
            bins,
            &mut process.diff[lane],
            pixels,
            (start_us - origin) / pixel_us,
            (start_us + dur_us - origin) / pixel_us,
        );
    }

    /// Counts a job activity of process `key`; `false` (not counted) when
    /// its name is of no class.
    pub fn add_activity(
        &mut self,
        key: &str,
        pid: impl FnOnce() -> serde_json::Value,
        name: &str,
        start_us: f64,
        dur_us: f64,
    ) -> bool {
        let Some(class) = activity_class(name) else {
            return false;
        };
        self.process(key, pid).activities[class].push((start_us, start_us + dur_us));
        true
    }

    /// The counter events, per process (`threads` where it had thread
    /// states, `activity` where it had activities), in time order per track.
    pub fn counters(self) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let pixel_us = self.pixel_us;
        let origin = self.first_pixel as f64 * pixel_us;
        let round = |x: f64| (x * 100.0).round() / 100.0;
        let mut procs = self.procs;
        procs.sort_by(|a, b| a.key.cmp(&b.key));
        for mut p in procs {
            if p.has_states {
                settle(&mut p.running, &p.diff[0]);
                settle(&mut p.runnable, &p.diff[1]);
                let mut last = None;
                for c in 0..self.pixels {
                    let now = (round(p.running[c]), round(p.runnable[c]));
                    if last != Some(now) {
                        out.push(serde_json::json!({
                            "ph": "C", "name": "threads", "cat": "overview", "pid": p.pid,
                            "ts": origin + c as f64 * pixel_us,
                            "args": { "running": now.0, "runnable": now.1 },
                        }));
                        last = Some(now);
                    }
                }
            }
            if p.activities.iter().any(|a| !a.is_empty()) {
                let mut shares: Vec<Vec<f64>> = Vec::new();
                for intervals in &mut p.activities {
                    let mut bins = vec![0.0; self.pixels];
                    let mut diff = vec![0.0; self.pixels + 1];
                    for (a, b) in union(intervals) {
                        add_span(
                            &mut bins,
                            &mut diff,
                            self.pixels,
                            (a - origin) / pixel_us,
                            (b - origin) / pixel_us,
                        );
                    }
                    settle(&mut bins, &diff);
                    shares.push(bins);
                }
                let mut last: Option<Vec<f64>> = None;
                for c in 0..self.pixels {
                    let now: Vec<f64> = shares.iter().map(|s| round(s[c].min(1.0))).collect();
                    if last.as_ref() != Some(&now) {
                        let args: serde_json::Map<String, serde_json::Value> = ACTIVITY_CLASSES
                            .iter()
                            .zip(&now)
                            .map(|((name, _), v)| ((*name).to_owned(), serde_json::json!(v)))
                            .collect();
                        out.push(serde_json::json!({
                            "ph": "C", "name": "activity", "cat": "overview", "pid": p.pid,
                            "ts": origin + c as f64 * pixel_us, "args": args,
                        }));
                        last = Some(now);
                    }
                }
            }
        }
        out
    }

    /// One pixel's length (µs), after the cap on pixels.
    pub fn pixel_us(&self) -> f64 {
        self.pixel_us
    }
}

/// Adds 1 per unit of time over `[xa, xb]` (in pixels) to `bins`: partial
/// pixels directly, whole ones through `diff` (see [`settle`]).
fn add_span(bins: &mut [f64], diff: &mut [f64], pixels: usize, xa: f64, xb: f64) {
    let end = pixels as f64;
    let (xa, xb) = (xa.max(0.0), xb.min(end));
    if xb <= xa || xb.is_nan() || xa.is_nan() {
        return;
    }
    let (ia, ib) = (xa.floor() as usize, xb.floor() as usize);
    if ia == ib {
        bins[ia] += xb - xa;
        return;
    }
    bins[ia] += (ia + 1) as f64 - xa;
    diff[ia + 1] += 1.0;
    diff[ib] -= 1.0;
    if ib < pixels {
        bins[ib] += xb - ib as f64;
    }
}

/// Adds the whole pixels that `diff` marks to `bins`.
fn settle(bins: &mut [f64], diff: &[f64]) {
    let mut acc = 0.0;
    for (bin, d) in bins.iter_mut().zip(diff) {
        acc += d;
        *bin += acc;
    }
}

/// The union of intervals, sorted and merged.
fn union(intervals: &mut [(f64, f64)]) -> Vec<(f64, f64)> {
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for &(a, b) in intervals.iter() {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// What `metadata.detail.overview` says.
pub fn overview_note(merged: usize, pixel_us: f64) -> serde_json::Value {
    serde_json::json!({
        "slices_merged": merged,
        "pixel_us": pixel_us,
        "how": "each process's thread states and its job's tensor activities are merged into two counters: threads (running, runnable: the average number of its threads per pixel) and activity (the share of each pixel with some tensor in a collective, fusion copy, negotiation or queued); ask view=full (the default) for every thread and tensor",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `(name, start, dur)` slices of one track; items are indices.
    fn run(pixel: f64, slices: &[(&'static str, f64, f64)]) -> Vec<Piece<usize, &'static str>> {
        let mut track = Track::new(pixel);
        for (i, &(name, start, dur)) in slices.iter().enumerate() {
            track.push(i, name, start, dur, 0.0);
        }
        track.finish()
    }

    fn summary<'a>(piece: &'a Piece<usize, &'static str>) -> &'a Summary<&'static str> {
        match piece {
            Piece::Summary(s) => s,
            Piece::Keep(i) => panic!("slice {i} kept, a summary expected"),
        }
    }

    #[test]
    fn long_slices_stay_and_short_ones_merge_per_pixel() {
        // Pixels of 100 µs: a 250 µs slice stays; in [300, 400) four short
        // slices (30 running, 10 runnable, 40 running, 20 blocked) merge.
        let pieces = run(
            100.0,
            &[
                ("blocked", 50.0, 250.0),
                ("running", 300.0, 30.0),
                ("runnable", 330.0, 10.0),
                ("running", 340.0, 40.0),
                ("blocked", 380.0, 20.0),
            ],
        );
        assert_eq!(pieces.len(), 2, "{pieces:?}");
        assert_eq!(pieces[0], Piece::Keep(0));
        let s = summary(&pieces[1]);
        assert_eq!((s.start_us, s.end_us, s.slices), (300.0, 400.0, 4));
        assert_eq!(*s.dominant(), "running");
        let fractions: Vec<(&str, f64)> = s.fractions().map(|(n, f)| (*n, f)).collect();
        assert_eq!(
            fractions,
            [("running", 0.7), ("runnable", 0.1), ("blocked", 0.2)]
        );
    }

    #[test]
    fn a_pixel_with_one_short_slice_keeps_that_slice() {
        let pieces = run(100.0, &[("running", 10.0, 5.0), ("blocked", 15.0, 300.0)]);
        assert_eq!(pieces, [Piece::Keep(0), Piece::Keep(1)]);
    }

    #[test]
    fn adjacent_pixels_that_look_alike_are_one_summary_and_different_ones_are_not() {
        // Ten pixels of the same 50/50 pattern, then three of mostly blocked.
        let mut slices = Vec::new();
        for pixel in 0..10 {
            let at = f64::from(pixel) * 100.0;
            slices.extend([("running", at, 25.0), ("blocked", at + 25.0, 25.0)]);
            slices.extend([("running", at + 50.0, 25.0), ("blocked", at + 75.0, 25.0)]);
        }
        for pixel in 10..13 {
            let at = f64::from(pixel) * 100.0;
            slices.extend([("running", at, 10.0), ("blocked", at + 10.0, 90.0)]);
        }
        let pieces = run(100.0, &slices);
        assert_eq!(pieces.len(), 2, "{pieces:?}");
        let first = summary(&pieces[0]);
        assert_eq!(
            (first.start_us, first.end_us, first.slices),
            (0.0, 1000.0, 40)
        );
        let second = summary(&pieces[1]);
        assert_eq!(
            (second.start_us, second.end_us, second.slices),
            (1000.0, 1300.0, 6)
        );
        assert_eq!(*second.dominant(), "blocked");
        // A gap of a pixel breaks a run even when alike.
        let gap = run(
            100.0,
            &[
                ("running", 0.0, 50.0),
                ("blocked", 50.0, 50.0),
                ("running", 200.0, 50.0),
                ("blocked", 250.0, 50.0),
            ],
        );
        assert_eq!(gap.len(), 2, "{gap:?}");
    }

    #[test]
    fn pieces_are_bounded_by_the_pixels_not_the_slices() {
        // 100,000 slices of 1 µs alternating, over 1,000 pixels of 100 µs,
        // with a drifting mix so that no two pixels look alike.
        let mut track = Track::new(100.0);
        let mut n = 0usize;
        for pixel in 0..1000u32 {
            let running = 1 + (pixel % 9) as usize * 10;
            for k in 0..100usize {
                let name = if k < running { "running" } else { "blocked" };
                track.push(n, name, f64::from(pixel) * 100.0 + k as f64, 1.0, 0.0);
                n += 1;
            }
        }
        let pieces = track.finish();
        assert!(pieces.len() <= 1000, "{} pieces", pieces.len());
        let slices: u32 = pieces
            .iter()
            .map(|p| match p {
                Piece::Summary(s) => s.slices,
                Piece::Keep(_) => 1,
            })
            .sum();
        assert_eq!(slices as usize, n, "every slice is accounted for");
    }

    #[test]
    fn the_pixel_comes_from_the_width_or_the_resolution() {
        assert_eq!(Detail::Full.pixel_us(0.0, 1e6), None);
        assert_eq!(Detail::Width(1000).pixel_us(0.0, 1e6), Some(1000.0));
        assert_eq!(Detail::Resolution(250.0).pixel_us(0.0, 1e6), Some(250.0));
        assert_eq!(Detail::Width(1000).pixel_us(5.0, 5.0), None, "no length");
        assert_eq!(
            Detail::Width(1000).pixel_us(f64::NEG_INFINITY, 5.0),
            None,
            "no start"
        );
    }

    #[test]
    fn a_summary_event_names_its_dominant_state_and_its_fractions() {
        let pieces = run(
            100.0,
            &[
                ("running", 0.0, 20.0),
                ("blocked", 20.0, 60.0),
                ("runnable", 80.0, 20.0),
            ],
        );
        let event = SummaryEvent::new("thread_state", 7u32, 8u32, summary(&pieces[0]));
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            serde_json::json!({
                "ph": "X", "cat": "thread_state", "name": "blocked", "pid": 7, "tid": 8,
                "ts": 0.0, "dur": 100.0,
                "args": { "summary": 3, "running": 0.2, "blocked": 0.6, "runnable": 0.2 },
            })
        );
    }

    #[test]
    fn the_overview_counts_threads_per_pixel_and_the_union_of_activities() {
        // Pixels of 100 µs over [0, 400).
        let mut o = Overview::new(100.0, 0.0, 399.0);
        let pid = || serde_json::json!(7);
        // Two threads running over [0, 200), one waiting over [50, 150).
        o.add_state("7", pid, ThreadState::Running, 0.0, 200.0);
        o.add_state("7", pid, ThreadState::Running, 0.0, 200.0);
        o.add_state("7", pid, ThreadState::Runnable, 50.0, 100.0);
        o.add_state("7", pid, ThreadState::Off, 200.0, 200.0);
        // Two tensors allreducing over [0, 100) and [50, 150): the union is [0, 150).
        assert!(o.add_activity("7", pid, "ALLREDUCE", 0.0, 100.0));
        assert!(o.add_activity("7", pid, "ALLREDUCE", 50.0, 100.0));
        assert!(o.add_activity("7", pid, "QUEUE", 300.0, 50.0));
        assert!(!o.add_activity("7", pid, "SOMETHING", 0.0, 10.0));
        let events = o.counters();
        let threads: Vec<(f64, f64, f64)> = events
            .iter()
            .filter(|e| e["name"] == "threads")
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["args"]["running"].as_f64().unwrap(),
                    e["args"]["runnable"].as_f64().unwrap(),
                )
            })
            .collect();
        // Pixels 0 and 1 alike (2 running, 0.5 waiting): one sample; then 0.
        assert_eq!(threads, [(0.0, 2.0, 0.5), (200.0, 0.0, 0.0)]);
        let activity: Vec<(f64, f64, f64)> = events
            .iter()
            .filter(|e| e["name"] == "activity")
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["args"]["collective"].as_f64().unwrap(),
                    e["args"]["queued"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            activity,
            [
                (0.0, 1.0, 0.0),
                (100.0, 0.5, 0.0),
                (200.0, 0.0, 0.0),
                (300.0, 0.0, 0.5)
            ]
        );
        assert!(events.iter().all(|e| e["pid"] == 7 && e["ph"] == "C"));
    }

    #[test]
    fn an_overview_has_at_most_its_cap_of_pixels() {
        let o = Overview::new(0.001, 0.0, 60e6);
        assert!(o.pixels <= Overview::MAX_PIXELS + 2, "{}", o.pixels);
        assert!((o.pixel_us() - 3000.0).abs() < 1e-9);
    }
}
