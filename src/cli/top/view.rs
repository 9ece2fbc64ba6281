//! The view drawn: a header with the totals, the watches (each resource named as `kubectl get`
//! names it, whole, the other columns giving way to it), the callers, and the streams that do
//! not hold the current state yet.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};

use super::app::App;
use super::column::{COLUMNS, Column};
use crate::selector::Target;

/// A watch's resource as the view shows it, the way `kubectl get` names things: the kind by its
/// plural (`featureflags`), the group on its own (`core.openfeature.dev`, the version left out),
/// and the object: `namespace/name`, or for a set its namespace and label selector
/// (`default -l app=checkout`). A selector it cannot read is shown as the broker wrote it.
fn shown(selector: &str) -> (String, String, String) {
    let Ok(target) = selector.parse::<Target>() else {
        return (String::new(), String::new(), selector.to_string());
    };
    let (kind, object) = match target {
        Target::One(s) => match s.namespace {
            Some(ns) => (s.kind, format!("{ns}/{}", s.name)),
            None => (s.kind, s.name),
        },
        Target::Set(set) => {
            let labels = match set.labels.is_empty() {
                true => "(every object)".to_string(),
                false => format!("-l {}", set.labels),
            };
            match set.namespace {
                Some(ns) => (set.kind, format!("{ns} {labels}")),
                None => (set.kind, labels),
            }
        }
    };
    (kind.resource, kind.group, object)
}

/// The columns of the watches' table besides the resource, in the order they are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    Stat(Column),
    Kind,
    Group,
}

/// How the watches' table fits its width: whether the kind leads the resource's text
/// (`featureflags/default/demo`) or has a column of its own, how wide the resource is, and
/// which other columns fit.
#[derive(Debug, Clone, PartialEq)]
struct Fit {
    kind_in_resource: bool,
    resource: u16,
    extras: Vec<(Extra, u16)>,
}

fn width(text: &str) -> u16 {
    u16::try_from(text.chars().count()).unwrap_or(u16::MAX)
}

/// `object` (`namespace/name`) cut to `room` characters: the name kept whole while it fits, the
/// namespace shortened first.
fn cut(object: &str, room: u16) -> String {
    let room = usize::from(room);
    let chars: Vec<char> = object.chars().collect();
    if chars.len() <= room {
        return object.to_string();
    }
    if room == 0 {
        return String::new();
    }
    let name_start = object
        .rfind('/')
        .map_or(0, |i| object[..=i].chars().count());
    let name_len = chars.len() - name_start;
    if name_len + 2 <= room && name_start > 0 {
        // `…` + the namespace's end + `/name`.
        let keep = room - 1 - name_len;
        let tail: String = chars[name_start - keep..].iter().collect();
        return format!("…{tail}");
    }
    let head: String = chars[..room - 1].iter().collect();
    format!("{head}…")
}

