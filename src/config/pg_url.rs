//! What a PostgreSQL connection string says about TLS (`sslmode`, `sslrootcert`), read the
//! way libpq users write it, so that `DATABASE_URL=...?sslmode=require` means TLS.
//!
//! The driver understands only `disable`, `prefer` and `require`, and no `sslrootcert`; the
//! gateway decides TLS itself (`store.postgres.tls`), so both parameters are taken out of the
//! string it hands the driver and folded into the TLS settings:
//! - `require` is `tls.mode: require`; `verify-ca` and `verify-full` are `verify-full` (the
//!   stricter check: chain and host name); `sslrootcert` is `tls.ca`.
//! - `disable`, `allow` and `prefer` (libpq's default) ask for no TLS of their own.
//! - A URL and a `tls` block that disagree are a config error naming both.

use percent_encoding::percent_decode_str;

use super::model::PgTlsMode;

/// The TLS parameters found in a connection string, and the string without them.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct UrlTls {
    /// The mode `sslmode` asks for, if it asks for TLS (`None` for disable/allow/prefer or
    /// no `sslmode`); `Some(Disable)` for an explicit `sslmode=disable`.
    pub(super) mode: Option<PgTlsMode>,
    /// `sslmode` as written.
    pub(super) written: Option<String>,
    pub(super) root_cert: Option<String>,
    /// The connection string without `sslmode` and `sslrootcert`.
    pub(super) rest: String,
}

fn mode_of(value: &str) -> Result<Option<PgTlsMode>, String> {
    Ok(match value {
        "disable" => Some(PgTlsMode::Disable),
        "allow" | "prefer" => None,
        "require" => Some(PgTlsMode::Require),
        "verify-ca" | "verify-full" => Some(PgTlsMode::VerifyFull),
        other => {
            return Err(format!(
                "sslmode '{other}' is not one of disable, allow, prefer, require, verify-ca, \
                 verify-full"
            ));
        }
    })
}

/// Splits the TLS parameters out of `url` (URL form `postgres://...?k=v&...` or keyword form
/// `host=... sslmode=...`).
pub(super) fn split(url: &str) -> Result<UrlTls, String> {
    let mut out = UrlTls::default();
    let mut take = |key: &str, value: String| -> Result<bool, String> {
        match key {
            "sslmode" => {
                out.mode = mode_of(&value)?;
                out.written = Some(value);
                Ok(true)
            }
            "sslrootcert" => {
                out.root_cert = Some(value);
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_string(),
            Some((head, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    let value = percent_decode_str(v).decode_utf8_lossy().into_owned();
                    if !take(k, value)? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    head.to_string()
                } else {
                    format!("{head}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for token in url.split_whitespace() {
            let (k, v) = token.split_once('=').unwrap_or((token, ""));
            if !take(k, v.trim_matches('\'').to_string())? {
                kept.push(token);
            }
        }
        kept.join(" ")
    };
    out.rest = rest;
    Ok(out)
}

/// The TLS mode and CA from what is configured elsewhere (`configured`, when anything is:
/// the `tls` block, or for `listen_url` what `url` resolved to; `from` names where its mode
/// and its CA were said) and the URL:
/// the configured one wins when the URL asks for nothing; a URL that asks for TLS it turns
/// off, or for none where it requires it, is refused (the message without the field's path,
/// which the caller puts in front).
pub(super) fn resolve(
    configured: Option<(PgTlsMode, Option<String>)>,
    from: (&str, &str),
    url: &UrlTls,
) -> Result<(PgTlsMode, Option<String>), String> {
    let Some((mode, ca)) = configured else {
        let mode = url.mode.unwrap_or(PgTlsMode::Disable);
        if url.root_cert.is_some() && mode != PgTlsMode::VerifyFull {
            return Err("sslrootcert needs sslmode=verify-full (or verify-ca)".into());
        }
        return Ok((mode, url.root_cert.clone()));
    };
    if let Some(asked) = url.mode
        && asked != mode
    {
        return Err(format!(
            "sslmode={} contradicts {}: {}; say it in one place",
            url.written.as_deref().unwrap_or_default(),
            from.0,
            mode.as_str()
        ));
    }
    if url.root_cert.is_some() && ca.is_some() && url.root_cert != ca {
        return Err(format!(
            "sslrootcert contradicts {}; say it in one place",
            from.1
        ));
    }
    Ok((mode, ca.or_else(|| url.root_cert.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TLS: (&str, &str) = ("store.postgres.tls.mode", "store.postgres.tls.ca");

    #[test]
    fn sslmode_and_sslrootcert_are_read_and_taken_out() {
        let u =
            split("postgres://u@db/x?sslmode=verify-full&sslrootcert=%2Fca.pem&connect_timeout=3")
                .unwrap();
        assert_eq!(u.mode, Some(PgTlsMode::VerifyFull));
        assert_eq!(u.root_cert.as_deref(), Some("/ca.pem"));
        assert_eq!(u.rest, "postgres://u@db/x?connect_timeout=3");
        let k = split("host=db user=u sslmode=require dbname=x").unwrap();
        assert_eq!(k.mode, Some(PgTlsMode::Require));
        assert_eq!(k.rest, "host=db user=u dbname=x");
        assert_eq!(
            split("postgres://u@db/x?sslmode=prefer").unwrap().mode,
            None
        );
        assert!(split("postgres://u@db/x?sslmode=sometimes").is_err());
    }

    #[test]
    fn a_url_and_a_tls_block_must_agree() {
        let require = split("postgres://u@db/x?sslmode=require").unwrap();
        assert_eq!(
            resolve(None, TLS, &require).unwrap(),
            (PgTlsMode::Require, None)
        );
        assert!(resolve(Some((PgTlsMode::Disable, None)), TLS, &require).is_err());
        assert_eq!(
            resolve(Some((PgTlsMode::Require, None)), TLS, &require).unwrap(),
            (PgTlsMode::Require, None)
        );
        let plain = split("postgres://u@db/x").unwrap();
        assert_eq!(
            resolve(Some((PgTlsMode::VerifyFull, None)), TLS, &plain).unwrap(),
            (PgTlsMode::VerifyFull, None)
        );
        let disable = split("postgres://u@db/x?sslmode=disable").unwrap();
        assert!(resolve(Some((PgTlsMode::Require, None)), TLS, &disable).is_err());
    }
}
