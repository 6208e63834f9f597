//! HTTP routes of the delivery context. Reads need the viewer role,
//! everything else the operator role (the controller's auth layer). Errors are
//! problem+json naming the field; a freeze or a rollout in progress is 409.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use mesh_plumbing::api::{ApiJson, ApiQuery, Problem, created};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, Conflict, NotFound, Unavailable, Unprocessable,
};
use mesh_plumbing::page::{ListQuery, Page};
use mesh_plumbing::path::{ModulePath, UuidPath, uuid};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::{
    ArtifactView, Delivery, DeliveryPolicy, FreezeRequest, FreezeView, NewRevision, NewSignature,
    NewSigningKey, Receipt, RevisionView, RolloutRequest, RolloutView, RunView, SigningKeyView,
};

/// `artifact_max_bytes` bounds the body of `POST /v1/artifacts` (every other
/// route keeps the API's 2 MiB).
pub(crate) fn routes(artifact_max_bytes: usize) -> OpenApiRouter<Arc<Delivery>> {
    OpenApiRouter::new()
        .merge(
            OpenApiRouter::new()
                .routes(routes!(push_artifact, list_artifacts))
                .layer(DefaultBodyLimit::max(artifact_max_bytes.saturating_add(1))),
        )
        .routes(routes!(add_signature))
        .routes(routes!(add_signing_key, list_signing_keys))
        .routes(routes!(remove_signing_key))
        .routes(routes!(create_revision, list_revisions))
        .routes(routes!(get_revision))
        .routes(routes!(get_policy, put_policy))
        .routes(routes!(start_rollout, list_rollouts))
        .routes(routes!(get_rollout))
        .routes(routes!(continue_rollout))
        .routes(routes!(cancel_rollout))
        .routes(routes!(list_runs))
        .routes(routes!(get_run))
        .routes(routes!(approve_run))
        .routes(routes!(deny_run))
        .routes(routes!(get_receipts))
        .routes(routes!(get_freeze, put_freeze, delete_freeze))
}

#[derive(Debug, Serialize, ToSchema)]
struct ArtifactList {
    artifacts: Vec<ArtifactView>,
}

/// Push an artifact: the body's bytes (a tar archive) are stored in the OCI
/// registry by their SHA-256 digest (signed by the controller only in a
/// fleet that trusts its key: `trust_controller_artifact_signatures`;
/// otherwise nodes run it once an operator's signature is added); 201 when
/// new, 200 when the same bytes were pushed before.
#[utoipa::path(
    post,
    path = "/v1/artifacts",
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The artifact's bytes"),
    responses(
        (status = 201, description = "Stored and signed", body = ArtifactView),
        (status = 200, description = "Already stored", body = ArtifactView),
        BodyErrors,
        Unavailable,
    )
)]
async fn push_artifact(
    State(delivery): State<Arc<Delivery>>,
    audit: Audit,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<ArtifactView>), Problem> {
    let body = body.map_err(|e| {
        Problem::new(
            e.status(),
            format!("the artifact's body: {}", e.body_text()),
        )
    })?;
    let (view, new) = delivery.push_artifact(&body, &audit).await?;
    Ok(created(new, view))
}

/// Every artifact pushed through the API.
#[utoipa::path(get, path = "/v1/artifacts",
    responses((status = 200, description = "Artifacts", body = ArtifactList)))]
async fn list_artifacts(
    State(delivery): State<Arc<Delivery>>,
) -> Result<Json<ArtifactList>, Problem> {
    Ok(Json(ArtifactList {
        artifacts: delivery.artifacts().await?,
    }))
}

