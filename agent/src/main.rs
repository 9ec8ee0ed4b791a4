//! ringwatch-agent: the node daemon.
fn main() {}
