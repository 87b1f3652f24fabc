//! `deploy/`: the Kubernetes manifests agree with the config they mount and with the
//! binary's endpoints; the Prometheus alerts and the Grafana dashboard query only series a
//! live gateway exports; every alert links to its runbook in docs/operations.md; and
//! promtool accepts the rules, their unit tests, every dashboard expression and a live
//! gateway's `/metrics`.

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

/// Every expression of the Grafana dashboard, its variables replaced by values Grafana would
/// put in (`$route` by the "All" value), with where it is (panel title, refId).
fn dashboard_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(deploy("grafana/idemgate.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let concrete = expr
                .replace("$__rate_interval", "1m")
                .replace("$__interval", "1m")
                .replace("$__range", "1h")
                .replace("$route", ".*");
            assert!(!concrete.contains('$'), "a variable left in {concrete}");
            exprs.push((format!("{} {}", panel["title"], target["refId"]), concrete));
        }
    }
    exprs
}

/// The metric names `expr` selects: `idemgate_*` and `process_*` identifiers (label values
/// are quoted and never start so).
fn queried_names(expr: &str) -> Vec<String> {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| word(c)) {
        let after = &rest[start..];
        let len = after.find(|c: char| !word(c)).unwrap_or(after.len());
        let ident = &after[..len];
        if ident.starts_with("idemgate_") || ident.starts_with("process_") {
            names.push(ident.to_string());
        }
        rest = &after[len..];
    }
    names
}

/// The sample names a scrape in the text format holds, from its `# TYPE` lines: a
/// histogram `h` as `h_bucket`, `h_sum` and `h_count`, a counter as its `_total` name (the
/// text format's `TYPE` line names it so), a gauge as itself; each with at least one sample.
fn sample_names(scrape: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for line in scrape.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        let samples: Vec<String> = match kind {
            "histogram" => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{name}{s}"))
                .collect(),
            _ => vec![name.to_string()],
        };
        for sample in samples {
            let written = scrape.lines().any(|l| {
                l.strip_prefix(sample.as_str())
                    .is_some_and(|r| r.starts_with(['{', ' ']))
            });
            assert!(written, "{sample} has a TYPE and no sample:\n{scrape}");
            names.insert(sample);
        }
    }
    names
}

/// Checks that every name the alerts and the dashboard query is in `scrape`, a live
/// gateway's `/metrics` in the text format.
fn assert_queried_names_are_exported(scrape: &str) {
    let exported = sample_names(scrape);
    let mut queried: Vec<(String, String)> = dashboard_exprs();
    let rules = yaml("prometheus/alerts.yml");
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            queried.push((
                format!("alert {}", rule["alert"]),
                rule["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let mut checked = 0;
    for (place, expr) in &queried {
        for name in queried_names(expr) {
            assert!(
                exported.contains(&name),
                "{place}: {name} is not exported by a live gateway (exported: {exported:?})"
            );
            checked += 1;
        }
    }
    assert!(checked >= 50, "only {checked} names checked");
}

#[test]
fn the_dashboard_has_its_variables_and_every_expression_parses() {
    let text = std::fs::read_to_string(deploy("grafana/idemgate.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 36);
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"))
    };
    assert_eq!(variable("datasource")["type"], "datasource");
    assert_eq!(variable("datasource")["query"], "prometheus");
    assert_eq!(variable("route")["type"], "query");
    // Every panel and query reads the chosen data source.
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{}",
            panel["title"]
        );
        for target in panel["targets"].as_array().unwrap() {
            assert_eq!(target["datasource"]["uid"], "${datasource}");
        }
    }
    // Each expression, as a recording rule, through promtool's parser.
    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 25, "{} expressions", exprs.len());
    let rules: Vec<Value> = exprs
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| serde_json::json!({ "record": format!("dashboard:expr_{i}"), "expr": expr }))
        .collect();
    let file = serde_json::json!({ "groups": [ { "name": "dashboard", "rules": rules } ] });
    let dir = std::env::temp_dir().join(format!("idemgate-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dashboard.rules.json");
    // JSON is YAML: promtool reads it as a rules file.
    std::fs::write(&path, serde_json::to_string_pretty(&file).unwrap()).unwrap();
    let out = promtool()
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool check rules on the dashboard's expressions:\n{said}"
    );
    assert!(
        said.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GitHub's anchor of a Markdown heading: lower case, spaces to dashes, other punctuation
/// dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_links_to_its_runbook_section_in_the_operations_guide() {
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
            .unwrap();
    let anchors: Vec<String> = guide
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    let rules = yaml("prometheus/alerts.yml");
    let mut alerts = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let name = rule["alert"].as_str().unwrap();
            let url = rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_else(|| panic!("{name} has no runbook_url"));
            let (file, section) = url.split_once('#').unwrap();
            assert_eq!(file, "docs/operations.md", "{name}");
            assert_eq!(section, name.to_lowercase(), "{name}: its own section");
            assert!(
                anchors.iter().any(|a| a == section),
                "{name}: no section #{section} in docs/operations.md"
            );
            alerts += 1;
        }
    }
    assert!(alerts >= 10, "{alerts} alerts");
    // The guide links the dashboard next to the alerts.
    assert!(guide.contains("(../deploy/grafana/idemgate.json)"));
}

#[test]
fn the_podmonitor_gives_the_job_name_idemgate_down_expects() {
    let monitor = yaml("kubernetes/podmonitor.yaml");
    assert_eq!(monitor["kind"], "PodMonitor");
    let deployment = yaml("kubernetes/deployment.yaml");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&monitor["spec"]["selector"]["matchLabels"], pod_labels);
    // jobLabel names the pod label whose value becomes the job.
    let job_label = monitor["spec"]["jobLabel"].as_str().unwrap();
    assert_eq!(pod_labels[job_label], "idemgate");
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["port"], "admin");
    assert_eq!(endpoint["path"], "/metrics");
    // The alert matches that job, and the annotation scrape's copy of the same pod label.
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    assert!(rules.contains("up{job=\"idemgate\"} == 0"));
    let copied = job_label.replace(['.', '/'], "_");
    assert!(
        rules.contains(&format!("up{{{copied}=\"idemgate\"}} == 0")),
        "{copied}"
    );
}

#[tokio::test]
async fn promtool_accepts_a_live_gateways_metrics() {
    // The plain GET below is the upstream's second execution: a 500.
    let up = Upstream::start_with(Behavior {
        script: vec![201, 500],
        ..Default::default()
    })
    .await;
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
    let scrape = String::from_utf8_lossy(&text.body).to_string();
    assert!(
        scrape.contains(
            "idemgate_requests_total{route=\"rest\",outcome=\"proxied\",status_class=\"5xx\"} 1\n"
        ),
        "{scrape}"
    );
    assert_queried_names_are_exported(&scrape);
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
