//! The servers under test, each a separate process: the release-built broker (on the fake API
//! server or a real control plane, through a kubeconfig), the bare tonic server (this binary's
//! `bare` subcommand) or the flagd daemon.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use control_plane::Leash;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, Command};

use crate::stats;

/// The flags that lift every per-caller limit, for a harness whose few loopback addresses stand
/// for thousands of sidecars (each known to every build; newer limits go by environment).
pub const UNLIMITED: [&str; 8] = [
    "--max-streams-per-caller",
    "1000000",
    "--new-watch-rate",
    "100000",
    "--new-watch-burst",
    "100000",
    "--max-watches-per-caller",
    "1000000",
];

/// The address a broker the harness starts serves gRPC on.
pub const BROKER_IP: [u8; 4] = [127, 0, 9, 1];

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// crd-broker.
    Broker,
    /// The bare tonic server.
    Bare,
    /// The flagd daemon, relaying through its own sync server.
    Flagd,
    /// Stock flagd-proxy.
    FlagdProxy,
}

/// A running server.
pub struct Target {
    /// Which.
    pub kind: Kind,
    /// Its gRPC address.
    pub grpc: SocketAddr,
    /// Its admin address (the broker only).
    pub admin: Option<SocketAddr>,
    child: Child,
    stdin: Option<ChildStdin>,
}

/// Whether process `pid` holds a TCP socket listening on `port` (IPv4 or IPv6).
fn listens(pid: u32, port: u16) -> bool {
    stats::sockets(pid, "0A", stats::End::Local, port) > 0
}

/// Where a broker's log (its stderr) goes.
pub enum Log {
    /// The harness's own stderr.
    Inherit,
    /// Nowhere.
    Null,
    /// A file.
    File(std::fs::File),
}

impl Log {
    fn stdio(&self) -> anyhow::Result<Stdio> {
        Ok(match self {
            Log::Inherit => Stdio::inherit(),
            Log::Null => Stdio::null(),
            Log::File(file) => file.try_clone()?.into(),
        })
    }
}

/// Times a broker is started on new ports when its own were taken before it bound them.
const LAUNCHES: usize = 3;

impl Target {
    /// Starts the broker binary against the API server behind `kubeconfig`, with `args` added
    /// to its command line.
    pub async fn broker(
        bin: &Path,
        kubeconfig: &Path,
        linger: Duration,
        args: &[&str],
    ) -> anyhow::Result<Target> {
        Self::broker_logging(bin, kubeconfig, linger, args, Log::Inherit).await
    }

    /// As [`Target::broker`], its log (warnings and errors) to `log`.
    pub async fn broker_logging(
        bin: &Path,
        kubeconfig: &Path,
        linger: Duration,
        args: &[&str],
        log: Log,
    ) -> anyhow::Result<Target> {
        let linger = humantime::format_duration(linger).to_string();
        let mut all = vec!["--linger", &linger];
        all.extend(["--max-connection-age", "0", "--readiness-interval", "1s"]);
        // A few loopback addresses stand for thousands of sidecars here: no per-caller limit is
        // meant to bind.
        all.extend(UNLIMITED);
        all.extend(args);
        // Newer limits as environment variables, which an older build ignores.
        let env = [("CRD_BROKER_MAX_SETS_PER_CALLER", "1000000")];
        Self::launch(bin, kubeconfig, &all, &env, log).await
    }

