//! Logs requests (decision 0033): the controller asks, on this node's own
//! declaration queue, for the recent output of the node's units of a module;
//! the agent answers with one `logs` report. The agent never listens for
//! anyone: the request comes the way declarations come, signed by the
//! controller, and the answer goes the way reports go.
//!
//! Only the units the node's inventory section declares for the module are
//! read, each in `<state_dir>/units/<unit>/` (`stdout.log`, `stderr.log` and
//! their rotated files, [`crate::units::tail`]): the request names a module
//! and positions, never a path.

use std::path::Path;

use mesh_protocol::{
    Envelope, LogStream, Logs, LogsRequest, MAX_LOG_ANSWER_BYTES, MAX_LOG_UNITS, MAX_REPORT_BYTES,
    NodeId, Report, UnitLogs,
};
use uuid::Uuid;

/// Whether a message of the declaration queue is a logs request (its
/// envelope's kind), before anything else of it is read.
pub fn is_request(bytes: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Kind<'a> {
        #[serde(borrow)]
        kind: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Kind<'_>>(bytes).is_ok_and(|k| k.kind == LogsRequest::KIND)
}

/// The answer to request `id`: the output of `units` (the node's units of
/// the module, by name), within the bounds of one report.
pub fn answer(
    units_dir: &Path,
    node: &NodeId,
    id: Uuid,
    request: &LogsRequest,
    units: &[String],
) -> Logs {
    let mut answer = Logs {
        request: id,
        module: request.module.clone(),
        units: Vec::new(),
        error: None,
    };
    if units.is_empty() {
        answer.error = Some(format!(
            "node {node} runs no unit of module {}",
            request.module
        ));
        return answer;
    }
    let units = &units[..units.len().min(MAX_LOG_UNITS)];
    let streams = units.len() * LogStream::ALL.len();
    // Room for each stream's position and framing, then the lines.
    let mut budget = MAX_LOG_ANSWER_BYTES.saturating_sub(streams * 256);
    let mut left = streams;
    let tail = request.tail as usize;
    let mut errors = Vec::new();
    for unit in units {
        let dir = units_dir.join(unit);
        let mut out = UnitLogs {
            unit: unit.clone(),
            streams: Vec::new(),
        };
        for stream in LogStream::ALL {
            let share = budget / left.max(1);
            left = left.saturating_sub(1);
            let after = request
                .after
                .iter()
                .find(|p| &p.unit == unit && p.stream == stream);
            match crate::units::tail::read_stream(&dir, unit, stream, after, tail, share) {
                Ok(s) => {
                    let used: usize = s.lines.iter().map(|l| l.len() + 3).sum();
                    budget = budget.saturating_sub(used.min(share));
                    out.streams.push(s);
                }
                Err(e) => errors.push(format!("unit {unit}: {}: {e}", stream.as_str())),
            }
        }
        answer.units.push(out);
    }
    if !errors.is_empty() {
        let text = errors.join("; ");
        answer.error = Some(text.chars().take(2000).collect());
    }
    // The budget keeps it far below the limit; should it not (a pathological
    // mix), no line is better than no answer.
    let fits = |a: &Logs| {
        Envelope::new(node.clone(), u64::MAX, Report::Logs(a.clone()))
            .encode()
            .len()
            <= MAX_REPORT_BYTES
    };
    if !fits(&answer) {
        for u in &mut answer.units {
            for s in &mut u.streams {
                s.lines.clear();
                s.more = true;
            }
        }
        answer.error = Some("the output did not fit in one answer; ask for fewer lines".into());
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_told_from_a_declaration() {
        let node = NodeId::parse("node-a").unwrap();
        let req = LogsRequest {
            module: "web".into(),
            tail: 5,
            after: vec![],
        };
        assert!(is_request(&Envelope::new(node.clone(), 0, req).encode()));
        assert!(!is_request(br#"{"kind":"declaration"}"#));
        assert!(!is_request(b"not json"));
    }

    /// What an agent older than logs requests does with one: its
    /// declaration path refuses the unknown kind, so it reports `applied`
    /// `rejected` with neither section nor generation, which the controller's
    /// inventory records nowhere (`applied report without a section`), and
    /// applies nothing. Harmless; the controller's wait names the node.
    #[test]
    fn an_older_agent_rejects_a_logs_request_without_naming_a_section() {
        let node = NodeId::parse("node-a").unwrap();
        let req = LogsRequest {
            module: "web".into(),
            tail: 5,
            after: vec![],
        };
        let bytes = Envelope::new(node.clone(), 0, req).encode();
        let err = crate::apply::decode(&bytes, &node).unwrap_err();
        assert_eq!(err.metric_label(), "unknown_kind", "{err}");
        assert_eq!(crate::apply::peek_section(&bytes), (None, None));
    }

    #[test]
    fn an_answer_covers_the_units_asked_and_fits_a_report() {
        let dir = tempfile::tempdir().unwrap();
        let node = NodeId::parse("node-a").unwrap();
        for unit in ["web-0", "web-1"] {
            let d = dir.path().join(unit);
            std::fs::create_dir_all(&d).unwrap();
            let big: String = (0..5000)
                .map(|i| format!("{unit} line {i} {}\n", "x".repeat(40)))
                .collect();
            std::fs::write(d.join("stdout.log"), big).unwrap();
            std::fs::write(d.join("stderr.log"), "oops\n").unwrap();
        }
        let req = LogsRequest {
            module: "web".into(),
            tail: 1000,
            after: vec![],
        };
        let units = vec!["web-0".to_owned(), "web-1".to_owned()];
        let a = answer(dir.path(), &node, Uuid::now_v7(), &req, &units);
        assert_eq!(a.units.len(), 2);
        assert!(a.error.is_none(), "{:?}", a.error);
        let env = Envelope::new(node.clone(), 1, Report::Logs(a.clone()));
        let bytes = env.encode();
        assert!(bytes.len() <= MAX_REPORT_BYTES, "{}", bytes.len());
        // It decodes as a report (the controller's check).
        Envelope::<Report>::decode(&bytes, MAX_REPORT_BYTES).unwrap();
        let web0 = &a.units[0];
        assert_eq!(web0.streams[1].lines, ["oops"]);
        assert!(!web0.streams[0].lines.is_empty());
        assert!(
            web0.streams[0]
                .lines
                .last()
                .unwrap()
                .starts_with("web-0 line 4999")
        );
        // No unit of the module: said, not read.
        let none = answer(dir.path(), &node, Uuid::now_v7(), &req, &[]);
        assert!(none.error.unwrap().contains("runs no unit"));
    }
}
