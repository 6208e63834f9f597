//! The OpenAPI document against the router that serves it (decision 0019):
//! every route the router serves is in the document with the role auth.rs
//! gives it and its problem+json errors, and nothing else is; a method a path
//! does not serve and an unknown path answer problem+json.
//!
//! The routes are taken from the router itself (the paths from its route
//! table, the methods by asking each path with every method: 405 means not
//! served), not from a list kept beside it. Runs against a real isolated
//! environment (bundle's test kit).

mod common;

use std::collections::BTreeSet;

use anyhow::Context as _;
use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use mesh_controller::auth::{self, Access};
use mesh_controller::openapi::{BEARER, DOCUMENT_PATH, ROLE_EXTENSION, role_name};
use mesh_plumbing::api::Role;
use mesh_testkit::TestEnv;
use serde_json::Value;
use tower::ServiceExt;

const PROBLEM_JSON: &str = "application/problem+json";
const METHODS: [Method; 7] = [
    Method::GET,
    Method::PUT,
    Method::POST,
    Method::DELETE,
    Method::PATCH,
    Method::OPTIONS,
    Method::TRACE,
];

struct Fixture {
    env: TestEnv,
    _dir: tempfile::TempDir,
    router: Router,
}

async fn fixture() -> anyhow::Result<Fixture> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = common::api_router(&env, dir.path()).await?;
    Ok(Fixture {
        env,
        _dir: dir,
        router,
    })
}

struct Answer {
    status: StatusCode,
    content_type: String,
    allow: String,
    body: Value,
}

async fn call(router: &Router, method: Method, uri: &str) -> anyhow::Result<Answer> {
    let response = router
        .clone()
        .oneshot(
            Request::builder()
                .method(method)
                .uri(uri)
                .body(Body::empty())?,
        )
        .await?;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (status, content_type, allow) =
        (response.status(), header("content-type"), header("allow"));
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24).await?;
    Ok(Answer {
        status,
        content_type,
        allow,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    })
}

/// The route patterns in the router's own table (its `Debug` lists them), less
/// axum's internal fallback routes (the caller drops `/`, the fallback's own).
fn served_paths(router: &Router) -> BTreeSet<String> {
    let debug = format!("{router:?}");
    debug
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with('/') && !s.contains("__private__axum"))
        .map(str::to_owned)
        .collect()
}

/// A concrete URI for a pattern: every `{param}` becomes `probe`.
fn concrete(pattern: &str) -> String {
    pattern
        .split('/')
        .map(|seg| if seg.starts_with('{') { "probe" } else { seg })
        .collect::<Vec<_>>()
        .join("/")
}

fn problem_ref(response: &Value) -> Option<&str> {
    response
        .pointer("/content")?
        .get(PROBLEM_JSON)?
        .pointer("/schema/$ref")?
        .as_str()
}

