# A small non-root image of crd-broker: build with the Rust toolchain, run on distroless.
#   docker build -t crd-broker .
#   docker run crd-broker serve --help
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# The workspace: the broker and the members cargo needs to read.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY benches benches
COPY examples examples
COPY tests/fake-apiserver tests/fake-apiserver
COPY loadtest loadtest
RUN cargo build --release --locked -p crd-broker \
    && strip target/release/crd-broker

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/crd-broker /usr/local/bin/crd-broker
USER 65532:65532
# gRPC (native API and flagd sync), admin (/livez, /readyz, /metrics, /debug/watches).
EXPOSE 8015 8016
ENTRYPOINT ["/usr/local/bin/crd-broker"]
# As the OpenFeature Operator starts flagd-proxy; the Helm chart passes `serve …` instead.
CMD ["start"]
