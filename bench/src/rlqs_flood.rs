//! RLQS streams that report and never read their answers: what a stream costs the server
//! when its client stops reading (scripts/bench.sh, section d2, reads the server's memory
//! meanwhile). Each stream sends `--reports` reports of `--buckets` buckets at once, then
//! holds still for `--hold`; all close when the run ends.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use tokio::sync::mpsc;

/// Open RLQS streams that report and never read their answers.
#[derive(Parser)]
#[command(name = "turnstile-rlqs-flood", version)]
struct Flood {
    /// gRPC address of the service.
    #[arg(long, default_value = "127.0.0.1:8081")]
    target: String,
    /// Streams to open.
    #[arg(long, default_value_t = 1_024)]
    streams: usize,
    /// HTTP/2 connections the streams are spread over.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Reports each stream sends.
    #[arg(long, default_value_t = 1)]
    reports: usize,
    /// Buckets in each report, each its own `user` id.
    #[arg(long, default_value_t = 3_500)]
    buckets: usize,
    /// Bytes of padding in each bucket id (3 500 buckets of 250: a report of about 1 MB).
    #[arg(long, default_value_t = 250)]
    id_bytes: usize,
    /// The reports' domain.
    #[arg(long, default_value = "rlqs")]
    domain: String,
    /// How long the streams stay open once all are opened.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    hold: Duration,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let flood = Flood::parse();
    let mut channels = Vec::with_capacity(flood.connections);
    for _ in 0..flood.connections.max(1) {
        channels.push(turnstile_bench::channel(&flood.target).await?);
    }
    let padding = "x".repeat(flood.id_bytes);
    let (mut held, mut refused) = (Vec::with_capacity(flood.streams), 0);
    for stream in 0..flood.streams {
        let (reports, rx) = mpsc::channel(flood.reports.max(1));
        for report in 0..flood.reports {
            let usages = (0..flood.buckets)
                .map(|bucket| BucketQuotaUsage {
                    bucket_id: Some(BucketId {
                        bucket: [(
                            "user".to_owned(),
                            format!("{stream}-{report}-{bucket}-{padding}"),
                        )]
                        .into(),
                    }),
                    time_elapsed: None,
                    num_requests_allowed: 1,
                    num_requests_denied: 0,
                })
                .collect();
            reports
                .send(RateLimitQuotaUsageReports {
                    domain: flood.domain.clone(),
                    bucket_quota_usages: usages,
                })
                .await
                .context("queue a report")?;
        }
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|report| (report, rx))
        });
        let mut client =
            RateLimitQuotaServiceClient::new(channels[stream % channels.len()].clone())
                .max_encoding_message_size(usize::MAX);
        match tokio::time::timeout(
            Duration::from_secs(5),
            client.stream_rate_limit_quotas(outbound),
        )
        .await
        {
            // The answers are held, never read.
            Ok(Ok(answers)) => held.push((reports, answers)),
            _ => refused += 1,
        }
    }
    tokio::time::sleep(flood.hold).await;
    println!(
        "{}",
        serde_json::json!({"streams": flood.streams, "opened": held.len(), "refused": refused})
    );
    Ok(())
}
