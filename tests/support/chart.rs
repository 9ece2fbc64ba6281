//! The Helm chart rendered as Helm would render it, by Go's own text/template
//! (`tests/helm/render.go`), and linted.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

pub const ROOT: &str = env!("CARGO_MANIFEST_DIR");

pub fn chart() -> PathBuf {
    Path::new(ROOT).join("helm/crd-broker")
}

pub fn yaml_file(path: &Path) -> Value {
    crd_broker::yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Renders the chart with values.yaml overlaid by `overrides`; the manifests, or the error.
pub fn render(overrides: Value) -> Result<Vec<Value>, String> {
    let go = std::env::var("GO").unwrap_or_else(|_| "go".into());
    let found = Command::new(&go)
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "Go is needed to render the chart with text/template: run the README's test command (scripts/test), which installs it, or set GO"
    );
    let mut values = yaml_file(&chart().join("values.yaml"));
    merge(&mut values, &overrides);
    let meta = yaml_file(&chart().join("Chart.yaml"));
    let context = json!({
        "Values": values,
        "Release": { "Name": "flags", "Namespace": "openfeature", "Service": "Helm" },
        "Chart": { "Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"] },
    });
    let dir = tempfile::tempdir().unwrap();
    let ctx = dir.path().join("context.json");
    std::fs::write(&ctx, context.to_string()).unwrap();
    let cache = Path::new(ROOT).join("target/go-cache");
    let out = Command::new(&go)
        .args(["run", "render.go"])
        .arg(chart())
        .arg(&ctx)
        .current_dir(Path::new(ROOT).join("tests/helm"))
        .env("GOCACHE", &cache)
        .env("GOPATH", cache.join("gopath"))
        .env("GO111MODULE", "off")
        .output()
        .expect("go runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    std::fs::write(dir.path().join("rendered.yaml"), &text).unwrap();
    lint(&[&dir.path().join("rendered.yaml")]);
    let docs = crd_broker::yaml::documents_as_json(&text)
        .expect("rendered YAML parses")
        .iter()
        .map(|d| serde_json::from_slice::<Value>(d).unwrap())
        .filter(|d| !d.is_null())
        .collect();
    Ok(docs)
}

/// yamllint: the default rules, with line length relaxed for long descriptions and sequences
/// allowed at their key's indentation (as helm's own toYaml writes them).
pub fn lint(files: &[&Path]) {
    let python = std::env::var_os("CRD_BROKER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join(".venv/bin/python"));
    let config = "{extends: default, rules: {line-length: {max: 120}, document-start: disable, comments: {min-spaces-from-content: 1}, indentation: {spaces: consistent, indent-sequences: whatever}}}";
    let out = Command::new(&python)
        .args(["-m", "yamllint", "-f", "parsable", "-d", config])
        .args(files)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "yamllint ({}) finds problems (run scripts/test to install it):\n{}{}",
        python.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

pub fn container(docs: &[Value]) -> Value {
    kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0].clone()
}
