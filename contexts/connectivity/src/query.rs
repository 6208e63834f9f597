//! The read models: the overlay (addresses, keys, exposures) and the
//! certificates (issued, held, refused and waiting requests).

use std::net::Ipv4Addr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

use crate::plan::Policy;
use crate::{Connectivity, Error};

/// One node on (or waiting for) the overlay.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OverlayNodeView {
    pub node: String,
    /// Its overlay address; absent: the overlay network is full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Its WireGuard public key; absent: it has not stated one (not on the overlay).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Labelled `mesh.hub=true`.
    pub hub: bool,
}

/// A public name and the nodes that serve it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ExposureView {
    /// The DNS name the port is exposed under.
    pub name: String,
    pub module: String,
    pub port: u16,
    pub protocol: String,
    /// The nodes serving it (those the module runs on).
    pub nodes: Vec<String>,
}

/// Answer of `GET /v1/overlay`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OverlayView {
    pub cidr: String,
    pub listen_port: u16,
    pub policy: Policy,
    pub domain: String,
    /// Every node not revoked, by id.
    pub nodes: Vec<OverlayNodeView>,
    /// Nodes without an overlay address because the network is full: an
    /// operator must widen `overlay_cidr`.
    pub unallocated: Vec<String>,
    pub exposures: Vec<ExposureView>,
}

/// What a node says it holds.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HeldView {
    pub serial: String,
    pub not_after: DateTime<Utc>,
    /// Seconds until it expires (negative: expired).
    pub remaining_secs: i64,
    /// Why its last renewal did not happen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub renew_error: Option<String>,
    pub reported_at: DateTime<Utc>,
}

/// One issued certificate.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CertificateView {
    pub node: String,
    /// `node` or a module's name.
    pub name: String,
    pub serial: String,
    pub subject: String,
    pub issued_at: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
    /// Seconds until it expires (negative: expired).
    pub remaining_secs: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
    /// What the node says it holds for this name (whichever serial).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<HeldView>,
}

/// A request not signed: refused (with the reason) or waiting for a CA.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RequestView {
    pub node: String,
    pub name: String,
    /// `refused` or `waiting`.
    pub status: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// Answer of `GET /v1/certificates`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct CertificatesView {
    /// By node, name, newest first.
    pub certificates: Vec<CertificateView>,
    /// The latest request of each node and name that was not signed.
    pub requests: Vec<RequestView>,
}

/// Forget certificates expired for more than a week (the table stays bounded).
pub(crate) async fn prune(tx: &mut PgConnection) -> Result<u64, Error> {
    let done = sqlx::query(
        "DELETE FROM connectivity.certificates WHERE not_after < now() - interval '7 days'",
    )
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected())
}

fn remaining(not_after: DateTime<Utc>, now: DateTime<Utc>) -> i64 {
    (not_after - now).num_seconds()
}

type CertRow = (
    String,
    String,
    String,
    String,
    DateTime<Utc>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<DateTime<Utc>>,
);

type RequestRow = (String, String, String, Option<String>, DateTime<Utc>);

impl Connectivity {
    /// The overlay: every node's address and key, and the public names.
    pub async fn overlay_view(&self) -> Result<OverlayView, Error> {
        let mut tx = self.pool.begin().await?;
        let snapshot = crate::reconcile::snapshot(&mut tx).await?;
        tx.commit().await?;
        let plan = &self.settings.plan;
        let mut nodes = Vec::with_capacity(snapshot.nodes.len());
        let mut unallocated = Vec::new();
        for n in snapshot.nodes.values() {
            if n.address.is_none() {
                unallocated.push(n.id.to_string());
            }
            nodes.push(OverlayNodeView {
                node: n.id.to_string(),
                address: n.address.map(|a| Ipv4Addr::from(a).to_string()),
                public_key: n.public_key.clone(),
                endpoint: n.endpoint.clone(),
                hub: n.is_hub(),
            });
        }
        let mut exposures = Vec::new();
        for m in snapshot.modules.values() {
            for p in &m.ports {
                if let Some(name) = &p.expose {
                    exposures.push(ExposureView {
                        name: name.clone(),
                        module: m.name.clone(),
                        port: p.port,
                        protocol: p.protocol.as_str().to_owned(),
                        nodes: m.nodes.iter().map(ToString::to_string).collect(),
                    });
                }
            }
        }
        exposures.sort_by(|a, b| (&a.name, &a.module, a.port).cmp(&(&b.name, &b.module, b.port)));
        Ok(OverlayView {
            cidr: plan.cidr.to_string(),
            listen_port: plan.listen_port,
            policy: plan.policy,
            domain: plan.domain.clone(),
            nodes,
            unallocated,
            exposures,
        })
    }

    /// Every certificate recorded (of `node` only, if given), what nodes
    /// hold, and the requests not signed.
    pub async fn certificates_view(&self, node: Option<&str>) -> Result<CertificatesView, Error> {
        let now = Utc::now();
        let rows: Vec<CertRow> = sqlx::query_as(
            "SELECT c.node, c.name, c.serial, c.subject, c.issued_at, c.not_after, c.revoked_at, \
                    h.serial, h.not_after, h.renew_error, h.reported_at \
             FROM connectivity.certificates c \
             LEFT JOIN connectivity.held h ON h.node = c.node AND h.name = c.name \
             WHERE $1::text IS NULL OR c.node = $1 \
             ORDER BY c.node, c.name, c.issued_at DESC",
        )
        .bind(node)
        .fetch_all(&self.pool)
        .await?;
        let certificates = rows
            .into_iter()
            .map(
                |(
                    node,
                    name,
                    serial,
                    subject,
                    issued_at,
                    not_after,
                    revoked_at,
                    h_serial,
                    h_after,
                    h_error,
                    h_at,
                )| {
                    let held = match (h_serial, h_after, h_at) {
                        (Some(serial), Some(not_after), Some(reported_at)) => Some(HeldView {
                            serial,
                            not_after,
                            remaining_secs: remaining(not_after, now),
                            renew_error: h_error,
                            reported_at,
                        }),
                        _ => None,
                    };
                    CertificateView {
                        node,
                        name,
                        serial,
                        subject,
                        issued_at,
                        not_after,
                        remaining_secs: remaining(not_after, now),
                        revoked_at,
                        held,
                    }
                },
            )
            .collect();
        let requests: Vec<RequestRow> = sqlx::query_as(
            "SELECT node, name, status, reason, updated_at FROM connectivity.requests \
                 WHERE status <> 'signed' AND ($1::text IS NULL OR node = $1) ORDER BY node, name",
        )
        .bind(node)
        .fetch_all(&self.pool)
        .await?;
        Ok(CertificatesView {
            certificates,
            requests: requests
                .into_iter()
                .map(|(node, name, status, reason, at)| RequestView {
                    node,
                    name,
                    status,
                    reason: reason.unwrap_or_default(),
                    at,
                })
                .collect(),
        })
    }
}
