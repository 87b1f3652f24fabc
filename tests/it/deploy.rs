//! `deploy/`: the Kubernetes manifests agree with the config they mount and with the
//! binary's endpoints; the Prometheus alerts name only metrics the gateway exports; and
//! promtool accepts the rules, their unit tests and a live gateway's `/metrics`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use http::Method;
use idemgate::config::Config;
use idemgate::metrics::{Format, Metrics, StateLabel, StoreMetrics, outcome};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::support::*;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(deploy(path)).unwrap();
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The same stand-ins for secrets as `config_files.rs`.
fn env(name: &str) -> Option<String> {
    match name {
        "DATABASE_URL" => Some("postgres://idemgate@localhost/idemgate".to_string()),
        "IDEMGATE_ADMIN_TOKEN" => Some("an-example-token-for-tests".to_string()),
        _ => None,
    }
}

fn seconds(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("a number of seconds: {v}"))
}

#[test]
fn the_kubernetes_manifests_agree_with_the_config_they_mount() {
    let cm = yaml("kubernetes/configmap.yaml");
    assert_eq!(cm["kind"], "ConfigMap");
    let text = cm["data"]["gateway.yaml"]
        .as_str()
        .expect("the ConfigMap holds gateway.yaml");
    let config = Config::from_yaml_with_env(text, &env)
        .unwrap_or_else(|e| panic!("configmap.yaml, gateway.yaml: {e}"));
    let admin = config.admin.as_ref().expect("the probes need admin.listen");

    let deployment = yaml("kubernetes/deployment.yaml");
    let pod = &deployment["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    let c = &containers[0];

    // The config is mounted where `serve --config` reads it, from this ConfigMap.
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let config_path = Path::new(args[args.iter().position(|a| *a == "--config").unwrap() + 1]);
    assert_eq!(args[0], "serve");
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| config_path.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the config's directory is mounted");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["configMap"]["name"], cm["metadata"]["name"]);
    assert_eq!(
        config_path.file_name().unwrap().to_str().unwrap(),
        "gateway.yaml"
    );

    // Named ports are the config's listeners, and the probes ask the admin API's paths.
    let port = |name: &str| {
        c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["containerPort"].as_u64().unwrap())
            .unwrap_or_else(|| panic!("no container port named {name}"))
    };
    assert_eq!(port("http"), u64::from(config.listen.port()));
    assert_eq!(port("admin"), u64::from(admin.listen.port()));
    for (probe, path) in [
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
    ] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"], "admin", "{probe}");
    }
    let service = yaml("kubernetes/service.yaml");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");

    // The shipped config draws no warning (a shutdown_grace shorter than a forward would).
    assert_eq!(config.warnings(), Vec::<String>::new());
    // A preStop hook holds SIGTERM back while the pod's endpoint removal propagates: the
    // native sleep action, which needs nothing in the image (it has no shell).
    let sleep = &c["lifecycle"]["preStop"]["sleep"]["seconds"];
    assert!(
        !sleep.is_null(),
        "a preStop sleep hook: {:?}",
        c["lifecycle"]
    );
    let pre_stop = seconds(sleep);
    assert!(pre_stop > 0, "preStop sleeps {pre_stop}s");
    assert!(
        c["lifecycle"]["preStop"]["exec"].is_null(),
        "no shell command: the image has no shell"
    );
    // Everything that runs between the pod's removal and SIGKILL fits in the grace period
    // with a margin (the exit itself): the preStop sleep, then drain_delay, then
    // shutdown_grace.
    let grace = seconds(&pod["terminationGracePeriodSeconds"]);
    let drain = config.server.drain_delay.as_secs();
    let shutdown = config.server.shutdown_grace.as_secs();
    const MARGIN: u64 = 5;
    assert!(
        grace >= pre_stop + drain + shutdown + MARGIN,
        "terminationGracePeriodSeconds {grace} must be at least preStop {pre_stop}s + drain_delay {drain}s + shutdown_grace {shutdown}s + {MARGIN}s"
    );
    // The kubelet sees /readyz fail before the listener closes.
    let readiness = &c["readinessProbe"];
    let noticed = seconds(&readiness["periodSeconds"]) * seconds(&readiness["failureThreshold"]);
    assert!(
        drain >= noticed,
        "drain_delay {drain}s must cover the readiness probe's period x failureThreshold ({noticed}s)"
    );

    // Non-root (the image's user), nothing writable, requests and a memory limit.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(pod["securityContext"]["runAsUser"], 10001);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert!(c["resources"]["requests"]["cpu"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());

    // One selector for all four.
    let labels = &deployment["spec"]["selector"]["matchLabels"];
    assert_eq!(&pod["containers"][0]["name"], "idemgate");
    assert_eq!(
        &deployment["spec"]["template"]["metadata"]["labels"],
        labels
    );
    assert_eq!(&service["spec"]["selector"], labels);
    assert_eq!(
        &yaml("kubernetes/pdb.yaml")["spec"]["selector"]["matchLabels"],
        labels
    );
}

