//! Watching a job after its knobs are pinned: knobs chosen under one load
//! must not be kept under another. [`Watch`] takes the job's per-cycle
//! statistics, scores windows the way a session does, learns the pinned
//! knobs' usual rate from the first windows (median of 5), and says when the
//! median of the latest 5 moved by more than 15% and 3 robust sd of the
//! first ones (at most 30%: however noisy the windows, a median that moved
//! that far moved), up or down: a load that went away changes which knobs
//! are best as much as one that came. The driver then re-checks the pinned
//! knobs against the start with a session in recheck mode
//! ([`crate::session::SessionConfig::recheck`]), which tunes again only if
//! they lost.
//!
//! Like the session, it never reads a clock or does I/O.

use crate::session::CycleObservation;

/// Settings of a watch.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchConfig {
    /// A window holds at least this many cycle intervals...
    pub measured_cycles: u64,
    /// ...and spans at least this long (µs of the job's clock).
    pub min_window_us: u64,
    /// The usual rate is the median of this many first windows.
    pub baseline_windows: usize,
    /// The rate now is the median of this many latest windows.
    pub recent_windows: usize,
    /// A change smaller than this fraction of the usual rate is never one.
    pub min_change: f64,
    /// A change must also exceed this many robust standard deviations of
    /// the baseline windows...
    pub noise_sigmas: f64,
    /// ...but a move of the median by more than this fraction is a change
    /// however noisy the baseline was (a median of several windows is far
    /// steadier than one window).
    pub max_change: f64,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            measured_cycles: 10,
            min_window_us: 1_000_000,
            baseline_windows: 5,
            recent_windows: 5,
            min_change: 0.15,
            noise_sigmas: 3.0,
            max_change: 0.3,
        }
    }
}

/// One watched window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchWindow {
    /// Start of its first cycle, job clock µs.
    pub start_unix_us: u64,
    /// Start of its last cycle, job clock µs.
    pub end_unix_us: u64,
    /// Bytes reduced per second over the window.
    pub score: f64,
}

/// What a watch found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WatchEvent {
    /// A window closed; nothing changed (or the baseline is still forming).
    Window(WatchWindow),
    /// The rate moved beyond noise: re-check the pinned knobs.
    Changed {
        /// The usual rate (median of the first windows), bytes/s.
        usual: f64,
        /// The rate now (median of the latest windows), bytes/s.
        now: f64,
    },
}

/// The watch over one pinned set of knobs.
#[derive(Debug, Clone)]
pub struct Watch {
    config: WatchConfig,
    first_cycle: u64,
    cycles: Vec<CycleObservation>,
    windows: Vec<WatchWindow>,
    usual: Option<(f64, f64)>,
    changed: bool,
}

fn median(values: &[f64]) -> f64 {
    crate::session::median(values).unwrap_or(f64::NAN)
}

impl Watch {
    /// A watch of knobs in force from `first_cycle` on.
    pub fn new(config: WatchConfig, first_cycle: u64) -> Self {
        Watch {
            config,
            first_cycle,
            cycles: Vec::new(),
            windows: Vec::new(),
            usual: None,
            changed: false,
        }
    }

    /// The windows so far: the job's throughput since the pin.
    pub fn windows(&self) -> &[WatchWindow] {
        &self.windows
    }

    /// The usual rate, once learned (bytes/s).
    pub fn usual(&self) -> Option<f64> {
        self.usual.map(|u| u.0)
    }

