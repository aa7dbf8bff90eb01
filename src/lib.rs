//! turnstile: a global rate-limit service for Envoy and Istio.
//!
//! A request flows top to bottom through these modules: `service` receives it over gRPC,
//! `request` validates it, `config` matches its descriptors against the rules, a `backend`
//! evaluates the resulting hits atomically with an `algorithm`, and `response` builds the
//! answer.

pub mod algorithm;
pub mod backend;
pub mod key;
pub mod limit;
