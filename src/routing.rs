//! A configuration snapshot and the upstream clients built from it ([`Routing`]): what a
//! request resolves its route, idempotency settings and upstream client against. A reload
//! builds a new one and swaps it in whole; a request keeps the snapshot it started with.
//!
//! Invariants: an upstream's admission counter ([`UpstreamLimit`]) is the same object in
//! every snapshot ([`LimitRegistry`] hands it out by upstream name), so slots taken under an
//! old snapshot are counted against the new limit; `Routing::metrics[i]` are the metric
//! handles of `config.routes[i]`, resolved when the snapshot is built (the same handles for a
//! route name in every snapshot), so a request counts without looking its route up by name.

use std::sync::Arc;

use http::Method;

use crate::config::{Config, Idempotency, PathMatch, Route};
use crate::forward::{UpstreamClient, Upstreams};
use crate::limits::UpstreamLimit;
use crate::metrics::{Metrics, RouteHandles};
use crate::problem::GatewayError;

/// One configuration and the upstream clients built from it.
pub struct Routing {
    pub config: Arc<Config>,
    pub(crate) upstreams: Upstreams,
    /// The metric handles of `config.routes[i]` at `i`.
    pub(crate) metrics: Vec<Arc<RouteHandles>>,
    /// `idemgate_upstream_duration_seconds` of the upstream of `config.routes[i]` at `i`.
    pub(crate) upstream_durations: Vec<crate::metrics::ShardedHistogram>,
    /// The routes as a lenient backend reads paths.
    lenient: Lenient,
}

impl Routing {
    pub(crate) fn new(config: Arc<Config>, gateway_limits: &LimitRegistry<'_>) -> Routing {
        let upstreams = Upstreams::new(config.upstreams.values(), |up| gateway_limits.get(up));
        let metrics = config
            .routes
            .iter()
            .map(|r| gateway_limits.metrics.route(&r.name))
            .collect();
        let upstream_durations = config
            .routes
            .iter()
            .map(|r| gateway_limits.metrics.upstream_duration(&r.upstream))
            .collect();
        let lenient = Lenient::new(&config);
        Routing {
            config,
            upstreams,
            metrics,
            upstream_durations,
            lenient,
        }
    }

    /// The index of the route a request with `method` and normalized `path` takes, or why
    /// it takes none: 404 `no-route`, or 400 `path-invalid` when the gateway's reading does
    /// not key it but a lenient backend's would ([`Lenient`]).
    pub(crate) fn route_index(&self, method: &Method, path: &str) -> Result<usize, GatewayError> {
        route_index(&self.config, &self.lenient, method, path)
    }

    /// The upstream a route forwards to.
    pub(crate) fn upstream_of(&self, route: &Route) -> &UpstreamClient {
        self.upstreams
            .get(&route.upstream)
            .expect("validated config: every route names an upstream")
    }

    /// The keyed route at `index` (as [`Routing::route_index`] found it), its idempotency
    /// and its upstream.
    pub(crate) fn keyed(&self, index: usize) -> (&Route, &Idempotency, &UpstreamClient) {
        let route = &self.config.routes[index];
        let idem = route
            .idempotency
            .as_ref()
            .expect("a keyed request's route is keyed");
        (route, idem, self.upstream_of(route))
    }
}

/// The standard methods (RFC 9110 section 9 and RFC 5789), compared byte for byte.
const STANDARD_METHODS: [Method; 9] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::HEAD,
    Method::OPTIONS,
    Method::TRACE,
    Method::CONNECT,
];

/// Methods are tokens compared exactly (RFC 9110 section 9.1), but some backends upper-case
/// them (Werkzeug, Django): a standard method in another case (`post`) would run there as
/// the keyed `POST` the gateway does not see, so it is refused (400 `method-invalid`).
/// `CONNECT` is 405: the gateway is no forward proxy. Any other method passes.
pub(crate) fn check_method(method: &Method) -> Result<(), GatewayError> {
    if method == Method::CONNECT {
        return Err(GatewayError::MethodNotAllowed);
    }
    if !STANDARD_METHODS.contains(method)
        && STANDARD_METHODS
            .iter()
            .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str()))
    {
        return Err(GatewayError::MethodInvalid);
    }
    Ok(())
}

