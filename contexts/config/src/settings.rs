//! Settings: layers of key/value pairs in four scopes, their precedence, and
//! the rendering of a module's effective settings into the files it declares.
//! Pure: no I/O (the layers' storage is in `layers.rs`).
//!
//! Precedence, strongest first: the module's layer, the node's layer, the
//! label layers whose selector the node's labels contain (the most specific,
//! i.e. the one with the most pairs, first; between two equally specific
//! layers that both set a key, the one whose name sorts first wins, and the
//! effective view reports the tie), the global layer.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mesh_protocol::{Labels, SettingsFormat};
use serde::{Deserialize, Serialize};

use crate::Error;

/// A setting's value: a JSON string, number or boolean.
pub type Value = serde_json::Value;

/// Keys of a layer, sorted.
pub type Values = BTreeMap<String, Value>;

/// At most this many keys in one layer.
pub const MAX_KEYS: usize = 256;
/// At most this many bytes in one string value.
pub const MAX_VALUE_BYTES: usize = 16 * 1024;

/// Which layer a value comes from.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(tag = "scope", rename_all = "lowercase")]
pub enum Scope {
    Global,
    /// A named label layer.
    Labels {
        name: String,
    },
    Node {
        name: String,
    },
    Module {
        name: String,
    },
}

impl Scope {
    /// The `(scope, name)` key of the layer's row.
    pub fn key(&self) -> (&'static str, &str) {
        match self {
            Scope::Global => ("global", ""),
            Scope::Labels { name } => ("labels", name),
            Scope::Node { name } => ("node", name),
            Scope::Module { name } => ("module", name),
        }
    }

    /// Back from a row's `(scope, name)`.
    pub fn from_key(scope: &str, name: &str) -> Option<Scope> {
        let name = name.to_owned();
        Some(match scope {
            "global" => Scope::Global,
            "labels" => Scope::Labels { name },
            "node" => Scope::Node { name },
            "module" => Scope::Module { name },
            _ => return None,
        })
    }

    /// `global`, `labels/<name>`, `node/<name>`, `module/<name>`: how the API
    /// path names the layer.
    pub fn path(&self) -> String {
        match self {
            Scope::Global => "global".to_owned(),
            Scope::Labels { name } => format!("labels/{name}"),
            Scope::Node { name } => format!("nodes/{name}"),
            Scope::Module { name } => format!("modules/{name}"),
        }
    }
}

/// One stored layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    pub scope: Scope,
    /// Label layers only.
    pub selector: Option<Labels>,
    pub values: Values,
}

/// Check a key: 1 to 128 of `[A-Za-z0-9_]`, not starting with a digit (so
/// every format, env files included, can carry it).
pub fn validate_key(field: &str, key: &str) -> Result<(), Error> {
    let ok = !key.is_empty()
        && key.len() <= 128
        && !key.as_bytes()[0].is_ascii_digit()
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid {
            field: field.to_owned(),
            reason: format!(
                "key `{}`: 1 to 128 of A-Z a-z 0-9 _, not starting with a digit",
                key.chars().take(64).collect::<String>()
            ),
        })
    }
}

/// Check a layer's values: keys, scalars only, sizes.
pub fn validate_values(values: &Values) -> Result<(), Error> {
    if values.len() > MAX_KEYS {
        return Err(Error::Invalid {
            field: "values".into(),
            reason: format!("{} keys, limit {MAX_KEYS}", values.len()),
        });
    }
    for (key, value) in values {
        let field = format!("values.{}", key.chars().take(64).collect::<String>());
        validate_key(&field, key)?;
        match value {
            Value::String(s) if s.len() > MAX_VALUE_BYTES => {
                return Err(Error::Invalid {
                    field,
                    reason: format!("{} bytes, limit {MAX_VALUE_BYTES}", s.len()),
                });
            }
            Value::String(s) if s.contains('\0') => {
                return Err(Error::Invalid {
                    field,
                    reason: "a NUL character cannot be rendered".into(),
                });
            }
            Value::String(_) | Value::Bool(_) => {}
            Value::Number(n) if n.as_f64().is_some_and(f64::is_finite) => {}
            _ => {
                return Err(Error::Invalid {
                    field,
                    reason: "a value is a string, a number or a boolean".into(),
                });
            }
        }
    }
    Ok(())
}