    /// Takes one cycle with work; returns an event when a window closes.
    /// After [`WatchEvent::Changed`] it keeps recording windows but reports
    /// no further change (the driver re-checks, then starts a new watch).
    pub fn observe_cycle(&mut self, cycle: &CycleObservation) -> Option<WatchEvent> {
        if cycle.cycle < self.first_cycle {
            return None;
        }
        if let Some(last) = self.cycles.last()
            && (cycle.cycle <= last.cycle || cycle.start_unix_us < last.start_unix_us)
        {
            return None;
        }
        self.cycles.push(*cycle);
        let first = self.cycles[0];
        let span_us = cycle.start_unix_us - first.start_unix_us;
        let intervals = self.cycles.len() as u64 - 1;
        if intervals < self.config.measured_cycles.max(1)
            || span_us < self.config.min_window_us.max(1)
        {
            return None;
        }
        let bytes: u64 = self.cycles[..self.cycles.len() - 1]
            .iter()
            .map(|c| c.bytes_reduced)
            .sum();
        let window = WatchWindow {
            start_unix_us: first.start_unix_us,
            end_unix_us: cycle.start_unix_us,
            score: bytes as f64 / (span_us as f64 / 1e6),
        };
        // The closing cycle opens the next window.
        self.cycles.clear();
        self.cycles.push(*cycle);
        self.windows.push(window);
        let scores: Vec<f64> = self.windows.iter().map(|w| w.score).collect();
        let b = self.config.baseline_windows.max(1);
        if self.usual.is_none() && scores.len() >= b {
            let usual = median(&scores[..b]);
            let deviations: Vec<f64> = scores[..b]
                .iter()
                .map(|s| (s - usual).abs() / usual.abs().max(f64::MIN_POSITIVE))
                .collect();
            self.usual = Some((usual, 1.4826 * median(&deviations)));
        }
        let r = self.config.recent_windows.max(1);
        if let Some((usual, sigma)) = self.usual
            && !self.changed
            && scores.len() >= b + r
        {
            let now = median(&scores[scores.len() - r..]);
            let threshold = (self.config.noise_sigmas * sigma)
                .min(self.config.max_change)
                .max(self.config.min_change);
            if (now - usual).abs() > threshold * usual.abs() {
                self.changed = true;
                return Some(WatchEvent::Changed { usual, now });
            }
        }
        Some(WatchEvent::Window(window))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cycles of 1000 bytes, `gap_us` apart, from `from`.
    fn feed(
        watch: &mut Watch,
        from: &mut u64,
        at: &mut u64,
        n: usize,
        gap_us: u64,
    ) -> Vec<WatchEvent> {
        let mut events = Vec::new();
        for _ in 0..n {
            *from += 1;
            *at += gap_us;
            let c = CycleObservation {
                cycle: *from,
                start_unix_us: *at,
                duration_us: 10,
                bytes_reduced: 1000,
                ..Default::default()
            };
            events.extend(watch.observe_cycle(&c));
        }
        events
    }

    fn config() -> WatchConfig {
        WatchConfig {
            measured_cycles: 4,
            min_window_us: 0,
            ..WatchConfig::default()
        }
    }

    #[test]
    fn a_steady_job_never_changes_and_a_faster_one_does() {
        let mut w = Watch::new(config(), 1);
        let (mut cycle, mut at) = (0, 0);
        let events = feed(&mut w, &mut cycle, &mut at, 200, 1000);
        assert!(events.iter().all(|e| matches!(e, WatchEvent::Window(_))));
        assert_eq!(w.usual(), Some(1e6));
        // The load goes away: cycles twice as fast. Three windows later the
        // median of the latest three has moved.
        let events = feed(&mut w, &mut cycle, &mut at, 40, 500);
        let changes: Vec<&WatchEvent> = events
            .iter()
            .filter(|e| matches!(e, WatchEvent::Changed { .. }))
            .collect();
        assert_eq!(changes.len(), 1, "one change, reported once: {events:?}");
        let WatchEvent::Changed { usual, now } = changes[0] else {
            unreachable!()
        };
        assert_eq!((*usual, *now), (1e6, 2e6));
    }

    #[test]
    fn one_slow_window_is_not_a_change() {
        let mut w = Watch::new(config(), 1);
        let (mut cycle, mut at) = (0, 0);
        feed(&mut w, &mut cycle, &mut at, 40, 1000);
        // One stall of 20 ms slows one window to a sixth.
        feed(&mut w, &mut cycle, &mut at, 1, 20_000);
        let events = feed(&mut w, &mut cycle, &mut at, 40, 1000);
        assert!(events.iter().all(|e| matches!(e, WatchEvent::Window(_))));
        // Before the pin's first cycle nothing counts.
        let mut w = Watch::new(config(), 100);
        let (mut cycle, mut at) = (0, 0);
        assert!(feed(&mut w, &mut cycle, &mut at, 50, 1000).is_empty());
    }
}
