//! Operator access to stored keys, shared by the key API (`admin.rs`) and `idemgate keys`.
//!
//! Operators address a key by the scope value the client sent (`acct_9`), while the store
//! keeps the scope with its source (`header:acct_9`, see `key.rs`). [`candidate_scopes`]
//! turns the value into the stored scopes it may name, one per keyed route's scope source;
//! when more than one of them holds the key, the lookup is ambiguous and the operator names
//! the route. A stored scope (`header:acct_9`, `authz:…`, as `keys show` prints it) is also
//! accepted as it is.
//!
//! A delete refuses a key in flight under a live lease unless forced (docs/contract.md §8.2);
//! a forced delete of such a key is logged and, in a serving process, counted as a possible
//! double.

use crate::config::{Config, ScopeSource};
use crate::key::namespaced;
use crate::store::{Deleted, KeyInfo, Store, StoreError};

/// Why an operator's lookup found no single key.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("no key '{key}' in scope '{scope}'")]
    NotFound { scope: String, key: String },
    #[error(
        "scope '{scope}' names keys of several routes ({routes}); give the route to choose one"
    )]
    Ambiguous { scope: String, routes: String },
    #[error("no keyed route named '{0}'")]
    UnknownRoute(String),
    #[error(
        "key '{key}' is in flight under a live lease: deleting it lets a retry forward again while the first attempt may still complete (a possible double); force the delete to do it anyway"
    )]
    InFlight { key: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The stored scopes that the operator's `value` may name (see the module docs), without
/// duplicates, in route order.
pub fn candidate_scopes(
    config: &Config,
    value: &str,
    route: Option<&str>,
) -> Result<Vec<String>, LookupError> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    let mut any = false;
    for r in &config.routes {
        if route.is_some_and(|name| name != r.name) {
            continue;
        }
        let Some(idem) = &r.idempotency else { continue };
        any = true;
        match &idem.scope {
            ScopeSource::Fixed(v) if v != value => {}
            ScopeSource::Authorization if !value.starts_with("authz:") => {}
            source => push(namespaced(source, value)),
        }
    }
    if let Some(name) = route
        && !any
    {
        return Err(LookupError::UnknownRoute(name.to_string()));
    }
    if route.is_none()
        && ["header:", "json:", "fixed:", "authz:"]
            .iter()
            .any(|p| value.starts_with(p))
    {
        push(value.to_string());
    }
    Ok(out)
}

/// The one row that `(value, key)` names, or why there is none.
pub async fn find(
    store: &dyn Store,
    config: &Config,
    value: &str,
    key: &str,
    route: Option<&str>,
) -> Result<KeyInfo, LookupError> {
    let mut found: Vec<KeyInfo> = Vec::new();
    for scope in candidate_scopes(config, value, route)? {
        if let Some(info) = store.inspect(&scope, key).await? {
            found.push(info);
        }
    }
    match found.len() {
        0 => Err(LookupError::NotFound {
            scope: value.to_string(),
            key: key.to_string(),
        }),
        1 => Ok(found.pop().expect("one row")),
        _ => Err(LookupError::Ambiguous {
            scope: value.to_string(),
            routes: found
                .iter()
                .map(|i| i.route.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Deletes the one row that `(value, key)` names; a key in flight under a live lease only
/// when `force`. Returns the deleted row's route and whether its lease was live.
pub async fn delete(
    store: &dyn Store,
    config: &Config,
    value: &str,
    key: &str,
    route: Option<&str>,
    force: bool,
) -> Result<(KeyInfo, bool), LookupError> {
    let info = find(store, config, value, key, route).await?;
    match store.delete(&info.scope, key, force).await? {
        Deleted::Yes { live_lease, .. } => {
            if live_lease {
                tracing::warn!(
                    route = %info.route,
                    key = %crate::key::KeyId::of(&info.scope, key),
                    "forced delete of a key in flight under a live lease: a retry forwards again while the first attempt may still complete (a possible double)"
                );
            }
            Ok((info, live_lease))
        }
        Deleted::NotFound => Err(LookupError::NotFound {
            scope: value.to_string(),
            key: key.to_string(),
        }),
        Deleted::InFlight => Err(LookupError::InFlight {
            key: key.to_string(),
        }),
    }
}
