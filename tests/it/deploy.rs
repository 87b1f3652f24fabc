//! `deploy/`: the Kubernetes manifests agree with the config they mount and with the
//! binary's endpoints.

use std::path::{Path, PathBuf};

use idemgate::config::Config;
use serde_json::Value;

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

    // Everything that runs between the pod's removal and SIGKILL fits in the grace period.
    let grace = seconds(&pod["terminationGracePeriodSeconds"]);
    let pre_stop = seconds(&c["lifecycle"]["preStop"]["sleep"]["seconds"]);
    let shutdown = config.server.shutdown_grace.as_secs();
    assert!(
        grace > pre_stop + shutdown,
        "terminationGracePeriodSeconds {grace} must exceed preStop {pre_stop}s + shutdown_grace {shutdown}s"
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
