# syntax=docker/dockerfile:1
# The batchlease images, for machines with a container engine:
#   docker build --target operator -t ghcr.io/batchlease/batchlease-operator:0.1.0 .
#   docker build --target demo-worker -t ghcr.io/batchlease/batchlease-demo-worker:0.1.0 .
#   docker build --target run -t ghcr.io/batchlease/batchlease-run:0.1.0 .
# hack/image.sh builds the same images (a Debian bookworm C runtime plus one
# binary, user 65532) as OCI archives without a daemon; that is what the
# tests run (e2e/tests/image.rs). Build args VERSION and REVISION fill the
# OCI labels.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p batchlease-operator -p batchlease-demo-worker -p batchlease-run \
 && install -D -m 0755 target/release/batchlease-operator /out/batchlease-operator \
 && install -D -m 0755 target/release/batchlease-demo-worker /out/batchlease-demo-worker \
 && install -D -m 0755 target/release/batchlease-run /out/batchlease-run

# distroless/cc: libc6, libgcc-s1, base-files, netbase, tzdata and CA
# certificates from Debian bookworm; no shell; user nonroot = 65532.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.version=$VERSION \
      org.opencontainers.image.revision=$REVISION \
      org.opencontainers.image.source=https://github.com/batchlease/batchlease \
      org.opencontainers.image.url=https://github.com/batchlease/batchlease \
      org.opencontainers.image.licenses=Apache-2.0 \
      org.opencontainers.image.vendor=batchlease \
      org.opencontainers.image.base.name=gcr.io/distroless/cc-debian12:nonroot
USER 65532:65532

FROM runtime AS demo-worker
LABEL org.opencontainers.image.title=batchlease-demo-worker \
      org.opencontainers.image.description="batchlease demo worker: runs the sample BatchTasks with fenced PostgreSQL commits"
COPY --from=build /out/batchlease-demo-worker /usr/local/bin/batchlease-demo-worker
ENTRYPOINT ["/usr/local/bin/batchlease-demo-worker"]

# No shell: copy /usr/local/bin/batchlease-run into the image that has
# your command (docs/batchlease-run.md).
FROM runtime AS run
LABEL org.opencontainers.image.title=batchlease-run \
      org.opencontainers.image.description="batchlease-run: runs any command as a batchlease worker, one process group per attempt under the kill switch"
COPY --from=build /out/batchlease-run /usr/local/bin/batchlease-run
ENTRYPOINT ["/usr/local/bin/batchlease-run"]

# Last, so a plain `docker build .` builds the operator.
FROM runtime AS operator
LABEL org.opencontainers.image.title=batchlease-operator \
      org.opencontainers.image.description="batchlease operator: runs BatchTasks with fenced, renewable TaskLeases"
COPY --from=build /out/batchlease-operator /usr/local/bin/batchlease-operator
ENTRYPOINT ["/usr/local/bin/batchlease-operator"]
