//! The bounded buffer of reports not yet confirmed by the broker.
//!
//! A report leaves the buffer only when the broker confirmed it (ack, not
//! returned as unroutable). When the buffer is full the oldest heartbeat goes
//! first (a newer one supersedes it), then the oldest units report (a whole list,
//! also superseded), then the oldest health report (likewise), then the oldest
//! resources report (likewise, and one is sent on every connect), then the
//! oldest hello (one is sent on every connect); an `applied` report goes only
//! when nothing else is left, and the next heartbeat still carries the applied
//! generations. A new hello replaces older hellos that are still waiting, a new
//! units report older units reports, a new health report older health reports,
//! a new resources report older resources reports (and certificates reports
//! likewise): never two of these kinds wait, besides one already in flight.

use std::collections::VecDeque;

use mesh_protocol::ReportKind;
use uuid::Uuid;

/// What a [`ReportBuffer::push`] let go of.
#[derive(Debug, Default)]
pub struct Dropped {
    /// Older reports of the kind the new one replaces (its newer whole state).
    pub superseded: Vec<Outgoing>,
    /// Reports dropped to make room: lost.
    pub evicted: Vec<Outgoing>,
}

/// One encoded report, ready to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub id: Uuid,
    pub kind: ReportKind,
    pub seq: u64,
    pub payload: Vec<u8>,
}

#[derive(Debug)]
struct Entry {
    report: Outgoing,
    in_flight: bool,
}

#[derive(Debug)]
pub struct ReportBuffer {
    entries: VecDeque<Entry>,
    capacity: usize,
}

impl ReportBuffer {
    pub fn new(capacity: usize) -> Self {
        ReportBuffer {
            entries: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn in_flight(&self) -> usize {
        self.entries.iter().filter(|e| e.in_flight).count()
    }

    /// Add a report; returns the reports superseded and those dropped to make
    /// room.
    pub fn push(&mut self, report: Outgoing) -> Dropped {
        let mut dropped = Dropped::default();
        if matches!(
            report.kind,
            ReportKind::Hello
                | ReportKind::Units
                | ReportKind::Certificates
                | ReportKind::Health
                | ReportKind::Resources
        ) {
            let mut i = 0;
            while i < self.entries.len() {
                if self.entries[i].report.kind == report.kind && !self.entries[i].in_flight {
                    if let Some(e) = self.entries.remove(i) {
                        dropped.superseded.push(e.report);
                    }
                } else {
                    i += 1;
                }
            }
        }
        while self.entries.len() >= self.capacity {
            let victim = [
                ReportKind::Heartbeat,
                ReportKind::Units,
                ReportKind::Health,
                ReportKind::Resources,
                ReportKind::Hello,
                ReportKind::Applied,
            ]
            .into_iter()
            .find_map(|k| {
                self.entries
                    .iter()
                    .position(|e| e.report.kind == k && !e.in_flight)
            })
            .unwrap_or(0);
            match self.entries.remove(victim) {
                Some(e) => dropped.evicted.push(e.report),
                None => break,
            }
        }
        self.entries.push_back(Entry {
            report,
            in_flight: false,
        });
        dropped
    }

    /// The oldest report not yet handed to the broker, now marked in flight.
    pub fn next_to_send(&mut self) -> Option<Outgoing> {
        let e = self.entries.iter_mut().find(|e| !e.in_flight)?;
        e.in_flight = true;
        Some(e.report.clone())
    }

    /// The broker confirmed `id`: forget it.
    pub fn confirmed(&mut self, id: Uuid) -> Option<Outgoing> {
        let i = self.entries.iter().position(|e| e.report.id == id)?;
        self.entries.remove(i).map(|e| e.report)
    }

    /// Publishing `id` failed (nack, returned, channel lost): send it again later.
    pub fn retry(&mut self, id: Uuid) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.report.id == id) {
            e.in_flight = false;
        }
    }

