//! Operator access to stored keys, shared by the key API (`admin.rs`) and `idemgate keys`.
//!
//! Operators address a key by the scope value the client sent (`acct_9`), while the store
//! keeps the scope with its source (`header:acct_9`, see `key.rs`). [`candidate_scopes`]
//! turns the value into the stored scopes it may name, one per keyed route's scope source;
//! when more than one of them holds the key, the lookup is ambiguous and the operator names
//! the route. A stored scope (`header:acct_9`, `authz:…`, as `keys show` prints it) is also
//! accepted as it is.
//!
//! [`list`] pages through the keys in primary-key order (`keys list`, `GET /v1/keys` without
//! `key`): each page walks the index on `(scope, key)` from its cursor, reads a bounded number
//! of rows whatever the filters match (`Store::list`), and hands back an opaque cursor to go
//! on from; a scope filter walks only the scopes the value names ([`candidate_scopes`]).
//!
//! A delete refuses a key in flight under a live lease unless forced (docs/contract.md §8.2);
//! a forced delete of such a key is logged and, in a serving process, counted as a possible
//! double.

use crate::config::{Config, ScopeSource};
use crate::key::namespaced;
use std::time::Duration;

use crate::store::{
    Deleted, KeyInfo, LIST_EXAMINE_MAX, LIST_EXAMINE_PER_KEY, LIST_LIMIT_MAX, ListQuery, Store,
    StoreError,
};

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
    /// A listing's parameter (`--state`, `state=`, ...) is not valid: names the parameter.
    #[error("invalid {param}: {why}")]
    Invalid { param: &'static str, why: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How many keys a page of a listing returns unless asked otherwise.
pub const LIST_LIMIT_DEFAULT: usize = 50;

/// The states a key's row can be in (the `state` column of migrations/0001_keys.sql).
pub const STATES: &[&str] = &["in_flight", "completed", "not_replayable", "unknown"];

/// What an operator asks a listing for, as given (the CLI's flags, the API's parameters);
/// [`ListRequest::parse`] checks each one and names the one that is wrong.
#[derive(Debug, Clone, Default)]
pub struct ListArgs {
    pub state: Option<String>,
    pub route: Option<String>,
    pub scope: Option<String>,
    pub older_than: Option<String>,
    pub limit: Option<String>,
    pub cursor: Option<String>,
}

/// A checked listing request.
#[derive(Debug, Clone)]
pub struct ListRequest {
    pub state: Option<String>,
    pub route: Option<String>,
    /// The scope value the client sent (or a stored scope), as for `keys show`.
    pub scope: Option<String>,
    pub older_than: Option<Duration>,
    pub limit: usize,
    /// Where the previous page ended: after `(scope, key)`, or at the start of `scope`.
    pub after: Option<(String, Option<String>)>,
}

impl ListRequest {
    pub fn parse(config: &Config, args: ListArgs) -> Result<ListRequest, LookupError> {
        let invalid = |param: &'static str, why: String| LookupError::Invalid { param, why };
        if let Some(state) = &args.state
            && !STATES.contains(&state.as_str())
        {
            return Err(invalid(
                "state",
                format!("'{state}' is not a state; one of {}", STATES.join(", ")),
            ));
        }
        if let Some(route) = &args.route
            && !config.routes.iter().any(|r| &r.name == route)
        {
            return Err(invalid("route", format!("no route named '{route}'")));
        }
        if args.scope.as_deref() == Some("") {
            return Err(invalid("scope", "empty".into()));
        }
        let older_than = args
            .older_than
            .as_deref()
            .map(|d| crate::config::parse_duration(d).map_err(|e| invalid("older_than", e)))
            .transpose()?;
        let limit = match args.limit.as_deref() {
            None => LIST_LIMIT_DEFAULT,
            Some(l) => match l.trim().parse::<usize>() {
                Ok(n) if (1..=LIST_LIMIT_MAX).contains(&n) => n,
                _ => {
                    return Err(invalid(
                        "limit",
                        format!("'{l}' is not a whole number from 1 to {LIST_LIMIT_MAX}"),
                    ));
                }
            },
        };
        let after = args
            .cursor
            .as_deref()
            .map(|c| {
                decode_cursor(c).ok_or_else(|| {
                    invalid(
                        "cursor",
                        "not a cursor from a previous page (pass next_cursor as it was given)"
                            .into(),
                    )
                })
            })
            .transpose()?;
        Ok(ListRequest {
            state: args.state,
            route: args.route,
            scope: args.scope,
            older_than,
            limit,
            after,
        })
    }
}

/// One page of a listing.
#[derive(Debug, Clone)]
pub struct Listed {
    pub keys: Vec<KeyInfo>,
    /// Where the next page starts, opaque ([`encode_cursor`]); `None` at the end.
    pub next_cursor: Option<String>,
}

/// The most bytes a cursor may take (a scope and a key, hex-encoded with their framing).
const CURSOR_MAX: usize = 64 * 1024;

/// The opaque cursor after `(scope, key)`, or at the start of `scope` (`key` `None`, in a
/// listing of one scope value whose stored scopes are walked one after another): the hex of
/// a JSON array, so that any text (a key holding a comma, a quote or a NUL) goes through a
/// query string unchanged.
pub fn encode_cursor(scope: &str, key: Option<&str>) -> String {
    let value = match key {
        Some(key) => serde_json::json!([scope, key]),
        None => serde_json::json!([scope]),
    };
    crate::fingerprint::hex(value.to_string().as_bytes())
}

/// What [`encode_cursor`] encoded; `None` for anything else.
pub fn decode_cursor(cursor: &str) -> Option<(String, Option<String>)> {
    if cursor.is_empty() || cursor.len() > CURSOR_MAX || !cursor.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let parts: Vec<String> = serde_json::from_slice(&bytes).ok()?;
    let mut parts = parts.into_iter();
    let (scope, key, rest) = (parts.next()?, parts.next(), parts.next());
    (!scope.is_empty() && rest.is_none()).then_some((scope, key))
}

/// One page of the keys `req` asks for, in `(scope, key)` order: at most `req.limit` keys,
/// after reading at most `LIST_EXAMINE_PER_KEY` rows per key asked for (at most
/// `LIST_EXAMINE_MAX`), so a page may hold fewer keys than the limit (even none) while the
/// cursor still moves on; `next_cursor` is `None` only once the walk reached the end.
pub async fn list(
    store: &dyn Store,
    config: &Config,
    req: &ListRequest,
) -> Result<Listed, LookupError> {
    let examine = (req.limit * LIST_EXAMINE_PER_KEY).min(LIST_EXAMINE_MAX);
    let query =
        |scope: Option<String>, after: Option<(String, String)>, limit, examine| ListQuery {
            after,
            scope,
            state: req.state.clone(),
            route: req.route.clone(),
            older_than: req.older_than,
            limit,
            examine,
        };
    let cursor_invalid = |why: String| LookupError::Invalid {
        param: "cursor",
        why,
    };
    let Some(value) = &req.scope else {
        let after = match &req.after {
            None => None,
            Some((scope, Some(key))) => Some((scope.clone(), key.clone())),
            Some((_, None)) => {
                return Err(cursor_invalid(
                    "it is a cursor of a listing of one scope: give the same --scope".into(),
                ));
            }
        };
        let page = store.list(&query(None, after, req.limit, examine)).await?;
        return Ok(Listed {
            keys: page.keys,
            next_cursor: page.next.map(|(s, k)| encode_cursor(&s, Some(&k))),
        });
    };
    // Each stored scope the value names, in route order, from the cursor's.
    let scopes = candidate_scopes(config, value, req.route.as_deref()).map_err(|e| match e {
        LookupError::UnknownRoute(route) => LookupError::Invalid {
            param: "route",
            why: format!("no keyed route named '{route}'"),
        },
        e => e,
    })?;
    let start = match &req.after {
        None => 0,
        Some((scope, _)) => scopes.iter().position(|s| s == scope).ok_or_else(|| {
            cursor_invalid(format!(
                "it is not a cursor of a listing of scope '{value}'"
            ))
        })?,
    };
    let mut keys: Vec<KeyInfo> = Vec::new();
    let mut examined = 0usize;
    for (i, scope) in scopes.iter().enumerate().skip(start) {
        if keys.len() >= req.limit || examined >= examine {
            // The page is full at the end of a scope: the next one starts at this scope.
            return Ok(Listed {
                keys,
                next_cursor: Some(encode_cursor(scope, None)),
            });
        }
        let after = match &req.after {
            Some((s, Some(k))) if i == start => Some((s.clone(), k.clone())),
            _ => None,
        };
        let page = store
            .list(&query(
                Some(scope.clone()),
                after,
                req.limit - keys.len(),
                examine - examined,
            ))
            .await?;
        examined += page.examined;
        keys.extend(page.keys);
        if let Some((s, k)) = page.next {
            return Ok(Listed {
                keys,
                next_cursor: Some(encode_cursor(&s, Some(&k))),
            });
        }
    }
    Ok(Listed {
        keys,
        next_cursor: None,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_any_text_and_refuse_anything_else() {
        for (scope, key) in [
            ("header:a", Some("k1")),
            ("json:a,b", Some("a \"quoted\" key, with\u{0} a NUL")),
            ("header:b", None),
        ] {
            let c = encode_cursor(scope, key);
            assert!(c.bytes().all(|b| b.is_ascii_hexdigit()), "{c}");
            assert_eq!(
                decode_cursor(&c),
                Some((scope.to_string(), key.map(str::to_string)))
            );
        }
        let hex = |s: &str| crate::fingerprint::hex(s.as_bytes());
        for bad in [
            String::new(),
            "zz".into(),
            "abc".into(),
            hex("{}"),
            hex("[]"),
            hex("[\"\",\"k\"]"),
            hex("[\"s\",\"k\",\"x\"]"),
            hex("[\"s\",1]"),
            "0".repeat(CURSOR_MAX + 2),
        ] {
            assert_eq!(decode_cursor(&bad), None, "{bad}");
        }
    }
}
