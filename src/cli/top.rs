//! `crd-broker top`: a live terminal view of a broker, read from its admin endpoints
//! (`/debug/watches`, `/debug/callers`, `/metrics`). Each watch with its subscribers, update
//! rate, last event, errors and staleness; the connections and the callers with streams open.
//! Sorted by a column of your choice, refreshed every interval, `q` to quit.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use serde_json::Value;

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
}

/// The watches' columns, as `--sort` and `s` choose them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Column {
    /// The resource.
    Resource,
    /// Subscribers now.
    Subscribers,
    /// New states per second.
    Rate,
    /// Seconds since the last event.
    Last,
    /// Errors since the watch started.
    Errors,
    /// Seconds the watch has reported only errors.
    Stale,
}

const COLUMNS: [Column; 6] = [
    Column::Resource,
    Column::Subscribers,
    Column::Rate,
    Column::Last,
    Column::Errors,
    Column::Stale,
];

impl Column {
    fn title(self) -> &'static str {
        match self {
            Column::Resource => "RESOURCE",
            Column::Subscribers => "SUBSCRIBERS",
            Column::Rate => "UPDATES/S",
            Column::Last => "LAST EVENT",
            Column::Errors => "ERRORS",
            Column::Stale => "STALE",
        }
    }

    fn next(self) -> Column {
        let i = COLUMNS.iter().position(|c| *c == self).unwrap_or(0);
        COLUMNS[(i + 1) % COLUMNS.len()]
    }
}

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
    updates: u64,
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

/// Draws the view.
pub fn draw(app: &App, frame: &mut Frame) {
    let [header, watches, callers, help] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(5),
        Constraint::Length(8),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let summary = match &app.snapshot {
        Some((s, _)) => {
            let subscribers: u64 = s.watches.iter().map(|w| w.subscribers).sum();
            let rate = s
                .watches
                .iter()
                .filter_map(|w| w.rate)
                .fold(0.0, |a, b| a + b);
            format!(
                "watches {}   subscribers {}   updates/s {:.1}   connections {}   flagd streams {}   callers {}",
                s.watches.len(),
                subscribers,
                rate,
                s.connections,
                s.sync_streams,
                s.callers_total
            )
        }
        None => "reading…".to_string(),
    };
    let version = app
        .snapshot
        .as_ref()
        .map(|(s, _)| s.version.as_str())
        .unwrap_or_default();
    let mut lines = vec![
        Line::from(vec![
            "crd-broker top ".bold(),
            format!("{} {version}", app.admin).into(),
        ]),
        Line::from(summary),
    ];
    if let Some(error) = &app.error {
        lines[1] = Line::from(format!("cannot read the broker: {error}")).red();
    }
    frame.render_widget(Paragraph::new(lines), header);

    let titles = COLUMNS.iter().map(|c| {
        let mut title = c.title().to_string();
        if *c == app.sort {
            title.push_str(if app.reverse { " ▲" } else { " ▼" });
        }
        Cell::from(title)
    });
    let rows = app.rows().into_iter().map(|w| {
        let stale = if w.stale > 0 {
            Cell::from(format!("{}s", w.stale)).red()
        } else {
            Cell::from("-")
        };
        Row::new(vec![
            Cell::from(w.selector),
            Cell::from(w.subscribers.to_string()),
            Cell::from(w.rate.map_or("-".into(), |r| format!("{r:.1}"))),
            Cell::from(w.last_event.map_or("never".into(), |s| format!("{s}s ago"))),
            Cell::from(w.errors.to_string()),
            stale,
        ])
    });
    let table = Table::new(
        rows,
        [
            Constraint::Fill(1),
            Constraint::Length(13),
            Constraint::Length(11),
            Constraint::Length(12),
            Constraint::Length(8),
            Constraint::Length(8),
        ],
    )
    .header(Row::new(titles).style(Style::new().add_modifier(Modifier::BOLD)))
    .block(Block::bordered().title(" watches "));
    frame.render_widget(table, watches);

    let caller_rows = app
        .snapshot
        .iter()
        .flat_map(|(s, _)| s.callers.iter())
        .map(|(caller, streams)| Row::new(vec![caller.clone(), streams.to_string()]));
    let callers_table = Table::new(caller_rows, [Constraint::Fill(1), Constraint::Length(10)])
        .header(Row::new(["CALLER", "STREAMS"]).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(" callers "));
    frame.render_widget(callers_table, callers);
    frame.render_widget(
        Paragraph::new("q quit   s next sort column   1-6 sort by column   r reverse").dim(),
        help,
    );
}

