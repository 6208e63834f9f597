//! HTTP routes of the config context. Errors are problem+json naming the field.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use mesh_plumbing::api::{Problem, Role, created_status};
use mesh_plumbing::etag::{self, Preconditions};
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, NotFound, NotModified, PreconditionFailed, PreconditionRequired,
};
use mesh_protocol::{FileMode, Labels, NodeId};
use serde::{Deserialize, Serialize};

use crate::query::{FileSpec, FileSummary, Target, validate_name};
use crate::{Config, Error};
use mesh_plumbing::api::ApiJson;
use mesh_plumbing::audit::Audit;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The file routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Config>> {
    OpenApiRouter::new()
        .routes(routes!(list_files))
        .routes(routes!(get_file, put_file, delete_file))
}

/// Body of `PUT /v1/files/{name}`: exactly one of `node` and `selector`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct FileBody {
    /// Absolute path on the node.
    path: String,
    /// The file's text.
    content: String,
    /// Octal string, e.g. `"0644"`.
    mode: String,
    /// The node the file is for.
    #[serde(default)]
    node: Option<String>,
    /// Every node whose labels contain all these pairs (`{}`: every node).
    #[serde(default)]
    selector: Option<Labels>,
}

impl FileBody {
    fn parse(self) -> Result<FileSpec, Error> {
        let mode = FileMode::parse_octal(&self.mode)?;
        let target = match (self.node, self.selector) {
            (Some(node), None) => Target::Node(NodeId::parse(&node)?),
            (None, Some(selector)) => Target::Selector(selector),
            (Some(_), Some(_)) => {
                return Err(Error::Invalid {
                    field: "selector".into(),
                    reason: "give exactly one of `node` and `selector`, not both".into(),
                });
            }
            (None, None) => {
                return Err(Error::Invalid {
                    field: "node".into(),
                    reason: "give exactly one of `node` (a node id) and `selector` (a label map)"
                        .into(),
                });
            }
        };
        let spec = FileSpec {
            path: self.path,
            content: self.content,
            mode,
            target,
        };
        spec.validate()?;
        Ok(spec)
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct FileList {
    files: Vec<FileSummary>,
}

/// Every declared file, without its content.
#[utoipa::path(
    get,
    path = "/v1/files",
    responses((status = 200, description = "Every file", body = FileList))
)]
async fn list_files(State(config): State<Arc<Config>>) -> Result<Json<FileList>, Problem> {
    Ok(Json(FileList {
        files: config.files().await?,
    }))
}

/// The `If-Match` / `If-None-Match` headers every write route documents.
pub(crate) const IF_MATCH: &str =
    "`*` or the quoted revisions this write replaces (its ETag); required to replace what exists";

/// One declared file. Its content is shown to operators and admins only: a
/// viewer token sees its size and revision.
#[utoipa::path(
    get,
    path = "/v1/files/{name}",
    params(
        ("name" = String, Path, description = "The file's name: 1 to 63 of a-z 0-9 . _ -"),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you hold: 304 while it is current"),
    ),
    responses(
        (status = 200, description = "The file", body = crate::FileView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        NotModified,
        NotFound,
    )
)]
async fn get_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let Some(mut file) = config.file(&name).await? else {
        return Err(Error::FileNotFound(name.chars().take(80).collect()).into());
    };
    if audit.principal().role < Role::Operator {
        file.content = None;
    }
    Ok(etag::conditional_get(&headers, file.revision, &file))
}

/// Declare a file (create or replace) for one node or every node a selector
/// matches. Replacing needs `If-Match` (the ETag read): 428 without it, 412
/// when stale; `If-None-Match: *` only creates.
#[utoipa::path(
    put,
    path = "/v1/files/{name}",
    params(
        ("name" = String, Path, description = "The file's name: 1 to 63 of a-z 0-9 . _ -"),
        ("If-Match" = Option<String>, Header, nullable = false, description = IF_MATCH),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "`*`: only create"),
    ),
    request_body = FileBody,
    responses(
        (status = 200, description = "Replaced", body = crate::FileView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        (status = 201, description = "Created", body = crate::FileView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        BodyErrors,
        PreconditionFailed,
        PreconditionRequired,
    )
)]
async fn put_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    headers: HeaderMap,
    ApiJson(body): ApiJson<FileBody>,
) -> Result<Response, Problem> {
    validate_name(&name)?;
    let pre = Preconditions::from_headers(&headers)?;
    let spec = body.parse()?;
    let (file, created) = config.put_file(&name, spec, &pre, &audit).await?;
    Ok(etag::with_etag(
        created_status(created),
        file.revision,
        file,
    ))
}

/// Remove a declared file from every node it was declared to.
#[utoipa::path(
    delete,
    path = "/v1/files/{name}",
    params(
        ("name" = String, Path, description = "The file's name: 1 to 63 of a-z 0-9 . _ -"),
        ("If-Match" = Option<String>, Header, nullable = false, description = "Delete only at one of these quoted revisions"),
    ),
    responses(
        (status = 204, description = "Removed"),
        BadRequest,
        NotFound,
        PreconditionFailed,
    )
)]
async fn delete_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<StatusCode, Problem> {
    let pre = Preconditions::from_headers(&headers)?;
    config.delete_file(&name, &pre, &audit).await?;
    Ok(StatusCode::NO_CONTENT)
}
