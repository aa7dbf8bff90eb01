//! Series of the rules in force, beside the reference's load counters: which version each
//! instance holds (so that a fleet whose instances disagree shows on a dashboard), since
//! when, and whether the last load failed. A counter of failed loads cannot say whether a
//! failure still stands; an alert needs to. The xDS responses ACKed and NACKed are counted
//! here too, and shown as zero on instances that read files, so that every instance has the
//! same series.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use metrics::{Counter, Gauge, Label};

use crate::ops::metrics::Metrics;

pub struct RulesSeries {
    metrics: Arc<Metrics>,
    /// A fingerprint of the version in force: equal on instances that hold the same rules.
    version: Gauge,
    /// When the rules in force were loaded, in Unix seconds.
    loaded_at: Gauge,
    /// 1 while the last rules read (files or an xDS response) were refused.
    refused: Gauge,
    acks: Counter,
    nacks: Counter,
}

impl RulesSeries {
    pub fn new(metrics: Arc<Metrics>) -> RulesSeries {
        let responses = |result| {
            metrics.counter(
                "turnstile_xds_responses",
                vec![Label::new("result", result)],
            )
        };
        RulesSeries {
            acks: responses("ack"),
            nacks: responses("nack"),
            version: metrics.gauge("turnstile_rules_version"),
            loaded_at: metrics.gauge("turnstile_rules_loaded_timestamp_seconds"),
            refused: metrics.gauge("turnstile_rules_last_load_refused"),
            metrics,
        }
    }

    /// Rules of `version` were put in force.
    pub fn loaded(&self, version: &str) {
        self.metrics.config_load_success.increment(1);
        self.version.set(fingerprint(version));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        self.loaded_at.set(now.as_secs_f64());
        self.refused.set(0.0);
    }

    /// An xDS response's rules of `version` were put in force, and the response ACKed.
    pub fn acked(&self, version: &str) {
        self.loaded(version);
        self.acks.increment(1);
    }

    /// An xDS response was refused (NACKed); the rules in force stay.
    pub fn nacked(&self) {
        self.refused();
        self.nacks.increment(1);
    }

    /// Rules read again are those in force: any earlier refusal no longer stands.
    pub fn unchanged(&self) {
        self.refused.set(0.0);
    }

    /// Rules read were refused; those in force stay.
    pub fn refused(&self) {
        self.metrics.config_load_error.increment(1);
        self.refused.set(1.0);
    }
}

/// The first 52 bits of the version's SHA-1, which a gauge's f64 holds exactly: a version is a
/// file hash or any string an xDS server chose, and a series value must be a number.
fn fingerprint(version: &str) -> f64 {
    let digest = sha1_smol::Sha1::from(version).digest().bytes();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(first) >> 12) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_series_follow_loads_and_refusals() {
        let metrics = Arc::new(Metrics::new(0.8, 10));
        let series = RulesSeries::new(metrics.clone());
        let value = |name: &str| {
            let text = metrics.render();
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
        };
        series.loaded("v1");
        let v1 = value("turnstile_rules_version");
        assert_eq!(v1, fingerprint("v1"));
        assert!(v1 < (1u64 << 52) as f64 && v1.fract() == 0.0);
        assert!(value("turnstile_rules_loaded_timestamp_seconds") > 1.6e9);
        series.refused();
        assert_eq!(value("turnstile_rules_last_load_refused"), 1.0);
        assert_eq!(value("turnstile_rules_version"), v1, "the old rules stay");
        series.unchanged();
        assert_eq!(value("turnstile_rules_last_load_refused"), 0.0);
        series.nacked();
        series.acked("v2");
        assert_ne!(value("turnstile_rules_version"), v1);
        assert_eq!(value("ratelimit_service_config_load_success"), 2.0);
        assert_eq!(value("ratelimit_service_config_load_error"), 2.0);
        assert_eq!(value("turnstile_xds_responses{result=\"ack\"}"), 1.0);
        assert_eq!(value("turnstile_xds_responses{result=\"nack\"}"), 1.0);
    }
}
