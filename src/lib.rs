//! turnstile: a global rate-limit service for Envoy and Istio.
//!
//! A request travels the folders top to bottom: `app` starts the process and wires the rest;
//! `edge` accepts the connection and reads the gRPC call (or HTTP `/json`); `service`
//! validates the request and matches its descriptors against the `config` rules; a `backend`
//! evaluates the hits atomically with an `algorithm`; and `service` builds the answer that
//! `edge` sends back. `rlqs` serves RLQS streams beside the rate-limit service; `ops` (metrics,
//! statsd, logs) and `decision` (the words every layer shares) sit underneath.
//!
//! A folder imports only the folders below it: decision, algorithm, ops, config, backend,
//! service, edge, rlqs, app, bottom to top.

pub mod algorithm;
pub mod app;
pub mod backend;
pub mod config;
pub mod decision;
pub mod edge;
pub mod ops;
pub mod rlqs;
pub mod service;
