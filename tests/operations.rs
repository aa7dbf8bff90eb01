//! What operators import, proven on the real tools: the Prometheus rules under
//! `deploy/prometheus` pass `promtool check rules` and their unit tests (every alert fires,
//! stays quiet and resolves), the Grafana dashboard under `deploy/grafana` is one of Grafana's
//! model, every series either reads is one turnstile exports, and on a live Prometheus
//! scraping two instances on one Redis under load every dashboard query has data and the
//! "limiting off" alert fires when Redis stops and resolves when it returns.
//!
//! The live test runs the shipped rules with every duration divided by `SPEED_UP` (so `for:
//! 2m` is 20s), made from the shipped files by the test, never kept beside them.
//! Print the measured times with `cargo test --test operations -- --nocapture`.

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::load::{Load, Spec, Target};
use support::redis::RedisServer;
use support::turnstile::{Rules, Turnstile, descriptor, free_port, http10_get as get, request};
use yaml_rust2::{Yaml, YamlLoader};

const ALERTS: &str = "deploy/prometheus/alerts.yaml";
const RECORDING: &str = "deploy/prometheus/recording.yaml";
const ALERT_TESTS: &str = "deploy/prometheus/alerts_test.yaml";
const DASHBOARD: &str = "deploy/grafana/turnstile.json";
const DASHBOARD_CHECK: &str = "scripts/check_dashboard.py";

/// The live test's rules run this many times faster than the shipped ones.
const SPEED_UP: u32 = 6;
const SCRAPE_INTERVAL: Duration = Duration::from_secs(2);
const EVALUATION_INTERVAL: Duration = Duration::from_millis(500);

fn shipped(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(shipped(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A tool on PATH; None (the test skipped) when missing, except under CI, where the set-up
/// (scripts/test.sh) must have installed it.
fn tool(name: &str, test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: no {name} on PATH (scripts/test.sh installs the prometheus package)"
        );
        eprintln!("skipped {test}: no {name} on PATH (scripts/test.sh installs it)");
    }
    found
}

/// The Python of scripts/test.sh's venv, where scripts/requirements-test.txt is installed.
fn venv_python(test: &str) -> Option<PathBuf> {
    let python = std::env::temp_dir().join("turnstile-venv/bin/python");
    let has_model = python.is_file()
        && Command::new(&python)
            .args(["-c", "import grafana_foundation_sdk"])
            .status()
            .is_ok_and(|s| s.success());
    if !has_model {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: no grafana-foundation-sdk in {} (scripts/test.sh installs it)",
            python.display()
        );
        eprintln!("skipped {test}: no venv with grafana-foundation-sdk (scripts/test.sh makes it)");
        return None;
    }
    Some(python)
}

fn run(program: &Path, args: &[&str]) -> (bool, String) {
    let output = Command::new(program)
        .args(args)
        .current_dir(shipped("deploy/prometheus"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

/// The alerts of the shipped file, by name, with their `for`.
fn alerts() -> Vec<(String, String)> {
    let docs = YamlLoader::load_from_str(&read(ALERTS)).expect("alerts.yaml is YAML");
    let mut alerts = Vec::new();
    for group in docs[0]["groups"].as_vec().expect("groups") {
        for rule in group["rules"].as_vec().expect("rules") {
            if let Some(name) = rule["alert"].as_str() {
                let wait = rule["for"].as_str().unwrap_or("0s");
                alerts.push((name.to_owned(), wait.to_owned()));
            }
        }
    }
    alerts
}

/// A Prometheus duration such as `90s`, `2m` or `1h`.
fn duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(number * unit))
}

#[test]
fn the_alert_rules_pass_promtool_and_their_tests_cover_every_alert() {
    let test = "the_alert_rules_pass_promtool_and_their_tests_cover_every_alert";
    let Some(promtool) = tool("promtool", test) else {
        return;
    };
    let (ok, text) = run(
        &promtool,
        &["check", "rules", "recording.yaml", "alerts.yaml"],
    );
    assert!(ok, "promtool check rules:\n{text}");
    let (ok, text) = run(&promtool, &["test", "rules", "alerts_test.yaml"]);
    assert!(ok, "promtool test rules:\n{text}");

    // Each alert has a test that sees it quiet, then firing, then resolved.
    let docs = YamlLoader::load_from_str(&read(ALERT_TESTS)).expect("alerts_test.yaml is YAML");
    let alerts = alerts();
    assert!(alerts.len() >= 5, "{alerts:?}");
    for (alert, _) in &alerts {
        let covered = docs[0]["tests"]
            .as_vec()
            .expect("tests")
            .iter()
            .any(|case| {
                let mut evals: Vec<(Duration, bool)> = case["alert_rule_test"]
                    .as_vec()
                    .into_iter()
                    .flatten()
                    .filter(|eval| eval["alertname"].as_str() == Some(alert))
                    .map(|eval| {
                        let at = duration(eval["eval_time"].as_str().expect("eval_time"))
                            .expect("an eval_time of one unit");
                        let fires = match &eval["exp_alerts"] {
                            Yaml::Array(expected) => !expected.is_empty(),
                            // An alias of a list written once above.
                            Yaml::Alias(_) => true,
                            other => panic!("{alert}: exp_alerts {other:?}"),
                        };
                        (at, fires)
                    })
                    .collect();
                evals.sort();
                let first = evals.iter().position(|(_, fires)| *fires);
                first.is_some_and(|first| {
                    evals[..first].iter().any(|(_, fires)| !fires)
                        && evals[first..].iter().any(|(_, fires)| !fires)
                })
            });
        assert!(
            covered,
            "{alert}: no test in {ALERT_TESTS} sees it quiet, firing, then resolved"
        );
    }
}

/// Every `expr` of the dashboard's panels, with its panel's title.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().expect("a panel title").to_owned();
            let expr = target["expr"].as_str().expect("a PromQL expr").to_owned();
            queries.push((title, expr));
        }
    }
    queries
}

