//! Rendering a rollout (the answer of `GET /v1/rollouts/{id}`) as lines, the
//! live view's frames (TTY: redrawn in place; otherwise only changed lines)
//! and the exit code of a final state.

use serde_json::Value;

// meshctl's exit codes, every one of them (stable: scripts depend on them).
// `EXIT_CODES_HELP` below is the table `meshctl --help` and the README show.

/// Exit code: success (a watched rollout succeeded).
pub const EXIT_SUCCEEDED: u8 = 0;
/// Exit code: usage, transport or API error.
pub const EXIT_ERROR: u8 = 1;
/// Exit code: `plan --detailed-exitcode` found changes to make.
pub const EXIT_CHANGES: u8 = 2;
/// Exit code: the rollout failed.
pub const EXIT_FAILED: u8 = 3;
/// Exit code: the rollout was rolled back.
pub const EXIT_ROLLED_BACK: u8 = 4;
/// Exit code: the rollout was denied or canceled.
pub const EXIT_DENIED_OR_CANCELED: u8 = 5;
/// Exit code: `--timeout` elapsed before a final state.
pub const EXIT_TIMEOUT: u8 = 6;
/// Exit code: a precondition failed: what was read changed before the write
/// (a stale ETag, HTTP 412).
pub const EXIT_PRECONDITION: u8 = 7;

/// The exit codes as `meshctl --help` shows them (and the README copies).
pub const EXIT_CODES_HELP: &str = "\
Exit codes (stable):
  0  success
  1  error: usage, transport, or the API's problem (title, detail, field)
  2  plan --detailed-exitcode: there are changes to apply
  3  a watched rollout failed
  4  a watched rollout was rolled back
  5  a watched rollout was denied or canceled
  6  --timeout elapsed before the rollout ended
  7  a precondition failed: it changed since it was read (stale ETag, 412)";

/// The exit code of a final rollout state; `None` while it is not final.
pub fn exit_code(state: &str) -> Option<u8> {
    match state {
        "succeeded" => Some(EXIT_SUCCEEDED),
        "failed" => Some(EXIT_FAILED),
        "rolled_back" => Some(EXIT_ROLLED_BACK),
        "denied" | "canceled" => Some(EXIT_DENIED_OR_CANCELED),
        _ => None,
    }
}

const BAR_WIDTH: usize = 20;

/// `[#####---------------]`: `done` of `total` in `BAR_WIDTH` cells.
pub fn bar(done: u64, total: u64) -> String {
    let filled = if total == 0 {
        0
    } else {
        (done.min(total) as usize * BAR_WIDTH) / total as usize
    };
    format!("[{}{}]", "#".repeat(filled), "-".repeat(BAR_WIDTH - filled))
}

fn s<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

