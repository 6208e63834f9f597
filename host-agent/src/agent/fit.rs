//! The size-fitting of outgoing reports: each report kind whose body grows
//! with what the node holds (items, units, resources, probes) is shrunk,
//! step by step and saying so, until its envelope fits
//! [`MAX_REPORT_BYTES`]. Pure functions: no I/O, nothing but the report.

use mesh_protocol::{
    Applied, Envelope, Health, ItemOutcome, MAX_REPORT_BYTES, NodeId, Report, Resources, Units,
};
use tracing::warn;

/// Shrink an applied report until its envelope fits [`MAX_REPORT_BYTES`]: first
/// keep only the failed items, then cut their messages, then drop them.
pub(super) fn fit_applied(mut a: Applied, node: &NodeId) -> Applied {
    let fits = |a: &Applied| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Applied(a.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    if fits(&a) {
        return a;
    }
    a.items.retain(|i| !i.ok);
    if fits(&a) {
        return a;
    }
    a.items = a
        .items
        .into_iter()
        .map(|i| ItemOutcome {
            item: truncate(&i.item, 200),
            ok: i.ok,
            error: i.error.map(|e| truncate(&e, 200)),
        })
        .collect();
    if fits(&a) {
        return a;
    }
    let n = a.items.len();
    a.items.clear();
    a.error = Some(format!(
        "{} ({n} item outcomes omitted for size)",
        truncate(a.error.as_deref().unwrap_or(""), 1000)
    ));
    a
}

/// Make a units report fit [`MAX_REPORT_BYTES`]: first drop the start times, then
/// (hundreds of units, far beyond what a node runs) cut the list, saying so in
/// the log.
pub(super) fn fit_units(mut u: Units, node: &NodeId) -> Units {
    let fits = |u: &Units| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Units(u.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    if fits(&u) {
        return u;
    }
    for s in &mut u.units {
        s.started_at = None;
    }
    let total = u.units.len();
    while !fits(&u) && !u.units.is_empty() {
        let keep = u.units.len() * 9 / 10;
        u.units.truncate(keep);
    }
    if u.units.len() < total {
        warn!(
            total,
            reported = u.units.len(),
            "too many units for one units report; the list is cut"
        );
    }
    u
}

/// Make a resources report fit [`MAX_REPORT_BYTES`]: first cut the reasons
/// to 200 characters, then drop them, then (hundreds of grants on one node)
/// cut the list, saying so in the log. Never refused: the controller learns
/// what fits.
pub(super) fn fit_resources(mut r: Resources, node: &NodeId) -> Resources {
    let fits = |r: &Resources| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Resources(r.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    r.resources.truncate(mesh_protocol::MAX_RESOURCES);
    if fits(&r) {
        return r;
    }
    let total = r.resources.len();
    for s in &mut r.resources {
        s.reason = s.reason.as_deref().map(|t| truncate(t, 200));
    }
    if !fits(&r) {
        for s in &mut r.resources {
            s.reason = None;
        }
    }
    while !fits(&r) && !r.resources.is_empty() {
        let keep = r.resources.len() * 9 / 10;
        r.resources.truncate(keep);
    }
    warn!(
        total,
        reported = r.resources.len(),
        "the resources report is too large; reasons shortened or dropped, and the list cut where still needed"
    );
    r
}

/// Make a health report fit [`MAX_REPORT_BYTES`]: first drop the details,
/// then (hundreds of probes, far beyond what a node runs) cut the list,
/// saying so in the log.
pub(super) fn fit_health(mut h: Health, node: &NodeId) -> Health {
    let fits = |h: &Health| {
        let probe = Envelope::new(node.clone(), u64::MAX, Report::Health(h.clone()));
        probe.encode().len() <= MAX_REPORT_BYTES
    };
    h.probes.truncate(mesh_protocol::MAX_PROBE_RESULTS);
    if fits(&h) {
        return h;
    }
    for p in &mut h.probes {
        p.detail = None;
    }
    let total = h.probes.len();
    while !fits(&h) && !h.probes.is_empty() {
        let keep = h.probes.len() * 9 / 10;
        h.probes.truncate(keep);
    }
    if h.probes.len() < total {
        warn!(
            total,
            reported = h.probes.len(),
            "too many probes for one health report; the list is cut"
        );
    }
    h
}

/// `s`, cut to `max_chars` characters (an ellipsis says it was cut).
pub(super) fn truncate(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_owned()
    } else {
        s.chars().take(max_chars).collect::<String>() + "…"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::{Outcome, ResourceStatusState};
    use uuid::Uuid;

    #[test]
    fn oversized_health_reports_are_shrunk() {
        let now = chrono::Utc::now();
        let probes: Vec<mesh_protocol::ProbeResult> = (0..600)
            .map(|i| mesh_protocol::ProbeResult {
                unit: format!("unit-{i}"),
                module: "m".into(),
                probe: "ready".into(),
                state: mesh_protocol::ProbeState::Unhealthy,
                since: now,
                checked_at: Some(now),
                failures: 3,
                detail: Some("d".repeat(mesh_protocol::MAX_PROBE_DETAIL)),
            })
            .collect();
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let small = fit_health(
            Health {
                probes: probes.clone(),
                summary: false,
            },
            &node,
        );
        assert!(!small.probes.is_empty());
        assert!(small.probes.iter().all(|p| p.detail.is_none()));
        let env = Envelope::new(node.clone(), 1, Report::Health(small));
        assert!(env.encode().len() <= MAX_REPORT_BYTES);
        // A small one is left as it is.
        let few = Health {
            probes: probes[..3].to_vec(),
            summary: true,
        };
        assert_eq!(fit_health(few.clone(), &node), few);
    }

    #[test]
    fn oversized_resources_reports_are_cut_to_fit() {
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let status = |i: u128, reason: Option<String>| mesh_protocol::ResourceStatus {
            grant: Uuid::from_u128(i),
            state: ResourceStatusState::Failed,
            credential_version: Some(1),
            reason,
            recreated: false,
        };
        let size = |r: &Resources| {
            Envelope::new(node.clone(), 1, Report::Resources(r.clone()))
                .encode()
                .len()
        };
        // Long reasons: shortened, every grant kept.
        let long = Resources {
            generation: 3,
            resources: (0..100)
                .map(|i| status(i, Some("r".repeat(mesh_protocol::MAX_REASON_CHARS))))
                .collect(),
        };
        assert!(size(&long) > MAX_REPORT_BYTES);
        let cut = fit_resources(long, &node);
        assert!(size(&cut) <= MAX_REPORT_BYTES);
        assert_eq!(cut.generation, 3);
        assert_eq!(cut.resources.len(), 100);
        assert!(cut.resources.iter().all(|s| {
            let r = s.reason.as_deref().unwrap();
            r.starts_with("rrr") && r.chars().count() <= 201
        }));
        // The most a section holds, each with a full reason: cut to what fits.
        let many = Resources {
            generation: 4,
            resources: (0..mesh_protocol::MAX_RESOURCES as u128)
                .map(|i| status(i, Some("x".repeat(mesh_protocol::MAX_REASON_CHARS))))
                .collect(),
        };
        let cut = fit_resources(many, &node);
        assert!(size(&cut) <= MAX_REPORT_BYTES);
        assert!(!cut.resources.is_empty());
        assert_eq!(cut.resources[0].grant, Uuid::from_u128(0));
        // A report that fits is left as it is.
        let small = Resources {
            generation: 1,
            resources: vec![status(1, Some("refused".into()))],
        };
        assert_eq!(fit_resources(small.clone(), &node), small);
    }

    #[test]
    fn oversized_applied_reports_are_shrunk() {
        let items = (0..1024)
            .map(|i| ItemOutcome {
                item: format!("/{}/{i}", "p".repeat(200)),
                ok: i % 2 == 0,
                error: Some("e".repeat(300)),
            })
            .collect();
        let a = Applied {
            section: Some(mesh_protocol::Section::Config),
            generation: Some(1),
            outcome: Outcome::Failed,
            items,
            error: Some("x".into()),
            unsupported_section: None,
        };
        let node = NodeId::parse(&"n".repeat(63)).unwrap();
        let small = fit_applied(a, &node);
        let env = Envelope::new(node, 1, Report::Applied(small));
        assert!(env.encode().len() <= MAX_REPORT_BYTES);
    }
}
