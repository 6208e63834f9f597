//! The receipt log of a run: append-only, in order, unforgeable by edit.
//!
//! An append must carry exactly the next sequence number, the run's id and a
//! time not before the previous receipt's, under an id the log has not seen;
//! anything else is a [`ReceiptError`]. History read back from the store is
//! validated the same way before anything uses it ([`ReceiptLog::from_history`]).
//! The table grants no UPDATE or DELETE at run time and a trigger refuses
//! them (migration V3); its insert trigger checks order a second time.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

/// One entry of a run's receipt log.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Receipt {
    pub id: Uuid,
    pub run: Uuid,
    /// 1, 2, 3, … per run, without gaps.
    pub seq: i32,
    /// Lowercase dotted name: `run.queued`, `approval.approved`, …
    pub kind: String,
    pub at: DateTime<Utc>,
    /// What the receipt says beyond its kind (who decided, the reason, the
    /// revision, the node's error).
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
}

/// Why an append (or a stored history) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    #[error("receipt {id} is for run {got}, not {expected}")]
    WrongRun { id: Uuid, expected: Uuid, got: Uuid },
    #[error("receipt {id} of run {run}: sequence {got}, expected {expected}")]
    OutOfOrder {
        id: Uuid,
        run: Uuid,
        expected: i32,
        got: i32,
    },
    #[error("receipt {id} of run {run}: time {got} is before the previous receipt's ({previous})")]
    TimeReversed {
        id: Uuid,
        run: Uuid,
        previous: DateTime<Utc>,
        got: DateTime<Utc>,
    },
    #[error("receipt {id} of run {run}: the id is already in the log")]
    DuplicateId { id: Uuid, run: Uuid },
    #[error("receipt {id} of run {run}: kind `{kind}` is not a lowercase dotted name")]
    BadKind { id: Uuid, run: Uuid, kind: String },
}

/// Receipt kinds (lowercase dotted names) this context writes.
pub mod kinds {
    pub const RUN_QUEUED: &str = "run.queued";
    pub const APPROVAL_REQUESTED: &str = "approval.requested";
    pub const APPROVAL_APPROVED: &str = "approval.approved";
    pub const APPROVAL_DENIED: &str = "approval.denied";
    pub const RUN_STARTED: &str = "run.started";
    pub const ARTIFACT_STAGED: &str = "artifact.staged";
    pub const UNIT_DEPLOYED: &str = "unit.deployed";
    pub const UNIT_RUNNING: &str = "unit.running";
    pub const RUN_SUCCEEDED: &str = "run.succeeded";
    pub const RUN_FAILED: &str = "run.failed";
    pub const RUN_CANCELED: &str = "run.canceled";
    pub const RUN_ROLLED_BACK: &str = "run.rolled_back";
    pub const RUN_PAUSED: &str = "run.paused";
    pub const RUN_RESUMED: &str = "run.resumed";
}