fn n(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// The lines of one rollout: a heading, one line per step with its bar, the
/// total, the paused or failure reason, and the current receipt (the latest
/// `last_receipt` among its runs).
pub fn render(rollout: &Value) -> Vec<String> {
    let state = s(rollout, "state").unwrap_or("?");
    let step = n(rollout, "step");
    let steps = n(rollout, "steps");
    let runs: &[Value] = rollout
        .get("runs")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let mut lines = vec![format!(
        "rollout {} of {} to revision {}: {state}",
        s(rollout, "id").unwrap_or("?"),
        s(rollout, "module").unwrap_or("?"),
        s(rollout, "revision").unwrap_or("?"),
    )];
    for i in 1..=steps {
        let of_step: Vec<&Value> = runs.iter().filter(|r| n(r, "step") == i).collect();
        let done = of_step
            .iter()
            .filter(|r| s(r, "state") == Some("succeeded"))
            .count() as u64;
        let total = of_step.len() as u64;
        let label = if total > 0 && done == total {
            "succeeded".to_owned()
        } else if i > step && of_step.iter().all(|r| s(r, "state") == Some("queued")) {
            "pending".to_owned()
        } else {
            // The run states of the step, each once, in the runs' order.
            let mut seen: Vec<&str> = Vec::new();
            for r in &of_step {
                let st = s(r, "state").unwrap_or("?");
                if !seen.contains(&st) {
                    seen.push(st);
                }
            }
            if seen.is_empty() {
                if i > step { "pending" } else { state }.to_owned()
            } else {
                seen.join(", ")
            }
        };
        let marker = if i == step { ">" } else { " " };
        lines.push(format!(
            "{marker} step {i}/{steps} {} {done}/{total} nodes  {label}",
            bar(done, total)
        ));
    }
    let done = n(rollout, "nodes_done");
    let total = n(rollout, "nodes_total");
    lines.push(format!(
        "  total    {} {done}/{total} nodes  {state}",
        bar(done, total)
    ));
    if let Some(r) = s(rollout, "paused_reason") {
        lines.push(format!("  paused: {r}"));
    }
    if let Some(r) = s(rollout, "reason") {
        lines.push(format!("  reason: {r}"));
    }
    for run in runs {
        if let Some(r) = s(run, "reason") {
            lines.push(format!("  {}: {r}", s(run, "node").unwrap_or("?")));
        }
    }
    // The latest receipt: by its time (RFC 3339 from one clock), the later run on a tie.
    let latest = runs
        .iter()
        .filter_map(|r| {
            let receipt = r.get("last_receipt").filter(|v| v.is_object())?;
            Some((s(receipt, "at").unwrap_or(""), r, receipt))
        })
        .max_by(|a, b| a.0.cmp(b.0));
    if let Some((_, run, receipt)) = latest {
        lines.push(format!(
            "  now: {}: {}",
            s(run, "node").unwrap_or("?"),
            s(receipt, "kind").unwrap_or("?")
        ));
    }
    lines
}

const NO_WRAP: &str = "\x1b[?7l";
const WRAP: &str = "\x1b[?7h";

/// How frames reach the terminal: redrawn in place on a TTY; otherwise only
/// the lines that were not in the frame before, without escape codes.
pub struct Screen {
    tty: bool,
    previous: Vec<String>,
}

impl Screen {
    pub fn new(tty: bool) -> Self {
        Screen {
            tty,
            previous: Vec::new(),
        }
    }

    /// What to write for `lines` after the frame before.
    pub fn frame(&mut self, lines: Vec<String>) -> String {
        let mut out = String::new();
        if self.tty {
            if !self.previous.is_empty() {
                // Back to the frame's first line, and clear to the end.
                out.push_str(&format!("\x1b[{}A\r\x1b[J", self.previous.len()));
            }
            // Autowrap off while drawing: a line wider than the terminal is
            // cut at its edge instead of taking two rows, so the next frame's
            // cursor-up lands on the first line.
            out.push_str(NO_WRAP);
            for l in &lines {
                out.push_str(l);
                out.push('\n');
            }
            out.push_str(WRAP);
        } else {
            for l in lines.iter().filter(|l| !self.previous.contains(l)) {
                out.push_str(l);
                out.push('\n');
            }
        }
        self.previous = lines;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rollout(state: &str) -> Value {
        json!({
            "id": "r-1", "module": "web", "revision": "rev-2", "previous_revision": "rev-1",
            "state": state, "paused_reason": null, "reason": null,
            "step": 2, "steps": 3, "nodes_done": 2, "nodes_total": 5,
            "max_unavailable": 1, "max_extra": 0, "settle_secs": 10, "failure_threshold": 1,
            "auto_rollback": true, "canary": 1,
            "created_at": "2026-12-02T06:00:00Z", "updated_at": "2026-12-02T06:01:00Z",
            "created_by": "ci",
            "runs": [
                {"id": "u1", "node": "web-1", "state": "succeeded", "revision": "rev-2", "step": 1, "reason": null,
                 "last_receipt": {"seq": 5, "kind": "run.succeeded", "at": "2026-12-02T06:00:30Z", "detail": {}}},
                {"id": "u2", "node": "web-2", "state": "succeeded", "revision": "rev-2", "step": 2, "reason": null,
                 "last_receipt": {"seq": 5, "kind": "run.succeeded", "at": "2026-12-02T06:00:50Z", "detail": {}}},
                {"id": "u3", "node": "web-3", "state": "deploying", "revision": "rev-2", "step": 2, "reason": null,
                 "last_receipt": {"seq": 2, "kind": "run.started", "at": "2026-12-02T06:00:55Z", "detail": {}}},
                {"id": "u4", "node": "web-4", "state": "queued", "revision": "rev-2", "step": 3, "reason": null,
                 "last_receipt": null},
                {"id": "u5", "node": "web-5", "state": "queued", "revision": "rev-2", "step": 3, "reason": null,
                 "last_receipt": {"seq": 1, "kind": "run.queued", "at": "2026-12-02T06:00:00Z", "detail": {}}}
            ]
        })
    }

    #[test]
    fn bars() {
        assert_eq!(bar(0, 3), "[--------------------]");
        assert_eq!(bar(2, 3), "[#############-------]");
        assert_eq!(bar(3, 3), "[####################]");
        assert_eq!(bar(1, 0), "[--------------------]");
        assert_eq!(bar(9, 3), "[####################]");
    }

    #[test]
    fn a_running_rollout_renders_its_steps_total_and_current_receipt() {
        assert_eq!(
            render(&rollout("running")),
            [
                "rollout r-1 of web to revision rev-2: running",
                "  step 1/3 [####################] 1/1 nodes  succeeded",
                "> step 2/3 [##########----------] 1/2 nodes  succeeded, deploying",
                "  step 3/3 [--------------------] 0/2 nodes  pending",
                "  total    [########------------] 2/5 nodes  running",
                "  now: web-3: run.started",
            ]
        );
    }

    #[test]
    fn reasons_are_shown() {
        let mut r = rollout("paused");
        r["paused_reason"] = json!("freeze: release week");
        r["runs"][2]["state"] = json!("failed");
        r["runs"][2]["reason"] = json!("probe http :8080 failed 3 times");
        r["reason"] = json!("1 node failed (threshold 1)");
        let lines = render(&r);
        assert!(lines.contains(&"  paused: freeze: release week".to_owned()));
        assert!(lines.contains(&"  reason: 1 node failed (threshold 1)".to_owned()));
        assert!(lines.contains(&"  web-3: probe http :8080 failed 3 times".to_owned()));
        assert!(lines.contains(
            &"> step 2/3 [##########----------] 1/2 nodes  succeeded, failed".to_owned()
        ));
    }

    #[test]
    fn an_unplanned_or_odd_rollout_still_renders() {
        let lines =
            render(&json!({"id": "r", "state": "awaiting_approval", "steps": 0, "runs": []}));
        assert_eq!(
            lines,
            [
                "rollout r of ? to revision ?: awaiting_approval",
                "  total    [--------------------] 0/0 nodes  awaiting_approval",
            ]
        );
        assert_eq!(render(&json!(null)).len(), 2);
    }

    #[test]
    fn on_a_tty_each_frame_redraws_in_place() {
        let mut screen = Screen::new(true);
        let lines = render(&rollout("running"));
        let first = screen.frame(lines.clone());
        assert_eq!(first, format!("\x1b[?7l{}\n\x1b[?7h", lines.join("\n")));
        let mut done = rollout("succeeded");
        done["nodes_done"] = json!(5);
        let second = screen.frame(render(&done));
        assert!(second.starts_with(
            "\x1b[6A\r\x1b[J\x1b[?7lrollout r-1 of web to revision rev-2: succeeded\n"
        ));
        assert!(second.ends_with("  now: web-3: run.started\n\x1b[?7h"));
        assert_eq!(second.matches('\n').count(), 6);
        // A frame with fewer lines goes back over all of the last one's.
        let third = screen.frame(vec!["one".to_owned()]);
        assert_eq!(third, "\x1b[6A\r\x1b[J\x1b[?7lone\n\x1b[?7h");
        assert_eq!(
            screen.frame(vec!["one".to_owned()]),
            "\x1b[1A\r\x1b[J\x1b[?7lone\n\x1b[?7h"
        );
    }

    #[test]
    fn off_a_tty_only_changed_lines_are_printed_without_escapes() {
        let mut screen = Screen::new(false);
        let first = screen.frame(render(&rollout("running")));
        assert_eq!(first.lines().count(), 6);
        assert_eq!(screen.frame(render(&rollout("running"))), "");
        let mut next = rollout("running");
        next["runs"][2]["state"] = json!("succeeded");
        next["runs"][2]["last_receipt"]["kind"] = json!("run.succeeded");
        next["nodes_done"] = json!(3);
        let out = screen.frame(render(&next));
        assert!(!out.contains('\x1b'));
        assert_eq!(
            out,
            "> step 2/3 [####################] 2/2 nodes  succeeded\n\
             \x20 total    [############--------] 3/5 nodes  running\n\
             \x20 now: web-3: run.succeeded\n"
        );
    }

    #[test]
    fn every_final_state_has_its_exit_code() {
        assert_eq!(exit_code("succeeded"), Some(0));
        assert_eq!(exit_code("failed"), Some(3));
        assert_eq!(exit_code("rolled_back"), Some(4));
        assert_eq!(exit_code("denied"), Some(5));
        assert_eq!(exit_code("canceled"), Some(5));
        for state in ["awaiting_approval", "running", "paused", "something_new"] {
            assert_eq!(exit_code(state), None, "{state}");
        }
        assert_eq!(EXIT_ERROR, 1);
        assert_eq!(EXIT_TIMEOUT, 6);
    }
}
