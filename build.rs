//! Generates the protobuf types and clients with prost (through protox, so no protoc is
//! needed), and the servers whose streams write pre-encoded responses through a pass-through
//! codec (see `src/grpc/frame.rs` and ADR 0007). The broker serves those streams through
//! `src/grpc/wire.rs` instead, which does not copy them; the generated servers serve the unary
//! methods, and the load harness's bare server.

use std::path::PathBuf;

use prost::Message;
use tonic_build::manual::{Builder, Method, Service};

const PROTOS: &[&str] = &[
    "crdbroker/v1/broker.proto",
    "flagd/sync/v1/sync.proto",
    "sync/v1/sync_service.proto",
];

fn method(name: &str, route: &str, input: &str, output: &str, codec: &str) -> Method {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(input)
        .output_type(output)
        .codec_path(codec)
        .build()
}

fn streaming(name: &str, route: &str, input: &str, output: &str) -> Method {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(input)
        .output_type(output)
        .codec_path("crate::grpc::frame::FrameCodec")
        .server_streaming()
        .build()
}

/// The commit built, for `crd_broker_build_info`: `CRD_BROKER_COMMIT` if set (an image build
/// has no `.git`), else git's, else `unknown`.
fn commit() -> String {
    println!("cargo:rerun-if-env-changed=CRD_BROKER_COMMIT");
    // Only paths that exist: cargo reruns a build script whose watched path is missing on
    // every build, and a source tree without `.git` (an archive, a copy) would rebuild the
    // crate each time.
    for path in [".git/HEAD", ".git/refs/heads"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Ok(commit) = std::env::var("CRD_BROKER_COMMIT") {
        return commit;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rustc-env=CRD_BROKER_COMMIT={}", commit());
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    std::fs::write(
        out.join("crdbroker_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_server(false)
        .bytes(".crdbroker")
        .compile_fds(descriptors)?;

    let prost = "tonic_prost::ProstCodec";
    let broker = Service::builder()
        .name("Broker")
        .package("crdbroker.v1")
        .method(streaming(
            "subscribe",
            "Subscribe",
            "crate::pb::SubscribeRequest",
            "crate::grpc::frame::Frame",
        ))
        .build();
    let flagd = Service::builder()
        .name("FlagSyncService")
        .package("flagd.sync.v1")
        .method(streaming(
            "sync_flags",
            "SyncFlags",
            "crate::pb::flagd::SyncFlagsRequest",
            "crate::grpc::frame::Encoded",
        ))
        .method(method(
            "fetch_all_flags",
            "FetchAllFlags",
            "crate::pb::flagd::FetchAllFlagsRequest",
            "crate::pb::flagd::FetchAllFlagsResponse",
            prost,
        ))
        .method(method(
            "get_metadata",
            "GetMetadata",
            "crate::pb::flagd::GetMetadataRequest",
            "crate::pb::flagd::GetMetadataResponse",
            prost,
        ))
        .build();
    let legacy = Service::builder()
        .name("FlagSyncService")
        .package("sync.v1")
        .method(streaming(
            "sync_flags",
            "SyncFlags",
            "crate::pb::legacy::SyncFlagsRequest",
            "crate::grpc::frame::Encoded",
        ))
        .method(method(
            "fetch_all_flags",
            "FetchAllFlags",
            "crate::pb::legacy::FetchAllFlagsRequest",
            "crate::pb::legacy::FetchAllFlagsResponse",
            prost,
        ))
        .build();
    Builder::new()
        .build_client(false)
        .compile(&[broker, flagd, legacy]);
    Ok(())
}
