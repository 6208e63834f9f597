//! How `meshctl` prints what it read: aligned tables (the default, `-o wide`
//! with more columns) or the API's own objects as JSON or YAML (`-o json`,
//! `-o yaml`) for scripts.

use chrono::{DateTime, Utc};
use clap::ValueEnum;
use serde_json::Value;

/// `-o`: the output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The table with more columns.
    Wide,
    /// The API's objects as JSON (a list: a JSON array of every page's items).
    Json,
    /// The API's objects as YAML.
    Yaml,
}

/// The text of `value` in a machine format (`json` pretty, `yaml`).
pub fn encode(format: Format, value: &Value) -> anyhow::Result<String> {
    Ok(match format {
        Format::Yaml => serde_norway::to_string(value)?,
        Format::Json | Format::Wide => {
            let mut s = serde_json::to_string_pretty(value)?;
            s.push('\n');
            s
        }
    })
}

/// Rows under headers, columns separated by three spaces and padded to the
/// widest cell (in characters); no trailing spaces.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let columns = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::new();
        for (i, cell) in cells.enumerate().take(columns) {
            if i > 0 {
                out.push_str("   ");
            }
            out.push_str(cell);
            if i + 1 < columns {
                out.push_str(&" ".repeat(widths[i] - cell.chars().count()));
            }
        }
        out.trim_end().to_owned()
    };
    let mut out = line(&mut headers.iter().copied());
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

/// Rows as columns padded to their widest cell (the last one is not padded),
/// two spaces apart: the delivery and signing commands' tables.
pub fn compact_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i == last {
                out.push_str(c);
            } else {
                let pad = widths.get(i).copied().unwrap_or(0);
                out.push_str(&format!("{c:<pad$}  "));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// A string field, or `-` when absent or null.
pub fn s(v: &Value, key: &str) -> String {
    match v.get(key) {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// A label map as `k=v,k=v` (`-` when empty or absent).
pub fn labels(v: Option<&Value>) -> String {
    let Some(map) = v.and_then(Value::as_object) else {
        return "-".to_owned();
    };
    if map.is_empty() {
        return "-".to_owned();
    }
    map.iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(",")
}

/// How long ago `at` (RFC 3339) was, from `now`: `42s`, `5m`, `3h`, `2d`.
pub fn age(at: Option<&str>, now: DateTime<Utc>) -> String {
    let Some(at) = at.and_then(|t| DateTime::parse_from_rfc3339(t).ok()) else {
        return "-".to_owned();
    };
    let secs = (now - at.with_timezone(&Utc)).num_seconds().max(0);
    duration(secs)
}

/// `secs` as the largest whole unit: `42s`, `5m`, `3h`, `2d`.
pub fn duration(secs: i64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

/// Milliseconds for people: `1500ms` → `1.5s`, `600ms` stays.
pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_align_on_the_widest_cell() {
        let t = table(
            &["NAME", "STATE", "LABELS"],
            &[
                vec!["web-1".into(), "alive".into(), "role=web".into()],
                vec!["db-10".into(), "unreachable".into(), "-".into()],
            ],
        );
        assert_eq!(
            t,
            "NAME    STATE         LABELS\n\
             web-1   alive         role=web\n\
             db-10   unreachable   -\n"
        );
        assert_eq!(table(&["A", "B"], &[]), "A   B\n", "headers alone");
    }

    #[test]
    fn machine_formats_print_the_objects() {
        let v = json!([{"id": "web-1", "labels": {"role": "web"}}]);
        let j = encode(Format::Json, &v).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&j).unwrap(), v);
        let y = encode(Format::Yaml, &v).unwrap();
        assert_eq!(y, "- id: web-1\n  labels:\n    role: web\n");
        assert_eq!(serde_norway::from_str::<Value>(&y).unwrap(), v);
    }

    #[test]
    fn cells() {
        let v = json!({"a": "x", "n": 3, "z": null, "l": {"role": "web", "zone": "eu"}});
        assert_eq!(s(&v, "a"), "x");
        assert_eq!(s(&v, "n"), "3");
        assert_eq!(s(&v, "z"), "-");
        assert_eq!(s(&v, "missing"), "-");
        assert_eq!(labels(v.get("l")), "role=web,zone=eu");
        assert_eq!(labels(Some(&json!({}))), "-");
        let now = DateTime::parse_from_rfc3339("2026-01-02T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(age(Some("2026-01-01T23:59:18Z"), now), "42s");
        assert_eq!(age(Some("2026-01-01T23:00:00Z"), now), "60m");
        assert_eq!(age(Some("2026-01-01T00:00:00Z"), now), "24h");
        assert_eq!(age(Some("2025-12-01T00:00:00Z"), now), "32d");
        assert_eq!(age(Some("not a time"), now), "-");
        assert_eq!(age(None, now), "-");
        assert_eq!(
            (millis(600), millis(4000), millis(1500)),
            ("600ms".into(), "4s".into(), "1.5s".into())
        );
    }
}