/// Add an operator's signature of a pushed artifact, made offline with a
/// key the operator holds (`meshctl artifact sign`): it must verify, by one
/// of the mesh's signing keys, before the registry keeps it beside the
/// artifact (one signature per key; a newer one by the same key replaces
/// it). 201 when new, 200 when the same signature was added before.
#[utoipa::path(
    post,
    path = "/v1/artifacts/{digest}/signatures",
    params(("digest" = String, Path, description = "The artifact's digest (sha256:…)")),
    request_body = NewSignature,
    responses(
        (status = 201, description = "Verified and stored", body = ArtifactView),
        (status = 200, description = "Already stored", body = ArtifactView),
        BodyErrors,
        NotFound,
        Unavailable,
    )
)]
async fn add_signature(
    State(delivery): State<Arc<Delivery>>,
    Path(digest): Path<String>,
    audit: Audit,
    ApiJson(new): ApiJson<NewSignature>,
) -> Result<(StatusCode, Json<ArtifactView>), Problem> {
    let digest = mesh_protocol::ArtifactDigest::parse("digest", &digest)?;
    let (view, new) = delivery.add_signature(&digest, &new, &audit).await?;
    Ok(created(new, view))
}

#[derive(Debug, Serialize, ToSchema)]
struct SigningKeyList {
    /// The operators' keys nodes trust, by name.
    keys: Vec<SigningKeyView>,
    /// The controller's own public key, when the fleet trusts its
    /// signatures too (`trust_controller_artifact_signatures`); absent
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    controller_key: Option<String>,
}

/// Add a signing key (admin): an operator's Ed25519 public key whose
/// artifact signatures every node trusts from its next delivery section.
/// 201 when new, 200 when the same name and key exist; 409 when the name or
/// the key is taken by another.
#[utoipa::path(
    post,
    path = "/v1/signing-keys",
    request_body = NewSigningKey,
    responses(
        (status = 201, description = "Added", body = SigningKeyView),
        (status = 200, description = "Already there", body = SigningKeyView),
        BodyErrors,
        Conflict,
    )
)]
async fn add_signing_key(
    State(delivery): State<Arc<Delivery>>,
    audit: Audit,
    ApiJson(new): ApiJson<NewSigningKey>,
) -> Result<(StatusCode, Json<SigningKeyView>), Problem> {
    let (view, new) = delivery.add_signing_key(&new, &audit).await?;
    Ok(created(new, view))
}

/// The keys whose artifact signatures nodes trust (admin).
#[utoipa::path(get, path = "/v1/signing-keys",
    responses((status = 200, description = "Signing keys", body = SigningKeyList)))]
async fn list_signing_keys(
    State(delivery): State<Arc<Delivery>>,
) -> Result<Json<SigningKeyList>, Problem> {
    Ok(Json(SigningKeyList {
        keys: delivery.signing_keys().await?,
        controller_key: delivery.trusted_controller_key(),
    }))
}

/// Remove a signing key (admin): nodes refuse artifacts signed only by it
/// from their next delivery section on (what they cached already keeps
/// running).
#[utoipa::path(delete, path = "/v1/signing-keys/{name}",
    params(("name" = String, Path, description = "The key's name")),
    responses((status = 200, description = "Removed", body = SigningKeyView), NotFound, Unprocessable))]
async fn remove_signing_key(
    State(delivery): State<Arc<Delivery>>,
    Path(name): Path<String>,
    audit: Audit,
) -> Result<Json<SigningKeyView>, Problem> {
    Ok(Json(delivery.remove_signing_key(&name, &audit).await?))
}

#[derive(Debug, Serialize, ToSchema)]
struct RevisionList {
    revisions: Vec<RevisionView>,
}

/// Create a revision of a module: its runnable definition (artifact digest,
/// unit, settings digest), immutable. 201 when new, 200 with the existing
/// revision when the same definition was made before.
#[utoipa::path(
    post,
    path = "/v1/modules/{name}/revisions",
    params(ModulePath),
    request_body = NewRevision,
    responses(
        (status = 201, description = "Created", body = RevisionView),
        (status = 200, description = "The same definition's revision", body = RevisionView),
        BodyErrors,
    )
)]
async fn create_revision(
    State(delivery): State<Arc<Delivery>>,
    ModulePath(name): ModulePath,
    audit: Audit,
    ApiJson(new): ApiJson<NewRevision>,
) -> Result<(StatusCode, Json<RevisionView>), Problem> {
    let (view, new) = delivery.create_revision(&name, &new, &audit).await?;
    Ok(created(new, view))
}

/// A module's revisions, oldest first.
#[utoipa::path(get, path = "/v1/modules/{name}/revisions",
    params(ModulePath),
    responses((status = 200, description = "Revisions", body = RevisionList), Unprocessable))]
