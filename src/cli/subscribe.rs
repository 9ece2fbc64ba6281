//! `crd-broker subscribe`: a client for people and scripts that prints one line per event.

use std::io::Write;

use anyhow::Context;
use serde_json::{Value, json};

use crate::pb;
use crate::pb::subscribe_response::Event;
use crate::selector::{KindRef, Selector};

/// How events are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns, like `kubectl get -w`.
    Text,
    /// One JSON object per line: `event`, `selector`, `resourceVersion`, `uid`, `object` (for
    /// FAILED: `event`, `selector`, `code`, `message`).
    Json,
}

/// What `subscribe` is asked to follow: one resource, or a set
/// (`featureflags.core.openfeature.dev/<ns>?labelSelector=app%3Dcheckout`, `*` for every
/// namespace).
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// One resource.
    One(Selector),
    /// A kind's objects in a namespace (none for a cluster-scoped kind) that a label selector
    /// selects.
    Set {
        /// The kind.
        kind: KindRef,
        /// The namespace.
        namespace: Option<String>,
        /// The label selector, as given (checked by the broker).
        labels: String,
    },
}

impl std::str::FromStr for Target {
    type Err = String;

    fn from_str(input: &str) -> Result<Self, String> {
        let Some((path, query)) = input.split_once('?') else {
            return input.parse().map(Target::One).map_err(|e| e.to_string());
        };
        let labels = match query.split_once('=') {
            Some(("labelSelector", value)) => percent_decoded(value)?,
            _ => {
                return Err(format!(
                    "{input:?}: a set is written KIND/NAMESPACE?labelSelector=SELECTOR (URL-encoded)"
                ));
            }
        };
        let (kind, namespace) = match path.split_once('/') {
            Some((kind, ns)) => (kind, Some(ns)),
            None => (path, None),
        };
        let kind = KindRef::parse_in(kind, input).map_err(|e| e.to_string())?;
        // The namespace is checked as a selector's would be; `*` is every namespace.
        let checked = namespace.filter(|ns| *ns != crate::source::ALL_NAMESPACES);
        Selector::new(kind.clone(), checked, "set", input).map_err(|e| e.to_string())?;
        Ok(Target::Set {
            kind,
            namespace: namespace.map(str::to_string),
            labels,
        })
    }
}

/// `%XX` escapes (and `+` for a space) decoded.
fn percent_decoded(text: &str) -> Result<String, String> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex: Vec<u8> = bytes.by_ref().take(2).collect();
                let value = std::str::from_utf8(&hex)
                    .ok()
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("{text:?}: a '%' must be followed by two hex digits"))?;
                out.push(value);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).map_err(|_| format!("{text:?} does not decode to UTF-8"))
}

fn reference(s: &Selector) -> pb::ResourceRef {
    pb::ResourceRef {
        group: s.kind.group.clone(),
        version: s.kind.version.clone().unwrap_or_default(),
        resource: s.kind.resource.clone(),
        namespace: s.namespace.clone().unwrap_or_default(),
        name: s.name.clone(),
        label_selector: String::new(),
    }
}

/// The request for these selectors.
pub fn request(selectors: &[Selector]) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: selectors.iter().map(reference).collect(),
    }
}

/// The request for these targets.
pub fn request_for(targets: &[Target]) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        resources: targets
            .iter()
            .map(|t| match t {
                Target::One(s) => reference(s),
                Target::Set {
                    kind,
                    namespace,
                    labels,
                } => pb::ResourceRef {
                    group: kind.group.clone(),
                    version: kind.version.clone().unwrap_or_default(),
                    resource: kind.resource.clone(),
                    namespace: namespace.clone().unwrap_or_default(),
                    name: String::new(),
                    label_selector: labels.clone(),
                },
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
        Event::Added => "ADDED",
        Event::Synced => "SYNCED",
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

/// Subscribes to `targets` on `server` and prints every event until the stream ends.
pub async fn run(server: String, output: Output, targets: Vec<Target>) -> anyhow::Result<()> {
    let mut client = pb::broker_client::BrokerClient::connect(server.clone())
        .await
        .with_context(|| format!("connecting to {server}"))?;
    let mut stream = client
        .subscribe(request_for(&targets))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_resources_or_sets_with_an_encoded_label_selector() {
        let one: Target = "featureflags.core.openfeature.dev/default/demo"
            .parse()
            .unwrap();
        assert!(matches!(one, Target::One(_)));
        let set: Target =
            "ff.v1beta1.core.openfeature.dev/default?labelSelector=app%3Dcheckout%2Ctier+in+(web)"
                .parse()
                .unwrap();
        let request = request_for(&[set]);
        let r = &request.resources[0];
        assert_eq!(
            (
                r.resource.as_str(),
                r.version.as_str(),
                r.namespace.as_str(),
                r.name.as_str()
            ),
            ("ff", "v1beta1", "default", "")
        );
        assert_eq!(r.label_selector, "app=checkout,tier in (web)");
        for (bad, needle) in [
            ("ff.core.openfeature.dev/default?app=x", "labelSelector="),
            (
                "ff.core.openfeature.dev/default?labelSelector=a%3",
                "two hex digits",
            ),
            (
                "ff.core.openfeature.dev/Bad_NS?labelSelector=a",
                "namespace",
            ),
        ] {
            let e = bad.parse::<Target>().unwrap_err();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
