//! `tuner`: Bayesian optimization of a collective runtime's knobs.
//!
//! A pure library: it is given observations and returns suggestions. It never
//! does I/O, reads a clock or starts threads, so the same observations (and
//! seed) always give the same suggestions. The exceptions: [`report`] writes
//! to a `Write` the caller hands it, and [`session::write_report`] writes a
//! finished session's report files where the caller says (so the agent and a
//! self-tuning job write the same report).
//!
//! Code map, in the order data flows:
//! - [`space`]: the knobs, their bounds and kinds, the unit-cube encoding, and
//!   the ready-made collective space ([`space::Space::collective`]).
//! - [`gp`]: Gaussian-process regression (Matérn 5/2 ARD, learned noise,
//!   per-observation noise hints), hyperparameters by L-BFGS (argmin).
//! - [`acquisition`]: Expected Improvement and its maximization.
//! - [`safe`]: exploration that costs the job little (a trust region around
//!   the incumbent, a safe set by lower confidence bound).
//! - [`optimizer`]: the suggest/observe loop (safe or global exploration,
//!   one-sided outliers discounted), recommendation, stopping rule.
//! - [`session`]: one tuning session's sample protocol (apply knobs, skip
//!   warm-up cycles, score a window of the job's cycles as bytes/s or as the
//!   median of sub-windows, measure the start twice, re-measure a disturbed
//!   window, confirm the choice against the start on interleaved fresh
//!   windows, pin the winner), shared by the agent and by a job that tunes
//!   itself.
//! - [`report`]: the session as a polars DataFrame, CSV, Parquet and HTML.
//!
//! Invariants: the score is maximized; `tuner` knows nothing of sockets,
//! processes or the agent; a refused observation changes nothing.

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
