//! turnstile: a global rate-limit service for Envoy and Istio.
//!
//! A request flows top to bottom through these modules: `service` receives it (over gRPC,
//! or HTTP `/json` via `admin`), `request` validates it, `plan` matches its descriptors
//! against the `config` rules, a `backend` evaluates the hits atomically with an
//! `algorithm`, and `response` builds the answer.

pub mod active;
pub mod admin;
pub mod algorithm;
pub mod allocator;
pub mod backend;
pub mod bounded;
pub mod cli;
pub mod config;
pub mod deadline;
pub mod decision;
pub mod explain;
pub mod fallback;
pub mod grpc;
pub mod health;
pub mod json;
pub mod key;
pub mod layers;
pub mod limit;
pub mod listener;
pub mod metrics;
pub mod pacemaker;
pub mod peers;
pub mod plan;
pub mod reload;
pub mod request;
pub mod response;
pub mod rlqs;
pub mod serve;
pub mod server;
pub mod service;
pub mod statsd;
pub mod telemetry;
pub mod xds;
