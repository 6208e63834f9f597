//! The mesh CA's certificates: a node's `certificates` reports (what it asks
//! for, with a CSR signed by a key that never leaves it, and what it holds).
//!
//! The rules a request must meet before anything is signed (decision 0027):
//!
//! - the name `node`: the CSR's common name is the sending node's id (the
//!   broker-verified sender of the envelope) and it asks for no name but
//!   `<node>` and `<node>.<domain>`; the certificate carries both (the
//!   second only while no module has the node's name);
//! - a module's name: the module is placed on the sending node and no node
//!   has its name, the common name is absent, `<module>` or
//!   `<module>.<domain>`, and it asks for no other name; the certificate
//!   carries `<module>.<domain>`;
//! - anything else is refused: the refusal and its reason are recorded (the
//!   latest per node and name, shown by `GET /v1/certificates`) and logged,
//!   and nothing is signed. Only the CSR's key is certified: its subject and
//!   extensions are not copied.
//!
//! Idempotent: a redelivered report never reaches here (the inbox), and a
//! request identical to one already signed (same node, name, key and names
//! asked: a CSR's bytes differ at every signature) is signed again only once
//! the certificate it got has lived half its lifetime (the agent renews at
//! two thirds); before that the request is answered with the
//! certificate already issued. Whatever the CSR, a node and name get at
//! most one new certificate per [`MIN_REISSUE`] (a minute, or a tenth of the
//! lifetime if shorter): a request within it is refused, saying so.
//!
//! Every certificate signed is told to the record
//! (`connectivity.certificate.issued`: node, name, serial, not after) in the
//! transaction that stores it, so a request answered with a certificate
//! already issued tells nothing new.

use chrono::{DateTime, Utc};
use mesh_credentials::pki::Csr;
use mesh_plumbing::outbox;
use mesh_protocol::{
    CertificateIssued, Certificates, NODE_CERTIFICATE, NodeId, RecordEvent, RecordKind,
};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use crate::{Error, SCHEMA, Settings};

/// The shortest time between two certificates of one node and name: a
/// minute, or a tenth of the lifetime when that is shorter (renewal at two
/// thirds is always past it).
pub const MIN_REISSUE: std::time::Duration = std::time::Duration::from_secs(60);

fn min_reissue(settings: &Settings) -> std::time::Duration {
    MIN_REISSUE.min(settings.certificate_lifetime / 10)
}

/// What became of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A new certificate was signed.
    Signed,
    /// A certificate issued for this very CSR is still young.
    AlreadySigned,
    Waiting,
    Refused(String),
}

/// What makes two requests the same: the key they are for and the names
/// they ask for (a CSR's bytes differ at every signature: ECDSA is randomized).
fn digest(csr: &Csr) -> String {
    let mut names = csr.names().to_vec();
    names.sort();
    let mut h = Sha256::new();
    h.update(csr.public_key_der());
    h.update([0]);
    h.update(csr.common_name().unwrap_or("").as_bytes());
    for n in names {
        h.update([0]);
        h.update(n.as_bytes());
    }
    hex::encode(h.finalize())
}