/// `host:port` of an admin address given as a URL or as `host:port`.
fn authority(admin: &str) -> anyhow::Result<String> {
    let rest = admin
        .strip_prefix("http://")
        .unwrap_or(admin)
        .trim_end_matches('/');
    anyhow::ensure!(
        !admin.starts_with("https://") && !rest.is_empty() && !rest.contains('/'),
        "--admin {admin}: expected http://host:port or host:port (the admin port is plain HTTP)"
    );
    Ok(rest.to_string())
}

/// A GET on the admin server; the body of a 200 answer.
async fn get(authority: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream
            .take(64 * 1024 * 1024)
            .read_to_end(&mut response)
            .await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .context("no answer within 5 s")??;
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("not an HTTP answer")?;
    let status = head.split(' ').nth(1).unwrap_or_default();
    anyhow::ensure!(status == "200", "{path} answered {status}");
    Ok(body.to_string())
}

/// Reads a snapshot from the broker at `admin`.
pub async fn fetch(admin: &str) -> anyhow::Result<Snapshot> {
    let authority = authority(admin)?;
    let (watches, callers, metrics) = tokio::try_join!(
        get(&authority, "/debug/watches"),
        get(&authority, "/debug/callers"),
        get(&authority, "/metrics"),
    )?;
    let watches: Value = serde_json::from_str(&watches).context("/debug/watches")?;
    let callers: Value = serde_json::from_str(&callers).context("/debug/callers")?;
    let now = SystemTime::now();
    let seconds_since = |v: &Value| {
        v.as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok())
            .map(|t| now.duration_since(t).unwrap_or_default().as_secs())
    };
    let number = |v: &Value| v.as_u64().unwrap_or_default();
    let watches = watches["watches"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| WatchRow {
            selector: w["selector"].as_str().unwrap_or_default().to_string(),
            subscribers: number(&w["subscribers"]),
            rate: None,
            last_event: seconds_since(&w["lastEvent"]),
            errors: number(&w["errors"]),
            stale: number(&w["staleSeconds"]),
            updates: number(&w["updates"]),
        })
        .collect();
    let list = callers["callers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["caller"].as_str().unwrap_or_default().to_string(),
                number(&c["streams"]),
            )
        })
        .collect();
    let mut connections = 0.0;
    let mut sync_streams = 0.0;
    let mut version = String::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or_default();
        if series.starts_with("crd_broker_connections{") {
            connections += value;
        } else if series == "sync_active_streams" {
            sync_streams = value;
        } else if let Some(labels) = series.strip_prefix("crd_broker_build_info{") {
            version = labels
                .split(',')
                .find_map(|l| l.strip_prefix("version=\""))
                .map(|v| v.trim_end_matches(['"', '}']).to_string())
                .unwrap_or_default();
        }
    }
    Ok(Snapshot {
        watches,
        callers: list,
        callers_total: number(&callers["total"]),
        connections,
        sync_streams,
        version,
    })
}

/// Runs the view until `q`.
pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    authority(&args.admin)?;
    let mut app = App::new(&args.admin, args.sort);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut terminal = ratatui::init();
        let result = (|| -> anyhow::Result<()> {
            let mut next_refresh = Instant::now();
            loop {
                if Instant::now() >= next_refresh {
                    match runtime.block_on(fetch(&app.admin)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_addresses_are_urls_or_host_and_port() {
        assert_eq!(
            authority("http://127.0.0.1:8016/").unwrap(),
            "127.0.0.1:8016"
        );
        assert_eq!(authority("[::1]:8016").unwrap(), "[::1]:8016");
        for bad in ["https://b:8016", "http://b:8016/metrics", ""] {
            assert!(authority(bad).is_err(), "{bad}");
        }
    }
}