/// See [`Routing::route_index`].
fn route_index(
    config: &Config,
    lenient: &Lenient,
    method: &Method,
    path: &str,
) -> Result<usize, GatewayError> {
    let index = config.route_index_for(method, path);
    let keyed = index
        .and_then(|i| config.routes[i].idempotency.as_ref())
        .is_some_and(|idem| idem.methods.contains(method));
    if !keyed && let Some(resembled) = lenient.resembled(config, method, path) {
        return Err(GatewayError::PathResembles(resembled.name.clone()));
    }
    index.ok_or(GatewayError::NoRoute)
}

/// The routes as a backend that reads paths leniently would match them (`path::lenient`:
/// `%2F` and `%5C` decoded, backslashes as slashes, `;parameters` dropped, no case): a
/// request that this reading keys and the gateway's does not is refused, never forwarded
/// unkeyed (docs/guarantees.md, "no spelling around a key").
pub(crate) struct Lenient {
    /// Every route's path lower-cased, in order; empty when no route is keyed (nothing to
    /// spell around).
    folded: Vec<PathMatch>,
    /// Whether a route's path has an upper-case letter, so that even a lower-case request
    /// path may route otherwise when read without case.
    fold_always: bool,
}

impl Lenient {
    pub(crate) fn new(config: &Config) -> Lenient {
        let any_keyed = config.routes.iter().any(|r| r.idempotency.is_some());
        let folded: Vec<PathMatch> = if any_keyed {
            config.routes.iter().map(|r| r.path.folded()).collect()
        } else {
            Vec::new()
        };
        let fold_always = folded.iter().zip(&config.routes).any(|(f, r)| *f != r.path);
        Lenient {
            folded,
            fold_always,
        }
    }

    /// The keyed route that the lenient reading of `path` reaches with `method`, if it keys
    /// that method there. `None` at once for a plain path spelled plainly.
    fn resembled<'c>(&self, config: &'c Config, method: &Method, path: &str) -> Option<&'c Route> {
        if self.folded.is_empty() || !(self.fold_always || crate::path::may_read_otherwise(path)) {
            return None;
        }
        let read = crate::path::lenient(path);
        let index = self.folded.iter().zip(&config.routes).position(|(p, r)| {
            p.matches(&read) && r.methods.as_ref().is_none_or(|m| m.contains(method))
        })?;
        let route = &config.routes[index];
        let keyed = route.idempotency.as_ref()?;
        keyed.methods.contains(method).then_some(route)
    }
}

/// Hands out each upstream's admission counter, the same one across reloads.
pub(crate) struct LimitRegistry<'a> {
    pub(crate) limits: &'a std::sync::Mutex<std::collections::HashMap<String, Arc<UpstreamLimit>>>,
    pub(crate) metrics: &'a Metrics,
}

