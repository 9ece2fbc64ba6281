//! Process signals: SIGINT (Ctrl-C) and SIGTERM, counted, so a second one can cut a drain short.

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::Mutex;

/// The termination signals a process receives.
pub struct Signals {
    term: Mutex<Signal>,
    int: Mutex<Signal>,
}

impl Signals {
    /// Starts listening for SIGTERM and SIGINT.
    pub fn new() -> std::io::Result<Self> {
        Ok(Signals {
            term: Mutex::new(signal(SignalKind::terminate())?),
            int: Mutex::new(signal(SignalKind::interrupt())?),
        })
    }

    /// Resolves on the next SIGTERM or SIGINT.
    pub async fn next(&self) {
        let mut term = self.term.lock().await;
        let mut int = self.int.lock().await;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}