/// One effective value and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Effective {
    #[schema(value_type = Object)]
    pub value: Value,
    /// The layer that set it.
    pub from: Scope,
    /// Weaker layers that set it too (shadowed), strongest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadowed: Vec<Scope>,
    /// Set when two equally specific label layers both set the key: the
    /// layers that lost the tie (the winner's name sorts first).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tie: Vec<Scope>,
}

fn matches(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The effective settings of `module` on a node `node` with `labels`, given
/// every layer (in any order).
pub fn effective(
    layers: &[Layer],
    module: &str,
    node: &str,
    labels: &Labels,
) -> BTreeMap<String, Effective> {
    // Strongest first: (rank, specificity desc, name) with rank module 0,
    // node 1, labels 2, global 3.
    let mut applicable: Vec<(u8, usize, &Layer)> = Vec::new();
    for layer in layers {
        match &layer.scope {
            Scope::Module { name } if name == module => applicable.push((0, 0, layer)),
            Scope::Node { name } if name == node => applicable.push((1, 0, layer)),
            Scope::Labels { .. } => {
                let selector = layer.selector.as_ref();
                if let Some(selector) = selector
                    && matches(selector, labels)
                {
                    applicable.push((2, usize::MAX - selector.len(), layer));
                }
            }
            Scope::Global => applicable.push((3, 0, layer)),
            _ => {}
        }
    }
    applicable.sort_by(|a, b| (a.0, a.1, &a.2.scope).cmp(&(b.0, b.1, &b.2.scope)));
    let mut out: BTreeMap<String, (Effective, (u8, usize))> = BTreeMap::new();
    for (rank, specificity, layer) in applicable {
        for (key, value) in &layer.values {
            match out.get_mut(key) {
                None => {
                    out.insert(
                        key.clone(),
                        (
                            Effective {
                                value: value.clone(),
                                from: layer.scope.clone(),
                                shadowed: Vec::new(),
                                tie: Vec::new(),
                            },
                            (rank, specificity),
                        ),
                    );
                }
                Some((e, strength)) => {
                    if *strength == (rank, specificity) {
                        e.tie.push(layer.scope.clone());
                    } else {
                        e.shadowed.push(layer.scope.clone());
                    }
                }
            }
        }
    }
    out.into_iter().map(|(k, (e, _))| (k, e)).collect()
}

/// The text of a settings file of `format` holding `settings`.
pub fn render(format: SettingsFormat, settings: &BTreeMap<String, Effective>) -> String {
    match format {
        SettingsFormat::Env => {
            let mut out = String::new();
            for (key, e) in settings {
                let _ = writeln!(out, "{key}={}", env_value(&e.value));
            }
            out
        }
        SettingsFormat::Json => {
            let map: serde_json::Map<String, Value> = settings
                .iter()
                .map(|(k, e)| (k.clone(), e.value.clone()))
                .collect();
            let mut text = serde_json::to_string_pretty(&Value::Object(map)).unwrap_or_default();
            text.push('\n');
            text
        }
        SettingsFormat::Toml => {
            let mut table = toml::Table::new();
            for (key, e) in settings {
                let value = match &e.value {
                    Value::String(s) => toml::Value::String(s.clone()),
                    Value::Bool(b) => toml::Value::Boolean(*b),
                    Value::Number(n) => match n.as_i64() {
                        Some(i) => toml::Value::Integer(i),
                        None => toml::Value::Float(n.as_f64().unwrap_or_default()),
                    },
                    other => toml::Value::String(other.to_string()),
                };
                table.insert(key.clone(), value);
            }
            toml::to_string(&table).unwrap_or_default()
        }
    }
}

/// A value of an env file: plain when it is safe unquoted, else double-quoted
/// with `\`, `"`, `$`, `` ` `` and newlines escaped.
fn env_value(value: &Value) -> String {
    let text = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let plain = !text.is_empty()
        && text.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(b, b'_' | b'-' | b'.' | b'/' | b':' | b'@' | b'+' | b',')
        });
    if plain {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '$' => out.push_str("\\$"),
            '`' => out.push_str("\\`"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn layer(scope: Scope, selector: Option<&[(&str, &str)]>, values: Value) -> Layer {
        Layer {
            scope,
            selector: selector.map(labels),
            values: serde_json::from_value(values).unwrap(),
        }
    }

    fn all_four() -> Vec<Layer> {
        vec![
            layer(
                Scope::Global,
                None,
                json!({"A": "global", "B": "global", "C": "global", "D": "global", "E": "global"}),
            ),
            layer(
                Scope::Labels { name: "web".into() },
                Some(&[("role", "web")]),
                json!({"B": "web", "C": "web", "T": "web"}),
            ),
            layer(
                Scope::Labels {
                    name: "web-eu".into(),
                },
                Some(&[("role", "web"), ("zone", "eu")]),
                json!({"B": "web-eu"}),
            ),
            layer(
                Scope::Labels { name: "eu".into() },
                Some(&[("zone", "eu")]),
                json!({"T": "eu"}),
            ),
            layer(
                Scope::Node { name: "n1".into() },
                None,
                json!({"C": "node", "D": "node"}),
            ),
            layer(Scope::Node { name: "n2".into() }, None, json!({"E": "n2"})),
            layer(
                Scope::Module { name: "app".into() },
                None,
                json!({"D": "module"}),
            ),
            layer(
                Scope::Module {
                    name: "other".into(),
                },
                None,
                json!({"A": "other"}),
            ),
        ]
    }

    #[test]
    fn module_over_node_over_labels_over_global() {
        let e = effective(
            &all_four(),
            "app",
            "n1",
            &labels(&[("role", "web"), ("zone", "eu")]),
        );
        let got: BTreeMap<&str, (&str, Scope)> = e
            .iter()
            .map(|(k, v)| (k.as_str(), (v.value.as_str().unwrap(), v.from.clone())))
            .collect();
        assert_eq!(got["A"], ("global", Scope::Global));
        // The most specific label layer wins.
        assert_eq!(
            got["B"],
            (
                "web-eu",
                Scope::Labels {
                    name: "web-eu".into()
                }
            )
        );
        assert_eq!(
            e["B"].shadowed,
            vec![Scope::Labels { name: "web".into() }, Scope::Global]
        );
        assert_eq!(got["C"], ("node", Scope::Node { name: "n1".into() }));
        assert_eq!(got["D"], ("module", Scope::Module { name: "app".into() }));
        assert_eq!(got["E"], ("global", Scope::Global));
        // Two one-pair layers tie on T: the smaller name wins, the tie is reported.
        assert_eq!(got["T"], ("eu", Scope::Labels { name: "eu".into() }));
        assert_eq!(e["T"].tie, vec![Scope::Labels { name: "web".into() }]);
    }

    #[test]
    fn a_node_that_moves_between_label_sets_follows_its_labels() {
        let layers = all_four();
        let web = effective(&layers, "app", "n3", &labels(&[("role", "web")]));
        assert_eq!(web["B"].value, json!("web"));
        assert!(web["T"].tie.is_empty());
        let db = effective(&layers, "app", "n3", &labels(&[("role", "db")]));
        assert_eq!(db["B"].value, json!("global"));
        assert!(!db.contains_key("T"));
    }

    #[test]
    fn renders_env_json_and_toml() {
        let layers = vec![layer(
            Scope::Global,
            None,
            json!({"PORT": 8080, "NAME": "web app", "DEBUG": false, "URL": "https://x/y", "Q": "a\"$b\n"}),
        )];
        let e = effective(&layers, "m", "n", &Labels::new());
        assert_eq!(
            render(SettingsFormat::Env, &e),
            "DEBUG=false\nNAME=\"web app\"\nPORT=8080\nQ=\"a\\\"\\$b\\n\"\nURL=https://x/y\n"
        );
        let json: Value = serde_json::from_str(&render(SettingsFormat::Json, &e)).unwrap();
        assert_eq!(json["PORT"], json!(8080));
        let toml: toml::Table = toml::from_str(&render(SettingsFormat::Toml, &e)).unwrap();
        assert_eq!(toml["NAME"].as_str(), Some("web app"));
        assert_eq!(toml["PORT"].as_integer(), Some(8080));
        assert_eq!(toml["Q"].as_str(), Some("a\"$b\n"));
    }

    #[test]
    fn bad_values_are_named() {
        let v: Values = serde_json::from_value(json!({"ok": 1, "bad": {"x": 1}})).unwrap();
        let err = validate_values(&v).unwrap_err().to_string();
        assert!(err.contains("values.bad"), "{err}");
        let v: Values = serde_json::from_value(json!({"1x": 1})).unwrap();
        assert!(
            validate_values(&v)
                .unwrap_err()
                .to_string()
                .contains("values.1x")
        );
    }
}
