//! The scenarios: each sets up a fake API server and a server under test, applies load on
//! loopback for a bounded time, and measures. One a file; what they share is in
//! [`crate::fixtures`], and the reports read their results.

pub mod attacks;
pub mod churn;
pub mod coldstart;
pub mod connections;
pub mod failover;
pub mod fanout;
pub mod granularity;
pub mod identity;
pub mod idle;
pub mod stalled;
pub mod storm;
