//! Generates the protobuf types and clients with prost (through protox, so no protoc is
//! needed), and the Broker server with a pass-through codec for pre-encoded responses
//! (see `src/grpc/frame.rs`).

use std::path::PathBuf;

use prost::Message;
use tonic_build::manual::{Builder, Method, Service};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptors = protox::compile(["crdbroker/v1/broker.proto"], ["proto"])?;
    std::fs::write(
        out.join("crdbroker_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_server(false)
        .bytes(".")
        .compile_fds(descriptors)?;
    let broker = Service::builder()
        .name("Broker")
        .package("crdbroker.v1")
        .method(
            Method::builder()
                .name("subscribe")
                .route_name("Subscribe")
                .input_type("crate::pb::SubscribeRequest")
                .output_type("crate::grpc::frame::Frame")
                .codec_path("crate::grpc::frame::FrameCodec")
                .server_streaming()
                .build(),
        )
        .build();
    Builder::new().build_client(false).compile(&[broker]);
    Ok(())
}
