//! `crd-broker top` against a real broker: drawn with ratatui's test backend from the admin
//! endpoints (watches, rates, callers, sorting, keys), and once for real in tmux (send-keys,
//! capture-pane, `q` to quit).

mod support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use crd_broker::cli::top::{App, Column, draw, fetch};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use support::*;

/// The screen as text, one line per row.
fn screen(app: &App) -> String {
    screen_of(app, 150, 30)
}

/// The screen of a `width` × `height` terminal as text, one line per row.
fn screen_of(app: &App, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    terminal.draw(|frame| draw(app, frame)).unwrap();
    let buffer = terminal.backend().buffer();
    let width = buffer.area.width as usize;
    buffer
        .content
        .chunks(width)
        .map(|row| row.iter().map(|c| c.symbol()).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n")
}

fn press(app: &mut App, c: char) -> bool {
    app.key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE))
}

#[tokio::test]
async fn top_shows_each_watch_its_rate_and_the_callers_and_sorts_by_any_column() {
    let fake = fake().await;
    for name in ["busy", "quiet"] {
        fake.apply(flag(name, "on")).unwrap();
    }
    let broker = broker_with_access(&fake, Default::default()).await;
    let admin = format!("http://{}", broker.admin_addr.unwrap());
    // From another address than the broker's own (loopback callers count as a local proxy).
    let mut client = connect_from(broker.addr, "127.0.0.2").await;
    let mut streams = Vec::new();
    for selectors in [vec![demo("busy")], vec![demo("busy")], vec![demo("quiet")]] {
        let selectors: Vec<&str> = selectors.iter().map(String::as_str).collect();
        let mut s = subscribe(&mut client, &selectors).await;
        next(&mut s).await;
        streams.push(s);
    }
    let mut app = App::new(&admin, Column::Subscribers);
    app.update(fetch(&admin, None).await.unwrap(), Instant::now());
    let text = screen(&app);
    assert!(text.contains("SUBSCRIBERS ▼"), "{text}");
    assert!(text.contains("watches 2   subscribers 3"), "{text}");
    assert!(text.contains("ip:127.0.0.2"), "the caller: {text}");
    assert!(text.contains("updates/s 0.0"), "{text}");
    assert!(text.contains("synced 3   stale 0   not sent 0"), "{text}");
    let rows = app.rows();
    assert_eq!(
        (rows[0].selector.as_str(), rows[0].subscribers),
        ("featureflags.v1beta1.core.openfeature.dev/default/busy", 2)
    );
    assert_eq!(rows[0].rate, None, "no rate before a second reading");

    // Changes to one flag: its rate is positive at the next refresh, the other's zero.
    for variant in ["off", "on", "off"] {
        fake.merge_patch(
            GV,
            "featureflags",
            "default",
            "busy",
            variant_patch(variant),
        )
        .unwrap();
        next(&mut streams[0]).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    app.update(fetch(&admin, None).await.unwrap(), Instant::now());
    assert!(!press(&mut app, 's'), "s sorts by the next column");
    assert_eq!(app.sort, Column::Rate);
    let rows = app.rows();
    assert!(
        rows[0].selector.ends_with("/busy") && rows[0].rate.unwrap() > 0.0,
        "{rows:?}"
    );
    assert_eq!(rows[1].rate, Some(0.0), "{rows:?}");
    assert!(screen(&app).contains("UPDATES/S ▼"));
    assert!(!press(&mut app, '1'));
    assert!(!press(&mut app, 'r'));
    let rows = app.rows();
    assert!(
        rows[0].selector.ends_with("/quiet"),
        "resource order, reversed: {rows:?}"
    );
    assert!(screen(&app).contains("RESOURCE ▲"));

    // A stream whose client stops reading a large flag while it changes: behind, and shown so.
    let mut big = flag("big", "v0");
    big["spec"]["flagSpec"]["metadata"] = serde_json::json!({ "padding": "x".repeat(64 * 1024) });
    fake.apply(big).unwrap();
    let mut stalled = subscribe(&mut client, &[&demo("big")]).await;
    next(&mut stalled).await;
    for i in 1..=40 {
        let patch = variant_patch(&format!("v{i}"));
        fake.merge_patch(GV, "featureflags", "default", "big", patch)
            .unwrap();
    }
    let stale = eventually("the stalled stream shows STALE", WAIT, async || {
        app.update(fetch(&admin, None).await.unwrap(), Instant::now());
        let snapshot = &app.snapshot.as_ref().unwrap().0;
        snapshot.stale == 1
    })
    .await;
    let text = screen(&app);
    assert!(text.contains("subscribers behind"), "{text}");
    assert!(
        text.contains("STALE") && text.contains("default/big"),
        "{text}"
    );
    println!("a stalled stream showed STALE after {stale:?}");
    assert!(press(&mut app, 'q'), "q quits");

    // A broker that does not answer is said so, and the view stays up.
    let mut gone = App::new("http://127.0.0.1:1", Column::Subscribers);
    let error = fetch("http://127.0.0.1:1", None).await.unwrap_err();
    gone.error = Some(format!("{error:#}"));
    assert!(screen(&gone).contains("cannot read the broker"));
}

#[tokio::test]
async fn top_names_a_resource_whole_at_80_and_120_columns() {
    // 63 characters: the longest DNS label, and a name that kubectl's group and version
    // prefix used to push off a 120-column screen.
    let long = "checkout-flags-for-the-european-storefronts-and-the-mobile-apps";
    assert_eq!(long.len(), 63);
    let fake = fake().await;
    for name in [long, "checkout-flags"] {
        fake.apply(flag(name, "on")).unwrap();
    }
    let broker = broker_with_access(&fake, Default::default()).await;
    let admin = format!("http://{}", broker.admin_addr.unwrap());
    let mut client = connect(broker.addr).await;
    let mut streams = Vec::new();
    for name in [long, "checkout-flags"] {
        let mut s = subscribe(&mut client, &[&demo(name)]).await;
        next(&mut s).await;
        streams.push(s);
    }
    let mut app = App::new(&admin, Column::Subscribers);
    app.update(fetch(&admin, None).await.unwrap(), Instant::now());
    let wide = screen_of(&app, 120, 40);
    for shown in [
        format!("featureflags/default/{long}"),
        "featureflags/default/checkout-flags".to_string(),
    ] {
        assert!(wide.contains(&shown), "{shown} at 120 columns:\n{wide}");
    }
    let narrow = screen_of(&app, 80, 40);
    assert!(
        narrow.contains(&format!("default/{long}")) && narrow.contains("default/checkout-flags"),
        "at 80 columns:\n{narrow}"
    );
}

/// A tmux session on a tmux server of its own (`-L`), killed when dropped; the server ends with
/// its last session.
struct Session(String);

impl Session {
    fn tmux(&self) -> std::process::Command {
        let mut tmux = std::process::Command::new("tmux");
        tmux.args(["-L", &self.0]);
        tmux
    }

    fn capture(&self) -> String {
        let out = self
            .tmux()
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &str) {
        let status = self
            .tmux()
            .args(["send-keys", "-t", &self.0, keys])
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn alive(&self) -> bool {
        self.tmux()
            .args(["has-session", "-t", &self.0])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self
            .tmux()
            .args(["kill-session", "-t", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test]
async fn top_runs_in_a_real_terminal_and_quits_on_q() {
    let found = std::process::Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "tmux is needed: run the README's test command (scripts/test), which installs it"
    );
    let fake = fake().await;
    fake.apply(flag("demo", "on")).unwrap();
    let broker = broker_with_access(&fake, Default::default()).await;
    let mut client = connect(broker.addr).await;
    let mut s = subscribe(&mut client, &[&demo("demo")]).await;
    next(&mut s).await;
    let admin = broker.admin_addr.unwrap();
    let session = Session(format!("crd-broker-top-{}", std::process::id()));
    // Run by a keeper, which ends it (and so the session and its server) should this test
    // binary be killed before it drops the session.
    let admin = format!("http://{admin}");
    let command = control_plane::leash::tree_line(&[
        env!("CARGO_BIN_EXE_crd-broker"),
        "top",
        "--admin",
        &admin,
        "--interval",
        "200ms",
    ]);
    let status = session
        .tmux()
        .args([
            "new-session",
            "-d",
            "-s",
            &session.0,
            "-x",
            "120",
            "-y",
            "40",
        ])
        .arg(command)
        .status()
        .unwrap();
    assert!(status.success());
    // At 120 columns the watch is named as kubectl names it, whole.
    eventually("top shows the watch", WAIT, async || {
        session.capture().contains("featureflags/default/demo")
    })
    .await;
    assert!(
        session.capture().contains("SUBSCRIBERS ▼"),
        "{}",
        session.capture()
    );
    session.keys("s");
    eventually("s sorts by the update rate", WAIT, async || {
        session.capture().contains("UPDATES/S ▼")
    })
    .await;
    session.keys("q");
    eventually("q quits", WAIT, async || !session.alive()).await;
}
