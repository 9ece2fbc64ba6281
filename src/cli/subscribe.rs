//! `crd-broker subscribe`: a client for people and scripts that prints one line per event.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde_json::{Value, json};
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::SubscribeArgs;
use crate::pb;
use crate::pb::subscribe_response::Event;
use crate::selector::{Selector, Target};

/// How events are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns, like `kubectl get -w`.
    Text,
    /// One JSON object per line: `event`, `selector`, `resourceVersion`, `uid`, `object` (for
    /// FAILED: `event`, `selector`, `code`, `message`).
    Json,
    /// The same records as YAML documents, each after a `---` line.
    Yaml,
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

/// One response as a record: `event`, `selector`, `resourceVersion`, `uid`, `object` (for
/// FAILED: `event`, `selector`, `code`, `message`).
fn record(response: &pb::SubscribeResponse) -> Value {
    let event = event_name(response.event());
    if response.event() == Event::Failed {
        return json!({
            "event": event,
            "selector": response.selector,
            "code": format!("{:?}", tonic::Code::from_i32(response.error_code)),
            "message": response.error_message,
        });
    }
    let object: Value = serde_json::from_slice(&response.object).unwrap_or(Value::Null);
    json!({
        "event": event,
        "selector": response.selector,
        "resourceVersion": response.resource_version,
        "uid": response.uid,
        "object": object,
    })
}

/// One response as output: a line of text or JSON, or a YAML document.
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
        Output::Json => record(response).to_string(),
        Output::Yaml => {
            let yaml = serde_saphyr::to_string(&record(response)).unwrap_or_default();
            format!("---\n{}", yaml.trim_end())
        }
    }
}

/// A channel to the broker that `args.server` names: plain or TLS over TCP (with the
/// client certificate of `--cert`/`--key` for mTLS), or a unix socket.
pub async fn channel(args: &SubscribeArgs) -> anyhow::Result<Channel> {
    let server = &args.server;
    let tls_flags = args.ca.is_some() || args.cert.is_some();
    if let Some(path) = server
        .strip_prefix("unix://")
        .or_else(|| server.strip_prefix("unix:"))
    {
        anyhow::ensure!(
            !tls_flags,
            "--ca, --cert and --key are for TLS over TCP; a unix socket ({server}) is plain"
        );
        let path = PathBuf::from(path);
        let connector = tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        });
        return Endpoint::from_static("http://localhost")
            .connect_with_connector(connector)
            .await
            .with_context(|| format!("connecting to {server}"));
    }
    let mut endpoint = Endpoint::from_shared(server.clone())
        .with_context(|| format!("--server {server} is not a URL"))?;
    if server.starts_with("https://") {
        let read = |path: &PathBuf| {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))
        };
        let mut tls = ClientTlsConfig::new();
        tls = match &args.ca {
            Some(ca) => tls.ca_certificate(Certificate::from_pem(read(ca)?)),
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
            tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        endpoint = endpoint.tls_config(tls).context("configuring TLS")?;
    } else {
        anyhow::ensure!(
            !tls_flags,
            "--ca, --cert and --key need an https:// --server (not {server})"
        );
    }
    endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {server}"))
}

/// The `authorization` header `--token-file` gives, read once.
fn bearer(path: &std::path::Path) -> anyhow::Result<MetadataValue<tonic::metadata::Ascii>> {
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    let token = token.trim();
    anyhow::ensure!(
        !token.is_empty(),
        "the token file {} is empty",
        path.display()
    );
    format!("Bearer {token}").parse().map_err(|_| {
        anyhow::anyhow!(
            "the token file {} holds characters a header cannot carry",
            path.display()
        )
    })
}

/// Subscribes as `args` say and prints every event until the stream ends.
pub async fn run(args: SubscribeArgs) -> anyhow::Result<()> {
    let channel = channel(&args).await?;
    let token = args.token_file.as_deref().map(bearer).transpose()?;
    let mut client = pb::broker_client::BrokerClient::with_interceptor(
        channel,
        move |mut request: tonic::Request<()>| {
            if let Some(token) = &token {
                request
                    .metadata_mut()
                    .insert("authorization", token.clone());
            }
            Ok(request)
        },
    );
    let mut stream = client
        .subscribe(request_for(&args.selectors))
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut stdout = std::io::stdout().lock();
    if args.output == Output::Text {
        writeln!(stdout, "{:<9} {:<60} RESOURCE-VERSION", "EVENT", "SELECTOR")?;
    }
    loop {
        match stream.message().await {
            Ok(Some(response)) => {
                writeln!(stdout, "{}", format(&response, args.output))?;
                stdout.flush()?;
            }
            Ok(None) => return Ok(()),
            Err(s) => anyhow::bail!("{:?}: {}", s.code(), s.message()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_is_asked_for_with_no_name_and_its_label_selector_decoded() {
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
    }
}
