//! `model`: per-thread state built from decoded events.
//!
//! Pure bookkeeping over events: no BPF, no I/O, so it is tested with
//! synthetic events.

use std::collections::BTreeMap;

use crate::events::Event;

/// Context-switch counts of one thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadSwitches {
    /// Times the thread left a CPU.
    pub switched_out: u64,
    /// Times the thread got a CPU.
    pub switched_in: u64,
    /// Of `switched_out`, how many were preemptions (still runnable).
    pub preempted: u64,
}

/// Context switches of the watched processes, per process and thread.
#[derive(Debug, Default)]
pub struct SwitchCounts {
    /// tgid → tid → counts.
    pub processes: BTreeMap<u32, BTreeMap<u32, ThreadSwitches>>,
    /// Events seen in total.
    pub events: u64,
}

impl SwitchCounts {
    /// Accounts one event.
    pub fn record(&mut self, event: &Event) {
        let Event::SchedSwitch(e) = event;
        self.events += 1;
        if e.prev_watched != 0 {
            let thread = self.thread(e.prev_tgid, e.prev_tid);
            thread.switched_out += 1;
            // __state 0 (TASK_RUNNING) when leaving the CPU means it was
            // preempted rather than blocked.
            if e.prev_state == 0 {
                thread.preempted += 1;
            }
        }
        if e.next_watched != 0 {
            self.thread(e.next_tgid, e.next_tid).switched_in += 1;
        }
    }

    fn thread(&mut self, tgid: u32, tid: u32) -> &mut ThreadSwitches {
        self.processes
            .entry(tgid)
            .or_default()
            .entry(tid)
            .or_default()
    }

    /// Sum over the threads of process `tgid`.
    pub fn process_total(&self, tgid: u32) -> ThreadSwitches {
        let mut total = ThreadSwitches::default();
        for t in self
            .processes
            .get(&tgid)
            .into_iter()
            .flat_map(|threads| threads.values())
        {
            total.switched_out += t.switched_out;
            total.switched_in += t.switched_in;
            total.preempted += t.preempted;
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ebpf::{EventHeader, SchedSwitchEvent};

    fn switch(prev: (u32, u32, bool, u32), next: (u32, u32, bool)) -> Event {
        Event::SchedSwitch(SchedSwitchEvent {
            hdr: EventHeader {
                ts_ns: 0,
                kind: 1,
                cpu: 0,
            },
            prev_tgid: prev.0,
            prev_tid: prev.1,
            next_tgid: next.0,
            next_tid: next.1,
            prev_state: prev.3,
            preempt: u8::from(prev.3 == 0),
            prev_watched: u8::from(prev.2),
            next_watched: u8::from(next.2),
            _pad: 0,
        })
    }

    #[test]
    fn counts_only_the_watched_side() {
        let mut counts = SwitchCounts::default();
        // watched 10/11 blocks, unwatched 20/20 runs; then it comes back, preempted later.
        counts.record(&switch((10, 11, true, 1), (20, 20, false)));
        counts.record(&switch((20, 20, false, 1), (10, 11, true)));
        counts.record(&switch((10, 11, true, 0), (10, 12, true)));
        assert_eq!(
            counts.processes[&10][&11],
            ThreadSwitches {
                switched_out: 2,
                switched_in: 1,
                preempted: 1
            }
        );
        assert_eq!(counts.processes[&10][&12].switched_in, 1);
        assert!(!counts.processes.contains_key(&20));
        assert_eq!(counts.process_total(10).switched_out, 2);
        assert_eq!(counts.process_total(10).switched_in, 2);
        assert_eq!(counts.events, 3);
    }
}
