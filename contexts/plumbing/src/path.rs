//! The path parameters many routes share, each parsed and documented once: an
//! extractor that answers the same 422 [`Problem`] naming the parameter
//! wherever it is used, and whose [`IntoParams`] lets a route's OpenAPI
//! description say `params(NodePath)` instead of spelling the parameter out.
//!
//! Each fits a route with that one path parameter (`/v1/nodes/{id}`,
//! `/v1/nodes/{id}/readmit`); a route with several reads them together.

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use mesh_protocol::NodeId;
use utoipa::IntoParams;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::{Required, Type};
use uuid::Uuid;

use crate::api::Problem;

/// `{id}` of a node's route: a [`NodeId`], or a 422 naming `id`.
pub struct NodePath(pub NodeId);

/// `{name}` of a module's route: a valid module name (1 to 48 of a-z 0-9 -),
/// or a 422 naming `name`.
pub struct ModulePath(pub String);

/// `{id}` of a route whose resource is named by a UUID (a revision, a
/// rollout, a run): the UUID, or a 422 naming `id`. Its description is the
/// route's own: `params(("id" = String, Path, description = "…"))`.
pub struct UuidPath(pub Uuid);

/// The one path parameter of the route, as text; a rejection is a [`Problem`].
async fn segment(parts: &mut Parts) -> Result<String, Problem> {
    let Path(text) = Path::<String>::from_request_parts(parts, &())
        .await
        .map_err(|e| Problem::new(e.status(), e.body_text()))?;
    Ok(text)
}

/// `text` cut to `n` characters, for a problem's detail.
fn cut(text: &str, n: usize) -> String {
    text.chars().take(n).collect()
}

impl<S: Send + Sync> FromRequestParts<S> for NodePath {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        let id = segment(parts).await?;
        NodeId::parse(&id)
            .map(NodePath)
            .map_err(|e| Problem::unprocessable("id", e.to_string()))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ModulePath {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        let name = segment(parts).await?;
        mesh_protocol::validate_module_name("name", &name)?;
        Ok(ModulePath(name))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for UuidPath {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Problem> {
        uuid("id", &segment(parts).await?).map(UuidPath)
    }
}

/// `text` as a UUID, or a 422 naming `field` (a path's `id`, a query's
/// filter).
pub fn uuid(field: &str, text: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(text)
        .map_err(|_| Problem::unprocessable(field, format!("`{}` is not a UUID", cut(text, 64))))
}

/// A required string parameter in the path.
fn path_param(name: &str, description: &str) -> Vec<Parameter> {
    vec![
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Path)
            .required(Required::True)
            .description(Some(description))
            .schema(Some(
                utoipa::openapi::ObjectBuilder::new().schema_type(Type::String),
            ))
            .build(),
    ]
}

impl IntoParams for NodePath {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        path_param("id", "The node's id")
    }
}

impl IntoParams for ModulePath {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        path_param("name", "The module's name")
    }
}
