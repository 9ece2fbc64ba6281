//! `crd-broker subscribe`: a client for people and scripts that prints one line per event.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::{Value, json};
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::pb;
use crate::pb::subscribe_response::Event;
use crate::selector::{Selector, Target};

/// `crd-broker subscribe`.
#[derive(Debug, Args)]
pub struct SubscribeArgs {
    /// The broker's gRPC address: `http://host:port`, `https://host:port` (TLS), or
    /// `unix:///path` for a unix socket.
    #[arg(
        long,
        env = "CRD_BROKER_SERVER",
        default_value = "http://127.0.0.1:8015"
    )]
    pub server: String,
    /// The CA certificate (PEM) that signed the broker's; without it an `https://` broker is
    /// verified against the system's roots.
    #[arg(long, env = "CRD_BROKER_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// A client certificate (PEM) for mTLS, with --key.
    #[arg(long, env = "CRD_BROKER_CERT", value_name = "FILE", requires = "key")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM), with --cert.
    #[arg(long, env = "CRD_BROKER_KEY", value_name = "FILE", requires = "cert")]
    pub key: Option<PathBuf>,
    /// A file whose contents are sent as `authorization: Bearer <token>` (e.g. a projected
    /// service account token, for `--identity token`).
    #[arg(long, env = "CRD_BROKER_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// How to print events.
    #[arg(long, short = 'o', env = "CRD_BROKER_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// When the stream ends (the broker drains, restarts or is lost), subscribe again with the
    /// version of each resource last printed: what did not change since comes back as CURRENT,
    /// with no object. Retries with backoff (0.1 s doubling to 5 s, jittered) until a status
    /// that is not worth retrying. `--resume=false`: exit when the stream ends.
    #[arg(
        long,
        env = "CRD_BROKER_RESUME",
        default_value_t = true,
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        default_missing_value = "true",
        value_name = "BOOL"
    )]
    pub resume: bool,
    /// Resources, as <resource>[.<version>].<group>/<namespace>/<name>
    /// (e.g. featureflags.core.openfeature.dev/default/demo), or one set, as
    /// <resource>[.<version>].<group>/<namespace>?labelSelector=<URL-encoded selector>
    /// (e.g. featureflags.core.openfeature.dev/default?labelSelector=app%3Dcheckout; the
    /// namespace * is every namespace).
    #[arg(required = true, value_name = "SELECTOR")]
    pub selectors: Vec<Target>,
}

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
        ..Default::default()
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
                Target::Set(set) => pb::ResourceRef {
                    group: set.kind.group.clone(),
                    version: set.kind.version.clone().unwrap_or_default(),
                    resource: set.kind.resource.clone(),
                    namespace: set.namespace.clone().unwrap_or_default(),
                    label_selector: set.labels.to_string(),
                    ..Default::default()
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
        Event::Current => "CURRENT",
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
    if response.event() == Event::Synced {
        return json!({
            "event": event,
            "selector": response.selector,
            "setVersion": response.set_version,
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
        Output::Text => {
            let version = match response.event() {
                Event::Synced => &response.set_version,
                _ => &response.resource_version,
            };
            let version = if version.is_empty() { "-" } else { version };
            format!("{event:<9} {:<60} {version}", response.selector)
        }
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

/// What a client holds, to resume with: the uid and resourceVersion of the last state of each
/// resource it was sent, or of each member of a set once its SYNCED came.
#[derive(Debug, Default)]
pub struct Holdings {
    /// By index in the request.
    ones: std::collections::BTreeMap<u32, (String, String)>,
    /// A set's members by selector.
    members: std::collections::BTreeMap<String, (String, String)>,
    /// Whether the set's SYNCED came.
    synced: bool,
    /// Whether this stream has sent nothing yet.
    fresh: bool,
}

impl Holdings {
    /// A new stream starts: what it sends first says whether what was held still stands.
    pub fn start(&mut self) {
        self.fresh = true;
    }

    /// Takes in one response.
    pub fn take(&mut self, r: &pb::SubscribeResponse) {
        let held = || (r.uid.clone(), r.resource_version.clone());
        // A set resumed at another version starts again with its members: those held and not
        // sent again are gone.
        if std::mem::take(&mut self.fresh) && r.event() != Event::Synced {
            self.members.clear();
            self.synced = false;
        }
        match r.event() {
            Event::Snapshot | Event::Updated | Event::Current => {
                self.ones.insert(r.index, held());
                self.members.insert(r.selector.clone(), held());
            }
            Event::Added => {
                self.members.insert(r.selector.clone(), held());
            }
            Event::Deleted | Event::Absent | Event::Failed => {
                self.ones.remove(&r.index);
                self.members.remove(&r.selector);
            }
            Event::Synced => self.synced = true,
            Event::Unspecified => {}
        }
    }

    /// The request for `targets` with what is held.
    pub fn request(&self, targets: &[Target]) -> pb::SubscribeRequest {
        let mut request = request_for(targets);
        for (i, r) in request.resources.iter_mut().enumerate() {
            if r.name.is_empty() {
                if self.synced {
                    r.resource_version = crate::grpc::set_version(
                        self.members
                            .iter()
                            .map(|(s, (uid, rv))| (s.as_str(), uid.as_str(), rv.as_str())),
                    );
                }
            } else if let Some((uid, rv)) = self.ones.get(&(i as u32)) {
                r.uid = uid.clone();
                r.resource_version = rv.clone();
            }
        }
        request
    }
}

/// How long `subscribe --resume` waits before its first try to resume, and at most.
const RESUME_FIRST: std::time::Duration = std::time::Duration::from_millis(100);
const RESUME_MOST: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether a stream that ended with `code` is resumed: the broker dropped it or could not
/// take it now, as against a request it refuses.
fn resumable(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        Ok | Unavailable
            | Unknown
            | Cancelled
            | DeadlineExceeded
            | Aborted
            | ResourceExhausted
            | Internal
    )
}

/// How long the broker said to wait before trying again (`grpc-retry-pushback-ms`), at most a
/// minute.
fn pushback(status: &tonic::Status) -> Option<std::time::Duration> {
    let millis: u64 = status
        .metadata()
        .get(crate::access::RETRY_PUSHBACK)?
        .to_str()
        .ok()?
        .parse()
        .ok()?;
    Some(std::time::Duration::from_millis(millis.min(60_000)))
}

/// Subscribes as `args` say and prints every event; with `--resume`, resumes when the stream
/// ends with the versions it was sent, until a status that is not worth retrying.
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
    let mut stdout = std::io::stdout().lock();
    // The header once the broker has taken the request: a refusal prints nothing on stdout.
    let mut header = args.output == Output::Text;
    let mut holdings = Holdings::default();
    let mut wait = RESUME_FIRST;
    loop {
        let request = holdings.request(&args.selectors);
        let ended = match client.subscribe(request).await {
            Ok(response) => {
                let mut stream = response.into_inner();
                if std::mem::take(&mut header) {
                    writeln!(stdout, "{:<9} {:<60} RESOURCE-VERSION", "EVENT", "SELECTOR")?;
                }
                holdings.start();
                loop {
                    match stream.message().await {
                        Ok(Some(response)) => {
                            wait = RESUME_FIRST;
                            holdings.take(&response);
                            writeln!(stdout, "{}", format(&response, args.output))?;
                            stdout.flush()?;
                        }
                        Ok(None) => break tonic::Status::ok(""),
                        Err(status) => break status,
                    }
                }
            }
            Err(status) => status,
        };
        if !args.resume || !resumable(ended.code()) {
            if ended.code() == tonic::Code::Ok {
                return Ok(());
            }
            anyhow::bail!("{:?}: {}", ended.code(), ended.message());
        }
        // Equal jitter: clients dropped together do not come back together; or when the
        // broker said, refusing a new stream for its pace (it spreads those hints itself).
        let jittered =
            pushback(&ended).unwrap_or_else(|| wait.mul_f64(0.5 + fastrand::f64() * 0.5));
        eprintln!(
            "the stream ended ({:?}: {}); resuming in {jittered:?}",
            ended.code(),
            ended.message()
        );
        tokio::time::sleep(jittered).await;
        wait = (wait * 2).min(RESUME_MOST);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_for_the_brokers_pace_is_retried_when_it_says_and_no_later_than_a_minute() {
        let mut status = tonic::Status::resource_exhausted("paced");
        assert_eq!(pushback(&status), None);
        for (header, wait) in [
            ("250", Some(250)),
            ("9999999", Some(60_000)),
            ("soon", None),
        ] {
            status
                .metadata_mut()
                .insert(crate::access::RETRY_PUSHBACK, header.parse().unwrap());
            assert_eq!(
                pushback(&status),
                wait.map(std::time::Duration::from_millis)
            );
        }
    }

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
        // Decoded, parsed, and sent as the broker writes it (a one-value `in` is `=`).
        assert_eq!(r.label_selector, "app=checkout,tier=web");
    }
}
