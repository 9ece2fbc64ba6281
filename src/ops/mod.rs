//! Operations: readiness and gRPC health, the admin HTTP endpoints and process signals. A high
//! layer: it reads the registry and the source's checks; nothing below it imports it.

pub mod admin;
pub mod health;
pub mod shutdown;
