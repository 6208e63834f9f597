//! The OpenAPI document of the HTTP API (decision 0019), served at
//! [`DOCUMENT_PATH`].
//!
//! Every context describes its own routes (`#[utoipa::path]` above each
//! handler) and hands them to the controller as an `OpenApiRouter`, so a route
//! and its description are registered together: a route cannot be served
//! without being in the document. [`finish`] then adds what the controller
//! decides, from the same table the auth layer enforces ([`auth::required`]):
//! each operation's role (the `x-mesh-role` extension and a line of its
//! description), its security requirement, the 401 and 403 answers of the auth
//! layer, and the 500 any route answers when a database fails. Every error
//! answer is `application/problem+json` with the `Problem` schema.

use axum::http::Method;
use mesh_plumbing::api::{Problem, Role};
use mesh_plumbing::openapi::problem_response;
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, InfoBuilder, OpenApi};
use utoipa::{PartialSchema, ToSchema};

use crate::auth::{self, Access};

/// Where the document is served (open: it describes routes, it shows no data).
pub const DOCUMENT_PATH: &str = "/v1/openapi.json";

/// The operation extension naming the role a route needs: `open`, `viewer`,
/// `operator` or `admin`.
pub const ROLE_EXTENSION: &str = "x-mesh-role";

/// The security scheme of API tokens (`Authorization: Bearer <token>`).
pub const BEARER: &str = "bearer";

const DESCRIPTION: &str = "The mesh controller's HTTP API: one interface in front of every \
context. Each operation names the role its token needs in `x-mesh-role` (`open`: no token). \
Every error answer is `application/problem+json` (RFC 9457) naming the field at fault; an \
unknown path answers 404 and a method a path does not serve 405 (with `Allow`), both \
problem+json too.";

/// The name `access` has in the document.
pub fn role_name(access: Access) -> &'static str {
    match access {
        Access::Open => "open",
        Access::Role(role) => role.as_str(),
    }
}

/// Each operation of a path item, with its method.
pub fn operations_mut(
    item: &mut utoipa::openapi::path::PathItem,
) -> impl Iterator<Item = (Method, &mut Operation)> {
    [
        (Method::GET, item.get.as_mut()),
        (Method::PUT, item.put.as_mut()),
        (Method::POST, item.post.as_mut()),
        (Method::DELETE, item.delete.as_mut()),
        (Method::OPTIONS, item.options.as_mut()),
        (Method::HEAD, item.head.as_mut()),
        (Method::PATCH, item.patch.as_mut()),
        (Method::TRACE, item.trace.as_mut()),
    ]
    .into_iter()
    .filter_map(|(m, op)| op.map(|op| (m, op)))
}

/// Open the members of every `allOf` in `doc` (the document as JSON): a
/// member that says `additionalProperties: false` (a `deny_unknown_fields`
/// type flattened into a view that adds fields, as `ModuleView` inlines
/// `ModuleSpec`) would refuse the other members' properties, so no answer
/// could match. The type still refuses unknown fields where it is a request
/// body on its own.
pub fn open_all_of(doc: &mut serde_json::Value) {
    match doc {
        serde_json::Value::Object(map) => {
            if let Some(serde_json::Value::Array(members)) = map.get_mut("allOf") {
                for member in members.iter_mut() {
                    close_none(member);
                }
            }
            for v in map.values_mut() {
                open_all_of(v);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(open_all_of),
        _ => {}
    }
}

/// Drop `additionalProperties: false` from `schema` and from the members of
/// its own `allOf` (nested inlining), not from the schemas its properties hold.
fn close_none(schema: &mut serde_json::Value) {
    if let serde_json::Value::Object(map) = schema {
        if map.get("additionalProperties") == Some(&serde_json::Value::Bool(false)) {
            map.remove("additionalProperties");
        }
        if let Some(serde_json::Value::Array(members)) = map.get_mut("allOf") {
            members.iter_mut().for_each(close_none);
        }
    }
}

/// Complete the document the contexts' routes make up: title, the `Problem`
/// schema, the bearer scheme, and per operation its role, security and the
/// answers of the auth layer.
pub fn finish(mut doc: OpenApi) -> OpenApi {
    doc.info = InfoBuilder::new()
        .title("mesh controller API")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(DESCRIPTION))
        .build();
    let components = doc.components.get_or_insert_with(Components::new);
    components
        .schemas
        .insert(Problem::name().into_owned(), Problem::schema());
    components.security_schemes.insert(
        BEARER.to_owned(),
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "An API token (`meshctl` and `bundle/up` print the first admin's)",
                ))
                .build(),
        )
        .into(),
    );
    for (path, item) in doc.paths.paths.iter_mut() {
        for (method, op) in operations_mut(item) {
            let access = auth::required(&method, Some(path));
            let role = role_name(access);
            op.extensions
                .get_or_insert_with(Default::default)
                .insert(ROLE_EXTENSION.to_owned(), serde_json::json!(role));
            let needs = match access {
                Access::Open => "Needs no API token.".to_owned(),
                Access::Role(r) => {
                    format!("Needs an API token with the `{r}` role or a larger one.")
                }
            };
            op.description = Some(match op.description.take() {
                Some(d) if !d.is_empty() => format!("{d}\n\n{needs}"),
                _ => needs,
            });
            let responses = &mut op.responses.responses;
            if let Access::Role(needed) = access {
                op.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new())]);
                responses.entry("401".to_owned()).or_insert_with(|| {
                    problem_response(
                        "No API token, or one not known or revoked (`WWW-Authenticate: Bearer`).",
                    )
                    .into()
                });
                if needed > Role::Viewer {
                    responses.entry("403".to_owned()).or_insert_with(|| {
                        problem_response(&format!("The token's role is smaller than `{needed}`."))
                            .into()
                    });
                }
            }
            if path != DOCUMENT_PATH {
                responses.entry("500".to_owned()).or_insert_with(|| {
                    problem_response(
                        "A database or another part failed; the detail is in the controller's log.",
                    )
                    .into()
                });
            }
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    #[test]
    fn members_of_all_of_admit_each_others_properties() {
        let mut doc = serde_json::json!({
            "ModuleView": {"allOf": [
                {"allOf": [{"additionalProperties": false, "properties": {"unit": {}}}]},
                {"properties": {"name": {}}}
            ]},
            "ModuleSpec": {"additionalProperties": false, "properties": {"unit": {}}}
        });
        super::open_all_of(&mut doc);
        assert!(
            doc["ModuleView"]["allOf"][0]["allOf"][0]
                .get("additionalProperties")
                .is_none()
        );
        assert_eq!(
            doc["ModuleSpec"]["additionalProperties"], false,
            "a body on its own stays closed"
        );
    }
}
