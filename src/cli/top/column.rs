//! The columns of `crd-broker top`'s table, in the order `s` cycles through them.

/// The watches' columns, as `--sort` and `s` choose them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Column {
    /// The resource.
    Resource,
    /// Subscribers now.
    Subscribers,
    /// New states per second.
    Rate,
    /// Seconds since the last event.
    Last,
    /// Errors since the watch started.
    Errors,
    /// Seconds the watch has reported only errors.
    Stale,
}

pub(super) const COLUMNS: [Column; 6] = [
    Column::Resource,
    Column::Subscribers,
    Column::Rate,
    Column::Last,
    Column::Errors,
    Column::Stale,
];

impl Column {
    pub(super) fn title(self) -> &'static str {
        match self {
            Column::Resource => "RESOURCE",
            Column::Subscribers => "SUBSCRIBERS",
            Column::Rate => "UPDATES/S",
            Column::Last => "LAST EVENT",
            Column::Errors => "ERRORS",
            Column::Stale => "STALE",
        }
    }

    pub(super) fn next(self) -> Column {
        let i = COLUMNS.iter().position(|c| *c == self).unwrap_or(0);
        COLUMNS[(i + 1) % COLUMNS.len()]
    }
}
