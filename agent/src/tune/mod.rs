//! The advisor: tuning sessions over the jobs' control sockets, their
//! reports (`reports`) and the `tune` command over the API (`cli`).
//!
//! The sessions, in the order data flows: `knobs` (the wire's knobs and the
//! tuner's, converted), `request` (the API's request and session JSON),
//! `disturbance` (judging a window by eBPF's view of the job),
//! `tuning` (the registry of sessions the API drives, re-exporting what the
//! rest of the agent uses) and `driver` (a session's own thread).

pub mod cli;
pub mod disturbance;
mod driver;
pub mod knobs;
pub mod reports;
pub mod request;
pub mod tuning;
