//! The identity sources a broker can be told to try (`--identity`), and the parsing of what the
//! ones that need no API call read: SPIFFE IDs in client certificates (`mtls`) and the headers a
//! local mesh proxy adds (`mesh`).

use std::fmt;
use std::str::FromStr;

use crate::selector::{is_dns_label, is_dns_subdomain, quote};

/// One way of telling who a caller is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentitySource {
    /// The connection's peer IP is a Running pod's `status.podIP` (looked up in the API).
    PeerPod,
    /// `authorization: Bearer <token>`, verified by a TokenReview.
    Token,
    /// The client certificate's URI SAN `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`.
    Mtls,
    /// A local mesh proxy's `x-forwarded-client-cert` (Istio) or `l5d-client-id` (Linkerd), on
    /// connections from the proxy's addresses only.
    Mesh,
}

/// The service mesh whose proxy `mesh` identity believes (`--mesh`): each proxy sets its own
/// header and passes the other mesh's through untouched, so only one can be believed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Mesh {
    /// Istio: `x-forwarded-client-cert`, set by the sidecar, which removes a client's own on a
    /// plaintext connection; it delivers from 127.0.0.6 (`::6` over IPv6).
    Istio,
    /// Linkerd: `l5d-client-id`, set by its proxy, which delivers from the pod's own IP to
    /// itself since 2.11 (from 127.0.0.1 or `::1` before).
    Linkerd,
}

impl Mesh {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mesh::Istio => "istio",
            Mesh::Linkerd => "linkerd",
        }
    }

    /// The header its proxy vouches for the caller in.
    pub fn header(self) -> &'static str {
        match self {
            Mesh::Istio => "x-forwarded-client-cert",
            Mesh::Linkerd => "l5d-client-id",
        }
    }

    /// The other mesh, whose header this mesh's proxy passes through as the client sent it.
    pub fn other(self) -> Mesh {
        match self {
            Mesh::Istio => Mesh::Linkerd,
            Mesh::Linkerd => Mesh::Istio,
        }
    }

    /// The addresses its proxy delivers from, the default `--mesh-proxy-addr` (Linkerd's since
    /// 2.11 is the pod's own IP, which needs no naming: a connection from the broker's own
    /// address is taken as its proxy's with `--mesh linkerd`).
    pub fn proxy_addresses(self) -> &'static [&'static str] {
        match self {
            Mesh::Istio => &["127.0.0.6", "::6"],
            Mesh::Linkerd => &["127.0.0.1", "::1"],
        }
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl IdentitySource {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            IdentitySource::PeerPod => "peer-pod",
            IdentitySource::Token => "token",
            IdentitySource::Mtls => "mtls",
            IdentitySource::Mesh => "mesh",
        }
    }

    /// Whether it asks the Kubernetes API (and so cannot work on the manifests source).
    pub fn needs_api(self) -> bool {
        matches!(self, IdentitySource::PeerPod | IdentitySource::Token)
    }
}

impl From<IdentitySource> for crate::telemetry::IdentifiedBy {
    fn from(source: IdentitySource) -> Self {
        use crate::telemetry::IdentifiedBy as By;
        match source {
            IdentitySource::PeerPod => By::PeerPod,
            IdentitySource::Token => By::Token,
            IdentitySource::Mtls => By::Mtls,
            IdentitySource::Mesh => By::Mesh,
        }
    }
}

impl fmt::Display for IdentitySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `--identity`: the sources to try, in order; empty for `none`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityList(pub Vec<IdentitySource>);

impl FromStr for IdentityList {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let names: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() || names == ["none"] {
            return Ok(IdentityList::default());
        }
        let mut sources = Vec::new();
        for name in names {
            let source = match name {
                "peer-pod" => IdentitySource::PeerPod,
                "token" => IdentitySource::Token,
                "mtls" => IdentitySource::Mtls,
                "mesh" => IdentitySource::Mesh,
                "none" => return Err("`none` cannot be combined with other sources".into()),
                other => {
                    return Err(format!(
                        "unknown identity source {}: expected peer-pod, token, mtls, mesh, or none",
                        quote(other)
                    ));
                }
            };
            if sources.contains(&source) {
                return Err(format!("{source} is listed twice"));
            }
            sources.push(source);
        }
        Ok(IdentityList(sources))
    }
}

