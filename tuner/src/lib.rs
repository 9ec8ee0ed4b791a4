//! `tuner`: Bayesian optimization of a collective runtime's knobs.
//!
//! A pure library: it is given observations and returns suggestions. It never
//! reads a clock or starts threads, so the same observations (and seed)
//! always give the same suggestions, and it does no I/O except in
//! [`report`], which writes to a `Write` the caller hands it and, in
//! [`report::write_report`], writes a finished session's report files where
//! the caller says (so the agent and a self-tuning job write the same
//! report).
//!
//! Code map, in the order data flows, with what each module must never do:
//! - [`space`]: the knobs, their bounds and kinds, the unit-cube encoding, and
//!   the ready-made collective space ([`space::Space::collective`]). Never
//!   knows an objective or a runtime protocol.
//! - [`gp`]: Gaussian-process regression (Matérn 5/2 ARD, learned noise,
//!   per-observation noise hints), hyperparameters by L-BFGS (argmin). Never
//!   sees knob names: plain encoded vectors in, scores out.
//! - [`acquisition`]: Expected Improvement and its maximization. Never fits a
//!   model or keeps state between calls.
//! - [`safe`]: exploration that costs the job little (a trust region around
//!   the incumbent, a safe set by lower confidence bound). Never keeps state
//!   of its own: the region is replayed from the observations.
//! - [`optimizer`]: the suggest/observe loop (safe or global exploration,
//!   one-sided outliers discounted), recommendation, stopping rule. Never
//!   knows what a score measures or where it came from.
//! - [`session`]: one tuning session's sample protocol (apply knobs, skip
//!   warm-up cycles, score a window of the job's cycles as bytes/s or as the
//!   median of sub-windows, measure the start twice, re-measure a disturbed
//!   window, confirm the choice against the start on interleaved fresh
//!   windows, pin the winner), shared by the agent and by a job that tunes
//!   itself. Never does I/O, reads a clock or builds its report: it hands
//!   the report's data to [`report`], which depends on it, never the
//!   reverse.
//! - [`watch`]: after a pin, says when the job's throughput moved enough to
//!   re-check the knobs. Never applies knobs or starts a session itself.
//! - [`report`]: the session as a polars DataFrame, CSV, Parquet and HTML,
//!   and the report files. The only module that does I/O; never reads a
//!   clock or drives a session.
//!
//! Invariants: the score is maximized; `tuner` knows nothing of sockets,
//! processes or the agent; a refused observation changes nothing; modules
//! depend on each other one way (no import cycles: `cargo test -p xtask
//! module_cycles` checks every crate).

#![warn(missing_docs)]

pub mod acquisition;
pub mod gp;
pub mod optimizer;
pub mod report;
pub mod safe;
pub mod session;
pub mod space;
pub mod watch;

pub use optimizer::{
    Best, Exploration, Observation, Optimizer, OptimizerConfig, OptimizerError, StopReason,
};
pub use space::{
    CollectiveKnobs, DEFAULT_CYCLE_TIME_MS, DEFAULT_FUSION_THRESHOLD_BYTES, Dim, DimKind, Point,
    Space, SpaceError, Value,
};
