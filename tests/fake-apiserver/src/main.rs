//! `fake-apiserver`: the fake Kubernetes API server as a process, for the load harness and for
//! people. Prints its URL on the first line of stdout; knobs are under `/fake/` (see the crate
//! README).

#![warn(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use fake_apiserver::{FakeApiServer, Options};

/// A fake Kubernetes API server for custom resources.
#[derive(Debug, Parser)]
#[command(name = "fake-apiserver", version)]
struct Args {
    /// Address to listen on (loopback; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// A CustomResourceDefinition YAML file to install at start (repeatable; a file may hold
    /// several documents separated by `---`).
    #[arg(long = "crd", value_name = "FILE.yaml")]
    crds: Vec<PathBuf>,
    /// Write a kubeconfig pointing at this server to this file (no auth in the clear; with
    /// `--tls`, its CA and a token user).
    #[arg(long, value_name = "FILE")]
    kubeconfig_out: Option<PathBuf>,
    /// How often watches that allow bookmarks get one.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    bookmark_interval: Duration,
    /// How many events of history to keep before resuming older watches gets 410.
    #[arg(long, default_value_t = 10_000)]
    history_limit: usize,
    /// Serve TLS with a CA of its own, HTTP/2 and HTTP/1.1 by ALPN, at most 100 concurrent
    /// streams per connection, as the kube-apiserver does. The kubeconfig written then trusts
    /// the CA and carries a token user.
    #[arg(long)]
    tls: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let mut options = Options {
        listen: args.listen,
        bookmark_every: args.bookmark_interval,
        history_limit: args.history_limit,
        tls: args.tls,
        ..Options::default()
    };
    for path in &args.crds {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading CRD file {}", path.display()))?;
        let docs: Vec<serde_json::Value> =
            serde_saphyr::from_multiple_with_options(&text, fake_apiserver::yaml_options())
                .with_context(|| format!("parsing YAML in {}", path.display()))?;
        for value in docs {
            if !value.is_null() {
                options.crds.push(value);
            }
        }
    }
    let server = FakeApiServer::start_with(options)
        .await
        .context("starting the fake API server")?;
    if let Some(path) = &args.kubeconfig_out {
        server
            .write_kubeconfig(path)
            .with_context(|| format!("writing kubeconfig to {}", path.display()))?;
    }
    println!("{}", server.url());
    tracing::info!(url = %server.url(), "fake-apiserver listening; knobs under /fake/");
    shutdown_signal().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
