//! Every API the broker serves, on one shelf: the native `crdbroker.v1.Broker` service
//! ([`native`]), flagd's sync protocols ([`flagd`]) and the broker as its own xDS name resolver
//! ([`xds`]); and what they share — [`admit`] (the one way into the registry), [`delivery`]
//! (drain, per-subscriber metrics, deadlines), [`status`] (the one mapping of errors to
//! `tonic::Status`), and the encodings ([`frame`], [`wire`]).

pub(crate) mod admit;
pub(crate) mod delivery;
mod flag_sets;
pub mod flagd;
pub mod frame;
mod messages;
pub mod native;
mod sets;
pub mod status;
pub mod wire;
pub mod xds;

pub use crate::registry::set_version;
pub use native::{BrokerService, MAX_RESOURCES};
pub use status::{drained, shutting_down, source_status};