    /// Starts the broker binary against the API server behind `kubeconfig` with `args` and `env`
    /// alone: every other setting at its default.
    pub async fn launch(
        bin: &Path,
        kubeconfig: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        log: Log,
    ) -> anyhow::Result<Target> {
        let mut attempt = 1;
        loop {
            // gRPC on an address no client connects from (a connection from the broker's own
            // address is no pod's, for `--identity peer-pod`); the admin port on 127.0.0.1,
            // where the harness reads `/debug` as the pod's own.
            let grpc: SocketAddr = (BROKER_IP, control_plane::free_port()).into();
            let admin: SocketAddr = ([127, 0, 0, 1], control_plane::free_port()).into();
            match Self::launch_once(bin, kubeconfig, grpc, admin, args, env, log.stdio()?).await {
                Err(e) if attempt < LAUNCHES => {
                    eprintln!("the broker did not start ({e:#}); again on other ports");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// A replica of a headless Service: the broker binary with gRPC on `grpc` (replicas share
    /// a port on addresses of their own), its admin port on the same address, with `args`.
    pub async fn replica(
        bin: &Path,
        kubeconfig: &Path,
        grpc: SocketAddr,
        args: &[&str],
    ) -> anyhow::Result<Target> {
        let admin = SocketAddr::new(grpc.ip(), control_plane::free_port());
        Self::launch_once(
            bin,
            kubeconfig,
            grpc,
            admin,
            args,
            &[],
            Log::Inherit.stdio()?,
        )
        .await
    }

    async fn launch_once(
        bin: &Path,
        kubeconfig: &Path,
        grpc: SocketAddr,
        admin: SocketAddr,
        args: &[&str],
        env: &[(&str, &str)],
        log: Stdio,
    ) -> anyhow::Result<Target> {
        let child = Command::new(bin)
            .args([
                "serve",
                "--grpc-addr",
                &grpc.to_string(),
                "--admin-addr",
                &admin.to_string(),
            ])
            .args(args)
            .envs(env.iter().copied())
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut target = Target {
            kind: Kind::Broker,
            grpc,
            admin: Some(admin),
            child,
            stdin: None,
        };
        target.wait_listening(grpc).await?;
        Ok(target)
    }

    /// Starts the bare tonic server (this binary, `bare` subcommand).
    pub async fn bare() -> anyhow::Result<Target> {
        let grpc: SocketAddr = ([127, 0, 0, 1], control_plane::free_port()).into();
        let mut child = Command::new(std::env::current_exe()?)
            .args(["bare", "--addr", &grpc.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .leashed()
            .spawn()?;
        let stdin = child.stdin.take();
        let mut target = Target {
            kind: Kind::Bare,
            grpc,
            admin: None,
            child,
            stdin,
        };
        target.wait_listening(grpc).await?;
        Ok(target)
    }

    /// Starts the flagd daemon (`scripts/peers`) with `sources` (its `--sources` JSON) against
    /// the API server behind `kubeconfig`, its log to `log`; its sync server is the gRPC address.
    pub async fn flagd(
        kubeconfig: &Path,
        sources: &serde_json::Value,
        log: Log,
    ) -> anyhow::Result<Target> {
        let bin = tokio::task::spawn_blocking(|| control_plane::peer("flagd")).await?;
        let [port, management, ofrep, sync] = [
            control_plane::free_port(),
            control_plane::free_port(),
            control_plane::free_port(),
            control_plane::free_port(),
        ];
        let mut command = Command::new(&bin);
        command
            .args(["start", "--sources", &sources.to_string()])
            .args([
                "--port",
                &port.to_string(),
                "--management-port",
                &management.to_string(),
            ])
            .args([
                "--ofrep-port",
                &ofrep.to_string(),
                "--sync-port",
                &sync.to_string(),
            ])
            .args(["--log-format", "json"]);
        Self::peer(Kind::Flagd, command, kubeconfig, log, sync).await
    }

    /// Stock flagd-proxy (built from its sources by `scripts/peers`), reading FeatureFlags
    /// through `kubeconfig`, logging to `log`.
    pub async fn flagd_proxy(kubeconfig: &Path, log: Log) -> anyhow::Result<Target> {
        let bin = tokio::task::spawn_blocking(|| control_plane::peer("flagd-proxy")).await?;
        let [port, management] = [control_plane::free_port(), control_plane::free_port()];
        let mut command = Command::new(&bin);
        command
            .args(["start", "--port", &port.to_string()])
            .args(["--management-port", &management.to_string()]);
        Self::peer(Kind::FlagdProxy, command, kubeconfig, log, port).await
    }

    /// A peer of kind `kind` as `command` starts it, with only `KUBECONFIG` and a `HOME` (the
    /// kubeconfig's folder: flagd looks for a config file there, and finds none), its output
    /// to `log`, once it listens for gRPC on loopback port `grpc`.
    async fn peer(
        kind: Kind,
        mut command: Command,
        kubeconfig: &Path,
        log: Log,
        grpc: u16,
    ) -> anyhow::Result<Target> {
        let child = command
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .env("HOME", kubeconfig.parent().unwrap_or(Path::new("/")))
            .stdin(Stdio::null())
            .stdout(log.stdio()?)
            .stderr(log.stdio()?)
            .kill_on_drop(true)
            .leashed()
            .spawn()
            .with_context(|| format!("starting {kind:?}"))?;
        let grpc: SocketAddr = ([127, 0, 0, 1], grpc).into();
        let mut target = Target {
            kind,
            grpc,
            admin: None,
            child,
            stdin: None,
        };
        target.wait_listening(grpc).await?;
        Ok(target)
    }

    /// Waits until this process listens on `addr`. A free port is only free when it was
    /// looked at: another process (a second harness, in parallel tests) may take it first, and
    /// then whoever answers there is not this server. So the listening socket must be one of
    /// this process's own; a server that exits first (its port taken) is an error.
    async fn wait_listening(&mut self, addr: SocketAddr) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !listens(self.pid(), addr.port()) {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!(
                    "{:?} exited ({status}) before it listened on {addr}",
                    self.kind
                );
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{:?} did not listen on {addr}",
                self.kind
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// How it ended, if it has.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its resident memory.
    pub fn rss(&self) -> u64 {
        stats::rss(self.pid())
    }

    /// Its CPU time so far.
    pub fn cpu(&self) -> Duration {
        stats::cpu(self.pid())
    }

    /// Sends a message for the bare server to broadcast to `name`'s streams.
    pub async fn feed(&mut self, name: &str, json: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("only the bare server is fed")?;
        stdin
            .write_all(format!("{name}\t{json}\n").as_bytes())
            .await?;
        stdin.flush().await?;
        Ok(())
    }

    /// The sum of every series of a counter or histogram component (e.g.
    /// `crd_broker_fanout_seconds_sum`) on the broker's `/metrics`; `None` for the bare server or
    /// an unreachable admin port.
    pub async fn metric_sum(&self, name: &str) -> Option<f64> {
        use tokio::io::AsyncReadExt;
        let mut tcp = tokio::net::TcpStream::connect(self.admin?).await.ok()?;
        tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: broker\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await.ok()?;
        Some(
            text.lines()
                .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
        )
    }

    /// Stops it.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The broker binary: `--broker-bin`, else `crd-broker` next to this binary.
pub fn broker_bin(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("this binary has a directory")?
            .join("crd-broker"),
    };
    anyhow::ensure!(
        path.exists(),
        "no broker binary at {} (build it with `cargo build --release -p crd-broker`, or pass --broker-bin)",
        path.display()
    );
    Ok(path)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_port_counts_as_listened_on_only_by_the_process_that_holds_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(super::listens(std::process::id(), port));
        // Another process (the first, init) does not hold it, whoever answers there.
        assert!(!super::listens(1, port));
        drop(listener);
        assert!(!super::listens(std::process::id(), port));
    }
}