/// The dashboard's variables of type `query`, as (name, query).
fn dashboard_variables(dashboard: &Value) -> Vec<(String, String)> {
    dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let name = v["name"].as_str().expect("a name").to_owned();
            let query = v["query"]["query"].as_str().expect("a query").to_owned();
            (name, query)
        })
        .collect()
}

/// The metric names a PromQL text reads: identifiers of turnstile's or the reference's
/// families, histogram suffixes taken off. Recorded series (`turnstile:...`) are left out:
/// recording.yaml makes them.
fn series_read(promql: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = promql.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
        if word(bytes[i]) && (i == 0 || !word(bytes[i - 1])) {
            let end = (i..bytes.len())
                .find(|&j| !word(bytes[j]))
                .unwrap_or(bytes.len());
            let name = &promql[i..end];
            let quoted = i > 0 && bytes[i - 1] == b'"';
            if !quoted
                && !name.contains(':')
                && (name.starts_with("turnstile_") || name.starts_with("ratelimit_"))
            {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .unwrap_or(name);
                names.push(family.to_owned());
            }
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

/// Every word (`[A-Za-z0-9_.]+`) of the files under `dir`, with dots read as underscores: a
/// series is named in the code either as itself or by the statsd name it is mapped from.
fn words(dir: &Path, into: &mut HashSet<String>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            words(&path, into);
        } else if let Ok(text) = std::fs::read_to_string(&path) {
            let word = |c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.');
            into.extend(text.split(word).map(|w| w.replace('.', "_")));
        }
    }
}

