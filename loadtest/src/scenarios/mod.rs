//! The scenarios: each sets up an API server (the fake, or a real control plane for
//! `apiserver-cost`) and a server under test, applies load on
//! loopback for a bounded time, and measures. One a file; what they share is in
//! [`crate::fixtures`], and the reports read their results.

pub mod apiserver_cost;
pub mod attacks;
pub mod churn;
pub mod coldstart;
pub mod connections;
pub mod failover;
pub mod fanout;
pub mod granularity;
pub mod identity;
pub mod idle;
pub mod incremental;
pub mod peers;
pub mod resolvers;
pub mod stalled;
pub mod storm;
