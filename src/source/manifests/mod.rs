//! The manifests source: a directory of YAML (or JSON) manifests — CRDs and custom resources —
//! served as if it were an API server. Adding, editing or removing a file behaves like a create,
//! update or delete. It is the embedded default for running without a cluster.
//!
//! The directory is polled on a thread of its own (see ADR 0006): each poll lists the files and
//! re-reads only those whose stamp (size, times, inode) changed, and takes a change only once two
//! polls in a row see the file the same, so an editor that truncates before it writes, or a
//! half-written file, is never served. A file that fails to parse, or is over the size or
//! nesting limits, keeps its last good contents and is reported once per change. A directory that
//! cannot be read keeps the last good state and counts as an outage of the source. Links are
//! followed only inside the directory, each directory once, [`MAX_DIR_DEPTH`] levels at most.
//! Objects get what an API server would give them: a `uid` that lasts while the object exists
//! (across edits, and moves between files), a `resourceVersion` that moves on every change,
//! `creationTimestamp`, `generation`, and the namespace `default` when none is written.

//!
//! One concern a file: [`document`] reads a file into documents (compact JSON, within the size
//! and nesting limits), [`catalog`] turns documents into the kinds and objects served, [`scan`]
//! polls the directory with its stability rules, and [`source`] serves the catalog as a
//! [`Source`](super::Source).

mod catalog;
mod document;
mod scan;
mod source;
#[cfg(test)]
mod tests;

pub use document::{MAX_FILE_BYTES, MAX_NESTING};
pub use scan::{DirectoryScan, MAX_DIR_DEPTH};
pub use source::Manifests;