async fn list_revisions(
    State(delivery): State<Arc<Delivery>>,
    ModulePath(name): ModulePath,
) -> Result<Json<RevisionList>, Problem> {
    Ok(Json(RevisionList {
        revisions: delivery.revisions(&name).await?,
    }))
}

/// One revision.
#[utoipa::path(get, path = "/v1/revisions/{id}",
    params(("id" = String, Path, description = "The revision's id (UUID)")),
    responses((status = 200, description = "The revision", body = RevisionView), NotFound, Unprocessable))]
async fn get_revision(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
) -> Result<Json<RevisionView>, Problem> {
    Ok(Json(delivery.revision(id).await?))
}

/// Whether a module's rollouts wait for approval.
#[utoipa::path(get, path = "/v1/modules/{name}/delivery",
    params(ModulePath),
    responses((status = 200, description = "The policy", body = DeliveryPolicy), Unprocessable))]
async fn get_policy(
    State(delivery): State<Arc<Delivery>>,
    ModulePath(name): ModulePath,
) -> Result<Json<DeliveryPolicy>, Problem> {
    Ok(Json(delivery.policy(&name).await?))
}

/// Set whether a module's rollouts wait for approval.
#[utoipa::path(put, path = "/v1/modules/{name}/delivery",
    params(ModulePath),
    request_body = DeliveryPolicy,
    responses((status = 200, description = "The policy", body = DeliveryPolicy), BodyErrors))]
async fn put_policy(
    State(delivery): State<Arc<Delivery>>,
    ModulePath(name): ModulePath,
    audit: Audit,
    ApiJson(policy): ApiJson<DeliveryPolicy>,
) -> Result<Json<DeliveryPolicy>, Problem> {
    Ok(Json(delivery.set_policy(&name, &policy, &audit).await?))
}

#[derive(Debug, Serialize, ToSchema)]
struct RolloutList {
    rollouts: Vec<RolloutView>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RolloutParams {
    /// Only this module's rollouts.
    module: Option<String>,
    /// Only rollouts in this state.
    state: Option<String>,
}

/// Roll a revision of a module out: one run per node the module runs on
/// that is not on it already, in steps of `max_unavailable`. 409 during a
/// freeze (with its reason) or while the module has a rollout in progress.
#[utoipa::path(
    post,
    path = "/v1/rollouts",
    request_body = RolloutRequest,
    responses(
        (status = 201, description = "Started (or awaiting approval)", body = RolloutView),
        BodyErrors,
        NotFound,
        Conflict,
    )
)]
async fn start_rollout(
    State(delivery): State<Arc<Delivery>>,
    audit: Audit,
    ApiJson(req): ApiJson<RolloutRequest>,
) -> Result<(StatusCode, Json<RolloutView>), Problem> {
    Ok((
        StatusCode::CREATED,
        Json(delivery.start_rollout(&req, &audit).await?),
    ))
}

/// The newest rollouts (at most 100), filtered.
#[utoipa::path(get, path = "/v1/rollouts", params(RolloutParams),
    responses((status = 200, description = "Rollouts", body = RolloutList), BadRequest, Unprocessable))]
async fn list_rollouts(
    State(delivery): State<Arc<Delivery>>,
    ApiQuery(params): ApiQuery<RolloutParams>,
) -> Result<Json<RolloutList>, Problem> {
    if let Some(m) = &params.module {
        mesh_protocol::validate_module_name("module", m)?;
    }
    if let Some(s) = &params.state
        && ![
            "awaiting_approval",
            "running",
            "paused",
            "succeeded",
            "failed",
            "rolled_back",
            "denied",
            "canceled",
        ]
        .contains(&s.as_str())
    {
        return Err(Problem::unprocessable(
            "state",
            format!(
                "`{}` is not a rollout state",
                s.chars().take(40).collect::<String>()
            ),
        ));
    }
    Ok(Json(RolloutList {
        rollouts: delivery
            .rollouts(params.module.as_deref(), params.state.as_deref())
            .await?,
    }))
}

