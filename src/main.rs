//! The `crd-broker` binary.

#![warn(clippy::unwrap_used)]

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    crd_broker::cli::Cli::parse().run().await
}