impl LimitRegistry<'_> {
    pub(crate) fn get(&self, up: &crate::config::UpstreamConfig) -> Arc<UpstreamLimit> {
        let mut limits = self.limits.lock().expect("limits lock");
        let limit = limits.entry(up.name.clone()).or_insert_with(|| {
            let gauge = self
                .metrics
                .upstream_in_flight
                .get_or_create(&crate::metrics::UpstreamLabel {
                    upstream: up.name.clone(),
                })
                .clone();
            Arc::new(UpstreamLimit::new(up.max_in_flight, gauge))
        });
        limit.set_max(up.max_in_flight);
        Arc::clone(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CONFIG: &str = r#"
store: { postgres: { url: "postgres://u@localhost/db" } }
upstreams: { app: { url: "http://127.0.0.1:9000", timeout: 30s } }
routes:
  - name: webhooks
    match: { path_prefix: /webhooks/ }
    upstream: app
    idempotency: { methods: [POST, PUT] }
  - name: Orders
    match: { path: /Orders/new }
    upstream: app
    idempotency: {}
  - name: rest
    match: { path_prefix: / }
    upstream: app
"#;

    /// What the gateway does with a request: `Some(keyed)` when it forwards it (keyed or
    /// not), `None` when it refuses it.
    fn gateway(config: &Config, lenient: &Lenient, method: &str, raw: &str) -> Option<bool> {
        let method = Method::from_bytes(method.as_bytes()).ok()?;
        check_method(&method).ok()?;
        let normal = crate::path::normalize(raw).ok()?;
        let index = route_index(config, lenient, &method, &normal).ok()?;
        let keyed = config.routes[index]
            .idempotency
            .as_ref()
            .is_some_and(|idem| idem.methods.contains(&method));
        Some(keyed)
    }

    /// A lenient backend, written apart from `path::lenient`: it upper-cases the method,
    /// decodes `%2F` and `%5C`, reads `\` as `/`, drops `;parameters`, merges slashes and
    /// ignores case. Whether it runs the request as a keyed handler's.
    fn backend_keys(method: &str, raw: &str) -> bool {
        let mut p = raw.to_string();
        for (from, to) in [
            ("%2F", "/"),
            ("%2f", "/"),
            ("%5C", "/"),
            ("%5c", "/"),
            ("\\", "/"),
        ] {
            p = p.replace(from, to);
        }
        let p: String = p
            .split('/')
            .map(|seg| seg.split(';').next().unwrap_or(""))
            .filter(|seg| !seg.is_empty())
            .collect::<Vec<_>>()
            .join("/");
        let p = format!("/{}", p.to_ascii_lowercase());
        let m = method.to_ascii_uppercase();
        (p == "/webhooks" || p.starts_with("/webhooks/")) && (m == "POST" || m == "PUT")
            || p == "/orders/new" && (m == "POST" || m == "PATCH")
    }

    /// A spelling of a separator or a character of a path a backend reads leniently.
    fn spelled(path: &str) -> impl Strategy<Value = String> {
        let parts: Vec<BoxedStrategy<String>> = path
            .chars()
            .map(|c| match c {
                '/' => prop_oneof![
                    3 => Just("/".to_string()),
                    1 => Just("%2F".to_string()),
                    1 => Just("%2f".to_string()),
                    1 => Just("%5C".to_string()),
                    1 => Just("\\".to_string()),
                    1 => Just(";v=1/".to_string()),
                ]
                .boxed(),
                c => prop_oneof![
                    Just(c.to_ascii_lowercase().to_string()),
                    Just(c.to_ascii_uppercase().to_string()),
                ]
                .boxed(),
            })
            .collect();
        parts.prop_map(|parts| parts.concat())
    }

    proptest! {
        #[test]
        fn what_a_lenient_backend_would_key_is_keyed_or_refused(
            (method, raw) in (
                prop_oneof![
                    Just("POST"), Just("post"), Just("Post"), Just("PUT"), Just("put"),
                    Just("PATCH"), Just("patch"), Just("GET"), Just("get"), Just("DELETE"),
                ],
                prop_oneof![
                    Just("/webhooks/pay"), Just("/webhooks/a/b"), Just("/webhooks"),
                    Just("/orders/new"), Just("/Orders/new"), Just("/files/x"),
                    Just("/web/hooks"),
                ],
            ).prop_flat_map(|(m, p)| (Just(m), spelled(p)))
        ) {
            let config = Config::from_yaml_with_env(CONFIG, &|_| None).unwrap();
            let lenient = Lenient::new(&config);
            if backend_keys(method, &raw) {
                let gw = gateway(&config, &lenient, method, &raw);
                prop_assert!(gw != Some(false), "{method} {raw}: forwarded unkeyed");
            }
        }
    }

    #[test]
    fn plain_paths_pass_and_only_resembling_ones_are_refused() {
        let config = Config::from_yaml_with_env(CONFIG, &|_| None).unwrap();
        let lenient = Lenient::new(&config);
        assert_eq!(
            gateway(&config, &lenient, "POST", "/webhooks/pay"),
            Some(true)
        );
        assert_eq!(
            gateway(&config, &lenient, "POST", "/files/a%2Fb"),
            Some(false)
        );
        assert_eq!(
            gateway(&config, &lenient, "GET", "/WEBHOOKS/pay"),
            Some(false)
        );
        assert_eq!(gateway(&config, &lenient, "POST", "/WEBHOOKS/pay"), None);
        assert_eq!(gateway(&config, &lenient, "POST", "/webhooks%2Fpay"), None);
        assert_eq!(gateway(&config, &lenient, "post", "/webhooks/pay"), None);
        assert_eq!(
            gateway(&config, &lenient, "PURGE", "/webhooks/pay"),
            Some(false)
        );
        assert_eq!(gateway(&config, &lenient, "POST", "/orders/new"), None);
        assert_eq!(
            gateway(&config, &lenient, "POST", "/Orders/new"),
            Some(true)
        );
        assert_eq!(
            check_method(&Method::CONNECT).unwrap_err().problem().status,
            405
        );
    }
}
