//! YAML, read by serde-saphyr (the parser kube uses) with the YAML 1.2 rules Kubernetes objects
//! are written for: only `true` and `false` are booleans (`on`, `yes` and `off` stay strings,
//! as flag variants often are), with saphyr's budgets on events, depth and aliases, and errors
//! on one line with the line and column.

use serde::de::{Deserialize, DeserializeOwned, Deserializer, Error as _};

/// The parser settings every YAML read here uses.
pub fn options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.with_snippet = false;
    options
}

/// One document.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    serde_saphyr::from_str_with_options(text, options()).map_err(|e| one_line(&e))
}

/// Every document of a stream, each as compact JSON, straight from the parser (no value tree in
/// between); an empty document is `null`.
pub fn documents_as_json(text: &str) -> Result<Vec<Vec<u8>>, String> {
    let docs: Vec<Json> =
        serde_saphyr::from_multiple_with_options(text, options()).map_err(|e| one_line(&e))?;
    Ok(docs.into_iter().map(|d| d.0).collect())
}

/// A document transcoded to compact JSON as it is parsed.
struct Json(Vec<u8>);

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(document: D) -> Result<Self, D::Error> {
        compact(document).map(Json)
    }
}

/// Any document (YAML or JSON) as compact JSON, transcoded as it is parsed.
pub fn compact<'de, D: Deserializer<'de>>(document: D) -> Result<Vec<u8>, D::Error> {
    let mut json = Vec::new();
    serde_transcode::transcode(document, &mut serde_json::Serializer::new(&mut json))
        .map_err(D::Error::custom)?;
    Ok(json)
}

fn one_line(error: &serde_saphyr::Error) -> String {
    error
        .to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_1_2_scalars_and_several_documents() {
        let docs =
            documents_as_json("a: on\nb: true\nc: 10\nd: ~\ne: 1.5\n---\n---\n- x\n").unwrap();
        let docs: Vec<String> = docs
            .into_iter()
            .map(|d| String::from_utf8(d).unwrap())
            .collect();
        assert_eq!(docs[0], r#"{"a":"on","b":true,"c":10,"d":null,"e":1.5}"#);
        assert_eq!(docs.last().unwrap(), r#"["x"]"#);
        let error = from_str::<serde_json::Value>("a: [1, 2\nb: c\n").unwrap_err();
        assert!(!error.contains('\n') && error.contains("line"), "{error}");
    }
}
