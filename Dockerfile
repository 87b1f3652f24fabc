# idemgate: a multi-stage build. The builder compiles the release binary; the runtime is a
# slim Debian with CA certificates, running as an unprivileged user. Mount the config at
# /etc/idemgate/gateway.yaml (or pass another path) and give secrets by environment
# (`${DATABASE_URL}`, `${IDEMGATE_ADMIN_TOKEN}` in the YAML).
#
#   docker build -t idemgate .
#   docker run --rm -p 8080:8080 -v $PWD/config/gateway.example.yaml:/etc/idemgate/gateway.yaml:ro \
#     -e DATABASE_URL=postgres://... -e IDEMGATE_ADMIN_TOKEN=... idemgate
#
# `cargo test` replays the build stage without Docker (tests/it/dockerfile.rs): it copies
# what each COPY names from the context and runs each RUN verbatim, so keep the stage to
# WORKDIR, ENV, COPY from the context and plain RUN lines (no cache mounts, no heredocs).

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src

# Dependencies first, in a layer of their own that only a change to Cargo.toml or Cargo.lock
# rebuilds: the manifest, the lock file, a stand-in for every target the manifest names
# (cargo refuses a manifest whose library, binary or benches are missing), then every
# dependency downloaded and compiled.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs \
 && echo 'fn main() {}' > benches/micro.rs \
 && echo 'fn main() {}' > benches/load.rs \
 && cargo fetch --locked \
 && cargo build --release --locked --bin idemgate

# Then what the binary is compiled from, named one by one (the benches stay stand-ins: the
# binary does not use them, so editing one does not rebuild the image). COPY keeps the files'
# times, which may be older than the stand-ins' build: touch the crate roots so cargo
# rebuilds the crate instead of shipping the stand-in.
COPY src ./src
COPY migrations ./migrations
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin idemgate \
 && strip target/release/idemgate

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /var/lib/idemgate --create-home idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
USER 10001:10001
WORKDIR /var/lib/idemgate
EXPOSE 8080 9090
# Healthy while /readyz answers 200 (the store has answered and been migrated since start; a
# later store outage stays 200, "degraded"; docs/operations.md, Probes), asked by
# the binary itself (the image has no curl) on admin.listen of the config CMD serves. A
# config without `admin`, or mounted elsewhere, needs its own HEALTHCHECK (or none:
# `docker run --no-healthcheck`, `healthcheck: { disable: true }` in compose).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["/usr/local/bin/idemgate", "health", "--config", "/etc/idemgate/gateway.yaml", "--timeout", "2s"]
# SIGTERM: /readyz fails, serving goes on for server.drain_delay, then in-flight requests get
# server.shutdown_grace (`docker stop -t` must cover both); SIGHUP reloads the config.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve", "--config", "/etc/idemgate/gateway.yaml"]
