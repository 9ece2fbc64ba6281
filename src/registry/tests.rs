//! Registry tests against a scripted source.
