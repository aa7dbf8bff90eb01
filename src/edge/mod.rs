//! Where calls come in and answers go out: accepting connections within their caps
//! (`connections`), serving them over HTTP/1 and HTTP/2 (`http`), the `ShouldRateLimit`
//! gRPC method (`grpc`), the tower layers, health, and the admin port with its `/json` form.
//!
//! It may import `service`, `backend`, `config`, `ops` and `decision`; only `rlqs` and `app`
//! import it.

pub mod admin;
pub mod connections;
pub mod grpc;
pub mod health;
pub mod http;
pub mod json;
pub mod layers;
pub mod pacemaker;
pub mod peers;
pub mod room;
