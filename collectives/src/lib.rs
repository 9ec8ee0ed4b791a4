//! `collectives`: a Horovod-style collective runtime over TCP.
//!
//! Never depends on the agent: a job runs the same with or without one.
