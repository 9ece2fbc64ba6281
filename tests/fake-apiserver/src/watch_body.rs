//! The body of one watch response: initial events, then live lines from the store, ended by the
//! deadline (`timeoutSeconds`), by a fault knob, or when the store drops the watcher.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::Shared;

/// A command the fault knobs send to every open watch.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Control {
    /// Nothing to do (the initial value).
    #[default]
    Run,
    /// End the response cleanly, with the terminating chunk, as at `timeoutSeconds`.
    Close,
    /// Drop the connection mid-body, without the terminating chunk (a network failure).
    Abort,
    /// Write this event line (an `ERROR`), then end cleanly.
    Error(Bytes),
}

/// Removes its watcher from the store when the response body is dropped, which hyper does when
/// the client goes away; so the open-watch count is the server's real view.
pub(crate) struct WatcherGuard {
    pub(crate) shared: Weak<Shared>,
    pub(crate) id: u64,
}

impl Drop for WatcherGuard {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.state().watchers.remove(&self.id);
        }
    }
}

/// What one watch response will write.
pub(crate) struct WatchBody {
    pub(crate) initial: VecDeque<Bytes>,
    pub(crate) rx: mpsc::Receiver<Bytes>,
    pub(crate) control: watch::Receiver<Control>,
    pub(crate) stall: watch::Receiver<bool>,
    pub(crate) deadline: Instant,
    pub(crate) _guard: Option<WatcherGuard>,
    pub(crate) done: bool,
}

impl WatchBody {
    async fn next_chunk(&mut self) -> Option<io::Result<Bytes>> {
        if self.done {
            return None;
        }
        loop {
            let stalled = *self.stall.borrow_and_update();
            tokio::select! {
                biased;
                changed = self.control.changed() => {
                    if changed.is_err() {
                        self.done = true;
                        return None;
                    }
                    let command = self.control.borrow_and_update().clone();
                    match command {
                        Control::Run => continue,
                        Control::Close => {
                            self.done = true;
                            return None;
                        }
                        Control::Abort => {
                            self.done = true;
                            return Some(Err(io::Error::other("watch aborted by a fault knob")));
                        }
                        Control::Error(line) => {
                            self.done = true;
                            return Some(Ok(line));
                        }
                    }
                }
                // A stalled server says nothing at all, not even the end at its deadline.
                _ = tokio::time::sleep_until(self.deadline), if !stalled => {
                    self.done = true;
                    return None;
                }
                changed = self.stall.changed() => {
                    if changed.is_err() {
                        self.done = true;
                        return None;
                    }
                }
                line = next_line(&mut self.initial, &mut self.rx), if !stalled => {
                    return line.map(Ok);
                }
            }
        }
    }

    /// The body as a stream of chunks, one event line each.
    pub(crate) fn into_stream(self) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
        futures::stream::unfold(self, |mut body| async move {
            let chunk = body.next_chunk().await?;
            Some((chunk, body))
        })
    }
}

async fn next_line(initial: &mut VecDeque<Bytes>, rx: &mut mpsc::Receiver<Bytes>) -> Option<Bytes> {
    match initial.pop_front() {
        Some(line) => Some(line),
        None => rx.recv().await,
    }
}

/// Keeps a strong reference alive only where needed; the guard itself holds a weak one so a
/// dropped server is not kept alive by a client that never disconnects.
pub(crate) fn guard(shared: &Arc<Shared>, id: u64) -> WatcherGuard {
    WatcherGuard {
        shared: Arc::downgrade(shared),
        id,
    }
}
