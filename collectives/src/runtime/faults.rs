//! The fault channel: the rendezvous connections, kept open, over which rank 0 learns at
//! once which rank's process went away and tells the others, so that every rank's error
//! names the rank that died rather than a neighbour that gave up after it.
//!
//! It carries only rare notices, never data, and it must never block the cycle thread: a
//! reader thread per link waits on the socket, and the cycle thread only reads the verdict.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::control::{read_message, write_message};

#[derive(Serialize, Deserialize)]
enum Notice {
    /// Rank 0 saw this rank's process go away.
    Dead { rank: usize, how: String },
    /// The sender is shutting down cleanly.
    Bye,
}

type Verdict = (Mutex<Option<(usize, String)>>, Condvar);

/// This rank's end of the fault channel.
pub(crate) struct FaultChannel {
    rank: usize,
    writers: Vec<Option<Arc<Mutex<TcpStream>>>>,
    verdict: Arc<Verdict>,
    closing: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn record(verdict: &Verdict, rank: usize, how: &str) -> bool {
    let (lock, cv) = verdict;
    let Ok(mut v) = lock.lock() else { return false };
    if v.is_some() {
        return false;
    }
    *v = Some((rank, how.to_string()));
    cv.notify_all();
    true
}

impl FaultChannel {
    /// Starts a reader per link (`links[p]` is the connection to rank `p`).
    pub fn start(rank: usize, links: Vec<Option<TcpStream>>) -> Self {
        let verdict: Arc<Verdict> = Arc::new((Mutex::new(None), Condvar::new()));
        let closing = Arc::new(AtomicBool::new(false));
        let mut writers: Vec<Option<Arc<Mutex<TcpStream>>>> = Vec::new();
        let mut readers = Vec::new();
        for (peer, link) in links.into_iter().enumerate() {
            let pair = link.and_then(|s| {
                let _ = s.set_read_timeout(None);
                let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                s.try_clone().ok().map(|w| (s, w))
            });
            match pair {
                Some((r, w)) => {
                    writers.push(Some(Arc::new(Mutex::new(w))));
                    readers.push((peer, r));
                }
                None => writers.push(None),
            }
        }
        let mut threads = Vec::new();
        for (peer, mut reader) in readers {
            let verdict = verdict.clone();
            let closing = closing.clone();
            let writers = writers.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ringwatch-fault-{peer}"))
                .spawn(move || {
                    loop {
                        match read_message::<_, Notice>(&mut reader) {
                            Ok(Notice::Bye) => return,
                            Ok(Notice::Dead { rank: dead, how }) => {
                                record(&verdict, dead, &how);
                            }
                            Err(_) => {
                                if closing.load(Ordering::Acquire) {
                                    return;
                                }
                                let how = if rank == 0 {
                                    "its process exited or crashed: its connection to rank 0 closed"
                                        .to_string()
                                } else {
                                    "its process exited or crashed".to_string()
                                };
                                if record(&verdict, peer, &how) && rank == 0 {
                                    // Tell everyone else who is gone.
                                    let notice = Notice::Dead { rank: peer, how };
                                    for (other, w) in writers.iter().enumerate() {
                                        if other != peer
                                            && let Some(w) = w
                                            && let Ok(mut w) = w.lock()
                                        {
                                            let _ = write_message(&mut *w, &notice);
                                        }
                                    }
                                }
                                return;
                            }
                        }
                    }
                });
            if let Ok(t) = spawned {
                threads.push(t);
            }
        }
        FaultChannel {
            rank,
            writers,
            verdict,
            closing,
            threads: Mutex::new(threads),
        }
    }

    /// The rank known to be gone and how, waiting at most `wait` for the news.
    pub fn lost_rank(&self, wait: Duration) -> Option<(usize, String)> {
        let (lock, cv) = &*self.verdict;
        let guard = lock.lock().ok()?;
        let (guard, _) = cv.wait_timeout_while(guard, wait, |v| v.is_none()).ok()?;
        guard.clone().filter(|(dead, _)| *dead != self.rank)
    }

    /// Says goodbye on every link and stops the readers.
    pub fn close(&self) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        for w in self.writers.iter().flatten() {
            if let Ok(mut w) = w.lock() {
                let _ = write_message(&mut *w, &Notice::Bye);
                let _ = w.shutdown(Shutdown::Both);
            }
        }
        let threads = self
            .threads
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for FaultChannel {
    fn drop(&mut self) {
        self.close();
    }
}
