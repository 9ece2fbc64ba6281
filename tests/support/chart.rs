//! The Helm chart rendered and linted by the real `helm` (built from its module by
//! `scripts/peers`, cached by version), and checked beside it with yamllint, jsonschema and
//! kubernetes-validate.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::Leash;

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
    render_release("flags", "openfeature", overrides)
}

/// [`render`] as the release `release` in `namespace`: values.yaml overlaid by `overrides`,
/// checked against values.schema.json, linted by `helm lint --strict` (a missing value is an
/// error) and rendered by `helm template`.
pub fn render_release(
    release: &str,
    namespace: &str,
    overrides: Value,
) -> Result<Vec<Value>, String> {
    let mut values = yaml_file(&chart().join("values.yaml"));
    merge(&mut values, &overrides);
    // helm checks the schema too; these messages name the value as a reader wrote it.
    let errors = schema_errors(&values);
    if !errors.is_empty() {
        return Err(format!(
            "values don't meet values.schema.json: {}",
            errors.join("; ")
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, overrides.to_string()).unwrap();
    helm_lint(namespace, &file)?;
    let text = helm(&["template", release])
        .arg(chart())
        .args(["--namespace", namespace, "--values"])
        .arg(&file)
        .output()
        .expect("helm runs");
    if !text.status.success() {
        return Err(String::from_utf8_lossy(&text.stderr).into_owned());
    }
    let text = String::from_utf8(text.stdout).unwrap();
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

/// `helm lint --strict` of the chart with the values file `values`: warnings are errors, and
/// so is a template naming a value that does not exist.
pub fn helm_lint(namespace: &str, values: &Path) -> Result<(), String> {
    let out = helm(&["lint", "--strict", "--quiet"])
        .arg(chart())
        .args(["--namespace", namespace, "--values"])
        .arg(values)
        .output()
        .expect("helm runs");
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "helm lint --strict: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// A `helm` command with `args`, in an empty home of its own (no repositories, no plugins, no
/// cluster).
pub fn helm(args: &[&str]) -> Command {
    static HELM: std::sync::OnceLock<(PathBuf, tempfile::TempDir)> = std::sync::OnceLock::new();
    let (path, home) = HELM.get_or_init(|| (super::peer("helm"), tempfile::tempdir().unwrap()));
    let mut helm = Command::new(path);
    helm.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .env("KUBECONFIG", home.path().join("no-cluster"))
        .leashed();
    helm
}

fn venv_python() -> PathBuf {
    std::env::var_os("CRD_BROKER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(ROOT).join(".venv/bin/python"))
}

/// Where `values` departs from the chart's values.schema.json (Draft 7, checked by the
/// `jsonschema` package from PyPI), one line each.
pub fn schema_errors(values: &Value) -> Vec<String> {
    let script = r#"
import json, sys, jsonschema
schema = json.load(open(sys.argv[1]))
jsonschema.Draft7Validator.check_schema(schema)
errors = jsonschema.Draft7Validator(schema).iter_errors(json.load(sys.stdin))
print(json.dumps(sorted("/".join(map(str, e.path)) + ": " + e.message for e in errors)))
"#;
    let mut child = Command::new(venv_python())
        .args(["-c", script])
        .arg(chart().join("values.schema.json"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .leashed()
        .spawn()
        .expect("python runs");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(values.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "jsonschema (run scripts/test to install it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The Kubernetes version the rendered objects are validated against.
pub const KUBERNETES_VERSION: &str = "1.32.0";

/// Checks every rendered object of a built-in kind against the Kubernetes schemas, strictly
/// (no unknown fields), with `kubernetes-validate` from PyPI. Objects of the Prometheus
/// Operator's kinds have no schema there; they are left to the callers' own checks.
pub fn kubernetes_validate(docs: &[Value]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("objects.yaml");
    let builtin: Vec<String> = docs
        .iter()
        .filter(|d| {
            !d["apiVersion"]
                .as_str()
                .unwrap_or_default()
                .starts_with("monitoring.coreos.com/")
        })
        .map(|d| format!("---\n{d}\n"))
        .collect();
    assert!(!builtin.is_empty());
    std::fs::write(&path, builtin.concat()).unwrap();
    let validate = venv_python().with_file_name("kubernetes-validate");
    let out = Command::new(&validate)
        .args(["--strict", "--quiet", "-k", KUBERNETES_VERSION])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{} (run scripts/test to install it): {e}",
                validate.display()
            )
        });
    assert!(
        out.status.success(),
        "kubernetes-validate finds problems:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// yamllint: the default rules, with line length relaxed for long descriptions and sequences
/// allowed at their key's indentation (as helm's own toYaml writes them).
pub fn lint(files: &[&Path]) {
    let python = venv_python();
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

/// The chart README's table of values, generated from values.yaml: each key with a `# --`
/// description, its default, and the description.
pub fn values_table() -> String {
    let text = std::fs::read_to_string(chart().join("values.yaml")).unwrap();
    let values = yaml_file(&chart().join("values.yaml"));
    let mut rows = vec![
        "| Key | Default | Description |".to_string(),
        "|---|---|---|".to_string(),
    ];
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut description: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(start) = trimmed.strip_prefix("# --") {
            description = Some(start.trim().to_string());
            continue;
        }
        if let Some(more) = trimmed.strip_prefix('#') {
            if let Some(d) = description.as_mut() {
                d.push(' ');
                d.push_str(more.trim());
            }
            continue;
        }
        if trimmed.is_empty() || trimmed.starts_with('-') {
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        path.retain(|(i, _)| *i < indent);
        path.push((indent, key.trim().to_string()));
        if let Some(d) = description.take() {
            let keys: Vec<&str> = path.iter().map(|(_, k)| k.as_str()).collect();
            let value = keys.iter().fold(&values, |v, k| &v[*k]);
            let cell = |s: String| s.replace('|', "\\|");
            rows.push(format!(
                "| `{}` | `{}` | {} |",
                keys.join("."),
                cell(value.to_string()),
                cell(d)
            ));
        }
    }
    rows.join("\n") + "\n"
}
