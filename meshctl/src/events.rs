//! The events stream (`GET /v1/events`, server-sent events): `meshctl
//! events` and `meshctl get nodes -w`.
//!
//! Following survives the controller going away: on a disconnect it
//! reconnects with a capped exponential backoff and sends `Last-Event-ID`,
//! the position of the last event printed, so nothing is lost and nothing is
//! repeated (the server resends only what is after it). A 410 (the position
//! was pruned) is reported and ends the command: re-list, then follow again.

use crate::client::{Api, StreamError, urlencode};
use crate::output::{self, Format};
use crate::resources::{self, Kind};
use anyhow::bail;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

/// Reassembles events from a byte stream cut anywhere (the SSE framing:
/// `field: value` lines, a blank line ends an event, `:` lines are comments).
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    id: Option<String>,
    event: Option<String>,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds `bytes`; the events they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
            let raw: Vec<u8> = self.buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&raw[..raw.len() - 1]);
            let line = line.strip_suffix('\r').unwrap_or(&line);
            if line.is_empty() {
                if !self.data.is_empty() || self.event.is_some() {
                    out.push(SseEvent {
                        id: self.id.take(),
                        event: self.event.take().unwrap_or_else(|| "message".to_owned()),
                        data: std::mem::take(&mut self.data).join("\n"),
                    });
                }
                self.id = None;
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "id" => self.id = Some(value.to_owned()),
                "event" => self.event = Some(value.to_owned()),
                "data" => self.data.push(value.to_owned()),
                _ => {}
            }
        }
        out
    }
}

/// The filters of `meshctl events`.
#[derive(Debug, Default, Clone)]
pub struct Filters {
    pub context: Option<String>,
    pub kind: Option<String>,
    pub node: Option<String>,
    pub module: Option<String>,
}

impl Filters {
    fn query(&self, follow: bool, after: Option<&str>) -> String {
        let mut q = vec![format!("follow={follow}")];
        for (k, v) in [
            ("context", &self.context),
            ("kind", &self.kind),
            ("node", &self.node),
            ("module", &self.module),
        ] {
            if let Some(v) = v {
                q.push(format!("{k}={}", urlencode(v)));
            }
        }
        if let Some(a) = after {
            q.push(format!("after={}", urlencode(a)));
        }
        format!("/v1/events?{}", q.join("&"))
    }
}

/// How one connection ended.
enum End {
    /// The server closed the stream (with `follow=false`: everything sent).
    Closed,
    /// The server dropped us (`event: dropped`), with its reason.
    Dropped(String),
    /// The connection broke.
    Broken(String),
}

/// Reads one open stream, handing each event to `on_event` and recording its
/// id in `last_id`.
async fn read(
    mut resp: reqwest::Response,
    last_id: &mut Option<String>,
    on_event: &mut (dyn FnMut(&SseEvent) -> anyhow::Result<()> + Send),
) -> anyhow::Result<End> {
    let mut parser = SseParser::default();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(End::Closed),
            Err(e) => return Ok(End::Broken(e.without_url().to_string())),
        };
        for ev in parser.feed(&chunk) {
            if ev.event == "dropped" {
                let reason = serde_json::from_str::<Value>(&ev.data)
                    .ok()
                    .and_then(|v| v["reason"].as_str().map(str::to_owned))
                    .unwrap_or(ev.data);
                return Ok(End::Dropped(reason));
            }
            on_event(&ev)?;
            if ev.id.is_some() {
                last_id.clone_from(&ev.id);
            }
        }
    }
}

/// The delay before reconnect attempt `attempt` (0-based): 250 ms doubling,
/// at most 5 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(250u64.saturating_mul(1 << attempt.min(5)).min(5_000))
}

/// Streams events after `after` (none: from now) through `on_event`; with
/// `follow` it never ends on its own and reconnects from the last id after
/// any disconnect, without it it ends once the kept events are sent.
pub async fn stream(
    api: &Api,
    filters: &Filters,
    follow: bool,
    after: Option<String>,
    on_event: &mut (dyn FnMut(&SseEvent) -> anyhow::Result<()> + Send),
) -> anyhow::Result<()> {
    let path = filters.query(follow, None);
    let mut last_id = after;
    let mut attempt: u32 = 0;
    loop {
        let why = match api.open_stream(&path, last_id.as_deref()).await {
            Ok(resp) => {
                attempt = 0;
                match read(resp, &mut last_id, on_event).await? {
                    End::Closed if !follow => return Ok(()),
                    End::Closed => "the controller closed the stream".to_owned(),
                    End::Dropped(reason) => format!("dropped by the controller: {reason}"),
                    End::Broken(e) => e,
                }
            }
            Err(StreamError::Api(e)) if e.status.as_u16() == 410 => bail!(
                "the stream cannot resume after position {}: it was pruned (410 Gone). Events in between are lost; re-list what you follow (meshctl get ...) and run the command again without --after. ({e})",
                last_id.as_deref().unwrap_or("?")
            ),
            Err(StreamError::Api(e)) if e.status.is_client_error() && e.status.as_u16() != 429 => {
                return Err(e.into());
            }
            Err(e) => e.to_string(),
        };
        if !follow {
            bail!("the events stream broke: {why}");
        }
        let wait = backoff(attempt);
        attempt = attempt.saturating_add(1);
        eprintln!(
            "meshctl: events: {why}; reconnecting in {} ms{}",
            wait.as_millis(),
            last_id
                .as_deref()
                .map(|id| format!(" (resuming after {id})"))
                .unwrap_or_default()
        );
        tokio::time::sleep(wait).await;
    }
}

