//! The Service the xDS server serves the replicas of (`--xds-service`), and the EndpointSlices
//! that list them.

use std::str::FromStr;

use crate::selector::{KindRef, Set, is_dns_label};

/// The Service whose replicas the xDS server serves: `NAME.NAMESPACE:PORT`, or
/// `NAME.NAMESPACE:PORT/PORT-NAME` where the Service's port differs from its `targetPort` (an
/// EndpointSlice lists the target port, under the Service port's name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsService {
    /// The Service's name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// The port clients dial.
    pub port: u16,
    /// The Service port's name, if given.
    pub port_name: Option<String>,
}

impl XdsService {
    /// The Cluster's name, and its load assignment's: `NAME.NAMESPACE:PORT`.
    pub fn cluster(&self) -> String {
        self.to_string()
    }

    /// Whether a client's `xds:///` target (the Listener it asks for) names this Service: its
    /// name, `NAME.NAMESPACE`, `NAME.NAMESPACE.svc` or `NAME.NAMESPACE.svc.DOMAIN`, with its
    /// port.
    pub fn named_by(&self, listener: &str) -> bool {
        let Some((host, port)) = listener.rsplit_once(':') else {
            return false;
        };
        if port.parse::<u16>().ok() != Some(self.port) {
            return false;
        }
        let qualified = format!("{}.{}", self.name, self.namespace);
        host == self.name
            || host == qualified
            || host == format!("{qualified}.svc")
            || host
                .strip_prefix(&format!("{qualified}.svc."))
                .is_some_and(|domain| !domain.is_empty())
    }

    /// The set of the Service's EndpointSlices.
    pub(super) fn endpoint_slices(&self) -> Set {
        Set {
            kind: KindRef {
                resource: "endpointslices".into(),
                version: Some("v1".into()),
                group: "discovery.k8s.io".into(),
            },
            namespace: Some(self.namespace.clone()),
            labels: format!("kubernetes.io/service-name={}", self.name)
                .parse()
                .unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for XdsService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}:{}", self.name, self.namespace, self.port)
    }
}

/// Why `--xds-service` is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--xds-service {0:?}: {1} (expected NAME.NAMESPACE:PORT or NAME.NAMESPACE:PORT/PORT-NAME, e.g. crd-broker.flags:8013/grpc)"
)]
pub struct XdsServiceError(String, &'static str);

impl FromStr for XdsService {
    type Err = XdsServiceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let shown: String = text.chars().take(100).collect();
        let err = |why| XdsServiceError(shown.clone(), why);
        let (host, port) = text.rsplit_once(':').ok_or_else(|| err("no port"))?;
        let (port, port_name) = match port.split_once('/') {
            Some((port, name)) if is_dns_label(name) => (port, Some(name.to_string())),
            Some(_) => return Err(err("the port's name is not a DNS label")),
            None => (port, None),
        };
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| err("the port is not a number from 1 to 65535"))?;
        let (name, namespace) = host.split_once('.').ok_or_else(|| err("no namespace"))?;
        if !is_dns_label(name) {
            return Err(err("the name is not a DNS label"));
        }
        if !is_dns_label(namespace) {
            return Err(err("the namespace is not a DNS label"));
        }
        Ok(XdsService {
            name: name.into(),
            namespace: namespace.into(),
            port,
            port_name,
        })
    }
}
