//! The shapes of names Kubernetes allows, and how an error message quotes a client's text.

/// Whether `s` looks like a Kubernetes version: `v1`, `v1beta1`, `v2alpha3`.
pub fn is_version(s: &str) -> bool {
    let Some(rest) = s.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    if digits == 0 || rest.starts_with('0') {
        return false;
    }
    let tail = &rest[digits..];
    if tail.is_empty() {
        return true;
    }
    let n = tail
        .strip_prefix("alpha")
        .or_else(|| tail.strip_prefix("beta"));
    n.is_some_and(|n| !n.is_empty() && !n.starts_with('0') && n.chars().all(|c| c.is_ascii_digit()))
}

/// RFC 1123 label: lowercase alphanumerics and `-`, alphanumeric at both ends, at most 63.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A resource's name as a client may write it: a plural, singular, short name or kind.
pub(super) fn is_resource_word(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The most of a client's text an error message quotes.
pub const QUOTE_LIMIT: usize = 64;

/// `text` quoted for an error message: in full up to [`QUOTE_LIMIT`] bytes, else its start
/// and its length, so that an error about a huge input is not itself huge (clients refuse
/// oversized status messages, and logs should not carry them).
pub fn quote(text: &str) -> String {
    if text.len() <= QUOTE_LIMIT {
        return format!("{text:?}");
    }
    let mut end = QUOTE_LIMIT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &text[..end], text.len())
}