/// One event as a line: position, time, event, node, module and the body.
pub fn line(ev: &SseEvent) -> String {
    let v: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
    let sent = v["sent_at"].as_str().unwrap_or("-");
    let mut out = format!(
        "{:>8}  {}  {}",
        ev.id.as_deref().unwrap_or("-"),
        sent,
        ev.event
    );
    for key in ["node", "module"] {
        if let Some(x) = v[key].as_str() {
            out.push_str(&format!("  {key}={x}"));
        }
    }
    if let Some(body) = v.get("body").filter(|b| !b.is_null()) {
        let text = body.to_string();
        let short: String = text.chars().take(160).collect();
        out.push_str("  ");
        out.push_str(&short);
        if short.len() < text.len() {
            out.push('…');
        }
    }
    out
}

/// `meshctl events`.
pub async fn events(
    api: &Api,
    filters: Filters,
    follow: bool,
    after: Option<String>,
    format: Option<Format>,
) -> anyhow::Result<()> {
    // Without --follow: the kept events (from the oldest, unless --after).
    let after = match (follow, after) {
        (_, Some(a)) => Some(a),
        (false, None) => Some("0".to_owned()),
        (true, None) => None,
    };
    let json = match format {
        None | Some(Format::Wide) => false,
        Some(Format::Json) => true,
        Some(Format::Yaml) => {
            bail!("events: -o yaml is not a stream format; use -o json (one JSON object a line)")
        }
    };
    let mut print = |ev: &SseEvent| -> anyhow::Result<()> {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        if json {
            writeln!(out, "{}", ev.data)?;
        } else {
            writeln!(out, "{}", line(ev))?;
        }
        out.flush()?;
        Ok(())
    };
    let result = stream(api, &filters, follow, after.clone(), &mut print).await;
    match result {
        // The oldest kept event is after 0: pruned history, not an error for
        // a listing from the start. Resume from now.
        Err(e) if !follow && after.as_deref() == Some("0") && e.to_string().contains("410") => {
            eprintln!("meshctl: events: older events were pruned; {e}");
            Ok(())
        }
        other => other,
    }
}

/// The events that mention `node` or `module` (newest `limit`), for
/// `describe`: the kept events, not followed.
pub async fn recent(api: &Api, filters: Filters, limit: usize) -> anyhow::Result<Vec<SseEvent>> {
    let mut all = Vec::new();
    let mut collect = |ev: &SseEvent| -> anyhow::Result<()> {
        all.push(ev.clone());
        if all.len() > limit {
            all.remove(0);
        }
        Ok(())
    };
    match stream(api, &filters, false, Some("0".to_owned()), &mut collect).await {
        Ok(()) => Ok(all),
        // Pruned history: describe shows what it can without events.
        Err(e) if e.to_string().contains("410") => Ok(all),
        Err(e) => Err(e),
    }
}