impl fmt::Display for IdentityList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.0.iter().map(|s| s.name()).collect();
        f.write_str(&names.join(","))
    }
}

/// A Kubernetes service account named by a SPIFFE ID or a mesh identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccount {
    /// The namespace.
    pub namespace: String,
    /// The service account.
    pub name: String,
}

/// Reads `spiffe://<trust-domain>/ns/<ns>/sa/<sa>` (the form Istio, Linkerd's SPIFFE mode and
/// SPIRE's Kubernetes workload registrar issue). With `trust_domain`, only that trust domain.
pub fn spiffe_id(uri: &str, trust_domain: Option<&str>) -> Result<ServiceAccount, String> {
    let rest = uri
        .strip_prefix("spiffe://")
        .ok_or_else(|| format!("{} is not a SPIFFE ID", quote(uri)))?;
    let (domain, path) = rest
        .split_once('/')
        .ok_or_else(|| format!("{} has no path", quote(uri)))?;
    if let Some(want) = trust_domain
        && domain != want
    {
        return Err(format!(
            "{} is in trust domain {}, not {want} (--trust-domain)",
            quote(uri),
            quote(domain)
        ));
    }
    match path.split('/').collect::<Vec<_>>().as_slice() {
        ["ns", ns, "sa", sa] if is_dns_label(ns) && is_dns_subdomain(sa) => Ok(ServiceAccount {
            namespace: ns.to_string(),
            name: sa.to_string(),
        }),
        _ => Err(format!(
            "{} is not of the form spiffe://<trust-domain>/ns/<namespace>/sa/<serviceaccount>",
            quote(uri)
        )),
    }
}

/// The identity Istio's proxy vouches for in `x-forwarded-client-cert`: the `URI` of the last
/// element (the one the local proxy appended; earlier ones came from further away, or from the
/// client itself), with that element's `Hash` (of the client's certificate) if it has one.
pub fn xfcc(
    header: &str,
    trust_domain: Option<&str>,
) -> Result<(ServiceAccount, Option<String>), String> {
    let last = split_outside_quotes(header, ',')
        .into_iter()
        .rfind(|e| !e.trim().is_empty())
        .ok_or("x-forwarded-client-cert is empty")?;
    let pairs: Vec<(&str, &str)> = split_outside_quotes(last, ';')
        .into_iter()
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim(), v.trim().trim_matches('"')))
        .collect();
    let value = |key: &str| {
        pairs
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| *v)
    };
    let uri = value("uri").ok_or("the last x-forwarded-client-cert element has no URI")?;
    let hash = value("hash").map(|h| h.chars().take(16).collect());
    Ok((spiffe_id(uri, trust_domain)?, hash))
}

/// The identity Linkerd's proxy puts in `l5d-client-id`:
/// `<sa>.<ns>.serviceaccount.identity.<control-plane-ns>.<trust-domain>`. With `trust_domain`,
/// only that trust domain.
pub fn l5d_client_id(header: &str, trust_domain: Option<&str>) -> Result<ServiceAccount, String> {
    let labels: Vec<&str> = header.trim().split('.').collect();
    match labels.as_slice() {
        [sa, ns, "serviceaccount", "identity", _, domain @ ..]
            if is_dns_label(ns) && is_dns_label(sa) =>
        {
            let domain = domain.join(".");
            if let Some(want) = trust_domain
                && domain != want
            {
                return Err(format!(
                    "l5d-client-id {} is of trust domain {}, not {} (--trust-domain)",
                    quote(header),
                    quote(&domain),
                    quote(want)
                ));
            }
            Ok(ServiceAccount {
                namespace: ns.to_string(),
                name: sa.to_string(),
            })
        }
        _ => Err(format!(
            "l5d-client-id {} is not <sa>.<ns>.serviceaccount.identity.…",
            quote(header)
        )),
    }
}

