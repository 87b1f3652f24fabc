//! TLS on each hop, with certificates made by the test: the listener (HTTP/1.1 and h2 by
//! ALPN), an https upstream, and PostgreSQL (require and verify-full); and an untrusted
//! certificate refused on each. Without `tls.ca` the platform's roots verify an upstream,
//! and `SSL_CERT_FILE` names them; none at all is a config error.

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::certs::TestPki;
use crate::support::process::GatewayProcess;
use crate::support::*;

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

fn https_client(ca: &std::path::Path, h2: bool) -> HttpsClient {
    let tls = idemgate::tls::client_config(Some(ca)).unwrap();
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1();
    // ALPN offers h2 only when the client wants it.
    let connector = if h2 {
        builder.enable_http2().build()
    } else {
        builder.build()
    };
    Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build(connector)
}

async fn keyed(
    client: &HttpsClient,
    url: &str,
    key: &str,
) -> Result<(u16, Version, Bytes), String> {
    let req = Request::builder()
        .method(Method::POST)
        .uri(url)
        .header("idempotency-key", key)
        .header("x-account-id", "a")
        .body(Full::new(Bytes::from_static(b"x")))
        .unwrap();
    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let (status, version) = (resp.status().as_u16(), resp.version());
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, version, body))
}

#[tokio::test]
async fn the_listener_speaks_tls_with_http1_and_h2_and_an_untrusted_client_gets_nothing() {
    let pki = TestPki::new();
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "", |y| {
        y.patch(
            "server: { shutdown_grace: 5s, header_read_timeout: 2s }",
            &format!(
                "server: {{ shutdown_grace: 5s, header_read_timeout: 2s, tls: {{ cert: \"{}\", key: \"{}\" }} }}",
                pki.cert.display(),
                pki.key.display()
            ),
        )
    })
    .await;
    let url = format!("https://localhost:{}/pay", gw.addr.port());
    let (status, version, first) = keyed(&https_client(&pki.ca, false), &url, "k")
        .await
        .unwrap();
    assert_eq!((status, version), (201, Version::HTTP_11));
    let (status, version, again) = keyed(&https_client(&pki.ca, true), &url, "k")
        .await
        .unwrap();
    assert_eq!((status, version), (201, Version::HTTP_2), "h2 by ALPN");
    assert_eq!(again, first, "replayed over h2");
    assert_eq!(up.seen()[0].headers["x-forwarded-proto"], "https");

    let stranger = TestPki::new();
    let refused = keyed(&https_client(&stranger.ca, false), &url, "k2").await;
    assert!(
        refused.is_err(),
        "a client that does not trust the certificate gets no answer"
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn an_https_upstream_is_verified_against_its_ca_and_an_untrusted_one_is_refused() {
    let pki = TestPki::new();
    let up = Upstream::start_tls(pki.server_config()).await;
    // The gateway calls it by name (the certificate is for localhost), verified by `ca`.
    let https = |ca: &std::path::Path| {
        let (plain, ca) = (up.url(), ca.display().to_string());
        let tls_url = format!("https://localhost:{}", up.addr.port());
        move |y: String| {
            y.patch(&plain, &tls_url).patch(
                "timeout: 5s }",
                &format!("timeout: 5s, tls: {{ ca: \"{ca}\" }} }}"),
            )
        }
    };
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "", https(&pki.ca)).await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(up.executions(), 1);

    let stranger = TestPki::new();
    let (gw2, _db2) = TestGateway::on_with(Backend::Postgres, &up, "", https(&stranger.ca)).await;
    let r = post(&c, &gw2, "a", "k", "x").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(
        row_state(&gw2, "a", "k").await,
        None,
        "released: nothing was sent"
    );
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn postgres_over_tls_require_and_verify_full_and_a_wrong_ca_is_refused() {
    let pki = TestPki::new();
    let (cert, key) = (pki.cert_pem.clone(), pki.key_pem.clone());
    let cluster =
        tokio::task::spawn_blocking(move || pg::Cluster::start_with_tls(Some((&cert, &key))))
            .await
            .unwrap();
    let up = Upstream::start().await;
    let c = client();
    let with_tls = |db: &str, tls: &str| {
        config_yaml(db, &up.url(), "").patch(
            "statement_timeout: 1s }",
            &format!("statement_timeout: 1s, tls: {tls} }}"),
        )
    };

    let db = cluster.new_database().await;
    let gw = TestGateway::start(
        &with_tls(
            &db,
            &format!("{{ mode: verify-full, ca: \"{}\" }}", pki.ca.display()),
        ),
        &db,
    )
    .await;
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    let encrypted: i64 = sql(&db)
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
              WHERE a.datname = current_database() AND a.application_name LIKE 'idemgate%' AND s.ssl",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted >= 1, "the gateway's connections are encrypted");

    let db2 = cluster.new_database().await;
    let gw2 = TestGateway::start(&with_tls(&db2, "{ mode: require }"), &db2).await;
    assert_eq!(
        post(&c, &gw2, "a", "k", "x").await.status,
        201,
        "require: encrypted, not verified"
    );

    let stranger = TestPki::new();
    let db3 = cluster.new_database().await;
    let yaml = with_tls(
        &db3,
        &format!("{{ mode: verify-full, ca: \"{}\" }}", stranger.ca.display()),
    );
    let config = idemgate::config::Config::from_yaml(&yaml).unwrap();
    let idemgate::config::StoreConfig::Postgres(pgc) = &config.store else {
        unreachable!()
    };
    let store = idemgate::store::postgres::PgStore::new(pgc).unwrap();
    let refused = store.migrate().await;
    assert!(
        matches!(refused, Err(idemgate::store::StoreError::Connect(_))),
        "a server certificate from another CA is refused: {refused:?}"
    );
}

#[tokio::test]
async fn without_tls_ca_an_https_upstream_is_verified_against_the_roots_in_ssl_cert_file() {
    let pki = TestPki::new();
    let up = Upstream::start_tls(pki.server_config()).await;
    let db = pg::fresh_database().await;
    // No `tls.ca`: the platform's roots, which SSL_CERT_FILE names. The variable is set on
    // the child process only (setting one in this threaded test process is unsound).
    let yaml = config_yaml(&db, &format!("https://localhost:{}", up.addr.port()), "");
    let ca = pki.ca.display().to_string();
    let gw = GatewayProcess::start_with_env(&yaml, &[("SSL_CERT_FILE", &ca)]).await;
    let c = client();
    let plain = send(&c, Method::GET, &gw.url("/x"), &[], "").await;
    assert_eq!(plain.status, 201, "{plain:?}\n{}", gw.log_text());
    let keyed = post_to(&c, &gw.url("/pay"), "a", "k", "x").await;
    assert_eq!(keyed.status, 201, "{keyed:?}");
    assert_eq!(up.executions(), 2);

    // Roots from another CA: the upstream's certificate is refused and nothing is sent.
    let stranger = TestPki::new();
    let other = stranger.ca.display().to_string();
    let gw2 = GatewayProcess::start_with_env(&yaml, &[("SSL_CERT_FILE", &other)]).await;
    let refused = send(&c, Method::GET, &gw2.url("/x"), &[], "").await;
    assert_eq!(
        (refused.status, refused.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(up.executions(), 2);
}

#[test]
fn no_trusted_roots_at_all_is_a_config_error_naming_the_field() {
    let pki = TestPki::new();
    let empty = pki.dir.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let config = pki.dir.join("gateway.yaml");
    std::fs::write(
        &config,
        config_yaml("postgres://u@localhost/db", "https://localhost:9443", ""),
    )
    .unwrap();
    let out = std::process::Command::new(crate::support::bin::idemgate())
        .args(["check", "--config"])
        .arg(&config)
        .env("SSL_CERT_FILE", &empty)
        .env_remove("SSL_CERT_DIR")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr
            .contains("upstreams.app.tls.ca: no trusted roots found; set tls.ca or SSL_CERT_FILE"),
        "{stderr}"
    );
}

/// A certificate rotated on disk and announced with SIGHUP is served to new connections
/// (open ones keep theirs); clients that trust only the old one are then refused.
#[tokio::test]
async fn the_listeners_certificate_is_read_again_on_sighup() {
    let (old, new) = (TestPki::new(), TestPki::new());
    let dir = std::env::temp_dir().join(format!("idemgate-rotate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&cert, &old.cert_pem).unwrap();
    std::fs::write(&key, &old.key_pem).unwrap();
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "server: { shutdown_grace: 5s, header_read_timeout: 2s }",
        &format!(
            "server: {{ shutdown_grace: 5s, header_read_timeout: 2s, tls: {{ cert: \"{}\", key: \"{}\" }} }}",
            cert.display(),
            key.display()
        ),
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let url = format!("https://localhost:{}/pay", gw.addr.port());
    assert_eq!(
        keyed(&https_client(&old.ca, false), &url, "k1")
            .await
            .unwrap()
            .0,
        201
    );
    assert!(
        keyed(&https_client(&new.ca, false), &url, "k2")
            .await
            .is_err()
    );

    std::fs::write(&cert, &new.cert_pem).unwrap();
    std::fs::write(&key, &new.key_pem).unwrap();
    gw.hangup();
    wait_until(
        "the certificate is read again",
        std::time::Duration::from_secs(10),
        || async { gw.log_text().contains("certificate was read again") },
    )
    .await;
    assert_eq!(
        keyed(&https_client(&new.ca, false), &url, "k3")
            .await
            .unwrap()
            .0,
        201
    );
    assert!(
        keyed(&https_client(&old.ca, false), &url, "k4")
            .await
            .is_err(),
        "the old certificate is no longer served"
    );
    gw.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
