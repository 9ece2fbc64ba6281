//! The real flagd daemon (`scripts/peers`), started on free loopback ports and asked through
//! its own OFREP evaluation API; and the Python flagd provider, evaluating on command.

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
        let mut command = tokio::process::Command::new(super::peer("flagd"));
        command.args(&args).env_clear().env("HOME", dir.path());
        Self::spawn(
            command,
            ([127, 0, 0, 1], ofrep).into(),
            ([127, 0, 0, 1], sync).into(),
            dir,
        )
    }

    /// flagd as `command` starts it (a wrapper of the binary at [`super::peer`]`("flagd")`,
    /// say), its OFREP API at `ofrep` and its sync server at `sync`; its output logged in `dir`.
    pub fn spawn(
        mut command: tokio::process::Command,
        ofrep: SocketAddr,
        sync: SocketAddr,
        dir: tempfile::TempDir,
    ) -> Flagd {
        let log = dir.path().join("flagd.log");
        let child = command
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::options().append(true).open(&log).unwrap())
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .expect("flagd starts");
        Flagd {
            child,
            ofrep,
            sync,
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

/// The Python flagd provider, unmodified, in-process mode (`tests/python/flagd_evaluate.py`),
/// configured only by its `FLAGD_*` environment, evaluating on command; killed when dropped.
pub struct Provider {
    _child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Provider {
    /// Started against the sync server at `at` for `selector`, and ready.
    pub async fn start(at: SocketAddr, selector: &str) -> Provider {
        use tokio::io::AsyncBufReadExt;
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/flagd_evaluate.py");
        let mut child =
            tokio::process::Command::new(super::python_with("openfeature.contrib.provider.flagd"))
                .arg(script)
                .env("FLAGD_RESOLVER", "in-process")
                .env("FLAGD_HOST", at.ip().to_string())
                .env("FLAGD_PORT", at.port().to_string())
                .env("FLAGD_SOURCE_SELECTOR", selector)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .leashed()
                .spawn()
                .expect("python runs");
        let stdin = child.stdin.take().unwrap();
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut provider = Provider {
            _child: child,
            stdin,
            lines,
        };
        let ready = provider.said().await;
        assert!(ready.starts_with("ready "), "{ready}");
        provider
    }

    /// Its next line.
    async fn said(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(60), self.lines.next_line())
            .await
            .expect("the provider answers")
            .unwrap()
            .expect("the provider runs")
    }

    async fn ask(&mut self, line: String) -> String {
        use tokio::io::AsyncWriteExt;
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.said().await
    }

    /// Evaluates `flag` until it is `value` (10 s at most): `seen SECONDS` or `timeout LAST`.
    pub async fn expect(&mut self, flag: &str, value: Value) -> String {
        self.ask(format!("expect {flag} {value}\n")).await
    }

    /// `flag`'s boolean evaluation: [value, variant, reason, error code].
    pub async fn details(&mut self, flag: &str) -> Value {
        serde_json::from_str(&self.ask(format!("details {flag}\n")).await).unwrap()
    }
}