/// `text` split at `sep` where it is not inside double quotes (XFCC quotes values that hold
/// `,`, `;` or `=`).
fn split_outside_quotes(text: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut quoted = false;
    let mut escaped = false;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                parts.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// The SPIFFE ID in a client certificate's URI SANs (the leaf of a verified chain).
pub fn certificate_spiffe_id(
    der: &[u8],
    trust_domain: Option<&str>,
) -> Result<ServiceAccount, String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| format!("the client certificate does not parse: {e}"))?;
    let sans = cert
        .subject_alternative_name()
        .map_err(|e| format!("the client certificate's SANs do not parse: {e}"))?;
    let uris: Vec<&str> = sans
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some(*u),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let spiffe: Vec<&str> = uris
        .iter()
        .copied()
        .filter(|u| u.starts_with("spiffe://"))
        .collect();
    match spiffe.as_slice() {
        [one] => spiffe_id(one, trust_domain),
        [] => Err("the client certificate has no spiffe:// URI SAN".into()),
        _ => Err("the client certificate has more than one spiffe:// URI SAN".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sa(ns: &str, name: &str) -> ServiceAccount {
        ServiceAccount {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn identity_lists_parse_in_order_and_refuse_nonsense() {
        assert_eq!(
            "peer-pod,token".parse::<IdentityList>().unwrap().0,
            vec![IdentitySource::PeerPod, IdentitySource::Token]
        );
        assert!("none".parse::<IdentityList>().unwrap().0.is_empty());
        assert!("".parse::<IdentityList>().unwrap().0.is_empty());
        for bad in ["none,token", "token,token", "pod", "peer-pod,x"] {
            assert!(bad.parse::<IdentityList>().is_err(), "{bad}");
        }
        let list: IdentityList = "mesh, mtls".parse().unwrap();
        assert_eq!(list.to_string(), "mesh,mtls");
    }

    #[test]
    fn spiffe_ids_name_a_service_account() {
        assert_eq!(
            spiffe_id("spiffe://cluster.local/ns/team-a/sa/web", None).unwrap(),
            sa("team-a", "web")
        );
        assert!(spiffe_id("spiffe://cluster.local/ns/team-a/sa/web", Some("other.org")).is_err());
        for bad in [
            "https://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local",
            "spiffe://cluster.local/ns/A/sa/b",
            "spiffe://cluster.local/ns/a/sa/b/extra",
            "spiffe://cluster.local/sa/b/ns/a",
        ] {
            assert!(spiffe_id(bad, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn xfcc_trusts_the_last_element_only() {
        let header = r#"By=spiffe://cluster.local/ns/broker/sa/crd-broker;Hash=abc;Subject="CN=x,O=y";URI=spiffe://cluster.local/ns/team-a/sa/web"#;
        assert_eq!(
            xfcc(header, None).unwrap(),
            (sa("team-a", "web"), Some("abc".to_string()))
        );
        // A client that sends its own element gets it followed by the proxy's.
        let forged = format!("URI=spiffe://cluster.local/ns/kube-system/sa/admin;Hash=x,{header}");
        assert_eq!(xfcc(&forged, None).unwrap().0, sa("team-a", "web"));
        assert_eq!(xfcc(&forged, None).unwrap().1.as_deref(), Some("abc"));
        assert!(xfcc("By=x;Hash=y", None).is_err());
        assert!(xfcc("", None).is_err());
    }

    #[test]
    fn linkerd_client_ids_name_a_service_account_of_the_trust_domain() {
        let id = "web.team-a.serviceaccount.identity.linkerd.cluster.local";
        assert_eq!(l5d_client_id(id, None).unwrap(), sa("team-a", "web"));
        assert_eq!(
            l5d_client_id(id, Some("cluster.local")).unwrap(),
            sa("team-a", "web")
        );
        let other = l5d_client_id(id, Some("prod.example")).unwrap_err();
        assert!(other.contains("not \"prod.example\""), "{other}");
        assert!(l5d_client_id("web.team-a.cluster.local", None).is_err());
    }

    proptest! {
        #[test]
        fn header_parsing_never_panics(text in "\\PC{0,200}") {
            let _ = xfcc(&text, None);
            let _ = l5d_client_id(&text, Some("cluster.local"));
            let _ = spiffe_id(&text, Some("cluster.local"));
        }

        #[test]
        fn certificate_parsing_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
            let _ = certificate_spiffe_id(&bytes, None);
        }
    }
}
