//! Routes that can never see a request, found at load: the first matching route wins, so a
//! route whose every request an earlier route matches is dead configuration, and a keyed
//! one silently turns its promise off (its requests go unkeyed to the earlier route).
//!
//! - Full shadowing (every path and method of a route matched by earlier routes, several of
//!   them together if need be) is a config error naming both routes.
//! - Partial shadowing of a keyed route (an earlier route takes some of its paths) is a
//!   warning naming the paths.
//!
//! Paths are compared as configured (normalized at load); `PathMatch::matches` is the
//! reading they follow.

use http::Method;

use super::model::{PathMatch, Route};

/// Whether every path `later` matches is matched by `earlier`.
fn covers(earlier: &PathMatch, later: &PathMatch) -> bool {
    match (earlier, later) {
        (PathMatch::Prefix(_), PathMatch::Prefix(p)) => earlier.matches(p),
        (_, PathMatch::Exact(e)) => earlier.matches(e),
        (PathMatch::Exact(_), PathMatch::Prefix(_)) => false,
    }
}

/// Whether some path `later` matches is matched by `earlier` (and `covers` is false).
fn overlaps(earlier: &PathMatch, later: &PathMatch) -> bool {
    match (earlier, later) {
        (PathMatch::Prefix(p), PathMatch::Prefix(_))
        | (PathMatch::Exact(p), PathMatch::Prefix(_)) => later.matches(p),
        (_, PathMatch::Exact(e)) => earlier.matches(e),
    }
}

fn takes(route: &Route, method: &Method) -> bool {
    route.methods.as_ref().is_none_or(|m| m.contains(method))
}

fn describe(route: &Route) -> String {
    let path = match &route.path {
        PathMatch::Exact(p) => format!("path {p}"),
        PathMatch::Prefix(p) => format!("path_prefix {p}"),
    };
    match &route.methods {
        None => format!("'{}' ({path}, every method)", route.name),
        Some(m) => format!(
            "'{}' ({path}, {})",
            route.name,
            m.iter().map(Method::as_str).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The earlier routes that together match every request of `routes[j]`, if they do.
pub(super) fn shadowed_by(routes: &[Route], j: usize) -> Option<Vec<usize>> {
    let later = &routes[j];
    let covering: Vec<usize> = (0..j)
        .filter(|&i| covers(&routes[i].path, &later.path))
        .collect();
    let whole = match &later.methods {
        // Every method: one earlier route must take every method.
        None => covering.iter().any(|&i| routes[i].methods.is_none()),
        Some(list) => list
            .iter()
            .all(|m| covering.iter().any(|&i| takes(&routes[i], m))),
    };
    whole.then_some(covering)
}

/// The error for a shadowed route, naming it and the routes before it.
pub(super) fn shadowed_error(routes: &[Route], j: usize, by: &[usize]) -> String {
    let names: Vec<String> = by.iter().map(|&i| describe(&routes[i])).collect();
    format!(
        "route {} is never reached: {} before it match{} every request it would, and the \
         first matching route wins (move it above, or narrow the earlier match)",
        describe(&routes[j]),
        names.join(" and "),
        if by.len() == 1 { "es" } else { "" }
    )
}

/// Warnings for keyed routes that earlier routes partly shadow.
pub(super) fn partial_warnings(routes: &[Route]) -> Vec<String> {
    let mut out = Vec::new();
    for (j, later) in routes.iter().enumerate() {
        if later.idempotency.is_none() {
            continue;
        }
        for earlier in &routes[..j] {
            let shared_method = match (&earlier.methods, &later.methods) {
                (None, _) | (_, None) => true,
                (Some(a), Some(b)) => a.iter().any(|m| b.contains(m)),
            };
            if shared_method
                && overlaps(&earlier.path, &later.path)
                && !covers(&earlier.path, &later.path)
            {
                let path = match &earlier.path {
                    PathMatch::Exact(p) | PathMatch::Prefix(p) => p,
                };
                out.push(format!(
                    "route {} takes requests under {path} before the keyed route {} sees them: \
                     those are forwarded unkeyed",
                    describe(earlier),
                    describe(later)
                ));
            }
        }
    }
    out
}
