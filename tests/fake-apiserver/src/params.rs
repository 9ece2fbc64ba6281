//! A request's query parameters, decoded once for the handler chain and the admin knobs.

/// Decoded query parameters (empty pairs, as in kube-rs's `?&…`, are skipped).
#[derive(Debug, Clone, Default)]
pub(crate) struct Params(pub(crate) Vec<(String, String)>);

impl Params {
    pub(crate) fn parse(query: &str) -> Self {
        Params(
            form_urlencoded::parse(query.as_bytes())
                .filter(|(k, _)| !k.is_empty())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A boolean parameter, parsed as Go's `strconv.ParseBool` does.
    pub(crate) fn flag(&self, key: &str) -> Option<bool> {
        self.get(key)
            .map(|v| matches!(v, "1" | "t" | "T" | "true" | "True" | "TRUE"))
    }
}