/// `meshctl get nodes -w`: the table, then every node whose row changes,
/// re-listed on each inventory event (and each reconnect).
pub async fn watch_nodes(
    api: &Api,
    selector: &[String],
    format: Option<Format>,
) -> anyhow::Result<()> {
    if matches!(format, Some(Format::Json | Format::Yaml)) {
        bail!("-w prints table rows; -o json|yaml is for a one-shot get");
    }
    let wide = format == Some(Format::Wide);
    let mut query = Vec::new();
    if !selector.is_empty() {
        query.push(format!(
            "selector={}",
            resources::selector_query(&resources::parse_selector(selector)?)
        ));
    }
    // Subscribe first, then list: a change between the two is not missed.
    let filters = Filters {
        context: Some("inventory".to_owned()),
        ..Filters::default()
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let stream_api = api;
    let listing = async {
        let mut shown: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let (items, _) = resources::list(api, Kind::Nodes, &query).await?;
        let rows: Vec<Vec<String>> = items.iter().map(|v| state_row(v, wide)).collect();
        let headers = headers(wide);
        let table = output::table(&headers, &rows);
        print!("{table}");
        let widths = column_widths(&table);
        for (v, row) in items.iter().zip(rows) {
            shown.insert(output::s(v, "id"), row);
        }
        loop {
            // Level-triggered: an event wakes the re-list, and a periodic
            // one bounds anything a lost wake-up would miss.
            tokio::select! {
                got = rx.recv() => if got.is_none() { return anyhow::Ok(()) },
                _ = tokio::time::sleep(RELIST) => {}
            }
            let (items, _) = resources::list(api, Kind::Nodes, &query).await?;
            for v in &items {
                let row = state_row(v, wide);
                let id = output::s(v, "id");
                if shown.get(&id) != Some(&row) {
                    println!("{}", pad(&row, &widths));
                    shown.insert(id, row);
                }
            }
            use std::io::Write as _;
            std::io::stdout().flush()?;
        }
    };
    let follow = async move {
        let mut on_event = |ev: &SseEvent| -> anyhow::Result<()> {
            if ev.event.starts_with("inventory.") {
                let _ = tx.try_send(());
            }
            Ok(())
        };
        stream(stream_api, &filters, true, None, &mut on_event).await
    };
    tokio::select! {
        r = listing => r,
        r = follow => r,
    }
}

/// How often `get nodes -w` re-lists even without an event.
const RELIST: Duration = Duration::from_secs(10);

/// The watched row: the table's row with the age column replaced by the
/// state's own timestamps (an age would change every second and reprint
/// every row).
fn state_row(v: &Value, wide: bool) -> Vec<String> {
    let mut row = Kind::Nodes.row(v, wide);
    row.remove(2);
    row
}

fn headers(wide: bool) -> Vec<&'static str> {
    let mut h = vec!["NAME", "STATE", "LABELS"];
    if wide {
        h.extend(["HOSTNAME", "HEARTBEAT"]);
    }
    h
}

/// The column widths of a table's header line (where each column starts).
fn column_widths(table: &str) -> Vec<usize> {
    let header = table.lines().next().unwrap_or("");
    let mut widths = Vec::new();
    let mut start = 0;
    let chars: Vec<char> = header.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if i + 3 <= chars.len() && chars[i..i + 3] == [' ', ' ', ' '] {
            let mut j = i;
            while j < chars.len() && chars[j] == ' ' {
                j += 1;
            }
            widths.push(j - 3 - start);
            start = j;
            i = j;
        } else {
            i += 1;
        }
    }
    widths
}

fn pad(row: &[String], widths: &[usize]) -> String {
    let mut out = String::new();
    for (i, cell) in row.iter().enumerate() {
        if i > 0 {
            out.push_str("   ");
        }
        out.push_str(cell);
        if let Some(w) = widths.get(i)
            && i + 1 < row.len()
        {
            out.push_str(&" ".repeat(w.saturating_sub(cell.chars().count())));
        }
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_reassembled_across_any_cut() {
        let text = b": keep-alive\n\nid: 7\nevent: inventory.node.joined\ndata: {\"a\":1}\n\nid: 8\r\nevent: x.y\r\ndata: one\r\ndata: two\r\n\r\n";
        let want = vec![
            SseEvent {
                id: Some("7".into()),
                event: "inventory.node.joined".into(),
                data: "{\"a\":1}".into(),
            },
            SseEvent {
                id: Some("8".into()),
                event: "x.y".into(),
                data: "one\ntwo".into(),
            },
        ];
        for cut in 0..text.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&text[..cut]);
            got.extend(p.feed(&text[cut..]));
            assert_eq!(got, want, "cut at {cut}");
        }
        let mut p = SseParser::default();
        let mut got = Vec::new();
        for b in text {
            got.extend(p.feed(std::slice::from_ref(b)));
        }
        assert_eq!(got, want, "byte by byte");
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        assert_eq!(backoff(0), Duration::from_millis(250));
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(4), Duration::from_millis(4000));
        assert_eq!(backoff(5), Duration::from_millis(5000));
        assert_eq!(backoff(60), Duration::from_millis(5000));
    }

    #[test]
    fn queries_and_lines() {
        let f = Filters {
            context: Some("inventory".into()),
            node: Some("web-1".into()),
            ..Filters::default()
        };
        assert_eq!(
            f.query(true, None),
            "/v1/events?follow=true&context=inventory&node=web-1"
        );
        let ev = SseEvent {
            id: Some("12".into()),
            event: "inventory.node.unreachable".into(),
            data: r#"{"position":12,"sent_at":"2026-01-01T00:00:00Z","node":"web-1","module":null,"body":{"node":"web-1"}}"#.into(),
        };
        assert_eq!(
            line(&ev),
            "      12  2026-01-01T00:00:00Z  inventory.node.unreachable  node=web-1  {\"node\":\"web-1\"}"
        );
    }

    #[test]
    fn watched_rows_line_up_under_the_header() {
        let t = output::table(
            &["NAME", "STATE", "LABELS"],
            &[vec!["web-1".into(), "alive".into(), "-".into()]],
        );
        let w = column_widths(&t);
        assert_eq!(w, vec![5, 5]);
        assert_eq!(
            pad(&["db-1".into(), "unreachable".into(), "x=y".into()], &w),
            "db-1    unreachable   x=y"
        );
    }
}
