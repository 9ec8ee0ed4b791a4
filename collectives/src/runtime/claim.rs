//! The job's autotune state and the one tuning claim (see `crate::control`'s "Tuning
//! claims"): shared by the control server (claims from clients) and rank 0's cycle thread
//! (the wait for an agent, self-tuning).
//!
//! Pure bookkeeping under one lock; it must never block on I/O or touch the data path.

use std::sync::Mutex;
use std::time::Instant;

use crate::control::AutotuneState;

#[derive(Debug)]
struct Inner {
    state: AutotuneState,
    /// The control client (connection id) holding the claim.
    holder: Option<u64>,
}

/// The answer to a claim or release: granted, the state after it, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClaimAnswer {
    pub granted: bool,
    pub state: AutotuneState,
    pub message: String,
}

impl ClaimAnswer {
    /// The answer as the control protocol's `tuning_claim` message.
    pub fn into_message(self, request_id: u64) -> crate::control::ServerMessage {
        crate::control::ServerMessage::TuningClaim {
            request_id,
            granted: self.granted,
            state: self.state,
            message: self.message,
        }
    }
}

/// Autotune state and claim holder of one job.
#[derive(Debug)]
pub(crate) struct TuningClaims {
    inner: Mutex<Inner>,
    /// When a `waiting` job stops waiting for an agent.
    wait_until: Option<Instant>,
}

