//! A manifest file read into documents: each carried straight from the parser into compact
//! JSON (no tree is kept), within the size and nesting limits, with `List`s unpacked and what
//! the catalog needs read out of it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::source::KindNames;

/// A SHA-256 digest.
pub(super) type Digest = [u8; 32];

/// One document of a file as it is kept: compact JSON, and what the catalog reads out of it.
/// The tree it was parsed into is not kept; that cost about 16 times the file's size.
#[derive(Debug)]
pub(super) struct Doc {
    pub(super) json: Bytes,
    /// Of `json`: a rewrite that changes nothing moves no resourceVersion.
    pub(super) digest: Digest,
    /// Of everything but `metadata` and `status`: what moves `generation`.
    pub(super) spec: Digest,
    pub(super) api_version: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) name: Option<String>,
    pub(super) namespace: Option<String>,
    /// For a CRD: the kind it defines, `None` if the CRD is incomplete.
    pub(super) crd: Option<Option<ManifestKind>>,
}

/// A document's top-level fields, each as its JSON text.
pub(super) type Fields<'a> = BTreeMap<String, &'a RawValue>;

/// One kind a CRD in the directory defines.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ManifestKind {
    pub(super) names: KindNames,
    /// Served versions, highest priority first.
    pub(super) versions: Vec<String>,
}

impl Doc {
    /// Reads a document's fields out of its compact JSON.
    pub(super) fn new(json: Vec<u8>) -> Result<Doc, String> {
        let fields: Fields =
            serde_json::from_slice(&json).map_err(|_| "a document is not a mapping".to_string())?;
        let text = |field: &str| {
            fields
                .get(field)
                .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        };
        let meta: Value = fields
            .get("metadata")
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or_default();
        let meta_text = |field: &str| meta[field].as_str().map(str::to_string);
        let mut spec = ring::digest::Context::new(&ring::digest::SHA256);
        for (field, raw) in fields
            .iter()
            .filter(|(f, _)| *f != "metadata" && *f != "status")
        {
            for part in [field.as_bytes(), b"\0", raw.get().as_bytes(), b"\0"] {
                spec.update(part);
            }
        }
        let api_version = text("apiVersion");
        let kind = text("kind");
        let is_crd = kind.as_deref() == Some("CustomResourceDefinition")
            && api_version
                .as_deref()
                .is_some_and(|v| v.starts_with("apiextensions.k8s.io/"));
        let crd = is_crd.then(|| {
            serde_json::from_slice::<Value>(&json)
                .ok()
                .and_then(|v| crd_kind(&v))
        });
        Ok(Doc {
            digest: sha256(&json),
            spec: digest_of(spec),
            api_version,
            kind,
            name: meta_text("name"),
            namespace: meta_text("namespace"),
            crd,
            json: Bytes::from(json),
        })
    }
}

pub(super) fn sha256(bytes: &[u8]) -> Digest {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(bytes);
    digest_of(context)
}

pub(super) fn digest_of(context: ring::digest::Context) -> Digest {
    context.finish().as_ref().try_into().unwrap_or([0; 32])
}

/// `json` (an object) with its top-level `field` set to `value`.
pub(super) fn with_field(json: &[u8], field: &str, value: &Value) -> Result<Vec<u8>, String> {
    let mut fields: Fields = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let value = serde_json::value::to_raw_value(value).map_err(|e| e.to_string())?;
    fields.insert(field.to_string(), &value);
    serde_json::to_vec(&fields).map_err(|e| e.to_string())
}

/// The largest manifest file read: as large as the largest message flagd clients take (no
/// Kubernetes object is over 1.5 MiB). Parsing YAML costs up to about a hundred times a
/// document's size in memory while it runs; JSON, a few times.
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// The deepest nesting (mappings, sequences and flow collections) read in a manifest.
pub const MAX_NESTING: usize = 64;

/// A file's documents, within the size and nesting limits. The file is opened once, and its
/// size and place are checked on that handle: a file that grew since it was listed is read no
/// further than the limit, and a link swapped to point outside `root` since it was listed is
/// refused (on Linux, where the handle says where it really is). Each document is carried
/// straight from the parser into compact JSON, with no tree in between.
pub(super) fn read_docs(path: &Path, root: &Path) -> Result<Vec<Arc<Doc>>, String> {
    use std::io::Read;
    let too_large =
        |len: u64| format!("{len} bytes: a manifest file may have at most {MAX_FILE_BYTES} bytes");
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    if let Some(real) = opened_at(&file)
        && !real.starts_with(root)
    {
        return Err(format!(
            "it leads to {}, outside the directory: not read",
            real.display()
        ));
    }
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len > MAX_FILE_BYTES {
        return Err(too_large(len));
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(text.len() as u64));
    }
    let json = path.extension().is_some_and(|e| e == "json");
    if let Some(line) = too_deep(&text, MAX_NESTING, json) {
        return Err(format!(
            "nested more than {MAX_NESTING} levels deep (line {line})"
        ));
    }
    if json {
        let mut parser = serde_json::Deserializer::from_str(&text);
        let doc = crate::yaml::compact(&mut parser).map_err(|e| e.to_string())?;
        parser.end().map_err(|e| e.to_string())?;
        return documents([doc]);
    }
    documents(crate::yaml::documents_as_json(&text)?)
}

