//! The view's state: the last snapshot read, the rates from the one before, the sort.

use std::collections::HashMap;
use std::time::Instant;

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use super::column::{COLUMNS, Column};

/// One watch as the view shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchRow {
    /// The canonical selector.
    pub selector: String,
    /// Subscribers now.
    pub subscribers: u64,
    /// New states per second since the previous refresh (none at the first).
    pub rate: Option<f64>,
    /// Seconds since the source last reported anything.
    pub last_event: Option<u64>,
    /// Errors since the watch started.
    pub errors: u64,
    /// Seconds it has reported only errors.
    pub stale: u64,
    pub(super) updates: u64,
}

/// A stream that does not hold the current state, as `/debug/subscribers` lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriberRow {
    /// The caller.
    pub caller: String,
    /// The protocol.
    pub protocol: String,
    /// `STALE` or `NOT SENT`.
    pub status: String,
    /// The first resource (or xDS type) it is behind on.
    pub resource: String,
    /// The version it was last handed of it, and the current one.
    pub delivered: String,
    /// See `delivered`.
    pub current: String,
}

/// What one refresh read from the broker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The watches.
    pub watches: Vec<WatchRow>,
    /// Callers with streams open, with the most first.
    pub callers: Vec<(String, u64)>,
    /// Callers in all (the list may be cut).
    pub callers_total: u64,
    /// Client connections open.
    pub connections: f64,
    /// flagd sync streams open.
    pub sync_streams: f64,
    /// The broker's version.
    pub version: String,
    /// Streams holding the current state, not yet, and handed nothing yet.
    pub synced: u64,
    /// See `synced`.
    pub stale: u64,
    /// See `synced`.
    pub not_sent: u64,
    /// The streams behind, the stale first.
    pub behind: Vec<SubscriberRow>,
}

/// The view's state.
#[derive(Debug)]
pub struct App {
    /// Where it reads from.
    pub admin: String,
    /// The sort column.
    pub sort: Column,
    /// Whether the order is reversed.
    pub reverse: bool,
    /// The last snapshot read, and when.
    pub snapshot: Option<(Snapshot, Instant)>,
    /// Why the last refresh failed, while it does.
    pub error: Option<String>,
}

impl App {
    /// A view of the broker at `admin`, sorted by `sort`.
    pub fn new(admin: &str, sort: Column) -> App {
        App {
            admin: admin.to_string(),
            sort,
            reverse: false,
            snapshot: None,
            error: None,
        }
    }

    /// Takes a new snapshot: update rates come from the previous one.
    pub fn update(&mut self, mut snapshot: Snapshot, at: Instant) {
        if let Some((previous, then)) = &self.snapshot {
            let seconds = at.duration_since(*then).as_secs_f64();
            let before: HashMap<&str, u64> = previous
                .watches
                .iter()
                .map(|w| (w.selector.as_str(), w.updates))
                .collect();
            for w in &mut snapshot.watches {
                if let Some(old) = before.get(w.selector.as_str())
                    && seconds > 0.0
                {
                    w.rate = Some(w.updates.saturating_sub(*old) as f64 / seconds);
                }
            }
        }
        self.snapshot = Some((snapshot, at));
        self.error = None;
    }

    /// Handles a key; whether to quit.
    pub fn key(&mut self, key: KeyEvent) -> bool {
        if key.kind != KeyEventKind::Press {
            return false;
        }
        match key.code {
            KeyCode::Char('q') | KeyCode::Esc => return true,
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => return true,
            KeyCode::Char('s') | KeyCode::Tab => self.sort = self.sort.next(),
            KeyCode::Char('r') => self.reverse = !self.reverse,
            KeyCode::Char(d @ '1'..='6') => {
                self.sort = COLUMNS[(d as u8 - b'1') as usize];
            }
            _ => {}
        }
        false
    }

    /// The watches in display order.
    pub fn rows(&self) -> Vec<WatchRow> {
        let Some((snapshot, _)) = &self.snapshot else {
            return Vec::new();
        };
        let mut rows = snapshot.watches.clone();
        let by = self.sort;
        rows.sort_by(|a, b| {
            use std::cmp::Ordering;
            let order = match by {
                Column::Resource => a.selector.cmp(&b.selector),
                Column::Subscribers => b.subscribers.cmp(&a.subscribers),
                Column::Rate => b
                    .rate
                    .unwrap_or(0.0)
                    .partial_cmp(&a.rate.unwrap_or(0.0))
                    .unwrap_or(Ordering::Equal),
                // The most recent first; never-seen last.
                Column::Last => a
                    .last_event
                    .unwrap_or(u64::MAX)
                    .cmp(&b.last_event.unwrap_or(u64::MAX)),
                Column::Errors => b.errors.cmp(&a.errors),
                Column::Stale => b.stale.cmp(&a.stale),
            };
            order.then_with(|| a.selector.cmp(&b.selector))
        });
        if self.reverse {
            rows.reverse();
        }
        rows
    }
}
