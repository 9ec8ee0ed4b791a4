//! The commands: `serve` (the node daemon, wiring every stage), `watch`
//! (one shot) and `top` (terminal).

pub mod serve;
pub mod top;
pub mod watch;