/// The objects of a file's documents: `List`s unpacked, empty documents skipped.
pub(super) fn documents(
    values: impl IntoIterator<Item = Vec<u8>>,
) -> Result<Vec<Arc<Doc>>, String> {
    let mut docs = Vec::new();
    for json in values {
        if json == b"null" {
            continue;
        }
        let doc = Doc::new(json)?;
        if doc.kind.as_deref() != Some("List") {
            docs.push(Arc::new(doc));
            continue;
        }
        let fields: Fields = serde_json::from_slice(&doc.json).map_err(|e| e.to_string())?;
        let items: Vec<&RawValue> = match fields.get("items") {
            Some(raw) => serde_json::from_str(raw.get())
                .map_err(|_| "a List's items are not a sequence".to_string())?,
            None => Vec::new(),
        };
        for item in items {
            docs.push(Arc::new(Doc::new(item.get().as_bytes().to_vec())?));
        }
    }
    Ok(docs)
}

/// Where an open file really is (Linux: `/proc/self/fd`); `None` where that cannot be told.
fn opened_at(file: &std::fs::File) -> Option<std::path::PathBuf> {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()
}

/// Whether a process other than this one has `path` open for writing (Linux, among the
/// processes whose open files this one may see: `/proc/<pid>/fd` and `fdinfo`). A file being
/// written in place is not complete, however long its writer pauses.
pub(super) fn open_for_writing(path: &Path) -> Option<u32> {
    let real = std::fs::canonicalize(path).ok()?;
    let own = std::process::id();
    for process in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = process
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(process.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).ok().as_deref() != Some(real.as_path()) {
                continue;
            }
            let info = process.path().join("fdinfo").join(fd.file_name());
            let Ok(info) = std::fs::read_to_string(info) else {
                continue;
            };
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok());
            // O_ACCMODE: O_WRONLY (1) or O_RDWR (2).
            if flags.is_some_and(|f| f & 0o3 != 0) {
                return Some(pid);
            }
        }
    }
    None
}

/// The first line where `text` nests deeper than `max` — block indentation and `- ` items (for
/// YAML) plus flow brackets — found in one pass before the parser, whose cost grows with the
/// depth, ever sees it.
pub(super) fn too_deep(text: &str, max: usize, json: bool) -> Option<usize> {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let mut depth = 0;
        if !json && flow == 0 && !trimmed.is_empty() && !trimmed.starts_with('#') {
            let indent = line.len() - trimmed.len();
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
            let dashes = trimmed
                .split_inclusive(' ')
                .take_while(|w| *w == "- ")
                .count();
            depth = indents.len() + dashes;
        }
        let (mut single, mut double, mut escaped) = (false, false, false);
        let mut previous = ' ';
        for c in trimmed.chars() {
            match c {
                _ if escaped => escaped = false,
                '\\' if double => escaped = true,
                '"' if !single => double = !double,
                '\'' if !double => single = !single,
                '#' if !json && !single && !double && previous == ' ' => break,
                '[' | '{' if !single && !double => flow += 1,
                ']' | '}' if !single && !double => flow = flow.saturating_sub(1),
                _ => {}
            }
            previous = c;
            if depth.max(indents.len()) + flow > max {
                return Some(n + 1);
            }
        }
        if depth > max {
            return Some(n + 1);
        }
    }
    None
}

/// The kind a CustomResourceDefinition document defines, if it is whole enough to serve.
pub(super) fn crd_kind(crd: &Value) -> Option<ManifestKind> {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let text = |v: &Value| v.as_str().map(str::to_string);
    let kind = text(&names["kind"])?;
    let namespaced = match spec["scope"].as_str()? {
        "Namespaced" => true,
        "Cluster" => false,
        _ => return None,
    };
    let mut versions: Vec<String> = spec["versions"]
        .as_array()?
        .iter()
        .filter(|v| v["served"].as_bool() == Some(true))
        .filter_map(|v| text(&v["name"]))
        .collect();
    if versions.is_empty() {
        return None;
    }
    versions.sort_by_key(|v| version_priority(v));
    Some(ManifestKind {
        names: KindNames {
            group: text(&spec["group"])?,
            plural: text(&names["plural"])?,
            singular: text(&names["singular"]).unwrap_or_else(|| kind.to_lowercase()),
            short_names: names["shortNames"]
                .as_array()
                .map(|a| a.iter().filter_map(text).collect())
                .unwrap_or_default(),
            kind,
            namespaced,
        },
        versions,
    })
}

/// Sorts versions as Kubernetes prefers them: GA, then beta, then alpha, newest first; other
/// names last, alphabetically.
pub(super) fn version_priority(
    v: &str,
) -> (u8, std::cmp::Reverse<u64>, std::cmp::Reverse<u64>, String) {
    let parsed = v.strip_prefix('v').and_then(|rest| {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        let major: u64 = rest[..digits].parse().ok()?;
        let tail = &rest[digits..];
        let (rank, minor) = if tail.is_empty() {
            (0, 0)
        } else if let Some(n) = tail.strip_prefix("beta") {
            (1, n.parse().ok()?)
        } else {
            (2, tail.strip_prefix("alpha")?.parse().ok()?)
        };
        Some((rank, major, minor))
    });
    match parsed {
        Some((rank, major, minor)) => (
            rank,
            std::cmp::Reverse(major),
            std::cmp::Reverse(minor),
            String::new(),
        ),
        None => (3, std::cmp::Reverse(0), std::cmp::Reverse(0), v.to_string()),
    }
}
