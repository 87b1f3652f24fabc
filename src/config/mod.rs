//! Configuration: the YAML file of docs/contract.md §4, in two stages.
//!
//! 1. The text is parsed by serde-saphyr into a generic tree, `${VAR}` references in string
//!    values are replaced from the environment, and the tree is deserialized into the `Raw*`
//!    types (`deny_unknown_fields`, everything optional that has a default) while the YAML
//!    path of every node is tracked, so an error reads `routes[1].idempotency.ttl: ...`.
//! 2. Validation turns the raw types into [`Config`]: real `Duration`s and byte sizes,
//!    parsed methods and header names, compiled routes, resolved upstreams, and cross-field
//!    checks (a lease must outlive its upstream's timeout).
//!
//! Which file owns what:
//!
//! - `mod.rs` (this file): loading ([`Config::load`], [`Config::from_yaml`], `${VAR}`
//!   interpolation), [`Config::warnings`] and [`Config::route_for`].
//! - `model.rs`: the typed, validated configuration ([`Config`] and the types it is made of),
//!   the [`defaults`], [`ConfigError`].
//! - `raw.rs`: the `Raw*` types, the shapes serde deserializes the YAML into; every field is
//!   documented there with its YAML spelling and default.
//! - `validate.rs`: raw to typed, with the defaults applied and every error naming its YAML
//!   path; `shadow.rs` (a route that another hides) and `pg_url.rs` (what a database URL
//!   says about TLS) are its parts. `tests.rs`: the unit tests of the whole.
//! - `units.rs`: durations and sizes, parsed ([`parse_duration`], [`parse_size`]) and
//!   formatted back the way the config writes them ([`fmt_duration`], [`fmt_size`]).
//!
//! Invariants of a [`Config`]: every route names an existing upstream; every keyed route's
//! `lease` is longer than that upstream's `timeout` (plus the store's time to record an
//! answer) and shorter than its `ttl`; route names
//! are unique; TLS files named by the config were readable when it was validated.
//!
//! Invariants of the code: every error names the YAML path of the value it concerns
//! (`store.postgres.pool_size`, `routes[0].idempotency.lease`), and the tests assert the
//! exact messages; the database URLs are never printed, neither in an error nor by `Debug`
//! (see [`PostgresConfig`]); a value is printed as the config spells it (the enums'
//! `as_str`, [`fmt_duration`], [`fmt_size`]), and every such spelling is one the config
//! accepts.

mod fields;
mod model;
mod pg_url;
mod raw;
mod routes;
mod shadow;
mod telemetry;
#[cfg(test)]
mod tests;
mod units;
mod validate;

use std::path::Path;

use http::Method;
use serde_json::Value;

pub use model::*;
pub use units::{fmt_duration, fmt_size, parse_duration, parse_size};

impl Config {
    /// Settings that are valid but likely wrong, for `check` and `serve` to print at load:
    /// a `shutdown_grace` shorter than a keyed upstream's `timeout` plus the time to record
    /// its answer cuts such forwards at every rolling deploy, and their keys are forwarded
    /// again by the next attempt (or held).
    pub fn warnings(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .server
            .retired
            .iter()
            .map(|field| format!("{field} is no longer read; remove it"))
            .collect();
        out.extend(shadow::partial_warnings(&self.routes));
        let record = self.store.record_bound();
        let mut seen = std::collections::BTreeSet::new();
        for route in &self.routes {
            if route.idempotency.is_none() || !seen.insert(route.upstream.as_str()) {
                continue;
            }
            let Some(up) = self.upstreams.get(&route.upstream) else {
                continue;
            };
            let needed = up.timeout + record;
            if self.server.shutdown_grace < needed {
                out.push(format!(
                    "server.shutdown_grace ({}) is shorter than upstreams.{}.timeout plus the \
                     time to record an answer ({}): a shutdown can cut a keyed forward, and its \
                     key is then forwarded again (or held) by the next attempt; raise \
                     shutdown_grace to at least {}",
                    fmt_duration(self.server.shutdown_grace),
                    up.name,
                    fmt_duration(needed),
                    fmt_duration(needed),
                ));
            }
        }
        if let StoreConfig::Postgres(pg) = &self.store
            && pg.pooler == Some(Pooler::Transaction)
            && pg.listen_url == pg.url
        {
            out.push(
                "store.postgres.pooler is 'transaction' but store.postgres.listen_url is not \
                 set: the wake-up listener goes through the pooler, which does not deliver \
                 notifications, so waiters will poll; point listen_url at PostgreSQL itself"
                    .into(),
            );
        }
        out
    }

    /// The first route in file order that matches (docs/contract.md §2.1).
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Route> {
        self.route_index_for(method, path).map(|i| &self.routes[i])
    }

    /// The index in `routes` of the route [`route_for`](Self::route_for) finds.
    pub fn route_index_for(&self, method: &Method, path: &str) -> Option<usize> {
        self.routes.iter().position(|r| r.matches(method, path))
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_yaml(&text)
    }

    /// Parses and validates config text, reading `${VAR}` from the process environment.
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        Config::from_yaml_with_env(text, &|name| std::env::var(name).ok())
    }

    /// Parses and validates config text with an explicit environment (for tests).
    pub fn from_yaml_with_env(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let mut tree: Value =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Yaml(e.to_string()))?;
        if tree.is_null() {
            return Err(invalid("(root)", "the file is empty"));
        }
        interpolate(&mut tree, "", env)?;
        let raw: raw::RawConfig = serde_path_to_error::deserialize(tree).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." { "(root)".into() } else { path };
            invalid(path, e.into_inner().to_string())
        })?;
        validate::validate(raw)
    }
}

/// Replaces `${VAR}` in every string of the tree; `$$` stands for a literal `$`.
fn interpolate(
    value: &mut Value,
    path: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    match value {
        Value::String(s) if s.contains('$') => {
            *s = interpolate_str(s, env).map_err(|m| invalid(display_path(path), m))?;
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &format!("{path}[{i}]"), env)?;
            }
        }
        Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                interpolate(item, &sub, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn display_path(path: &str) -> String {
    if path.is_empty() {
        "(root)".into()
    } else {
        path.into()
    }
}

fn interpolate_str(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('{') {
            let end = tail
                .find('}')
                .ok_or_else(|| "unterminated '${' (write '$$' for a literal '$')".to_string())?;
            let name = &tail[..end];
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("invalid environment variable name '{name}'"));
            }
            let val = env(name).ok_or_else(|| format!("environment variable {name} is not set"))?;
            out.push_str(&val);
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}
