//! crd-broker shares one Kubernetes watch per custom resource among many gRPC subscribers.
//!
//! # Architecture
//!
//! A client opens a server stream naming the resources it needs. The [`grpc`] layer validates
//! the request ([`selector`] is the one place selectors are parsed and checked), resolves each
//! resource through the [`registry`], and streams each resource's state: at once, then on every
//! change. The registry keeps one entry per resource, created by the first subscriber and removed
//! a `--linger` after the last one leaves; each entry's task drives a [`source`] watch and
//! publishes the latest state through a `tokio::sync::watch` channel, whose receiver count is the
//! reference count. Sources are the Kubernetes API (kube-rs `watch_object`) and a directory of
//! manifests. [`config`] holds the command line and wires the pieces together; it is the only
//! module that knows them all.
//!
//! Dependencies point one way: grpc → registry → source, with the registry generic over the
//! [`source::Source`] trait.

#![warn(clippy::unwrap_used)]

pub mod admin;
pub mod config;
pub mod grpc;
pub mod health;
pub mod on_wake;
pub mod registry;
pub mod selector;
pub mod server;
pub mod shutdown;
pub mod source;
pub mod subscribe;
pub mod telemetry;
pub mod tls;

/// Protobuf types, the generated clients (prost) and servers (pre-encoded streams).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("crdbroker.v1");

    include!(concat!(env!("OUT_DIR"), "/crdbroker.v1.Broker.rs"));

    /// `flagd.sync.v1`: the flagd sync protocol.
    pub mod flagd {
        tonic::include_proto!("flagd.sync.v1");

        include!(concat!(
            env!("OUT_DIR"),
            "/flagd.sync.v1.FlagSyncService.rs"
        ));
    }

    /// `sync.v1`: the legacy flagd sync protocol.
    pub mod legacy {
        tonic::include_proto!("sync.v1");

        include!(concat!(env!("OUT_DIR"), "/sync.v1.FlagSyncService.rs"));
    }

    /// The encoded file descriptor set of `proto/`, for gRPC reflection.
    pub const DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("crdbroker_descriptor");
}
