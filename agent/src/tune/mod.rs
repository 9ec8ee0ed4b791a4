//! The advisor: tuning sessions over the jobs' control sockets (`tuning`),
//! their reports (`reports`) and the `tune` command over the API (`cli`).

pub mod cli;
pub mod reports;
pub mod tuning;