/// Every `$ref` in `value`.
fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "$ref" {
                    if let Some(s) = v.as_str() {
                        out.push(s);
                    }
                } else {
                    refs(v, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn every_served_route_is_in_the_document_with_its_role_and_problems() -> anyhow::Result<()> {
    let f = fixture().await?;
    let doc = call(&f.router, Method::GET, DOCUMENT_PATH).await?;
    assert_eq!(doc.status, StatusCode::OK, "the document is open");
    assert!(doc.content_type.starts_with("application/json"));
    let doc = doc.body;
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().context("paths")?;

    // Served, from the router: its table's paths, and each method that is not 405.
    let mut served = BTreeSet::new();
    let table = served_paths(&f.router);
    assert!(
        table.len() >= 15 && table.contains(DOCUMENT_PATH),
        "the router's table was not found in its Debug output (axum changed it?): {table:?}"
    );
    // The dashboard's static files are served beside the API, not part of it
    // (decision 0035): they are not in the document, and checked in
    // tests/dashboard.rs.
    for path in table
        .iter()
        .filter(|p| !mesh_controller::dashboard::ROUTES.contains(&p.as_str()))
    {
        for method in METHODS {
            let answer = call(&f.router, method.clone(), &concrete(path)).await?;
            if answer.status == StatusCode::METHOD_NOT_ALLOWED {
                assert!(
                    answer.content_type.starts_with(PROBLEM_JSON),
                    "405 of {method} {path} is not problem+json: {:?}",
                    answer.content_type
                );
                assert!(
                    !answer.allow.is_empty(),
                    "405 of {method} {path} has no Allow"
                );
            } else if answer.status == StatusCode::NOT_FOUND
                && answer.body["detail"] == "no such route"
            {
                // The router's fallback (its table holds it too): no route.
            } else {
                served.insert((method.to_string(), path.clone()));
            }
        }
    }
    // Described, from the document.
    let mut described = BTreeSet::new();
    for (path, item) in paths {
        for (method, _) in item.as_object().context("path item")? {
            described.insert((method.to_uppercase(), path.clone()));
        }
    }
    assert_eq!(
        served, described,
        "routes served (left) and routes in the document (right) differ"
    );

    let schemas = doc["components"]["schemas"]
        .as_object()
        .context("schemas")?;
    assert!(schemas.contains_key("Problem"));
    assert_eq!(
        doc["components"]["securitySchemes"][BEARER]["scheme"], "bearer",
        "the bearer scheme"
    );
    for (method, path) in &described {
        let op = &doc["paths"][path][method.to_lowercase()];
        let what = format!("{method} {path}");
        let m: Method = method.parse()?;
        let access = auth::required(&m, Some(path));
        assert_eq!(
            op[ROLE_EXTENSION],
            role_name(access),
            "{what}: the role in the document is not the one auth.rs enforces"
        );
        let responses = op["responses"].as_object().context("responses")?;
        assert!(
            responses.keys().any(|s| s.starts_with('2')),
            "{what}: no success answer"
        );
        match access {
            Access::Open => assert!(op.get("security").is_none(), "{what} is open"),
            Access::Role(role) => {
                assert_eq!(op["security"][0][BEARER], Value::Array(vec![]), "{what}");
                assert!(responses.contains_key("401"), "{what}: no 401");
                assert_eq!(
                    responses.contains_key("403"),
                    role > Role::Viewer,
                    "{what}: a 403 exactly when a smaller role exists"
                );
            }
        }
        for (status, response) in responses {
            // The one error answer that is not a problem: /healthz's 503 is the
            // health report itself (what is down).
            let report = path == "/healthz" && status == "503";
            if status.as_str() >= "400" && !report {
                // A problem with extension members (RFC 9457 3.2, the logs
                // route's 504 carrying what the nodes that answered said) is
                // a schema whose `allOf` holds the Problem.
                let extends_problem = problem_ref(response)
                    .and_then(|r| r.strip_prefix("#/components/schemas/"))
                    .and_then(|name| schemas.get(name))
                    .and_then(|s| s["allOf"].as_array())
                    .is_some_and(|all| {
                        all.iter()
                            .any(|m| m["$ref"] == "#/components/schemas/Problem")
                    });
                assert!(
                    extends_problem
                        || problem_ref(response) == Some("#/components/schemas/Problem"),
                    "{what}: {status} is not problem+json with the Problem schema"
                );
                assert_eq!(
                    response["content"].as_object().map(|c| c.len()),
                    Some(1),
                    "{what}: {status} has another content type besides problem+json"
                );
            }
        }
        // Every `{param}` of the path is a declared path parameter.
        for param in path.split('/').filter_map(|s| s.strip_prefix('{')) {
            let name = param.trim_end_matches('}');
            let declared = op["parameters"].as_array().is_some_and(|ps| {
                ps.iter()
                    .any(|p| p["name"] == name && p["in"] == "path" && p["required"] == true)
            });
            assert!(declared, "{what}: path parameter `{name}` is not declared");
        }
    }
    // Every reference resolves.
    let mut all = Vec::new();
    refs(&doc, &mut all);
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .with_context(|| format!("a reference outside the schemas: {r}"))?;
        assert!(schemas.contains_key(name), "unresolved reference {r}");
    }
    f.env.teardown().await
}

#[tokio::test]
async fn wrong_methods_and_unknown_paths_answer_problem_json() -> anyhow::Result<()> {
    let f = fixture().await?;
    // A guarded path, an open one, one with a parameter: 405 without asking for
    // a token (the method is wrong whoever asks), with Allow.
    for (method, uri, allow) in [
        (Method::PATCH, "/v1/nodes", "GET"),
        (Method::DELETE, "/healthz", "GET"),
        (Method::POST, "/v1/files/motd", "PUT"),
        (Method::GET, "/v1/join", "POST"),
    ] {
        let a = call(&f.router, method.clone(), uri).await?;
        assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
        assert!(
            a.content_type.starts_with(PROBLEM_JSON),
            "{method} {uri}: {}",
            a.content_type
        );
        assert_eq!(a.body["status"], 405, "{method} {uri}: {}", a.body);
        assert!(
            a.body["detail"]
                .as_str()
                .is_some_and(|d| d.contains(method.as_str())),
            "{method} {uri}: the detail names the method: {}",
            a.body
        );
        assert!(
            a.allow.contains(allow),
            "{method} {uri}: Allow {:?}",
            a.allow
        );
    }
    for uri in ["/v1/nope", "/", "/v1/nodes/a/b/c", "/v1/files/"] {
        let a = call(&f.router, Method::GET, uri).await?;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{uri}");
        assert!(
            a.content_type.starts_with(PROBLEM_JSON),
            "{uri}: {}",
            a.content_type
        );
        assert_eq!(a.body["status"], 404, "{uri}");
    }
    f.env.teardown().await
}
