//! Shared test harness: real processes on free loopback ports, cleaned up by PID.
#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod clock;
pub mod envoy;
pub mod load;
pub mod otlp;
pub mod raw;
pub mod redis;
pub mod reference;
pub mod tools;
pub mod turnstile;
