//! crd-broker: shares one Kubernetes watch per custom resource among many gRPC subscribers.

#![warn(clippy::unwrap_used)]