fn valid_kind(kind: &str) -> bool {
    let parts: Vec<&str> = kind.split('.').collect();
    kind.len() <= 64
        && parts.len() >= 2
        && parts.iter().all(|p| {
            p.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
                && p.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
}

/// A run's receipts, validated: every entry in order.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceiptLog {
    run: Uuid,
    entries: Vec<Receipt>,
}

impl ReceiptLog {
    /// An empty log of `run`.
    pub fn new(run: Uuid) -> Self {
        ReceiptLog {
            run,
            entries: Vec::new(),
        }
    }

    /// A log from stored receipts (in `seq` order), each checked as an append.
    pub fn from_history(run: Uuid, history: Vec<Receipt>) -> Result<Self, ReceiptError> {
        let mut log = ReceiptLog::new(run);
        for r in history {
            log.append(r)?;
        }
        Ok(log)
    }

    pub fn run(&self) -> Uuid {
        self.run
    }

    pub fn entries(&self) -> &[Receipt] {
        &self.entries
    }

    pub fn last(&self) -> Option<&Receipt> {
        self.entries.last()
    }

    /// The next sequence number.
    pub fn next_seq(&self) -> i32 {
        self.entries.last().map_or(1, |r| r.seq + 1)
    }

    /// Append `receipt` if it is exactly the next one.
    pub fn append(&mut self, receipt: Receipt) -> Result<(), ReceiptError> {
        let (id, run) = (receipt.id, self.run);
        if receipt.run != self.run {
            return Err(ReceiptError::WrongRun {
                id,
                expected: self.run,
                got: receipt.run,
            });
        }
        if !valid_kind(&receipt.kind) {
            return Err(ReceiptError::BadKind {
                id,
                run,
                kind: receipt.kind.chars().take(64).collect(),
            });
        }
        if self.entries.iter().any(|r| r.id == receipt.id) {
            return Err(ReceiptError::DuplicateId { id, run });
        }
        let expected = self.next_seq();
        if receipt.seq != expected {
            return Err(ReceiptError::OutOfOrder {
                id,
                run,
                expected,
                got: receipt.seq,
            });
        }
        if let Some(last) = self.entries.last()
            && receipt.at < last.at
        {
            return Err(ReceiptError::TimeReversed {
                id,
                run,
                previous: last.at,
                got: receipt.at,
            });
        }
        self.entries.push(receipt);
        Ok(())
    }

    /// The next receipt of `kind` at `now` (or at the previous receipt's time
    /// if the clock went back: the log's times never go back), appended.
    pub fn next(
        &mut self,
        kind: &str,
        now: DateTime<Utc>,
        detail: serde_json::Value,
    ) -> Result<Receipt, ReceiptError> {
        let at = self.entries.last().map_or(now, |l| l.at.max(now));
        let receipt = Receipt {
            id: Uuid::now_v7(),
            run: self.run,
            seq: self.next_seq(),
            kind: kind.to_owned(),
            at,
            detail,
        };
        self.append(receipt.clone())?;
        Ok(receipt)
    }
}

/// Load a run's receipts from the store and validate them.
pub async fn load(tx: &mut PgConnection, run: Uuid) -> Result<ReceiptLog, crate::Error> {
    let rows: Vec<Receipt> = sqlx::query_as(
        "SELECT id, run, seq, kind, at, detail FROM delivery.receipts WHERE run = $1 ORDER BY seq",
    )
    .bind(run)
    .fetch_all(&mut *tx)
    .await?;
    Ok(ReceiptLog::from_history(run, rows)?)
}

/// Append the receipt `kind` to `run`'s log in `tx`: the stored history is
/// read and validated, the new receipt checked as the next one, then written.
/// The caller holds the context's lock, so appends to one run never race.
pub async fn append(
    tx: &mut PgConnection,
    run: Uuid,
    kind: &str,
    now: DateTime<Utc>,
    detail: serde_json::Value,
) -> Result<Receipt, crate::Error> {
    let mut log = load(tx, run).await?;
    let receipt = log.next(kind, now, detail)?;
    sqlx::query(
        "INSERT INTO delivery.receipts (id, run, seq, kind, at, detail) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(receipt.id)
    .bind(receipt.run)
    .bind(receipt.seq)
    .bind(&receipt.kind)
    .bind(receipt.at)
    .bind(&receipt.detail)
    .execute(&mut *tx)
    .await?;
    Ok(receipt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn receipt(run: Uuid, seq: i32, kind: &str, at: DateTime<Utc>) -> Receipt {
        Receipt {
            id: Uuid::now_v7(),
            run,
            seq,
            kind: kind.to_owned(),
            at,
            detail: serde_json::json!({}),
        }
    }

    #[test]
    fn appends_in_order() {
        let run = Uuid::now_v7();
        let t = Utc::now();
        let mut log = ReceiptLog::new(run);
        log.append(receipt(run, 1, "run.queued", t)).unwrap();
        log.append(receipt(run, 2, "run.started", t)).unwrap();
        log.append(receipt(run, 3, "run.succeeded", t + Duration::seconds(1)))
            .unwrap();
        assert_eq!(log.entries().len(), 3);
        assert_eq!(log.next_seq(), 4);
    }

    #[test]
    fn out_of_order_sequence_is_rejected() {
        let run = Uuid::now_v7();
        let t = Utc::now();
        let mut log = ReceiptLog::new(run);
        assert!(matches!(
            log.append(receipt(run, 2, "run.queued", t)),
            Err(ReceiptError::OutOfOrder {
                expected: 1,
                got: 2,
                ..
            })
        ));
        log.append(receipt(run, 1, "run.queued", t)).unwrap();
        for seq in [1, 3, 0, -1] {
            assert!(matches!(
                log.append(receipt(run, seq, "run.started", t)),
                Err(ReceiptError::OutOfOrder { expected: 2, .. })
            ));
        }
        assert_eq!(log.entries().len(), 1, "nothing refused was kept");
    }

    #[test]
    fn wrong_run_is_rejected() {
        let run = Uuid::now_v7();
        let other = Uuid::now_v7();
        let mut log = ReceiptLog::new(run);
        assert!(matches!(
            log.append(receipt(other, 1, "run.queued", Utc::now())),
            Err(ReceiptError::WrongRun { .. })
        ));
        assert!(log.entries().is_empty());
    }

    #[test]
    fn time_reversal_is_rejected() {
        let run = Uuid::now_v7();
        let t = Utc::now();
        let mut log = ReceiptLog::new(run);
        log.append(receipt(run, 1, "run.queued", t)).unwrap();
        assert!(matches!(
            log.append(receipt(
                run,
                2,
                "run.started",
                t - Duration::milliseconds(1)
            )),
            Err(ReceiptError::TimeReversed { .. })
        ));
        // The writer never produces one: a clock that went back stamps the
        // previous time.
        let r = log
            .next(
                "run.started",
                t - Duration::seconds(5),
                serde_json::json!({}),
            )
            .unwrap();
        assert_eq!(r.at, t);
    }

    #[test]
    fn duplicate_id_is_rejected() {
        let run = Uuid::now_v7();
        let t = Utc::now();
        let mut log = ReceiptLog::new(run);
        let first = receipt(run, 1, "run.queued", t);
        log.append(first.clone()).unwrap();
        let mut again = receipt(run, 2, "run.started", t);
        again.id = first.id;
        assert!(matches!(
            log.append(again),
            Err(ReceiptError::DuplicateId { .. })
        ));
    }

    #[test]
    fn kinds_are_lowercase_dotted() {
        let run = Uuid::now_v7();
        let mut log = ReceiptLog::new(run);
        for bad in ["queued", "Run.Queued", "run..queued", "run.queued!", ".run"] {
            assert!(matches!(
                log.append(receipt(run, 1, bad, Utc::now())),
                Err(ReceiptError::BadKind { .. })
            ));
        }
        log.append(receipt(run, 1, "approval.approved", Utc::now()))
            .unwrap();
    }

    #[test]
    fn stored_history_is_validated_before_use() {
        let run = Uuid::now_v7();
        let t = Utc::now();
        let good = vec![
            receipt(run, 1, "run.queued", t),
            receipt(run, 2, "run.started", t),
        ];
        assert!(ReceiptLog::from_history(run, good.clone()).is_ok());
        let mut gap = good.clone();
        gap[1].seq = 3;
        assert!(ReceiptLog::from_history(run, gap).is_err());
        let mut foreign = good;
        foreign[0].run = Uuid::now_v7();
        assert!(ReceiptLog::from_history(run, foreign).is_err());
    }
}