/// Lays the watches out in `width` columns (inside the border). The resource comes first and
/// whole: the kind leaves it for a column of its own when it would not fit, and the other
/// columns give way, the least telling first (group, kind, then the statistics; the sort column
/// last).
fn fit(
    rows: &[(String, String, String)],
    titles: &dyn Fn(Column) -> String,
    sort: Column,
    width: u16,
) -> Fit {
    const SPACING: u16 = 1;
    let longest = |f: &dyn Fn(&(String, String, String)) -> String| {
        rows.iter().map(|r| self::width(&f(r))).max().unwrap_or(0)
    };
    let title = self::width(&titles(Column::Resource));
    let with_kind = longest(&|(kind, _, object)| {
        if kind.is_empty() {
            object.clone()
        } else {
            format!("{kind}/{object}")
        }
    })
    .max(title);
    let without_kind = longest(&|(_, _, object)| object.clone()).max(title);
    let kind_in_resource = with_kind <= width;
    let resource = if kind_in_resource {
        with_kind
    } else {
        without_kind.min(width)
    };
    let stat = |c: Column| (Extra::Stat(c), self::width(&titles(c)).max(6));
    let kinds = longest(&|(kind, _, _)| kind.clone()).max(4);
    let groups = longest(&|(_, group, _)| group.clone()).clamp(5, 30);
    // Most telling first.
    let mut wanted = vec![
        stat(Column::Subscribers),
        stat(Column::Rate),
        stat(Column::Last),
        stat(Column::Errors),
        stat(Column::Stale),
    ];
    // The column the rows are sorted by stays longest.
    wanted.sort_by_key(|(e, _)| *e != Extra::Stat(sort));
    if !kind_in_resource {
        wanted.push((Extra::Kind, kinds));
    }
    wanted.push((Extra::Group, groups));
    let mut room = width.saturating_sub(resource);
    let mut kept = Vec::new();
    // In that order, until one does not fit: a column never shows where a more telling one
    // could not.
    for (extra, w) in wanted {
        if w + SPACING > room {
            break;
        }
        room -= w + SPACING;
        kept.push((extra, w));
    }
    // Drawn in a fixed order: the kind, the statistics, the group.
    let place = |e: &Extra| match e {
        Extra::Kind => 0,
        Extra::Stat(c) => 1 + COLUMNS.iter().position(|x| x == c).unwrap_or(0),
        Extra::Group => 10,
    };
    kept.sort_by_key(|(e, _)| place(e));
    Fit {
        kind_in_resource,
        resource,
        extras: kept,
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
    frame.render_widget(summary(app), header);
    frame.render_widget(watches_table(app, watches.width.saturating_sub(2)), watches);
    let [callers, behind] =
        Layout::horizontal([Constraint::Fill(1), Constraint::Fill(2)]).areas(callers);
    frame.render_widget(callers_table(app), callers);
    frame.render_widget(behind_table(app), behind);
    frame.render_widget(
        Paragraph::new("q quit   s next sort column   1-6 sort by column   r reverse").dim(),
        help,
    );
}

/// The header: the broker and its version, then the totals (or why they cannot be read).
fn summary(app: &App) -> Paragraph<'static> {
    let totals = match &app.snapshot {
        Some((s, _)) => {
            let subscribers: u64 = s.watches.iter().map(|w| w.subscribers).sum();
            // Folded from 0.0: a float `sum` starts at -0.0, which prints as "-0.0".
            let rate = s
                .watches
                .iter()
                .filter_map(|w| w.rate)
                .fold(0.0, |a, b| a + b);
            format!(
                "watches {}   subscribers {}   updates/s {:.1}   connections {}   flagd streams {}   callers {}   synced {}   stale {}   not sent {}",
                s.watches.len(),
                subscribers,
                rate,
                s.connections,
                s.sync_streams,
                s.callers_total,
                s.synced,
                s.stale,
                s.not_sent
            )
        }
        None => "reading…".to_string(),
    };
    let version = app
        .snapshot
        .as_ref()
        .map(|(s, _)| s.version.as_str())
        .unwrap_or_default();
    let second = match &app.error {
        Some(error) => Line::from(format!("cannot read the broker: {error}")).red(),
        None => Line::from(totals),
    };
    Paragraph::new(vec![
        Line::from(vec![
            "crd-broker top ".bold(),
            format!("{} {version}", app.admin).into(),
        ]),
        second,
    ])
}

/// The watches, laid out for `width` columns inside the border.
fn watches_table(app: &App, width: u16) -> Table<'static> {
    let title = |c: Column| {
        let mut title = c.title().to_string();
        if c == app.sort {
            title.push_str(if app.reverse { " ▲" } else { " ▼" });
        }
        title
    };
    let rows = app.rows();
    let names: Vec<(String, String, String)> = rows.iter().map(|w| shown(&w.selector)).collect();
    let fit = fit(&names, &title, app.sort, width);
    let mut header = vec![Cell::from(title(Column::Resource))];
    let mut widths = vec![Constraint::Min(fit.resource)];
    for (extra, w) in &fit.extras {
        header.push(Cell::from(match extra {
            Extra::Stat(c) => title(*c),
            Extra::Kind => "KIND".to_string(),
            Extra::Group => "GROUP".to_string(),
        }));
        widths.push(Constraint::Length(*w));
    }
    let body: Vec<Row> = rows
        .into_iter()
        .zip(names)
        .map(|(w, (kind, group, object))| {
            let resource = if fit.kind_in_resource && !kind.is_empty() {
                format!("{kind}/{object}")
            } else {
                cut(&object, fit.resource)
            };
            let mut cells = vec![Cell::from(resource)];
            cells.extend(fit.extras.iter().map(|(extra, _)| match extra {
                Extra::Kind => Cell::from(kind.clone()),
                Extra::Group => Cell::from(group.clone()).dim(),
                Extra::Stat(Column::Subscribers) => Cell::from(w.subscribers.to_string()),
                Extra::Stat(Column::Rate) => {
                    Cell::from(w.rate.map_or("-".into(), |r| format!("{r:.1}")))
                }
                Extra::Stat(Column::Last) => {
                    Cell::from(w.last_event.map_or("never".into(), |s| format!("{s}s ago")))
                }
                Extra::Stat(Column::Errors) => Cell::from(w.errors.to_string()),
                Extra::Stat(Column::Stale) if w.stale > 0 => {
                    Cell::from(format!("{}s", w.stale)).red()
                }
                Extra::Stat(_) => Cell::from("-"),
            }));
            Row::new(cells)
        })
        .collect();
    Table::new(body, widths)
        .header(Row::new(header).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(" watches "))
}

/// The callers with streams open, the most first.
fn callers_table(app: &App) -> Table<'static> {
    let rows: Vec<Row> = app
        .snapshot
        .iter()
        .flat_map(|(s, _)| s.callers.iter())
        .map(|(caller, streams)| Row::new(vec![caller.clone(), streams.to_string()]))
        .collect();
    Table::new(rows, [Constraint::Fill(1), Constraint::Length(10)])
        .header(Row::new(["CALLER", "STREAMS"]).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(" callers "))
}