/// A rollout: its state, step, nodes done and every run with its latest receipt.
#[utoipa::path(get, path = "/v1/rollouts/{id}",
    params(("id" = String, Path, description = "The rollout's id (UUID)")),
    responses((status = 200, description = "The rollout", body = RolloutView), NotFound, Unprocessable))]
async fn get_rollout(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
) -> Result<Json<RolloutView>, Problem> {
    Ok(Json(delivery.rollout(id).await?))
}

/// Continue a paused rollout (after its canary, or a lifted freeze).
#[utoipa::path(post, path = "/v1/rollouts/{id}/continue",
    params(("id" = String, Path, description = "The rollout's id (UUID)")),
    responses((status = 200, description = "The rollout", body = RolloutView), NotFound, Conflict, Unprocessable))]
async fn continue_rollout(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
    audit: Audit,
) -> Result<Json<RolloutView>, Problem> {
    Ok(Json(delivery.continue_rollout(id, &audit).await?))
}

/// Cancel a rollout: runs not yet deployed are canceled.
#[utoipa::path(post, path = "/v1/rollouts/{id}/cancel",
    params(("id" = String, Path, description = "The rollout's id (UUID)")),
    responses((status = 200, description = "The rollout", body = RolloutView), NotFound, Conflict, Unprocessable))]
async fn cancel_rollout(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
    audit: Audit,
) -> Result<Json<RolloutView>, Problem> {
    Ok(Json(delivery.cancel_rollout(id, &audit).await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RunFilters {
    /// Only this rollout's runs (its UUID).
    rollout: Option<String>,
    /// Only runs of this module's rollouts.
    module: Option<String>,
    /// Only runs on this node.
    node: Option<String>,
    /// Only runs in this state (`queued`, `awaiting_approval`, `staging`,
    /// `deploying`, `settling`, `succeeded`, `failed`, `canceled`,
    /// `rolled_back`).
    state: Option<String>,
}

/// A page of runs.
#[derive(Debug, Serialize, ToSchema)]
struct RunList {
    runs: Vec<RunView>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<Uuid>,
}

const RUN_STATES: [&str; 9] = [
    "queued",
    "awaiting_approval",
    "staging",
    "deploying",
    "settling",
    "succeeded",
    "failed",
    "canceled",
    "rolled_back",
];

/// Runs (one node's part of a rollout), newest first, filtered, a page at a
/// time, each with its latest receipt: `after` is a run's id (runs created
/// before it), `limit` 1 to 500, default 100.
#[utoipa::path(get, path = "/v1/runs", params(RunFilters, Page),
    responses((status = 200, description = "A page of runs", body = RunList), BadRequest, Unprocessable))]
async fn list_runs(
    State(delivery): State<Arc<Delivery>>,
    ListQuery(page, params): ListQuery<RunFilters>,
) -> Result<Json<RunList>, Problem> {
    let rollout = params
        .rollout
        .as_deref()
        .map(|r| uuid("rollout", r))
        .transpose()?;
    let before = page.after_id()?;
    if let Some(m) = &params.module {
        mesh_protocol::validate_module_name("module", m)?;
    }
    if let Some(n) = &params.node {
        mesh_protocol::NodeId::parse(n)
            .map_err(|e| Problem::unprocessable("node", e.to_string()))?;
    }
    if let Some(s) = &params.state
        && !RUN_STATES.contains(&s.as_str())
    {
        return Err(Problem::unprocessable(
            "state",
            format!(
                "`{}` is not a run state",
                s.chars().take(40).collect::<String>()
            ),
        ));
    }
    let limit = page.limit(100, crate::MAX_RUNS_PAGE)?;
    let filter = crate::RunFilter {
        rollout,
        module: params.module.as_deref(),
        node: params.node.as_deref(),
        state: params.state.as_deref(),
        before,
    };
    let runs = delivery.runs(&filter, limit).await?;
    let next = mesh_plumbing::page::next(&runs, limit, |r| r.id);
    Ok(Json(RunList { runs, next }))
}

/// One run.
#[utoipa::path(get, path = "/v1/runs/{id}",
    params(("id" = String, Path, description = "The run's id (UUID)")),
    responses((status = 200, description = "The run", body = RunView), NotFound, Unprocessable))]
