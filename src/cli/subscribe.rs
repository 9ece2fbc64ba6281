//! `crd-broker subscribe`: a client for people and scripts that prints one line per event.

use std::io::Write;

use anyhow::Context;
use serde_json::{Value, json};

use crate::pb;
use crate::pb::subscribe_response::Event;
use crate::selector::Selector;

/// How events are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns, like `kubectl get -w`.
    Text,
    /// One JSON object per line: `event`, `selector`, `resourceVersion`, `uid`, `object` (for
    /// FAILED: `event`, `selector`, `code`, `message`).
    Json,
}

/// The request for these selectors.
pub fn request(selectors: &[Selector]) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: selectors
            .iter()
            .map(|s| pb::ResourceRef {
                group: s.kind.group.clone(),
                version: s.kind.version.clone().unwrap_or_default(),
                resource: s.kind.resource.clone(),
                namespace: s.namespace.clone().unwrap_or_default(),
                name: s.name.clone(),
            })
            .collect(),
    }
}

fn event_name(e: Event) -> &'static str {
    match e {
        Event::Snapshot => "SNAPSHOT",
        Event::Updated => "UPDATED",
        Event::Deleted => "DELETED",
        Event::Absent => "ABSENT",
        Event::Failed => "FAILED",
        Event::Unspecified => "UNSPECIFIED",
    }
}

/// One response as a line of output.
pub fn format(response: &pb::SubscribeResponse, output: Output) -> String {
    let event = event_name(response.event());
    match output {
        Output::Text if response.event() == Event::Failed => format!(
            "{event:<9} {:<60} {:?}: {}",
            response.selector,
            tonic::Code::from_i32(response.error_code),
            response.error_message
        ),
        Output::Text => format!(
            "{event:<9} {:<60} {}",
            response.selector,
            if response.resource_version.is_empty() {
                "-"
            } else {
                &response.resource_version
            }
        ),
        Output::Json if response.event() == Event::Failed => json!({
            "event": event,
            "selector": response.selector,
            "code": format!("{:?}", tonic::Code::from_i32(response.error_code)),
            "message": response.error_message,
        })
        .to_string(),
        Output::Json => {
            let object: Value = serde_json::from_slice(&response.object).unwrap_or(Value::Null);
            json!({
                "event": event,
                "selector": response.selector,
                "resourceVersion": response.resource_version,
                "uid": response.uid,
                "object": object,
            })
            .to_string()
        }
    }
}

/// Subscribes to `selectors` on `server` and prints every event until the stream ends.
pub async fn run(server: String, output: Output, selectors: Vec<Selector>) -> anyhow::Result<()> {
    let mut client = pb::broker_client::BrokerClient::connect(server.clone())
        .await
        .with_context(|| format!("connecting to {server}"))?;
    let mut stream = client
        .subscribe(request(&selectors))
        .await
        .map_err(|s| anyhow::anyhow!("{}: {}", s.code(), s.message()))?
        .into_inner();
    let mut stdout = std::io::stdout().lock();
    if output == Output::Text {
        writeln!(stdout, "{:<9} {:<60} RESOURCE-VERSION", "EVENT", "SELECTOR")?;
    }
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                writeln!(stdout, "{}", format(&response, output))?;
                stdout.flush()?;
            }
            Ok(None) => return Ok(()),
            Err(s) => anyhow::bail!("{}: {}", s.code(), s.message()),
        }
    }
}
