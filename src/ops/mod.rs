//! Operations: readiness and gRPC health, the admin HTTP endpoints, process signals and
//! process metrics. A high
//! layer: it reads the registry and the source's checks; nothing below it imports it.

pub mod admin;
pub mod health;
pub mod process;
pub mod shutdown;
