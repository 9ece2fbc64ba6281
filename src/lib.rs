//! crd-broker shares one Kubernetes watch per custom resource among many gRPC subscribers.
//!
//! # Architecture
//!
//! A folder is a layer; dependencies point one way, from the top of this list to the bottom,
//! and inside a folder no file imports one that imports it back (`tests/layers.rs` checks both):
//!
//! - [`cli`] — the command line: parses flags, picks the source and listeners, starts a
//!   [`broker`], which assembles the layers below (the only module besides the command line that
//!   knows them all).
//! - [`ops`] — readiness and gRPC health, the admin endpoints, signals. It reads the registry.
//! - [`grpc`] — every API on one shelf: the native service ([`grpc::native`]), flagd's sync
//!   services ([`grpc::flagd`]) and the broker as its own xDS name resolver ([`grpc::xds`]:
//!   state-of-the-world ADS serving the ready replicas of its own Service from that Service's
//!   EndpointSlices, a set in the registry), beside what they share: admission (the one way into
//!   the registry), delivery (drain, deadlines, per-subscriber metrics), the one mapping of
//!   errors to `Status`, and the one stream shape every subscriber's stream has (a watch, what
//!   ends it early, and the protocol's view of each state). A request is validated ([`selector`]
//!   is the one place selectors are parsed), resolved through the registry, and each resource's
//!   state streamed: at once, then on every change.
//! - [`access`] — who the caller is and what it may read: identity sources (peer pod, token,
//!   certificate, mesh headers), the namespace policy, per-caller limits, and who may read the
//!   admin port's guarded endpoints (one token reviewer for both ports). Its per-connection
//!   layer puts the caller into each request's extensions; the services ask it to admit requests.
//! - [`transport`] — the HTTP/2 server: listeners, TLS, per-connection drain and maximum age,
//!   keepalive, the request size limit, the gRPC server metrics. It knows no service: it makes
//!   each connection's service through a function it is given (and labels calls by the method
//!   table the broker gave telemetry), and hands every request its [`conn::Peer`] and
//!   [`conn::ConnDrain`] (a leaf module both sides read) through the request's extensions.
//! - [`registry`] — the heart: one entry per resource, created by its first subscriber and
//!   removed a `--linger` after the last leaves; each entry's task drives a [`source`] watch
//!   and publishes the latest state through a `tokio::sync::watch` channel, whose receiver count
//!   is the reference count. It knows no gRPC and no callers.
//! - [`source`] — the [`source::Source`] trait the registry is generic over, implemented by the
//!   Kubernetes API (kube-rs `watch_object`) and a directory of manifests; a scripted source
//!   fed by its caller stands in for both in unit tests and benchmarks.
//! - [`selector`] — the core words: a resource ([`selector::Selector`]), a set
//!   ([`selector::Set`]) and what a client writes to follow either ([`selector::Target`]),
//!   parsed, displayed and validated in one place for the command line and the services alike;
//!   label selectors ([`selector::labels`]).
//! - [`rights`] — what the broker's own identity may do in the cluster (access reviews of
//!   itself), which the Kubernetes source and the access layer both ask for readiness.
//! - [`cache`] — a bounded single-flight cache, for discovery, pod lookups and token reviews.
//! - [`sync`] — a mutex's guard through a holder's panic, and a future polled only after it
//!   woke: leaf pieces every layer may use.
//! - [`telemetry`] — metric families (each defined and registered in its layer's file: watches,
//!   subscriptions, the gRPC server, access, Kubernetes API requests, xDS, the process), logs and
//!   traces. Every layer records into it and it imports none of them: what it needs to know at
//!   start (the kinds served, the methods the broker serves, the source's error reasons) is
//!   handed in by the [`broker`] that assembles the layers.

#![warn(clippy::unwrap_used)]

pub mod access;
pub mod broker;
pub mod cache;
pub mod cli;
pub mod conn;
pub mod grpc;
pub mod ops;
pub mod registry;
pub mod rights;
pub mod selector;
pub mod source;
pub mod sync;
pub mod telemetry;
pub mod transport;
pub mod yaml;

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
