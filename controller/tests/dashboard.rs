//! The dashboard's static files (dashboard.rs, decision 0035): served with no
//! token, with their exact content types and the strict headers (CSP,
//! nosniff, revalidation with an ETag); outside the OpenAPI document; and
//! everything with data under `/v1` still needs a token. Runs the router
//! against a real isolated environment (bundle's test kit).

mod common;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use mesh_controller::dashboard::{self, CSP};
use mesh_controller::openapi::DOCUMENT_PATH;
use mesh_testkit::TestEnv;
use tower::ServiceExt;

async fn router(env: &TestEnv, dir: &tempfile::TempDir) -> anyhow::Result<Router> {
    common::api_router(env, dir.path()).await
}

async fn call(
    router: &Router,
    method: Method,
    uri: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(StatusCode, HeaderMap, Vec<u8>)> {
    let mut req = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let response = router.clone().oneshot(req.body(Body::empty())?).await?;
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), 1 << 24).await?;
    Ok((status, headers, body.to_vec()))
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

#[tokio::test]
async fn the_static_files_are_open_with_strict_headers_and_v1_still_needs_a_token()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = router(&env, &dir).await?;

    for (uri, content_type, holds) in [
        (
            dashboard::PATH,
            "text/html; charset=utf-8",
            "<script type=\"module\" src=\"/dashboard/app.js\"></script>",
        ),
        (
            "/dashboard/app.js",
            "text/javascript; charset=utf-8",
            "sessionStorage",
        ),
        (
            "/dashboard/sse.js",
            "text/javascript; charset=utf-8",
            "Last-Event-ID",
        ),
        (
            "/dashboard/view.js",
            "text/javascript; charset=utf-8",
            "textContent",
        ),
        ("/dashboard/style.css", "text/css; charset=utf-8", ".node"),
        ("/dashboard/favicon.svg", "image/svg+xml", "<svg"),
    ] {
        // No Authorization header at all.
        let (status, h, body) = call(&router, Method::GET, uri, &[]).await?;
        assert_eq!(status, StatusCode::OK, "{uri}");
        assert_eq!(header(&h, "content-type"), content_type, "{uri}");
        assert_eq!(header(&h, "content-security-policy"), CSP, "{uri}");
        assert_eq!(header(&h, "x-content-type-options"), "nosniff", "{uri}");
        assert_eq!(header(&h, "cache-control"), "no-cache", "{uri}");
        assert_eq!(header(&h, "referrer-policy"), "no-referrer", "{uri}");
        assert_eq!(header(&h, "x-frame-options"), "DENY", "{uri}");
        assert!(
            !header(&h, "x-request-id").is_empty(),
            "{uri}: the access layers wrap it"
        );
        let body = String::from_utf8(body)?;
        assert!(body.contains(holds), "{uri} does not hold {holds:?}");
        // Revalidation: the same tag is answered 304, with the same policy.
        let tag = header(&h, "etag").to_owned();
        assert!(tag.starts_with('"') && tag.len() > 2, "{uri}: ETag {tag:?}");
        let (status, h, body) = call(
            &router,
            Method::GET,
            uri,
            &[("if-none-match", tag.as_str())],
        )
        .await?;
        assert_eq!(status, StatusCode::NOT_MODIFIED, "{uri}");
        assert!(body.is_empty(), "{uri}");
        assert_eq!(header(&h, "etag"), tag, "{uri}");
        assert_eq!(header(&h, "content-security-policy"), CSP, "{uri}");
        let (status, _, _) =
            call(&router, Method::GET, uri, &[("if-none-match", "\"other\"")]).await?;
        assert_eq!(status, StatusCode::OK, "{uri}");
    }
    for directive in [
        "default-src 'self'",
        "script-src 'self'",
        "frame-ancestors 'none'",
        "form-action 'none'",
    ] {
        assert!(CSP.contains(directive), "{directive}");
    }
    assert!(!CSP.contains("unsafe"), "no unsafe-inline, no unsafe-eval");

    // `/dashboard/` leads to the page; an unknown file is a problem.
    let (status, h, _) = call(&router, Method::GET, "/dashboard/", &[]).await?;
    assert_eq!(status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(header(&h, "location"), dashboard::PATH);
    let (status, h, body) = call(&router, Method::GET, "/dashboard/secrets.json", &[]).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(header(&h, "content-type").starts_with("application/problem+json"));
    assert!(String::from_utf8(body)?.contains("secrets.json"));
    let (status, h, _) = call(&router, Method::POST, dashboard::PATH, &[]).await?;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(header(&h, "allow").contains("GET"));

    // Everything with data still needs a token.
    for uri in [
        "/v1/nodes",
        "/v1/modules",
        "/v1/alerts",
        "/v1/rollouts",
        "/v1/events",
        "/v1/health",
    ] {
        let (status, h, _) = call(&router, Method::GET, uri, &[]).await?;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri}");
        assert_eq!(header(&h, "www-authenticate"), "Bearer", "{uri}");
    }
    let (status, _, _) = call(
        &router,
        Method::GET,
        "/v1/nodes",
        &[("authorization", &format!("Bearer {}", env.admin_token()))],
    )
    .await?;
    assert_eq!(status, StatusCode::OK, "a token opens /v1");

    // The dashboard is not part of the API's document.
    let (status, _, doc) = call(&router, Method::GET, DOCUMENT_PATH, &[]).await?;
    assert_eq!(status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_slice(&doc)?;
    let paths = doc["paths"]
        .as_object()
        .map(|p| p.keys().cloned().collect::<Vec<_>>());
    let paths = paths.unwrap_or_default();
    assert!(!paths.is_empty());
    assert!(
        paths.iter().all(|p| !p.starts_with("/dashboard")),
        "{paths:?}"
    );
    env.teardown().await
}
