//! The embedded store's operator reads: a row as an operator sees it, and one page of a
//! listing (`Store::list`).

use rusqlite::params;

use crate::fingerprint::hex;
use crate::store::{KeyInfo, ListPage, ListQuery};

/// The columns of a row as an operator sees it ([`key_info`]), times as text; `body_bytes`
/// is how the body's length is read (`length(body)` on the table), `now` the database clock
/// in milliseconds (the store's `NOW`).
pub(super) fn key_info_columns(body_bytes: &str, now: &str) -> String {
    let ts = |col: &str| format!("strftime('%Y-%m-%d %H:%M:%f+00', {col} / 1000.0, 'unixepoch')");
    format!(
        "scope, key, route, state, status, attempts, {body_bytes}, {}, {}, {}, {}, fingerprint,
         {now} - created_at, lease_expires_at - {now}",
        ts("created_at"),
        ts("completed_at"),
        ts("lease_expires_at"),
        ts("expires_at")
    )
}

/// A row of [`key_info_columns`].
pub(super) fn key_info(r: &rusqlite::Row<'_>) -> rusqlite::Result<KeyInfo> {
    Ok(KeyInfo {
        scope: r.get(0)?,
        key: r.get(1)?,
        route: r.get(2)?,
        state: r.get(3)?,
        status: r
            .get::<_, Option<i64>>(4)?
            .and_then(|s| u16::try_from(s).ok()),
        attempts: r.get(5)?,
        body_bytes: r.get::<_, Option<i64>>(6)?.map(|n| n as usize),
        created_at: r.get(7)?,
        completed_at: r.get(8)?,
        lease_expires_at: r.get(9)?,
        expires_at: r.get(10)?,
        fingerprint_hex: hex(&r.get::<_, Vec<u8>>(11)?),
        age_ms: r.get(12)?,
        lease_left_ms: r.get(13)?,
    })
}

/// One page of a listing, in the caller's transaction; `now` is the database clock in
/// milliseconds (the store's `NOW`).
pub(super) fn page(
    tx: &rusqlite::Transaction<'_>,
    q: &ListQuery,
    now: &str,
) -> rusqlite::Result<ListPage> {
    // The same walk as the Postgres store's (`list_sql` there): the primary key in
    // order, at most `examine` rows read, the other filters checked on them.
    let mut walk: Vec<&str> = Vec::new();
    if q.after.is_some() {
        walk.push("(scope, key) > (?1, ?2)");
    }
    if q.scope.is_some() {
        walk.push("scope = ?3");
    }
    let walk = if walk.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", walk.join(" AND "))
    };
    let sql = format!(
        "WITH walked AS (
             SELECT scope, key, route, state, status, attempts,
                    length(body) AS body_bytes, created_at, completed_at,
                    lease_expires_at, expires_at, fingerprint,
                    (?4 IS NULL OR state = ?4)
                       AND (?5 IS NULL OR route = ?5)
                       AND (?6 IS NULL OR created_at <= {now} - ?6) AS hit
               FROM idemgate_keys {walk}
              ORDER BY scope, key
              LIMIT ?8
         ),
         ranked AS (
             SELECT *,
                    count(*) FILTER (WHERE hit)
                        OVER (ORDER BY scope, key ROWS UNBOUNDED PRECEDING) AS nth,
                    row_number() OVER (ORDER BY scope, key) AS n,
                    count(*) OVER () AS total
               FROM walked
         )
         SELECT {}, hit AND nth <= ?7, n = total, total
           FROM ranked
          WHERE (hit AND nth <= ?7) OR n = total
          ORDER BY scope, key",
        key_info_columns("body_bytes", now)
    );
    let (after_scope, after_key) = match &q.after {
        Some((s, k)) => (Some(s.as_str()), Some(k.as_str())),
        None => (None, None),
    };
    let older_ms: Option<i64> = q
        .older_than
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let limit = i64::try_from(q.limit).unwrap_or(i64::MAX);
    let examine = i64::try_from(q.examine).unwrap_or(i64::MAX);
    let mut stmt = tx.prepare(&sql)?;
    let mut rows = stmt.query(params![
        after_scope,
        after_key,
        q.scope,
        q.state,
        q.route,
        older_ms,
        limit,
        examine
    ])?;
    let mut page = ListPage::default();
    let mut last_read = None;
    let mut last_match_is_last_read = false;
    while let Some(r) = rows.next()? {
        let returned: bool = r.get(14)?;
        let last: bool = r.get(15)?;
        page.examined = usize::try_from(r.get::<_, i64>(16)?).unwrap_or(0);
        let at = (r.get::<_, String>(0)?, r.get::<_, String>(1)?);
        if returned {
            page.keys.push(key_info(r)?);
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