/// The streams that do not hold the current state, the stale first: what each was last handed
/// of the first resource it is behind on, against the current version.
fn behind_table(app: &App) -> Table<'static> {
    let rows: Vec<Row> = app
        .snapshot
        .iter()
        .flat_map(|(s, _)| s.behind.iter())
        .map(|b| {
            let (_, _, object) = shown(&b.resource);
            let status = match b.status.as_str() {
                "STALE" => Cell::from(b.status.clone()).red(),
                _ => Cell::from(b.status.clone()),
            };
            Row::new(vec![
                Cell::from(b.caller.clone()),
                Cell::from(b.protocol.clone()),
                Cell::from(object),
                Cell::from(format!("{} → {}", b.delivered, b.current)),
                status,
            ])
        })
        .collect();
    let widths = [
        Constraint::Fill(2),
        Constraint::Length(8),
        Constraint::Fill(2),
        Constraint::Fill(2),
        Constraint::Length(8),
    ];
    Table::new(rows, widths)
        .header(
            Row::new([
                "CALLER",
                "PROTOCOL",
                "RESOURCE",
                "HANDED → CURRENT",
                "STATUS",
            ])
            .style(Style::new().add_modifier(Modifier::BOLD)),
        )
        .block(Block::bordered().title(" subscribers behind "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    use crate::cli::top::{Snapshot, WatchRow};

    /// A name of 63 characters, the longest a namespace or a DNS label may have.
    const LONG: &str = "checkout-flags-for-the-european-storefronts-and-the-mobile-apps";

    fn row(selector: &str, subscribers: u64) -> WatchRow {
        WatchRow {
            selector: selector.to_string(),
            subscribers,
            rate: Some(0.5),
            last_event: Some(3),
            errors: 0,
            stale: 0,
            updates: 0,
        }
    }

    /// The view of these watches in a `width` × 40 terminal, as text.
    fn screen(watches: Vec<WatchRow>, width: u16) -> String {
        let mut app = App::new("http://127.0.0.1:8016", Column::Subscribers);
        app.update(
            Snapshot {
                watches,
                ..Snapshot::default()
            },
            Instant::now(),
        );
        let mut terminal =
            ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, 40)).unwrap();
        terminal.draw(|frame| draw(&app, frame)).unwrap();
        let buffer = terminal.backend().buffer();
        buffer
            .content
            .chunks(usize::from(width))
            .map(|line| line.iter().map(|c| c.symbol()).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn watches() -> Vec<WatchRow> {
        assert_eq!(LONG.len(), 63);
        vec![
            row(
                "featureflags.v1beta1.core.openfeature.dev/default/checkout-flags",
                3,
            ),
            row(
                &format!("featureflags.v1beta1.core.openfeature.dev/default/{LONG}"),
                2,
            ),
            row(
                "featureflags.v1beta1.core.openfeature.dev/default?labelSelector=app=checkout",
                1,
            ),
            row("widgets.v1.example.com/w1", 0),
        ]
    }

    #[test]
    fn at_120_columns_names_are_whole_and_kinds_short_as_kubectl_writes_them() {
        let text = screen(watches(), 120);
        for shown in [
            "featureflags/default/checkout-flags",
            &format!("featureflags/default/{LONG}"),
            "featureflags/default -l app=checkout",
            "widgets/w1",
            "SUBSCRIBERS ▼",
        ] {
            assert!(text.contains(shown), "{shown} in:\n{text}");
        }
        assert!(!text.contains("v1beta1"), "no versions:\n{text}");
    }

    #[test]
    fn at_80_columns_the_name_stays_whole_and_other_columns_give_way() {
        let text = screen(watches(), 80);
        assert!(text.contains(&format!("default/{LONG}")), "{text}");
        assert!(text.contains("default/checkout-flags"), "{text}");
        assert!(text.contains("default -l app=checkout"), "{text}");
        // Short names leave room for the kind in the resource, and for statistics.
        let short = screen(watches().into_iter().take(1).collect(), 80);
        assert!(
            short.contains("featureflags/default/checkout-flags")
                && short.contains("SUBSCRIBERS ▼"),
            "{short}"
        );
        assert!(
            !short.contains("GROUP"),
            "the group gives way first:\n{short}"
        );
    }

    #[test]
    fn an_object_too_long_for_the_width_keeps_its_name_and_shortens_the_namespace() {
        let object = format!("{LONG}/{LONG}");
        let cut = cut(&object, 78);
        assert!(
            cut.ends_with(&format!("/{LONG}")) && cut.starts_with('…'),
            "{cut}"
        );
        assert_eq!(cut.chars().count(), 78);
        assert_eq!(super::cut("default/demo", 78), "default/demo");
        let name = super::cut(LONG, 20);
        assert_eq!((name.chars().count(), name.ends_with('…')), (20, true));
    }
}
