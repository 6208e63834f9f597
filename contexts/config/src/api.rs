//! HTTP routes of the config context. Errors are problem+json naming the field.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use mesh_plumbing::api::Problem;
use mesh_protocol::{FileMode, Labels, NodeId};
use serde::{Deserialize, Serialize};

use crate::query::{FileSpec, FileSummary, Target, validate_name};
use crate::{Config, Error};
use mesh_plumbing::api::ApiJson;
use mesh_plumbing::audit::Audit;

pub(crate) fn routes(config: Arc<Config>) -> Router {
    Router::new()
        .route("/v1/files", get(list_files))
        .route(
            "/v1/files/{name}",
            get(get_file).put(put_file).delete(delete_file),
        )
        .with_state(config)
}

/// Body of `PUT /v1/files/{name}`: exactly one of `node` and `selector`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBody {
    path: String,
    content: String,
    /// Octal string, e.g. `"0644"`.
    mode: String,
    #[serde(default)]
    node: Option<String>,
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

#[derive(Debug, Serialize)]
struct FileList {
    files: Vec<FileSummary>,
}

async fn list_files(State(config): State<Arc<Config>>) -> Result<Json<FileList>, Problem> {
    Ok(Json(FileList {
        files: config.files().await?,
    }))
}

async fn get_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    match config.file(&name).await? {
        Some(file) => Ok(Json(file).into_response()),
        None => Err(Error::FileNotFound(name.chars().take(80).collect()).into()),
    }
}

async fn put_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    ApiJson(body): ApiJson<FileBody>,
) -> Result<Response, Problem> {
    validate_name(&name)?;
    let spec = body.parse()?;
    let (file, created) = config.put_file(&name, spec, &audit).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(file)).into_response())
}

async fn delete_file(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
) -> Result<StatusCode, Problem> {
    config.delete_file(&name, &audit).await?;
    Ok(StatusCode::NO_CONTENT)
}
