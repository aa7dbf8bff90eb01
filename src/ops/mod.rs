//! What operators see of the process: Prometheus metrics (the reference's stats through its
//! statsd_exporter mapping, the process's, turnstile's own), their statsd export, logs and
//! traces, and the series of the rules in force.
//!
//! It may import `decision` and `algorithm` only (a metric counts an outcome), never
//! `backend` or `config`, so every layer above can count what it does.

pub mod mapper;
pub mod metrics;
pub mod process;
pub mod rules_series;
pub mod stats;
pub mod statsd;
pub mod telemetry;