#[test]
fn the_dashboard_is_grafanas_model_and_reads_only_exported_series() {
    let test = "the_dashboard_is_grafanas_model_and_reads_only_exported_series";
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).expect("dashboard JSON");

    // A data-source variable, used by every panel and query; no label value written in.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus data-source variable"
    );
    let mut ids = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().expect("a title");
        ids.push(panel["id"].as_u64().expect("a numeric id"));
        let grid = &panel["gridPos"];
        let (x, w) = (grid["x"].as_u64(), grid["w"].as_u64());
        assert!(
            matches!((x, w), (Some(x), Some(w)) if w > 0 && x + w <= 24)
                && grid["h"].as_u64() > Some(0),
            "{title}: gridPos {grid}"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        for target in panel["targets"].as_array().expect("targets") {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
        }
    }
    let count = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), count, "panel ids are unique");

    let declared: Vec<String> = dashboard_variables(&dashboard)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let queries: Vec<String> = dashboard_queries(&dashboard)
        .into_iter()
        .map(|(_, expr)| expr)
        .chain(
            dashboard_variables(&dashboard)
                .into_iter()
                .map(|(_, query)| query),
        )
        .collect();
    assert!(queries.len() >= 20, "{} queries", queries.len());
    for query in &queries {
        // Label values are variables; the only constant is the gRPC method Envoy calls.
        let mut rest = query.as_str();
        while let Some(at) = rest.find('"') {
            let after = &rest[at + 1..];
            let end = after.find('"').expect("a closed string");
            let value = &after[..end];
            let label_matcher = rest[..at].ends_with('=') || rest[..at].ends_with("=~");
            if label_matcher {
                assert!(
                    value.starts_with('$') || value == "ShouldRateLimit",
                    "a label value written in: {value:?} in {query}"
                );
            }
            rest = &after[end + 1..];
        }
        for (at, _) in query.match_indices('$') {
            let name: String = query[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                declared.contains(&name) || name == "__rate_interval",
                "${name} is not a variable of the dashboard: {query}"
            );
        }
    }

    // Every series read, by the dashboard or the rules, is one the code exports.
    let mut exported = HashSet::new();
    words(&shipped("src"), &mut exported);
    let rules = read(ALERTS) + &read(RECORDING);
    let mut read_series: Vec<String> = queries.iter().flat_map(|q| series_read(q)).collect();
    read_series.extend(series_read(&rules));
    read_series.sort();
    read_series.dedup();
    assert!(read_series.len() >= 20, "{read_series:?}");
    for name in &read_series {
        assert!(
            exported.contains(name),
            "{name} is read but not exported by turnstile (not named in src/)"
        );
    }
    // And every recorded series read is one recording.yaml makes.
    for query in queries.iter().chain([&rules]) {
        for (at, _) in query.match_indices("turnstile:") {
            let name: String = query[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            assert!(
                read(RECORDING).contains(&format!("record: {name}\n")),
                "{name} is not recorded by {RECORDING}"
            );
        }
    }

    // Grafana's own model: the file decodes and encodes back unchanged.
    let Some(python) = venv_python(test) else {
        return;
    };
    let output = Command::new(python)
        .arg(shipped(DASHBOARD_CHECK))
        .arg(shipped(DASHBOARD))
        .output()
        .expect("run the dashboard check");
    assert!(
        output.status.success(),
        "{DASHBOARD} against Grafana's model:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `text` with every duration of a rule (`for:` and range selectors) divided by `by`.
fn sped_up(text: &str, by: u32) -> String {
    let shorter = |d: &str| {
        let d = duration(d).unwrap_or_else(|| panic!("a duration of one unit, not {d:?}"));
        format!("{}ms", (d / by).as_millis())
    };
    let mut out = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(wait) = trimmed.strip_prefix("for: ") {
            let indent = &line[..line.len() - trimmed.len()];
            out.push_str(&format!("{indent}for: {}\n", shorter(wait.trim())));
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find('[') {
            out.push_str(&rest[..=at]);
            let after = &rest[at + 1..];
            let end = after.find([']', ':']).expect("a closed range");
            out.push_str(&shorter(&after[..end]));
            rest = &after[end..];
        }
        out.push_str(rest);
        out.push('\n');
    }
    out
}

#[test]
fn sped_up_rules_keep_everything_but_their_durations() {
    let text = "      - alert: A\n        expr: rate(x[1m]) > 0 or y[5m:30s]\n        for: 2m\n";
    assert_eq!(
        sped_up(text, 6),
        "      - alert: A\n        expr: rate(x[10000ms]) > 0 or y[50000ms:30s]\n        for: 20000ms\n"
    );
}

/// A Prometheus server on a loopback port, killed (by PID) when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scraping `targets` as job `turnstile`, with the shipped rules sped up.
    async fn start(binary: &Path, targets: &[SocketAddr]) -> Prometheus {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut rule_files = Vec::new();
        for rules in [RECORDING, ALERTS] {
            let path = dir
                .path()
                .join(Path::new(rules).file_name().expect("a file"));
            std::fs::write(&path, sped_up(&read(rules), SPEED_UP)).expect("write rules");
            rule_files.push(format!("  - {}\n", path.display()));
        }
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: {}ms\n  evaluation_interval: {}ms\nrule_files:\n{}\
             scrape_configs:\n  - job_name: turnstile\n    static_configs:\n      - targets: [{}]\n",
            SCRAPE_INTERVAL.as_millis(),
            EVALUATION_INTERVAL.as_millis(),
            rule_files.concat(),
            targets.join(", ")
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("log")).expect("log file"),
            ))
            .spawn()
            .expect("spawn prometheus");
        let mut prometheus = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!("prometheus exited: {status}\n{}", prometheus.log());
            }
            if let Ok((200, _)) = get(addr, "/-/ready").await {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready:\n{}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("log")).unwrap_or_default()
    }

    /// The result of an instant query (`data.result`).
    async fn query(&self, promql: &str) -> Vec<Value> {
        let path = format!("/api/v1/query?query={}", encoded(promql));
        let (status, body) = get(self.addr, &path).await.expect("query prometheus");
        let answer: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {status} {body}"));
        assert_eq!(answer["status"], "success", "{promql}: {body}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The states of the alerts named `name` (`pending`, `firing`), by instance.
    async fn alert(&self, name: &str) -> Vec<(String, String)> {
        let (_, body) = get(self.addr, "/api/v1/alerts").await.expect("alerts");
        let answer: Value = serde_json::from_str(&body).expect("alerts JSON");
        answer["data"]["alerts"]
            .as_array()
            .expect("alerts")
            .iter()
            .filter(|a| a["labels"]["alertname"] == name)
            .map(|a| {
                let instance = a["labels"]["instance"].as_str().unwrap_or("").to_owned();
                (instance, a["state"].as_str().unwrap_or("").to_owned())
            })
            .collect()
    }

    /// Wait (bounded) until `done` holds of the states of alert `name`; the time it took.
    async fn wait_alert(
        &self,
        name: &str,
        within: Duration,
        what: &str,
        done: impl Fn(&[(String, String)]) -> bool,
    ) -> Duration {
        let started = Instant::now();
        loop {
            let states = self.alert(name).await;
            if done(&states) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "{name} not {what} within {within:?}: {states:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encoding of a query parameter.
fn encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

const RULES: &str = "\
domain: ops
descriptors:
  - key: plan
    value: free
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 20}
";

/// A dashboard query as Grafana sends it, with the variables set to everything of job
/// `turnstile` and a rate window that covers the whole test.
fn substituted(query: &str) -> String {
    query
        .replace("$__rate_interval", "5m")
        .replace("$job", "turnstile")
        .replace("$instance", ".*")
        .replace("$domain", ".*")
}

/// `label_values(selector, label)` as a query with a result when the variable has values.
fn variable_query(query: &str) -> String {
    let inner = query
        .strip_prefix("label_values(")
        .and_then(|q| q.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not label_values(): {query}"));
    let (selector, label) = inner
        .rsplit_once(',')
        .expect("label_values(selector, label)");
    format!("group by ({}) ({})", label.trim(), selector.trim())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_prometheus_shows_every_panel_and_alerts_while_redis_is_down() {
    let test = "a_live_prometheus_shows_every_panel_and_alerts_while_redis_is_down";
    let Some(binary) = tool("prometheus", test) else {
        return;
    };
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    // The second in the reference's global shadow mode, so that its series have data too.
    let enforcing = vec!["--redis-url".to_owned(), redis.url()];
    let mut shadowing = enforcing.clone();
    shadowing.push("--shadow-mode".to_owned());
    let instances = Turnstile::start_all(rules.path(), &[enforcing, shadowing]).await;
    let prometheus = Prometheus::start(&binary, &[instances[0].http, instances[1].http]).await;

    // Each call hits an enforced rule (50/s) and a shadow-mode one (20/s), on both instances.
    let call = request(
        "ops",
        vec![
            descriptor(&[("plan", "free"), ("user", "u1")]),
            descriptor(&[("tenant", "t1")]),
        ],
    );
    let mut targets = Vec::new();
    for (id, instance) in instances.iter().enumerate() {
        targets.push(Target {
            id,
            channel: instance.channel().await,
            request: call.clone(),
        });
    }
    let mut spec = Spec::new(targets, 4);
    spec.pace = Duration::from_millis(5);
    spec.max_calls = 1_000_000;
    spec.max_time = Duration::from_secs(240);
    spec.call_timeout = Duration::from_secs(2);
    let load = Load::start(spec);

    let deadline = Instant::now() + Duration::from_secs(30);
    while prometheus.query("up == 1").await.len() < 2 {
        assert!(Instant::now() < deadline, "both instances scraped");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A bad rules file is refused, and mended: the refusal shows and clears.
    rules.write("broken.yaml", "domain: other\ndescriptors: [a, b]\n");
    let refused = "turnstile_rules_last_load_refused == 1";
    let deadline = Instant::now() + Duration::from_secs(30);
    while prometheus.query(refused).await.len() < 2 {
        assert!(Instant::now() < deadline, "the refused rules not seen");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    std::fs::remove_file(rules.path().join("broken.yaml")).expect("remove the bad file");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !prometheus.query(refused).await.is_empty() {
        assert!(Instant::now() < deadline, "the refusal not cleared");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Under load with Redis up, limiting is on: the alert does not fire for longer than it
    // would take to. A stray backend timeout on a busy machine may make it pending, which
    // is what its `for:` is for.
    let (name, wait) = alerts()
        .into_iter()
        .find(|(name, _)| name == "TurnstileLimitingOff")
        .expect("the limiting-off alert");
    let wait = duration(&wait).expect("its for:") / SPEED_UP;
    let quiet_until = Instant::now() + wait + 2 * SCRAPE_INTERVAL;
    let mut pending = 0;
    while Instant::now() < quiet_until {
        let states = prometheus.alert(&name).await;
        if states.iter().any(|(_, state)| state == "firing") {
            let errors = prometheus
                .query("sum by (instance, kind) (increase(turnstile_backend_errors[1m])) > 0")
                .await;
            panic!("{name} firing with Redis up: {states:?}\nbackend errors: {errors:?}");
        }
        pending += usize::from(!states.is_empty());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("{name} pending in {pending} looks while Redis was up, never firing");

    // Redis stops: firing on both instances within its for: plus two scrapes.
    redis.stop();
    let bound = wait + 2 * SCRAPE_INTERVAL;
    let fired = prometheus
        .wait_alert(&name, bound, "firing on both instances", |states| {
            states.len() == 2 && states.iter().all(|(_, state)| state == "firing")
        })
        .await;
    println!("{name} firing {fired:?} after Redis stopped (for: {wait:?}, bound {bound:?})");

    // Redis returns: resolved once the failures leave the rate window.
    redis.restart();
    let resolved = prometheus
        .wait_alert(&name, Duration::from_secs(60), "resolved", |states| {
            states.is_empty()
        })
        .await;
    println!("{name} resolved {resolved:?} after Redis returned");
    let answered = load.stop().await.len();
    println!("{answered} calls answered during the test");

    // Every panel's query, and every variable's, has data.
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).expect("dashboard JSON");
    let mut empty = Vec::new();
    let queries = dashboard_queries(&dashboard);
    for (title, expr) in &queries {
        let query = substituted(expr);
        if prometheus.query(&query).await.is_empty() {
            empty.push(format!("{title}: {query}"));
        }
    }
    for (name, query) in dashboard_variables(&dashboard) {
        let query = substituted(&variable_query(&query));
        if prometheus.query(&query).await.is_empty() {
            empty.push(format!("variable {name}: {query}"));
        }
    }
    assert!(
        empty.is_empty(),
        "queries without data:\n{}",
        empty.join("\n")
    );
    println!(
        "{} panel queries and their variables all have data",
        queries.len()
    );
}

mod traces {
    //! What an operator sees of a running turnstile. Traces: the real binary, tracing on by its
    //! settings (the reference's TRACING_* variables and the standard OTEL_* ones), exporting to
    //! an OTLP receiver run by the test (`support::otlp`), over gRPC and over HTTP. Each
    //! decision is one span with the domain and the outcome; the sampling ratio holds; a
    //! caller's `traceparent` is continued, a real Envoy's (1.40, its own OpenTelemetry tracing
    //! on) included; tracing off (or set off) sends nothing; settings that cannot work stop the
    //! start with a clear error.
    //!
    //! Every instance is stopped with SIGTERM before its spans are counted: shutting down
    //! flushes the exporter's queue, so after the exit nothing more can arrive.

    use crate::support;
    use std::io::Read;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use support::envoy::{self, Envoy, Upstream};
    use support::otlp::{Receiver, Span};
    use support::turnstile::{INHERITED_ENV, Rules, Turnstile, descriptor, request};
    use tokio::task::JoinSet;

    const RULES: &str = r#"
domain: traced
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free
    rate_limit: {unit: hour, requests_per_unit: 1000000}
"#;

    /// How long spans may take to arrive once their instance has exited.
    const ARRIVAL: Duration = Duration::from_secs(10);

    /// Export often, so the spans of a test leave while it runs and not only at shutdown.
    const QUICK_EXPORT: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "100");

    /// Variables (or resource attributes), as name and value.
    type Env<'a> = &'a [(&'a str, &'a str)];

    fn user(name: &str) -> RateLimitRequest {
        request("traced", vec![descriptor(&[("user", name)])])
    }

    fn free() -> RateLimitRequest {
        request("traced", vec![descriptor(&[("free", "x")])])
    }

    async fn start(rules: &Rules, env: &[(&str, &str)]) -> Turnstile {
        let config = rules.path().to_str().unwrap();
        Turnstile::start_with(&["--config", config], env).await
    }

    /// One call with these gRPC metadata.
    async fn call_with(
        t: &Turnstile,
        request: RateLimitRequest,
        metadata: &[(&'static str, &str)],
    ) -> Code {
        let mut call = tonic::Request::new(request);
        for (name, value) in metadata {
            call.metadata_mut().insert(*name, value.parse().unwrap());
        }
        let response = t.client().await.should_rate_limit(call).await.unwrap();
        Code::try_from(response.into_inner().overall_code).unwrap()
    }

    /// `calls` calls of `request`, over one connection, several in flight.
    async fn calls(t: &Turnstile, calls: usize, request: RateLimitRequest) {
        const IN_FLIGHT: usize = 8;
        let client = t.client().await;
        let mut tasks = JoinSet::new();
        for worker in 0..IN_FLIGHT {
            let (mut client, request) = (client.clone(), request.clone());
            let share = calls / IN_FLIGHT + usize::from(worker < calls % IN_FLIGHT);
            tasks.spawn(async move {
                for _ in 0..share {
                    client.should_rate_limit(request.clone()).await.unwrap();
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    }

    async fn stop(mut t: Turnstile) {
        let status = t.terminate().await;
        assert!(status.success(), "turnstile exited {status}");
    }

    fn attribute<'a>(span: &'a Span, key: &str) -> &'a str {
        span.attributes
            .get(key)
            .unwrap_or_else(|| panic!("no {key} in {span:?}"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_decision_is_a_span_with_its_domain_and_outcome() {
        let receiver = Receiver::start().await;
        let grpc = format!("http://{}", receiver.grpc);
        let http = format!("http://{}", receiver.http);
        // Rows: the settings, the port the spans must come in on, the resource they must carry.
        let rows: [(Env, &str, Env); 4] = [
            // Envoy Gateway's settings: TRACING_* and the endpoint; the reference's default
            // protocol is OTLP/HTTP.
            (
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
                    ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
                    ("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-7d4f"),
                    ("TRACING_SAMPLING_RATE", "1.0"),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", &http),
                ],
                "http",
                &[
                    ("service.name", "envoy-ratelimit"),
                    ("service.namespace", "envoy-gateway-system"),
                    ("service.instance.id", "envoy-ratelimit-7d4f"),
                ],
            ),
            // The reference's gRPC exporter, and its default service name.
            (
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", &grpc),
                ],
                "grpc",
                &[("service.name", "RateLimit")],
            ),
            // The standard variables alone: an endpoint turns tracing on.
            (
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", &grpc),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                    ("OTEL_SERVICE_NAME", "limiter"),
                ],
                "grpc",
                &[("service.name", "limiter")],
            ),
            (
                &[
                    (
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                        &format!("{http}/v1/traces"),
                    ),
                    (
                        "OTEL_RESOURCE_ATTRIBUTES",
                        "service.name=edge-limiter,service.instance.id=i-1",
                    ),
                ],
                "http",
                &[
                    ("service.name", "edge-limiter"),
                    ("service.instance.id", "i-1"),
                ],
            ),
        ];
        for (row, (env, protocol, resource)) in rows.into_iter().enumerate() {
            let rules = Rules::new(RULES);
            let mut env = env.to_vec();
            env.push(QUICK_EXPORT);
            let t = start(&rules, &env).await;
            let before = receiver.spans().len();
            let name = format!("row{row}");
            assert_eq!(call_with(&t, user(&name), &[]).await, Code::Ok);
            assert_eq!(call_with(&t, user(&name), &[]).await, Code::OverLimit);
            let unknown = request("nowhere", vec![descriptor(&[("user", "a")])]);
            assert_eq!(call_with(&t, unknown, &[]).await, Code::Ok);
            let invalid = request("", vec![descriptor(&[("user", "a")])]);
            let error = t
                .client()
                .await
                .should_rate_limit(invalid)
                .await
                .unwrap_err();
            assert_eq!(error.code(), tonic::Code::InvalidArgument);
            stop(t).await;

            let spans = receiver.wait_for_spans(before + 4, ARRIVAL).await;
            let spans = &spans[before..];
            assert_eq!(spans.len(), 4, "row {row}: {spans:#?}");
            let mut outcomes: Vec<(&str, &str)> = spans
                .iter()
                .map(|span| (attribute(span, "domain"), attribute(span, "outcome")))
                .collect();
            outcomes.sort();
            assert_eq!(
                outcomes,
                [
                    ("", "InvalidArgument"),
                    ("nowhere", "OK"),
                    ("traced", "OK"),
                    ("traced", "OVER_LIMIT"),
                ],
                "row {row}"
            );
            for span in spans {
                assert_eq!(span.name, "ShouldRateLimit", "row {row}");
                assert_eq!(span.protocol, protocol, "row {row}");
                assert_eq!(span.parent_span_id, "", "row {row}: a root span");
                for (key, value) in resource {
                    assert_eq!(
                        span.resource.get(*key).map(String::as_str),
                        Some(*value),
                        "row {row}: {key}"
                    );
                }
                if attribute(span, "domain") == "traced" {
                    // The backend's time, in microseconds: the memory backend decided.
                    attribute(span, "backend_time_us").parse::<u64>().unwrap();
                } else {
                    // No limit matched (or the request was refused): no backend call.
                    assert!(
                        !span.attributes.contains_key("backend_time_us"),
                        "row {row}: {span:?}"
                    );
                }
                // An error is the span's status; a refusal is an answer, not an error.
                let error = attribute(span, "outcome") == "InvalidArgument";
                assert_eq!(span.error, error, "row {row}: {span:?}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sampling_ratio_holds() {
        const CALLS: usize = 4_000;
        const RATIO: f64 = 0.25;
        let receiver = Receiver::start().await;
        let rules = Rules::new(RULES);
        let endpoint = format!("http://{}", receiver.grpc);
        let t = start(
            &rules,
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                ("TRACING_SAMPLING_RATE", "0.25"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                // Room for every sampled span: a drop would read as a low ratio.
                ("OTEL_BSP_MAX_QUEUE_SIZE", "8192"),
                QUICK_EXPORT,
            ],
        )
        .await;
        calls(&t, CALLS, free()).await;
        stop(t).await;

        // Binomial: each trace id is sampled with probability RATIO, independently. Five
        // standard deviations either way: a correct sampler fails this about once in 1.7 million.
        let mean = CALLS as f64 * RATIO;
        let sigma = (CALLS as f64 * RATIO * (1.0 - RATIO)).sqrt();
        let (low, high) = ((mean - 5.0 * sigma) as usize, (mean + 5.0 * sigma) as usize);
        let spans = receiver.wait_for_spans(low, ARRIVAL).await;
        println!(
            "{} of {CALLS} calls traced at ratio {RATIO} (expected {low} to {high})",
            spans.len()
        );
        assert!(
            (low..=high).contains(&spans.len()),
            "{} of {CALLS} calls traced at ratio {RATIO}: expected {low} to {high}",
            spans.len()
        );
        let mut traces: Vec<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
        traces.sort_unstable();
        traces.dedup();
        assert_eq!(
            traces.len(),
            spans.len(),
            "each decision is a trace of its own"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_callers_trace_context_is_continued() {
        const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
        const PARENT: &str = "00f067aa0ba902b7";
        let receiver = Receiver::start().await;
        let rules = Rules::new(RULES);
        let endpoint = format!("http://{}", receiver.grpc);
        // A ratio of zero: only a caller's sampled trace is traced (the parent decides).
        let t = start(
            &rules,
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                ("TRACING_SAMPLING_RATE", "0"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                QUICK_EXPORT,
            ],
        )
        .await;
        let sampled = format!("00-{TRACE}-{PARENT}-01");
        assert_eq!(
            call_with(&t, free(), &[("traceparent", &sampled)]).await,
            Code::Ok
        );
        // Rows the span must not come from: a caller's trace not sampled, no trace context, and
        // one that is not a trace context.
        let unsampled = format!("00-{}-{PARENT}-00", "1".repeat(32));
        for metadata in [
            &[("traceparent", unsampled.as_str())][..],
            &[],
            &[("traceparent", "00-not-a-trace-01")],
        ] {
            assert_eq!(call_with(&t, free(), metadata).await, Code::Ok);
        }
        stop(t).await;

        let spans = receiver.wait_for_spans(1, ARRIVAL).await;
        assert_eq!(spans.len(), 1, "{spans:#?}");
        assert_eq!(spans[0].trace_id, TRACE);
        assert_eq!(spans[0].parent_span_id, PARENT);
        assert_ne!(spans[0].span_id, PARENT);
        assert_eq!(attribute(&spans[0], "domain"), "traced");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tracing_off_sends_nothing() {
        let receiver = Receiver::start().await;
        let endpoint = format!("http://{}", receiver.grpc);
        // Rows: no tracing setting at all; an endpoint, with tracing set off by the reference's
        // switch; an endpoint, with the standard switch off.
        let rows: [Env; 3] = [
            &[],
            &[
                ("TRACING_ENABLED", "false"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ],
            &[
                ("OTEL_SDK_DISABLED", "true"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ],
        ];
        for (row, env) in rows.into_iter().enumerate() {
            let rules = Rules::new(RULES);
            let mut env = env.to_vec();
            env.extend([QUICK_EXPORT, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
            let t = start(&rules, &env).await;
            calls(&t, 200, free()).await;
            stop(t).await;
            assert_eq!(receiver.exports(), 0, "row {row}: {:?}", receiver.spans());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_collector_leaves_calls_answered() {
        // A port nothing listens on, and an export queue far smaller than the calls: spans
        // are dropped, calls are not.
        let closed = support::turnstile::free_port();
        let endpoint = format!("http://127.0.0.1:{closed}");
        for protocol in ["grpc", "http"] {
            let rules = Rules::new(RULES);
            let t = start(
                &rules,
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_EXPORTER_PROTOCOL", protocol),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
                    ("OTEL_BSP_MAX_QUEUE_SIZE", "64"),
                    QUICK_EXPORT,
                ],
            )
            .await;
            calls(&t, 2_000, free()).await;
            assert_eq!(
                call_with(&t, user("last"), &[]).await,
                Code::Ok,
                "{protocol}"
            );
            stop(t).await;
        }
    }

    #[test]
    fn settings_that_cannot_work_stop_the_start() {
        let rules = Rules::new(RULES);
        // Rows: the environment, and what stderr must say.
        let rows: [(Env, &str); 5] = [
            (
                &[("TRACING_SAMPLING_RATE", "1.5")],
                "not a ratio from 0 to 1",
            ),
            (
                &[("TRACING_SAMPLING_RATE", "half")],
                "not a ratio from 0 to 1",
            ),
            (
                &[("TRACING_EXPORTER_PROTOCOL", "thrift")],
                "invalid value 'thrift'",
            ),
            (&[("TRACING_ENABLED", "maybe")], "invalid value 'maybe'"),
            (
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
                ],
                "OTLP protocol \"http/json\" is not supported",
            ),
        ];
        for (env, expected) in rows {
            let mut child = Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args([
                    "serve",
                    "--grpc-addr",
                    "127.0.0.1:0",
                    "--http-addr",
                    "127.0.0.1:0",
                ])
                .args(["--debug-addr", "127.0.0.1:0", "--config"])
                .arg(rules.path())
                .env_clear()
                .envs(
                    INHERITED_ENV
                        .iter()
                        .filter_map(|k| Some((k, std::env::var_os(k)?))),
                )
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            // Bounded: an instance that started after all is killed, and the row fails.
            let deadline = Instant::now() + Duration::from_secs(10);
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break status;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("{env:?}: turnstile started");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut stderr = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            assert!(!status.success(), "{env:?}: {stderr}");
            assert!(stderr.contains(expected), "{env:?}: {stderr}");
        }
    }

    /// The shipped Envoy example with Envoy's own OpenTelemetry tracing on, exporting to
    /// `collector` over gRPC: Envoy then sends `traceparent` on its rate-limit call.
    fn traced_envoy_example(collector: std::net::SocketAddr) -> String {
        let yaml = envoy::example_text("envoy.yaml");
        let tracing = r#"                stat_prefix: ingress_http
                tracing:
                  provider:
                    name: envoy.tracers.opentelemetry
                    typed_config:
                      "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                      grpc_service:
                        envoy_grpc: {cluster_name: otel}
                      service_name: envoy
"#;
        let cluster = format!(
            r#"  clusters:
    - name: otel
      type: STATIC
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {{}}
      load_assignment:
        cluster_name: otel
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {{address: {}, port_value: {}}}
"#,
            collector.ip(),
            collector.port()
        );
        for anchor in [
            "                stat_prefix: ingress_http\n",
            "  clusters:\n",
        ] {
            assert_eq!(yaml.matches(anchor).count(), 1, "`{anchor}` in the example");
        }
        yaml.replace("                stat_prefix: ingress_http\n", tracing)
            .replace("  clusters:\n", &cluster)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn envoys_trace_continues_into_turnstile() {
        let Some(binary) = support::tools::envoy_or_skip("envoys_trace_continues_into_turnstile")
        else {
            return;
        };
        let receiver = Receiver::start().await;
        let rules = Rules::new(
            "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: hour, requests_per_unit: 100}\n",
        );
        let endpoint = format!("http://{}", receiver.grpc);
        let env = [
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            QUICK_EXPORT,
        ];
        let turnstiles = [start(&rules, &env).await, start(&rules, &env).await];
        let upstream = Upstream::start();
        let proxy = Envoy::start_yaml(
            &binary,
            &traced_envoy_example(receiver.grpc),
            [turnstiles[0].grpc, turnstiles[1].grpc],
            upstream.addr,
        )
        .await;
        let reply = proxy.get(std::net::Ipv4Addr::LOCALHOST, "/", &[]).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        for t in turnstiles {
            stop(t).await;
        }

        // Envoy exports its own spans on a timer of its own: wait for the decision's span and
        // the Envoy span it names as its parent.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans = receiver.spans();
            let decisions: Vec<&Span> = spans
                .iter()
                .filter(|s| s.name == "ShouldRateLimit")
                .collect();
            assert!(decisions.len() <= 1, "{decisions:#?}");
            if let Some(decision) = decisions.first() {
                assert_ne!(
                    decision.parent_span_id, "",
                    "not a child of Envoy's span: {decision:?}"
                );
                if let Some(parent) = spans.iter().find(|s| s.span_id == decision.parent_span_id) {
                    assert_eq!(parent.trace_id, decision.trace_id);
                    assert_eq!(
                        parent.resource.get("service.name").map(String::as_str),
                        Some("envoy")
                    );
                    assert_eq!(attribute(decision, "domain"), "edge");
                    assert_eq!(attribute(decision, "outcome"), "OK");
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no decision span with its Envoy parent: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
