//! The operator's reads: a row as an operator sees it, and one page of a listing
//! (`Store::list`, [`list_sql`]).

use super::session::Db;
use super::statements::{LIST_TYPES, list_sql};
use crate::fingerprint::hex;
use crate::store::{KeyInfo, ListPage, ListQuery, StoreError};

/// One page of a listing; the statement is sent unnamed, planned for its values.
pub(super) async fn page(db: &Db, q: &ListQuery) -> Result<ListPage, StoreError> {
    let (after_scope, after_key) = match &q.after {
        Some((s, k)) => (Some(s.as_str()), Some(k.as_str())),
        None => (None, None),
    };
    let older_ms: Option<i64> = q
        .older_than
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let limit = i64::try_from(q.limit).unwrap_or(i64::MAX);
    let examine = i64::try_from(q.examine).unwrap_or(i64::MAX);
    let sql = list_sql(q.after.is_some(), q.scope.is_some());
    let rows = db
        .with_conn("list", async |c| {
            c.unnamed(
                &sql,
                LIST_TYPES,
                &[
                    &after_scope,
                    &after_key,
                    &q.scope,
                    &q.state,
                    &q.route,
                    &older_ms,
                    &limit,
                    &examine,
                ],
            )
            .await
        })
        .await?;
    let mut page = ListPage::default();
    let mut last_read = None;
    let mut last_match_is_last_read = false;
    for r in &rows {
        let returned: bool = r.get(14);
        let last: bool = r.get(15);
        page.examined = usize::try_from(r.get::<_, i64>(16)).unwrap_or(0);
        let at = (r.get::<_, String>(0), r.get::<_, String>(1));
        if returned {
            page.keys.push(key_info(r));
        }
        if last {
            last_match_is_last_read = returned;
            last_read = Some(at);
        }
    }
    let last_match = page.keys.last().map(|k| (k.scope.clone(), k.key.clone()));
    page.next = ListPage::next_after(
        q,
        page.examined,
        last_match,
        last_read,
        page.keys.len(),
        last_match_is_last_read,
    );
    Ok(page)
}

/// A row of `INSPECT_SQL` or `list_sql` (their first 14 columns) as an operator sees it.
pub(super) fn key_info(r: &tokio_postgres::Row) -> KeyInfo {
    KeyInfo {
        scope: r.get(0),
        key: r.get(1),
        route: r.get(2),
        state: r.get(3),
        status: r
            .get::<_, Option<i32>>(4)
            .and_then(|s| u16::try_from(s).ok()),
        attempts: r.get(5),
        body_bytes: r.get::<_, Option<i32>>(6).map(|n| n as usize),
        created_at: r.get(7),
        completed_at: r.get(8),
        lease_expires_at: r.get(9),
        expires_at: r.get(10),
        fingerprint_hex: hex(r.get::<_, &[u8]>(11)),
        age_ms: r.get(12),
        lease_left_ms: r.get(13),
    }
}
