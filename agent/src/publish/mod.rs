//! model → answers: the live view published once a second (`live`, with the
//! jobs' activities and counter tracks from `tracks`), timeline range
//! queries (`timeline`) at a level of detail (`lod`) and Prometheus exposition
//! (`metrics`).

pub mod live;
pub mod lod;
pub mod metrics;
pub mod timeline;
pub mod tracks;
