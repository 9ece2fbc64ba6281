//! `crd-broker top`: a live terminal view of a broker, read from its admin endpoints
//! (`/debug/watches`, `/debug/callers`, `/debug/subscribers`, `/metrics`). Each watch with its
//! subscribers, update rate, last event, errors and staleness; the connections and the callers
//! with streams open; how many streams hold the current state (SYNCED) and which do not yet
//! (STALE), as `istioctl proxy-status` shows proxies.
//! Sorted by a column of your choice, refreshed every interval, `q` to quit.
//!
//! [`fetch`] reads a [`Snapshot`] from the broker, the [`App`] keeps it (with the rates from the
//! one before) and the sort, and [`draw`] lays it out for the terminal's width.

use anyhow::Context;
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event};

mod app;
mod column;
mod fetch;
mod view;

pub use app::{App, Snapshot, SubscriberRow, WatchRow};
pub use column::Column;
pub use fetch::fetch;
pub use view::draw;

/// `crd-broker top`.
#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// The broker's admin address: `http://host:port` or `host:port`.
    #[arg(
        long,
        env = "CRD_BROKER_ADMIN",
        default_value = "http://127.0.0.1:8016"
    )]
    pub admin: String,
    /// How often the view refreshes.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub interval: Duration,
    /// The column to sort the watches by (`s` cycles through them, `r` reverses).
    #[arg(long, value_enum, default_value_t = Column::Subscribers)]
    pub sort: Column,
    /// A file holding a bearer token to send (read again at each refresh, as projected tokens
    /// rotate): for a broker with `--admin-auth kubernetes` reached from outside its pod.
    #[arg(long, env = "CRD_BROKER_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<std::path::PathBuf>,
}

/// The token in `file`, if one is given.
fn token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    file.map(|f| {
        std::fs::read_to_string(f)
            .map(|t| t.trim().to_string())
            .with_context(|| format!("reading --token-file {}", f.display()))
    })
    .transpose()
}

/// Runs the view until `q`.
pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    fetch::authority(&args.admin)?;
    let mut app = App::new(&args.admin, args.sort);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut terminal = ratatui::init();
        let result = (|| -> anyhow::Result<()> {
            let mut next_refresh = Instant::now();
            loop {
                if Instant::now() >= next_refresh {
                    let snapshot = token(args.token_file.as_deref())
                        .and_then(|token| runtime.block_on(fetch(&app.admin, token.as_deref())));
                    match snapshot {
                        Ok(snapshot) => app.update(snapshot, Instant::now()),
                        Err(e) => app.error = Some(format!("{e:#}")),
                    }
                    next_refresh = Instant::now() + args.interval;
                }
                terminal.draw(|frame| draw(&app, frame))?;
                let wait = next_refresh.saturating_duration_since(Instant::now());
                if event::poll(wait)?
                    && let Event::Key(key) = event::read()?
                    && app.key(key)
                {
                    return Ok(());
                }
            }
        })();
        ratatui::restore();
        result
    })
    .await?
}