async fn get_run(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
) -> Result<Json<RunView>, Problem> {
    Ok(Json(delivery.run(id).await?))
}

/// An approval's or a denial's reason.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct Decision {
    /// Why (required to deny).
    #[serde(default)]
    reason: Option<String>,
}

/// Approve the rollout of a run awaiting approval; `decided_by` is the
/// operator's token, never the body.
#[utoipa::path(post, path = "/v1/runs/{id}/approve",
    params(("id" = String, Path, description = "The run's id (UUID)")),
    request_body = Decision,
    responses((status = 200, description = "The run", body = RunView), BodyErrors, NotFound, Conflict))]
async fn approve_run(
    delivery: State<Arc<Delivery>>,
    id: UuidPath,
    audit: Audit,
    decision: ApiJson<Decision>,
) -> Result<Json<RunView>, Problem> {
    decide(delivery, id, true, audit, decision).await
}

/// Approve (`approve`) or deny the rollout of the run `id`.
async fn decide(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(id): UuidPath,
    approve: bool,
    audit: Audit,
    ApiJson(d): ApiJson<Decision>,
) -> Result<Json<RunView>, Problem> {
    let reason = d.reason.as_deref();
    Ok(Json(delivery.decide(id, approve, reason, &audit).await?))
}

/// Deny the rollout of a run awaiting approval, with a reason: its runs end
/// canceled, the reason in their receipts.
#[utoipa::path(post, path = "/v1/runs/{id}/deny",
    params(("id" = String, Path, description = "The run's id (UUID)")),
    request_body = Decision,
    responses((status = 200, description = "The run", body = RunView), BodyErrors, NotFound, Conflict))]
async fn deny_run(
    delivery: State<Arc<Delivery>>,
    id: UuidPath,
    audit: Audit,
    decision: ApiJson<Decision>,
) -> Result<Json<RunView>, Problem> {
    decide(delivery, id, false, audit, decision).await
}

#[derive(Debug, Serialize, ToSchema)]
struct ReceiptList {
    run: Uuid,
    receipts: Vec<Receipt>,
}

/// A run's receipt log, in order (append-only; validated as it is read).
#[utoipa::path(get, path = "/v1/runs/{id}/receipts",
    params(("id" = String, Path, description = "The run's id (UUID)")),
    responses((status = 200, description = "The receipts", body = ReceiptList), NotFound, Unprocessable))]
async fn get_receipts(
    State(delivery): State<Arc<Delivery>>,
    UuidPath(run): UuidPath,
) -> Result<Json<ReceiptList>, Problem> {
    Ok(Json(ReceiptList {
        run,
        receipts: delivery.receipts(run).await?,
    }))
}

/// The freeze, if one is set.
#[utoipa::path(get, path = "/v1/freeze",
    responses((status = 200, description = "The freeze", body = FreezeView)))]
async fn get_freeze(State(delivery): State<Arc<Delivery>>) -> Result<Json<FreezeView>, Problem> {
    Ok(Json(delivery.freeze().await?))
}

/// Freeze deliveries: every new rollout is refused with 409 and the reason;
/// rollouts in progress pause at their next step unless `pause_in_flight`
/// is false.
#[utoipa::path(put, path = "/v1/freeze", request_body = FreezeRequest,
    responses((status = 200, description = "The freeze", body = FreezeView), BodyErrors))]
async fn put_freeze(
    State(delivery): State<Arc<Delivery>>,
    audit: Audit,
    ApiJson(req): ApiJson<FreezeRequest>,
) -> Result<Json<FreezeView>, Problem> {
    Ok(Json(delivery.set_freeze(&req, &audit).await?))
}

/// Lift the freeze; rollouts it paused go on.
#[utoipa::path(delete, path = "/v1/freeze",
    responses((status = 204, description = "Lifted (or there was none)")))]
async fn delete_freeze(
    State(delivery): State<Arc<Delivery>>,
    audit: Audit,
) -> Result<StatusCode, Problem> {
    delivery.lift_freeze(&audit).await?;
    Ok(StatusCode::NO_CONTENT)
}
