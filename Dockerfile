# syntax=docker/dockerfile:1
# A small non-root image of crd-broker, for amd64 and arm64:
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse --short=12 HEAD) -t crd-broker .
#   docker run crd-broker serve --help
#
# The build stage runs on the builder's own platform and cross-compiles for the target one, so
# no emulation is needed. Cargo's registry and target directory are BuildKit cache mounts: a
# change to src/ rebuilds the broker's own crate, not its dependencies.
FROM --platform=$BUILDPLATFORM rust:1.95-slim-bookworm AS build
ARG TARGETARCH
ARG REVISION=unknown
WORKDIR /src
# The target triple, and a C cross compiler for ring when the target is not the builder's.
RUN set -eu; \
    case "$TARGETARCH" in \
      amd64) triple=x86_64-unknown-linux-gnu; gnu=x86-64-linux-gnu ;; \
      arm64) triple=aarch64-unknown-linux-gnu; gnu=aarch64-linux-gnu ;; \
      *) echo "unsupported architecture $TARGETARCH (amd64 or arm64)" >&2; exit 1 ;; \
    esac; \
    echo "$triple" > /triple; \
    if [ "$TARGETARCH" != "$(dpkg --print-architecture)" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends "gcc-$gnu" "libc6-dev-$TARGETARCH-cross"; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    rustup target add "$triple"
ENV CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER=x86_64-linux-gnu-gcc \
    CC_x86_64_unknown_linux_gnu=x86_64-linux-gnu-gcc
# The workspace: the broker and the members cargo needs to read.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
COPY benches benches
COPY examples examples
COPY tests/fake-apiserver tests/fake-apiserver
COPY tests/control-plane tests/control-plane
COPY loadtest loadtest
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=crd-broker-target-$TARGETARCH \
    set -eu; \
    triple=$(cat /triple); \
    CRD_BROKER_COMMIT="$REVISION" cargo build --release --locked -p crd-broker --target "$triple"; \
    cp "target/$triple/release/crd-broker" /crd-broker

FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=""
LABEL org.opencontainers.image.title="crd-broker" \
      org.opencontainers.image.description="Shares one Kubernetes watch per custom resource among many gRPC subscribers; a drop-in for flagd-proxy" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.created="$CREATED" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"
COPY --from=build /crd-broker /usr/local/bin/crd-broker
USER 65532:65532
# gRPC (native API and flagd sync), admin (/livez, /readyz, /metrics, /debug/watches, health).
EXPOSE 8015 8016
ENTRYPOINT ["/usr/local/bin/crd-broker"]
# As the OpenFeature Operator starts flagd-proxy; the Helm chart passes `serve …` instead.
CMD ["start"]
