//! The OpenAPI pieces every context's routes share (decision 0019): the
//! problem+json error responses, so that each route names the errors it can
//! produce in one word (`responses((status = 200, ...), NotFound, BodyErrors)`),
//! each with the [`Problem`](crate::api::Problem) schema and the
//! `application/problem+json` content type.
//!
//! Each context describes its own routes with `#[utoipa::path]` and returns them
//! as a `utoipa_axum::router::OpenApiRouter`, every operation tagged with the
//! context's name by [`tagged`] (so no route repeats it); the controller merges them into the
//! one document it serves at `/v1/openapi.json` and adds what its auth layer
//! decides (the role each route needs, 401, 403).

use std::collections::BTreeMap;

use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder};
use utoipa_axum::router::OpenApiRouter;

/// `router` with every operation tagged `tag`, the name of the context that
/// serves it: a context says its tag once, where it returns its routes,
/// rather than in each route's `#[utoipa::path]`.
pub fn tagged<S: Clone + Send + Sync + 'static>(
    mut router: OpenApiRouter<S>,
    tag: &str,
) -> OpenApiRouter<S> {
    for item in router.get_openapi_mut().paths.paths.values_mut() {
        let operations = [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ];
        for operation in operations.into_iter().flatten() {
            operation.tags = Some(vec![tag.to_owned()]);
        }
    }
    router
}

/// The content type of every error answer.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// A response whose body is a [`Problem`](crate::api::Problem).
pub fn problem_response(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            PROBLEM_JSON,
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build(),
        )
        .build()
}

macro_rules! problem_responses {
    ($($(#[$doc:meta])* $name:ident => [$(($status:literal, $description:literal)),+];)*) => {
        $(
            $(#[$doc])*
            pub struct $name;

            impl utoipa::IntoResponses for $name {
                fn responses() -> BTreeMap<String, RefOr<Response>> {
                    BTreeMap::from([
                        $(($status.to_owned(), problem_response($description).into()),)+
                    ])
                }
            }
        )*
    };
}

problem_responses! {
    /// 400: the query string or a header cannot be read.
    BadRequest => [("400", "The query string or a header cannot be read; `detail` says why.")];
    /// 400, 413, 422: what a JSON body can get wrong.
    BodyErrors => [
        ("400", "The body is not JSON (or a header cannot be read); `detail` says why."),
        ("413", "The body is larger than the API takes (2 MiB)."),
        ("422", "A value in the body or the path is wrong; `field` names it, `detail` says why.")
    ];
    /// 401: a credential the route checks itself (a join token) is not known.
    Unauthorized => [("401", "The credential is not known; `detail` says which.")];
    /// 403: the credential is known but refused.
    Forbidden => [("403", "The credential is refused; `detail` says why.")];
    /// 404: no such resource.
    NotFound => [("404", "No such resource; `detail` names it.")];
    /// 410: a position (`Last-Event-ID`) older than what is kept.
    Gone => [("410", "The position is older than the oldest kept; re-list, then follow again without it.")];
    /// 409: the resource's state forbids the change.
    Conflict => [("409", "The resource's state forbids this change; `detail` says which.")];
    /// 412: a precondition (`If-Match`, `If-None-Match`) does not hold.
    PreconditionFailed => [("412", "`If-Match` or `If-None-Match` does not hold; re-read and retry.")];
    /// 422: a value in the path or the query is wrong.
    Unprocessable => [("422", "A value is wrong; `field` names it, `detail` says why.")];
    /// 503: a part the change needs (the broker's management API) failed; the
    /// change was not recorded and is safe to repeat.
    Unavailable => [("503", "A part this change needs failed; nothing was recorded: try again.")];
    /// 503: every slot of a bounded resource (event streams) is taken.
    Busy => [("503", "The controller serves as many of these as it takes; retry later.")];
    /// 428: replacing needs a precondition (`If-Match`).
    PreconditionRequired => [("428", "The resource exists: say which revision you replace with `If-Match`.")];
}

/// 304: the `If-None-Match` of a `GET` names the current revision; no body.
pub struct NotModified;

impl utoipa::IntoResponses for NotModified {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        BTreeMap::from([(
            "304".to_owned(),
            ResponseBuilder::new()
                .description("`If-None-Match` names the current revision: your copy is current.")
                .build()
                .into(),
        )])
    }
}