impl TuningClaims {
    /// Starts in `state`; a `waiting` job waits until `wait_until`.
    pub fn new(state: AutotuneState, wait_until: Option<Instant>) -> Self {
        TuningClaims {
            inner: Mutex::new(Inner {
                state,
                holder: None,
            }),
            wait_until,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A poisoned lock only means a panic elsewhere mid-update of two plain fields.
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// The state now.
    pub fn state(&self) -> AutotuneState {
        self.with(|i| i.state)
    }

    /// Client `client` asks for the claim.
    pub fn claim(&self, client: u64) -> ClaimAnswer {
        self.with(|i| match (i.holder, i.state) {
            (Some(h), _) if h == client => ClaimAnswer {
                granted: true,
                state: i.state,
                message: "this client already holds the tuning claim".into(),
            },
            (Some(h), state) => ClaimAnswer {
                granted: false,
                state,
                message: format!("another control client (connection {h}) is tuning this job"),
            },
            (None, AutotuneState::SelfTuning) => ClaimAnswer {
                granted: false,
                state: AutotuneState::SelfTuning,
                message: "the job is tuning itself (no agent claimed it in time)".into(),
            },
            (None, previous) => {
                i.holder = Some(client);
                i.state = AutotuneState::Agent;
                ClaimAnswer {
                    granted: true,
                    state: AutotuneState::Agent,
                    message: format!("claim granted (the job was {})", previous.as_str()),
                }
            }
        })
    }

    /// Client `client` releases its claim; `completed` -> `done`, else `interrupted`.
    pub fn release(&self, client: u64, completed: bool) -> ClaimAnswer {
        self.with(|i| {
            if i.holder != Some(client) {
                return ClaimAnswer {
                    granted: false,
                    state: i.state,
                    message: "this client does not hold the tuning claim".into(),
                };
            }
            i.holder = None;
            i.state = if completed {
                AutotuneState::Done
            } else {
                AutotuneState::Interrupted
            };
            ClaimAnswer {
                granted: true,
                state: i.state,
                message: format!("claim released; the job is {}", i.state.as_str()),
            }
        })
    }

    /// Client `client`'s connection closed: a claim it held ends as `interrupted`.
    /// Returns whether it held the claim.
    pub fn disconnected(&self, client: u64) -> bool {
        self.with(|i| {
            if i.holder == Some(client) {
                i.holder = None;
                i.state = AutotuneState::Interrupted;
                true
            } else {
                false
            }
        })
    }

    /// Whether a `waiting` job's wait for an agent is over at `now`.
    #[cfg_attr(feature = "autotune", allow(dead_code))]
    pub fn wait_over(&self, now: Instant) -> bool {
        self.wait_until.is_some_and(|t| now >= t)
    }

    /// At `now`, whether a `waiting` job's wait is over with no claim; if so the state
    /// becomes `self_tuning` (atomically with respect to claims).
    #[cfg_attr(not(feature = "autotune"), allow(dead_code))]
    pub fn begin_self_tuning(&self, now: Instant) -> bool {
        let due = self.wait_until.is_some_and(|t| now >= t);
        due && self.with(|i| {
            if i.state == AutotuneState::Waiting && i.holder.is_none() {
                i.state = AutotuneState::SelfTuning;
                true
            } else {
                false
            }
        })
    }

    #[cfg_attr(not(feature = "autotune"), allow(dead_code))]
    /// Rank 0 tunes again after its pinned knobs lost a re-check: only from `done`,
    /// and only while no agent holds the claim.
    pub fn resume_self_tuning(&self) -> bool {
        self.with(|i| {
            if i.state == AutotuneState::Done && i.holder.is_none() {
                i.state = AutotuneState::SelfTuning;
                true
            } else {
                false
            }
        })
    }

    #[cfg_attr(not(feature = "autotune"), allow(dead_code))]
    /// Self-tuning ended: `done` when it finished, `interrupted` when it was cut short.
    pub fn end_self_tuning(&self, finished: bool) {
        self.with(|i| {
            if i.state == AutotuneState::SelfTuning {
                i.state = if finished {
                    AutotuneState::Done
                } else {
                    AutotuneState::Interrupted
                };
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_holder_at_a_time_and_release_or_disconnect_ends_it() {
        let c = TuningClaims::new(AutotuneState::Off, None);
        assert!(c.claim(1).granted);
        assert_eq!(c.state(), AutotuneState::Agent);
        assert!(c.claim(1).granted, "the holder may ask again");
        let refused = c.claim(2);
        assert!(!refused.granted);
        assert!(refused.message.contains("connection 1"), "{refused:?}");
        assert!(!c.release(2, true).granted, "only the holder releases");
        assert!(!c.disconnected(2));
        assert_eq!(c.state(), AutotuneState::Agent);
        assert_eq!(c.release(1, true).state, AutotuneState::Done);
        // Done re-tunes on request; a vanished holder leaves it interrupted.
        assert!(c.claim(2).granted);
        assert!(c.disconnected(2));
        assert_eq!(c.state(), AutotuneState::Interrupted);
        assert!(c.claim(3).granted);
        assert_eq!(c.release(3, false).state, AutotuneState::Interrupted);
    }

    #[test]
    fn waiting_turns_into_self_tuning_only_unclaimed_and_after_the_wait() {
        let start = Instant::now();
        let c = TuningClaims::new(AutotuneState::Waiting, Some(start + Duration::from_secs(5)));
        assert!(!c.begin_self_tuning(start));
        assert!(c.begin_self_tuning(start + Duration::from_secs(6)));
        assert_eq!(c.state(), AutotuneState::SelfTuning);
        assert!(!c.claim(1).granted, "no claims while the job tunes itself");
        c.end_self_tuning(true);
        assert_eq!(c.state(), AutotuneState::Done);
        assert!(!c.begin_self_tuning(start + Duration::from_secs(7)));
        // A re-check resumes from done, once at a time, and never over an agent's claim.
        assert!(c.resume_self_tuning());
        assert_eq!(c.state(), AutotuneState::SelfTuning);
        assert!(!c.resume_self_tuning());
        c.end_self_tuning(true);
        assert!(c.claim(2).granted);
        assert!(!c.resume_self_tuning(), "an agent holds the tuning");

        let c = TuningClaims::new(AutotuneState::Waiting, Some(start));
        assert!(c.claim(1).granted);
        assert!(!c.begin_self_tuning(start + Duration::from_secs(60)));
        c.disconnected(1);
        assert_eq!(c.state(), AutotuneState::Interrupted);
        assert!(
            !c.begin_self_tuning(start + Duration::from_secs(60)),
            "interrupted never self-tunes"
        );
    }
}
