# idemgate: a multi-stage build. The builder compiles the release binary; the runtime is a
# slim Debian with CA certificates, running as an unprivileged user. Mount the config at
# /etc/idemgate/gateway.yaml (or pass another path) and give secrets by environment
# (`${DATABASE_URL}`, `${IDEMGATE_ADMIN_TOKEN}` in the YAML).
#
#   docker build -t idemgate .
#   docker run --rm -p 8080:8080 -v $PWD/config/gateway.example.yaml:/etc/idemgate/gateway.yaml:ro \
#     -e DATABASE_URL=postgres://... -e IDEMGATE_ADMIN_TOKEN=... idemgate

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not refetch them.
COPY Cargo.toml Cargo.lock ./
RUN cargo fetch --locked
COPY . .
RUN cargo build --release --locked --bin idemgate \
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
# SIGTERM drains in-flight requests for server.shutdown_grace; SIGHUP reloads the config.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve", "--config", "/etc/idemgate/gateway.yaml"]
