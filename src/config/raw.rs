//! The raw configuration: exactly what the YAML may say, as serde deserializes it.
//!
//! Every struct denies unknown fields, and everything that has a default is optional here:
//! defaults are applied, and values checked, by `validate.rs`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{InFlight, LogFormat, Mode, OnStoreError, OnUnknownOutcome};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) listen: Option<String>,
    pub(super) admin: Option<RawAdmin>,
    #[serde(default)]
    pub(super) server: RawServer,
    pub(super) store: RawStore,
    pub(super) upstreams: BTreeMap<String, RawUpstream>,
    pub(super) routes: Vec<RawRoute>,
    pub(super) replay_cache: Option<RawReplayCache>,
    pub(super) log: Option<RawLog>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) format: Option<LogFormat>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReplayCache {
    pub(super) max_bytes: Option<RawSize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) listen: String,
    pub(super) token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) max_connections: Option<usize>,
    pub(super) max_header_bytes: Option<RawSize>,
    pub(super) header_read_timeout: Option<String>,
    pub(super) body_read_timeout: Option<String>,
    pub(super) shutdown_grace: Option<String>,
    pub(super) drain_delay: Option<String>,
    pub(super) max_buffered_bytes: Option<RawSize>,
    pub(super) worker_threads: Option<usize>,
    pub(super) tls: Option<RawServerTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerTls {
    pub(super) cert: String,
    pub(super) key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCaOnly {
    pub(super) ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) postgres: Option<RawPostgres>,
    pub(super) sqlite: Option<RawSqlite>,
    pub(super) gc: Option<RawGc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGc {
    pub(super) interval: Option<String>,
    pub(super) batch_size: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPostgres {
    pub(super) url: String,
    pub(super) listen_url: Option<String>,
    pub(super) pooler: Option<String>,
    pub(super) pool_size: Option<usize>,
    pub(super) acquire_timeout: Option<String>,
    pub(super) connect_timeout: Option<String>,
    pub(super) statement_timeout: Option<String>,
    pub(super) tls: Option<RawPgTls>,
    pub(super) allow_async_commit: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSqlite {
    pub(super) path: String,
    pub(super) busy_timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPgTls {
    pub(super) mode: String,
    pub(super) ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) url: String,
    pub(super) connect_timeout: Option<String>,
    pub(super) timeout: Option<String>,
    pub(super) max_in_flight: Option<usize>,
    pub(super) tls: Option<RawCaOnly>,
    pub(super) http2: Option<bool>,
    pub(super) preserve_host: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: String,
    #[serde(rename = "match")]
    pub(super) matcher: RawMatch,
    pub(super) upstream: String,
    pub(super) idempotency: Option<RawIdempotency>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMatch {
    pub(super) path: Option<String>,
    pub(super) path_prefix: Option<String>,
    pub(super) methods: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIdempotency {
    pub(super) mode: Option<Mode>,
    pub(super) key: Option<Vec<RawKeySource>>,
    pub(super) scope: Option<RawScope>,
    pub(super) required: Option<bool>,
    pub(super) methods: Option<Vec<String>>,
    pub(super) fingerprint: Option<RawFingerprint>,
    pub(super) ttl: Option<String>,
    pub(super) lease: Option<String>,
    pub(super) in_flight: Option<InFlight>,
    pub(super) wait_timeout: Option<String>,
    pub(super) retry_statuses: Option<Vec<RawStatus>>,
    pub(super) on_unknown_outcome: Option<OnUnknownOutcome>,
    pub(super) on_store_error: Option<OnStoreError>,
    pub(super) max_request_body: Option<RawSize>,
    pub(super) max_stored_response: Option<RawSize>,
    pub(super) replay_headers: Option<Vec<String>>,
    pub(super) forward_key_header: Option<String>,
    pub(super) serialize: Option<RawSerialize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSerialize {
    pub(super) max_in_flight: Option<u32>,
    pub(super) wait_timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(super) enum RawKeySource {
    Header(String),
    Json(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(super) enum RawScope {
    Header(String),
    Json(String),
    Authorization(bool),
    Fixed(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFingerprint {
    #[serde(default)]
    pub(super) headers: Vec<String>,
    #[serde(default)]
    pub(super) json_canonical: bool,
    #[serde(default)]
    pub(super) json_ignore: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawStatus {
    Code(u16),
    Range(String),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawSize {
    Bytes(u64),
    Text(String),
}
