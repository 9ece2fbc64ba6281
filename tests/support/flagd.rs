//! The real flagd daemon (`scripts/peers`), started on free loopback ports and asked through
//! its own OFREP evaluation API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::Leash;

/// A flagd daemon, killed when dropped.
pub struct Flagd {
    pub child: tokio::process::Child,
    /// Its OFREP (HTTP) evaluation address.
    pub ofrep: SocketAddr,
    /// Its own sync server's address.
    pub sync: SocketAddr,
    /// Its log (console format).
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Flagd {
    /// `flagd start --sources SOURCES` (a JSON array) on free loopback ports.
    pub async fn start(sources: Value) -> Flagd {
        Self::start_with(&["start", "--sources", &sources.to_string()]).await
    }

    /// `flagd ARGS`, each port `args` does not set (evaluation, management, OFREP, sync) on a
    /// free loopback port.
    pub async fn start_with(args: &[&str]) -> Flagd {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("flagd.log");
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let mut port = |flag: &str| -> u16 {
            match args.iter().position(|a| a == flag) {
                Some(i) => args[i + 1].parse().expect("a port"),
                None => {
                    let port = super::free_port();
                    args.extend([flag.to_string(), port.to_string()]);
                    port
                }
            }
        };
        let _ = (port("--port"), port("--management-port"));
        let (ofrep, sync) = (port("--ofrep-port"), port("--sync-port"));
        let child = tokio::process::Command::new(super::peer("flagd"))
            .args(&args)
            .env_clear()
            .env("HOME", dir.path())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::options().append(true).open(&log).unwrap())
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .expect("flagd starts");
        Flagd {
            child,
            ofrep: ([127, 0, 0, 1], ofrep).into(),
            sync: ([127, 0, 0, 1], sync).into(),
            log,
            _dir: dir,
        }
    }

    /// The OFREP evaluation of `key` with an empty context: the HTTP status and the body.
    pub async fn evaluate(&self, key: &str) -> Option<(u16, Value)> {
        let path = format!("/ofrep/v1/evaluate/flags/{key}");
        let (status, body) = super::http_post(self.ofrep, &path, &json!({ "context": {} }))
            .await
            .ok()?;
        Some((status, serde_json::from_str(&body).unwrap_or(Value::Null)))
    }

    /// Waits (`within` at most) until `key` evaluates to `value`; how long it took.
    pub async fn until(&mut self, key: &str, value: Value, within: Duration) -> Duration {
        let started = Instant::now();
        let mut last = None;
        while started.elapsed() < within {
            if let Ok(Some(exit)) = self.child.try_wait() {
                panic!("flagd exited ({exit}):\n{}", self.log_text());
            }
            last = self.evaluate(key).await;
            if matches!(&last, Some((200, body)) if body["value"] == value) {
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "{key} did not evaluate to {value} within {within:?}; last: {last:?}\n{}",
            self.log_text()
        );
    }

    pub fn log_text(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}
