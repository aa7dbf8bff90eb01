//! Rules reload while the real binary serves: every way a file can change, bad edits that
//! must change nothing, and a reload under load that must fail no request.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use support::turnstile::{Rules, Turnstile, descriptor, request, signal};

const WAIT: Duration = Duration::from_secs(5);

fn rules(domain: &str, limit: u32) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
    )
}

/// The limit in force for (domain, k=probe), or None when no rule applies.
async fn limit_of(t: &Turnstile, domain: &str) -> Option<u32> {
    limit_of_key(t, domain, "k").await
}

/// The limit in force for (domain, key=probe), or None when no rule applies.
async fn limit_of_key(t: &Turnstile, domain: &str, key: &str) -> Option<u32> {
    let mut r = request(domain, vec![descriptor(&[(key, "probe")])]);
    r.descriptors[0].hits_addend =
        Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
    let response = t.call(r).await.expect("call");
    response.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit)
}

/// Wait until the limit in force is `expected`; the time it took.
async fn wait_for(t: &Turnstile, domain: &str, expected: Option<u32>) -> Duration {
    wait_for_key(t, domain, "k", expected).await
}

/// Wait until the limit in force for (domain, key=probe) is `expected`; the time it took.
async fn wait_for_key(t: &Turnstile, domain: &str, key: &str, expected: Option<u32>) -> Duration {
    let start = Instant::now();
    loop {
        if limit_of_key(t, domain, key).await == expected {
            return start.elapsed();
        }
        assert!(start.elapsed() < WAIT, "limit never became {expected:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Wait until the Prometheus sample `series` is `expected` (a reload was attempted).
async fn wait_for_metric(t: &Turnstile, series: &str, expected: f64) {
    let start = Instant::now();
    while t.metric(series).await.unwrap_or(0.0) != expected {
        assert!(start.elapsed() < WAIT, "{series} never reached {expected}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn write_atomically(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[tokio::test]
async fn edits_in_place_and_renames_over_each_take_effect_once() {
    let r = Rules::new(&rules("d", 1));
    let t = Turnstile::start(r.path(), &[]).await;
    assert_eq!(limit_of(&t, "d").await, Some(1));
    let mut latencies = Vec::new();
    for i in 2..22 {
        if i % 2 == 0 {
            r.write("rules.yaml", &rules("d", i));
        } else {
            write_atomically(r.path(), "rules.yaml", &rules("d", i));
        }
        latencies.push(wait_for(&t, "d", Some(i)).await);
    }
    latencies.sort();
    println!(
        "reload latency over {} reloads: median {:?}, max {:?}",
        latencies.len(),
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("ratelimit_service_config_load_success 21"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_kubernetes_configmap_symlink_swap_is_followed() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let version = |n: u32| {
        let d = root.join(format!("..2026_{n}"));
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("rules.yaml"), rules("cm", n)).unwrap();
        d
    };
    std::os::unix::fs::symlink(version(1), root.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", root.join("rules.yaml")).unwrap();
    let t = Turnstile::start(root, &[]).await;
    assert_eq!(limit_of(&t, "cm").await, Some(1));

    let next = version(2);
    std::os::unix::fs::symlink(&next, root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    wait_for(&t, "cm", Some(2)).await;
}

#[tokio::test]
async fn a_bad_edit_keeps_the_rules_in_force_until_it_is_fixed() {
    let r = Rules::new(&rules("d", 3));
    let t = Turnstile::start(r.path(), &[]).await;
    let mut errors = 0.0;
    // Valid rules followed by a comment that takes the file past 16 MiB.
    let huge = format!("{}# {}\n", rules("d", 7), "x".repeat(16 << 20));
    for broken in [
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 7",
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 7}\n",
        "domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: hour, requests_per_unit: 7}\n",
        "",
        // Once crashed the process: the reload runs on a worker thread's small stack.
        support::turnstile::nested_rules("d", 2_000).as_str(),
        // A key twice: one of its values would be lost.
        "domain: d\ndomain: e\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 7}\n",
        huge.as_str(),
    ] {
        r.write("rules.yaml", broken);
        errors += 1.0;
        wait_for_metric(&t, "ratelimit_service_config_load_error", errors).await;
        assert_eq!(limit_of(&t, "d").await, Some(3), "after {broken:?}");
    }
    assert_eq!(t.http_get("/healthcheck").await.unwrap().0, 200);
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains(&format!("ratelimit_service_config_load_error {errors}")),
        "{metrics}"
    );
    r.write("rules.yaml", &rules("d", 7));
    wait_for(&t, "d", Some(7)).await;
}

#[tokio::test]
async fn a_deleted_domain_file_removes_its_rules_and_sighup_forces_a_reload() {
    let r = Rules::new(&rules("one", 1));
    r.write("two.yaml", &rules("two", 2));
    let t = Turnstile::start(r.path(), &[]).await;
    assert_eq!(limit_of(&t, "two").await, Some(2));
    std::fs::remove_file(r.path().join("two.yaml")).unwrap();
    wait_for(&t, "two", None).await;
    assert_eq!(limit_of(&t, "one").await, Some(1));

    // Poll so rarely that only SIGHUP can trigger the reload. The poller scans the files as
    // it is made, before turnstile serves: the edit comes after that scan. A second instance
    // polling often is the control: once it has the edit, a poller could have seen it.
    let polled = Rules::new(&rules("p", 1));
    let t = Turnstile::start(polled.path(), &["--config-poll-interval", "1h"]).await;
    let control = Turnstile::start(polled.path(), &["--config-poll-interval", "50ms"]).await;
    polled.write("rules.yaml", &rules("p", 9));
    wait_for(&control, "p", Some(9)).await;
    assert_eq!(
        limit_of(&t, "p").await,
        Some(1),
        "no reload without a trigger"
    );
    signal(t.pid(), "HUP");
    wait_for(&t, "p", Some(9)).await;
}

#[tokio::test]
async fn counters_survive_a_reload_that_only_changes_the_number() {
    let r = Rules::new(&rules("d", 3));
    let t = Turnstile::start(r.path(), &[]).await;
    let hit = || request("d", vec![descriptor(&[("k", "user")])]);
    t.call(hit()).await.unwrap();
    t.call(hit()).await.unwrap();
    r.write("rules.yaml", &rules("d", 5));
    wait_for(&t, "d", Some(5)).await;
    let after = t.call(hit()).await.unwrap();
    assert_eq!(
        after.statuses[0].limit_remaining, 2,
        "5 - (2 before + 1 now)"
    );
}

#[tokio::test]
async fn reloads_under_load_fail_no_request() {
    let r = Rules::new(&rules("d", 1_000_000));
    let t = Turnstile::start(r.path(), &[]).await;
    let channel = t.channel().await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..64)
        .map(|i| {
            let mut client =
                envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(
                    channel.clone(),
                );
            let stop = stop.clone();
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, 0u32);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let value = format!("w{i}");
                    match client
                        .should_rate_limit(request("d", vec![descriptor(&[("k", &value)])]))
                        .await
                    {
                        Ok(r) if r.get_ref().overall_code == Code::Ok as i32 => ok += 1,
                        _ => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    for i in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        r.write("rules.yaml", &rules("d", 2_000_000 + i));
        wait_for(&t, "d", Some(2_000_000 + i)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut ok, mut failed) = (0, 0);
    for w in workers {
        let (o, f) = w.await.unwrap();
        ok += o;
        failed += f;
    }
    println!("{ok} requests across 5 reloads, {failed} failed");
    assert!(ok > 64, "the load ran");
    assert_eq!(failed, 0);
}

#[tokio::test]
async fn the_reference_runtime_layout_loads_and_follows_a_root_symlink_swap() {
    // RUNTIME_ROOT=<dir>/current -> v1, rules in current/ratelimit/config/*, any file name,
    // two files of one domain merged (MERGE_DOMAIN_CONFIG), dotfiles skipped.
    let dir = tempfile::tempdir().unwrap();
    let version = |n: u32| {
        let config = dir.path().join(format!("v{n}/ratelimit/config"));
        std::fs::create_dir_all(&config).unwrap();
        std::fs::write(config.join("a.conf"), rules("rt", n)).unwrap();
        std::fs::write(
            config.join("b"),
            "domain: rt\ndescriptors:\n  - key: other\n    rate_limit: {unit: hour, requests_per_unit: 7}\n",
        )
        .unwrap();
        std::fs::write(config.join(".editor-swap"), "not: [yaml").unwrap();
        dir.path().join(format!("v{n}"))
    };
    let current = dir.path().join("current");
    std::os::unix::fs::symlink(version(1), &current).unwrap();
    let root = current.to_str().unwrap();
    let env = [
        ("RUNTIME_ROOT", root),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("MERGE_DOMAIN_CONFIG", "true"),
    ];
    let t = Turnstile::start_with(&[], &env).await;
    assert_eq!(limit_of(&t, "rt").await, Some(1));

    let next = version(2);
    let tmp = dir.path().join("current.tmp");
    std::os::unix::fs::symlink(next, &tmp).unwrap();
    std::fs::rename(&tmp, &current).unwrap();
    wait_for(&t, "rt", Some(2)).await;
}

/// A request sees the rules before a reload or after it, never some of each: two limits
/// changed by one reload always answer the same number within one response.
#[tokio::test]
async fn a_request_sees_the_old_rules_or_the_new_never_a_mix() {
    let both = |limit: u32| {
        format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n  - key: b\n    rate_limit: {{unit: hour, requests_per_unit: {limit}}}\n"
        )
    };
    let r = Rules::new(&both(1));
    let t = Turnstile::start(r.path(), &[]).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = tokio::spawn({
        let (channel, stop) = (t.channel().await, stop.clone());
        async move {
            let mut client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel);
            let mut seen = std::collections::BTreeSet::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut r = request(
                    "d",
                    vec![descriptor(&[("a", "x")]), descriptor(&[("b", "x")])],
                );
                for d in &mut r.descriptors {
                    d.hits_addend =
                        Some(envoy_types::pb::google::protobuf::UInt64Value { value: 0 });
                }
                let answer = client
                    .should_rate_limit(r)
                    .await
                    .expect("call")
                    .into_inner();
                let limits: Vec<Option<u32>> = answer
                    .statuses
                    .iter()
                    .map(|s| s.current_limit.as_ref().map(|l| l.requests_per_unit))
                    .collect();
                assert_eq!(limits[0], limits[1], "a mix of two rule sets: {limits:?}");
                seen.insert(limits[0]);
            }
            seen
        }
    });
    for limit in 2..=20 {
        write_atomically(r.path(), "rules.yaml", &both(limit));
        wait_for_key(&t, "d", "b", Some(limit)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = probe.await.expect("no response mixed two rule sets");
    assert!(seen.len() > 1, "the probe ran across reloads: {seen:?}");
}