    /// The connection is gone: nothing is in flight any more.
    pub fn reset_in_flight(&mut self) {
        for e in &mut self.entries {
            e.in_flight = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(kind: ReportKind, seq: u64) -> Outgoing {
        Outgoing {
            id: Uuid::now_v7(),
            kind,
            seq,
            payload: Vec::new(),
        }
    }

    fn seqs(b: &ReportBuffer) -> Vec<u64> {
        b.entries.iter().map(|e| e.report.seq).collect()
    }

    fn evicted(d: &Dropped) -> Vec<u64> {
        d.evicted.iter().map(|o| o.seq).collect()
    }

    /// In a buffer of `capacity`: `kind` 1, applied 2, `kind` 3. The newer
    /// `kind` replaces the waiting one; both left are then sent (in flight).
    fn superseding(kind: ReportKind, capacity: usize) -> ReportBuffer {
        let mut b = ReportBuffer::new(capacity);
        b.push(r(kind, 1));
        b.push(r(ReportKind::Applied, 2));
        let dropped = b.push(r(kind, 3));
        assert_eq!(
            dropped.superseded.iter().map(|o| o.seq).collect::<Vec<_>>(),
            vec![1]
        );
        assert!(dropped.evicted.is_empty());
        assert_eq!(seqs(&b), vec![2, 3]);
        assert_eq!(b.next_to_send().map(|o| o.seq), Some(2));
        assert_eq!(b.next_to_send().map(|o| o.seq), Some(3));
        b
    }

    #[test]
    fn drops_heartbeats_first_then_hellos() {
        let mut b = ReportBuffer::new(3);
        b.push(r(ReportKind::Applied, 1));
        b.push(r(ReportKind::Heartbeat, 2));
        b.push(r(ReportKind::Heartbeat, 3));
        let dropped = b.push(r(ReportKind::Applied, 4));
        assert_eq!(evicted(&dropped), vec![2]);
        assert!(dropped.superseded.is_empty());
        assert_eq!(seqs(&b), vec![1, 3, 4]);
        b.push(r(ReportKind::Hello, 5));
        assert_eq!(seqs(&b), vec![1, 4, 5]);
        // A new hello supersedes the waiting one.
        b.push(r(ReportKind::Hello, 6));
        assert_eq!(seqs(&b), vec![1, 4, 6]);
        // Only applied left: the oldest goes.
        b.push(r(ReportKind::Applied, 7));
        b.push(r(ReportKind::Applied, 8));
        assert_eq!(seqs(&b), vec![4, 7, 8]);
    }

    #[test]
    fn units_reports_supersede_each_other() {
        // In flight stays (it may be confirmed); the waiting one is replaced.
        let mut b = superseding(ReportKind::Units, 3);
        b.push(r(ReportKind::Units, 4));
        assert_eq!(seqs(&b), vec![2, 3, 4]);
        // Full: units go before hellos and applied.
        b.reset_in_flight();
        b.push(r(ReportKind::Hello, 5));
        assert_eq!(seqs(&b), vec![2, 4, 5]);
    }

    #[test]
    fn health_reports_supersede_each_other_and_go_before_hellos() {
        let mut b = ReportBuffer::new(3);
        b.push(r(ReportKind::Health, 1));
        b.push(r(ReportKind::Hello, 2));
        let dropped = b.push(r(ReportKind::Health, 3));
        assert_eq!(
            dropped.superseded.iter().map(|o| o.seq).collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(seqs(&b), vec![2, 3]);
        b.push(r(ReportKind::Applied, 4));
        // Full: the health report goes before the hello and the applied.
        let dropped = b.push(r(ReportKind::Applied, 5));
        assert_eq!(evicted(&dropped), vec![3]);
        assert_eq!(seqs(&b), vec![2, 4, 5]);
    }

    #[test]
    fn a_newer_resources_report_replaces_a_waiting_one() {
        // Never two waiting: one in flight may stay (it may be confirmed).
        let mut b = superseding(ReportKind::Resources, 4);
        b.push(r(ReportKind::Resources, 4));
        b.push(r(ReportKind::Resources, 5));
        assert_eq!(seqs(&b), vec![2, 3, 5]);
        // Full: the resources report goes before the hello and the applied.
        b.reset_in_flight();
        b.push(r(ReportKind::Hello, 6));
        let dropped = b.push(r(ReportKind::Applied, 7));
        assert_eq!(evicted(&dropped), vec![3]);
        assert_eq!(seqs(&b), vec![2, 5, 6, 7]);
    }

    #[test]
    fn in_flight_and_confirm() {
        let mut b = ReportBuffer::new(10);
        let a = r(ReportKind::Applied, 1);
        b.push(a.clone());
        b.push(r(ReportKind::Heartbeat, 2));
        assert_eq!(b.next_to_send().map(|o| o.seq), Some(1));
        assert_eq!(b.next_to_send().map(|o| o.seq), Some(2));
        assert_eq!(b.next_to_send(), None);
        b.retry(a.id);
        assert_eq!(b.next_to_send().map(|o| o.seq), Some(1));
        assert_eq!(b.confirmed(a.id).map(|o| o.seq), Some(1));
        assert_eq!(b.len(), 1);
        b.reset_in_flight();
        assert_eq!(b.in_flight(), 0);
    }
}