/// The common name and names to sign for, or why not.
async fn decide(
    tx: &mut PgConnection,
    node: &NodeId,
    name: &str,
    csr: &Csr,
    domain: &str,
) -> Result<Result<(String, Vec<String>), String>, Error> {
    let text = |t: &str| t.chars().take(80).collect::<String>();
    if name == NODE_CERTIFICATE {
        let full = format!("{node}.{domain}");
        if csr.common_name() != Some(node.as_str()) {
            return Ok(Err(format!(
                "the common name `{}` is not the sending node `{node}`",
                text(csr.common_name().unwrap_or(""))
            )));
        }
        if let Some(other) = csr
            .names()
            .iter()
            .find(|n| n.as_str() != node.as_str() && **n != full)
        {
            return Ok(Err(format!(
                "`{}` is not a name of node `{node}` (only `{node}` and `{full}`)",
                text(other)
            )));
        }
        // `<node>.<domain>` only while no module takes that name.
        let module: Option<String> = sqlx::query_scalar(
            "SELECT module FROM connectivity.modules WHERE module = $1 AND NOT removed",
        )
        .bind(node.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let mut names = vec![node.as_str().to_owned()];
        if module.is_none() {
            names.push(full);
        }
        return Ok(Ok((node.as_str().to_owned(), names)));
    }
    let placed: Option<String> = sqlx::query_scalar(
        "SELECT module FROM connectivity.modules WHERE module = $1 AND NOT removed AND $2 = ANY(nodes)",
    )
    .bind(name)
    .bind(node.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if placed.is_none() {
        return Ok(Err(format!(
            "module `{name}` is not placed on node `{node}`"
        )));
    }
    // A module named as a node would certify that node's name.
    let node_named: Option<String> = sqlx::query_scalar(
        "SELECT node FROM connectivity.nodes WHERE node = $1 AND revoked_at IS NULL",
    )
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    if node_named.is_some() {
        return Ok(Err(format!(
            "`{name}` is also a node's name: a certificate for module `{name}` would certify that node"
        )));
    }
    let full = format!("{name}.{domain}");
    let allowed = |n: &str| n == name || n == full;
    if let Some(cn) = csr.common_name()
        && !allowed(cn)
    {
        return Ok(Err(format!(
            "the common name `{}` is not `{name}` or `{full}`",
            text(cn)
        )));
    }
    if let Some(other) = csr.names().iter().find(|n| !allowed(n)) {
        return Ok(Err(format!(
            "`{}` is not a name of module `{name}` (only `{name}` and `{full}`)",
            text(other)
        )));
    }
    Ok(Ok((full.clone(), vec![full])))
}

/// Handle one request of `node` for `name` (the caller holds the context's
/// lock).
pub(crate) async fn request(
    tx: &mut PgConnection,
    settings: &Settings,
    node: &NodeId,
    name: &str,
    csr_pem: &str,
) -> Result<Outcome, Error> {
    let parsed = Csr::parse(csr_pem);
    let csr_digest = match &parsed {
        Ok(csr) => digest(csr),
        Err(_) => hex::encode(Sha256::digest(csr_pem.as_bytes())),
    };
    let outcome = match parsed {
        Err(e) => Outcome::Refused(format!("the CSR: {e}")),
        Ok(csr) => match decide(tx, node, name, &csr, &settings.plan.domain).await? {
            Err(reason) => Outcome::Refused(reason),
            Ok((common_name, names)) => {
                sign(
                    tx,
                    settings,
                    node,
                    name,
                    &csr,
                    &csr_digest,
                    &common_name,
                    &names,
                )
                .await?
            }
        },
    };
    let (status, reason) = match &outcome {
        Outcome::Signed | Outcome::AlreadySigned => ("signed", None),
        Outcome::Waiting => ("waiting", Some("no CA configured".to_owned())),
        Outcome::Refused(r) => ("refused", Some(r.clone())),
    };
    if let Outcome::Refused(reason) = &outcome {
        tracing::warn!(%node, name, %reason, "certificate request refused");
    }
    sqlx::query(
        "INSERT INTO connectivity.requests AS r (node, name, csr, csr_digest, status, reason, serial) \
         VALUES ($1, $2, $3, $4, $5, $6, \
             (SELECT serial FROM connectivity.certificates WHERE node = $1 AND name = $2 \
              AND csr_digest = $4 AND $5 = 'signed' ORDER BY issued_at DESC LIMIT 1)) \
         ON CONFLICT (node, name) DO UPDATE SET csr = excluded.csr, csr_digest = excluded.csr_digest, \
             status = excluded.status, reason = excluded.reason, serial = excluded.serial, \
             updated_at = now()",
    )
    .bind(node.as_str())
    .bind(name)
    .bind(csr_pem)
    .bind(&csr_digest)
    .bind(status)
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    Ok(outcome)
}

#[allow(clippy::too_many_arguments)]
async fn sign(
    tx: &mut PgConnection,
    settings: &Settings,
    node: &NodeId,
    name: &str,
    csr: &Csr,
    csr_digest: &str,
    common_name: &str,
    names: &[String],
) -> Result<Outcome, Error> {
    let young: Option<String> = sqlx::query_scalar(
        "SELECT serial FROM connectivity.certificates \
         WHERE node = $1 AND name = $2 AND csr_digest = $3 AND revoked_at IS NULL \
           AND now() < issued_at + (not_after - issued_at) / 2 \
         ORDER BY issued_at DESC LIMIT 1",
    )
    .bind(node.as_str())
    .bind(name)
    .bind(csr_digest)
    .fetch_optional(&mut *tx)
    .await?;
    if young.is_some() {
        return Ok(Outcome::AlreadySigned);
    }
    // At most one new certificate per node and name a minute, whatever the
    // CSR: a node minting certificates with fresh keys in a loop is bounded.
    let recent: Option<String> = sqlx::query_scalar(
        "SELECT serial FROM connectivity.certificates \
         WHERE node = $1 AND name = $2 AND revoked_at IS NULL \
           AND issued_at > now() - make_interval(secs => $3) LIMIT 1",
    )
    .bind(node.as_str())
    .bind(name)
    .bind(min_reissue(settings).as_secs_f64())
    .fetch_optional(&mut *tx)
    .await?;
    if recent.is_some() {
        return Ok(Outcome::Refused(format!(
            "a certificate for `{name}` was issued less than {} s ago: ask again later",
            min_reissue(settings).as_secs()
        )));
    }
    let Some(ca) = settings.ca.as_deref() else {
        return Ok(Outcome::Waiting);
    };
    let issued = ca.sign(csr, common_name, names, settings.certificate_lifetime)?;
    sqlx::query(
        "INSERT INTO connectivity.certificates \
         (serial, node, name, subject, csr_digest, certificate, not_after) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&issued.serial)
    .bind(node.as_str())
    .bind(name)
    .bind(format!("CN={common_name}"))
    .bind(csr_digest)
    .bind(&issued.certificate_pem)
    .bind(issued.not_after)
    .execute(&mut *tx)
    .await?;
    let event = RecordEvent::new(RecordKind::CertificateIssued(CertificateIssued {
        node: node.clone(),
        name: name.to_owned(),
        serial: issued.serial.clone(),
        not_after: issued.not_after,
    }));
    outbox::record(tx, SCHEMA, &event).await?;
    tracing::info!(%node, name, serial = %issued.serial, not_after = %issued.not_after, "certificate issued");
    Ok(Outcome::Signed)
}

/// One node's `certificates` report: what it holds, then each request.
/// Returns whether a certificate was signed (its section changes).
pub(crate) async fn report(
    tx: &mut PgConnection,
    settings: &Settings,
    node: &NodeId,
    body: &Certificates,
) -> Result<bool, Error> {
    // A node is known from its first report on (its hello may come later).
    let revoked: Option<bool> = sqlx::query_scalar(
        "INSERT INTO connectivity.nodes AS n (node) VALUES ($1) \
         ON CONFLICT (node) DO UPDATE SET node = n.node RETURNING n.revoked_at IS NOT NULL",
    )
    .bind(node.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    if revoked == Some(true) {
        tracing::warn!(%node, "certificates report of a revoked node ignored");
        return Ok(false);
    }
    if !body.held.is_empty() {
        let n = body.held.len();
        let mut names: Vec<&str> = Vec::with_capacity(n);
        let mut serials: Vec<&str> = Vec::with_capacity(n);
        let mut afters: Vec<DateTime<Utc>> = Vec::with_capacity(n);
        let mut errors: Vec<Option<&str>> = Vec::with_capacity(n);
        let mut held: Vec<_> = body.held.iter().collect();
        held.sort_by(|a, b| a.name.cmp(&b.name));
        held.dedup_by(|a, b| a.name == b.name);
        for h in held {
            names.push(&h.name);
            serials.push(&h.serial);
            afters.push(h.not_after);
            errors.push(h.renew_error.as_deref());
        }
        sqlx::query(
            "INSERT INTO connectivity.held AS h (node, name, serial, not_after, renew_error) \
             SELECT $1, u.* FROM UNNEST($2::text[], $3::text[], $4::timestamptz[], $5::text[]) \
                  AS u(name, serial, not_after, renew_error) \
             ON CONFLICT (node, name) DO UPDATE SET serial = excluded.serial, \
                 not_after = excluded.not_after, renew_error = excluded.renew_error, reported_at = now()",
        )
        .bind(node.as_str())
        .bind(&names)
        .bind(&serials)
        .bind(&afters)
        .bind(&errors)
        .execute(&mut *tx)
        .await?;
    }
    let mut signed = false;
    for r in &body.requests {
        signed |= request(tx, settings, node, &r.name, &r.csr).await? == Outcome::Signed;
    }
    Ok(signed)
}

/// Requests left waiting for a CA, signed now that there is one (the
/// periodic resync). Returns whether any was signed.
pub(crate) async fn waiting(tx: &mut PgConnection, settings: &Settings) -> Result<bool, Error> {
    if settings.ca.is_none() {
        return Ok(false);
    }
    let rows: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT r.node, r.name, r.csr FROM connectivity.requests r JOIN connectivity.nodes n USING (node) \
         WHERE r.status = 'waiting' AND n.revoked_at IS NULL ORDER BY r.node, r.name",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut signed = false;
    for (node, name, csr) in rows {
        let node = crate::reconcile::node_id(&node)?;
        signed |= request(tx, settings, &node, &name, &csr).await? == Outcome::Signed;
    }
    Ok(signed)
}