/// Every sample name the gateway can export: a registry with one sample in every family
/// (an empty family is not written at all).
fn exported_names() -> std::collections::BTreeSet<String> {
    let store = StoreMetrics::default();
    store.observe("claim", Duration::from_millis(1));
    store.pool_wait.observe(0.001);
    store
        .pool
        .get_or_create(&StateLabel { state: "waiting" })
        .set(0);
    let m = Metrics::new(&store);
    m.request("payments", outcome::FORWARDED, 200);
    m.observed("payments", idemgate::metrics::observed::WOULD_REPLAY);
    m.lease("payments", "taken_over");
    m.upstream("payments", Duration::from_millis(1));
    m.encode(Format::Text)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

#[test]
fn the_alert_rules_name_only_metrics_the_gateway_exports() {
    let rules = yaml("prometheus/alerts.yml");
    let exported = exported_names();
    let mut checked = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let expr = rule["expr"].as_str().unwrap();
            for (i, _) in expr.match_indices("idemgate_") {
                let name: String = expr[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(
                    exported.contains(&name),
                    "alert {}: {name} is not exported (exported: {exported:?})",
                    rule["alert"]
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 8, "only {checked} metric names checked");
    // And the outcome and event names they filter on are the gateway's.
    let text = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    for name in [
        outcome::STORE_UNAVAILABLE,
        outcome::BYPASSED,
        outcome::UPSTREAM_UNAVAILABLE,
        outcome::UPSTREAM_TIMEOUT,
        outcome::OUTCOME_UNKNOWN,
    ] {
        assert!(text.contains(name), "{name}");
    }
}

/// promtool, or a loud failure: CI installs it (Debian's `prometheus` package).
fn promtool() -> std::process::Command {
    let found = std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "promtool is missing: install the Debian package `prometheus` (.ci/run does)"
    );
    std::process::Command::new("promtool")
}

#[test]
fn promtool_accepts_the_alert_rules_and_their_unit_tests() {
    for args in [
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts.test.yml"],
    ] {
        let out = promtool()
            .args(args)
            .current_dir(deploy("prometheus"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test]
async fn promtool_accepts_a_live_gateways_metrics() {
    let up = Upstream::start().await;
    // With an observe route too, so its counters are linted.
    let shadow = "  - name: shadow\n    match: { path_prefix: /shadow }\n    upstream: app\n    idempotency: { mode: observe }\n  - name: rest\n";
    let (gw, _) = TestGateway::on_with(Backend::Postgres, &up, "", |y| {
        y.patch("  - name: rest\n", shadow)
    })
    .await;
    let c = client();
    post(&c, &gw, "acct", "k1", "x").await;
    post(&c, &gw, "acct", "k1", "x").await;
    post(&c, &gw, "acct", "k1", "other").await;
    send(&c, Method::GET, &gw.url("/plain"), &[], "").await;
    for _ in 0..2 {
        post_to(&c, &gw.url("/shadow"), "acct", "k1", "x").await;
    }
    let url = format!("http://{}/metrics", gw.admin);

    // What Prometheus asks for, it gets.
    let prometheus_accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let open = send(&c, Method::GET, &url, &[("accept", prometheus_accept)], "").await;
    assert_eq!(open.status, 200);
    assert!(
        open.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text; version=1.0.0")
    );
    assert!(String::from_utf8_lossy(&open.body).ends_with("# EOF\n"));

    // Anyone else gets the text format, which promtool lints.
    let text = send(&c, Method::GET, &url, &[], "").await;
    assert_eq!(text.status, 200);
    assert_eq!(
        text.headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert!(String::from_utf8_lossy(&text.body).contains("idemgate_requests_total{"));
    assert!(
        String::from_utf8_lossy(&text.body)
            .contains("idemgate_observed_total{route=\"shadow\",outcome=\"would_replay\"} 1\n")
    );
    let mut child = tokio::process::Command::from(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&text.body).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics:\n{said}\non:\n{}",
        String::from_utf8_lossy(&text.body)
    );
}
