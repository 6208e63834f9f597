//! The operator dashboard (docs/decisions/0035): a read-only page served from
//! files embedded in this binary, at [`PATH`].
//!
//! The files are hand-written HTML, CSS and ES modules (`controller/dashboard/`),
//! compiled in with `include_str!`: no CDN, no Node build, nothing fetched from
//! elsewhere. They hold no data, so they need no token; the page asks the
//! operator for an API token, keeps it in `sessionStorage` only and sends it as
//! a bearer token with every `/v1` call, so the dashboard can see exactly what
//! the token may see and nothing more. Every answer carrying data stays behind
//! the auth layer (auth.rs); these routes are outside it and outside the
//! OpenAPI document of `/v1` (decision 0019).
//!
//! Every file is served with a strict Content-Security-Policy ([`CSP`]: only
//! this origin, no inline script or style, no framing, no form submission,
//! Trusted Types so no string can become markup), `X-Content-Type-Options:
//! nosniff`, its exact content type, `Referrer-Policy: no-referrer` and
//! `Cache-Control: no-cache` with a strong ETag (the hash of the embedded
//! bytes, answered 304 on `If-None-Match`): a browser revalidates and never
//! runs a stale page against a newer controller.
//!
//! Architecture Invariant: the dashboard holds no data and no credential
//! beyond the browser session; it reads the API as any client does.

use axum::Router;
use axum::extract::Path;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, ETAG, IF_NONE_MATCH, REFERRER_POLICY,
    X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use mesh_plumbing::api::Problem;

/// Where the page is served.
pub const PATH: &str = "/dashboard";

/// Every route pattern this module serves (none of them under `/v1`, none in
/// the OpenAPI document).
pub const ROUTES: [&str; 3] = [PATH, "/dashboard/", "/dashboard/{file}"];

/// The policy of every dashboard file: scripts, styles, images and API calls
/// from this origin only; no inline script or style (the page has none), no
/// plugin, no `<base>`, no form submission (the token field is read by script,
/// never submitted), never framed; DOM sinks take no strings (the page builds
/// its nodes with `textContent`).
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'; require-trusted-types-for 'script'";

/// One embedded file: its name under [`PATH`], content type and bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

const INDEX: Asset = Asset {
    name: "index.html",
    content_type: "text/html; charset=utf-8",
    body: include_str!("../dashboard/index.html"),
};

const ASSETS: [Asset; 6] = [
    INDEX,
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../dashboard/style.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../dashboard/app.js"),
    },
    Asset {
        name: "sse.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../dashboard/sse.js"),
    },
    Asset {
        name: "view.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../dashboard/view.js"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        body: include_str!("../dashboard/favicon.svg"),
    },
];

/// The dashboard's routes: the page at [`PATH`] (`/dashboard/` redirects
/// there), its files at `/dashboard/<file>`; an unknown file is a
/// problem+json 404. No state, no token.
pub fn router() -> Router {
    Router::new()
        .route(
            PATH,
            get(|headers: HeaderMap| async move { serve(&INDEX, &headers) }),
        )
        .route("/dashboard/", get(|| async { Redirect::permanent(PATH) }))
        .route("/dashboard/{file}", get(file))
}

async fn file(Path(name): Path<String>, headers: HeaderMap) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(asset) => serve(asset, &headers),
        None => Problem::not_found(format!(
            "no dashboard file `{}`",
            name.chars().take(64).collect::<String>()
        ))
        .into_response(),
    }
}

/// A strong ETag of `body`: FNV-1a, 64 bits, of the embedded bytes (they
/// change only with the binary).
fn etag(body: &str) -> String {
    let hash = body.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("\"{hash:016x}\"")
}

fn serve(asset: &Asset, headers: &HeaderMap) -> Response {
    let tag = etag(asset.body);
    let fresh = headers
        .get(IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag || t.trim() == "*"));
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(CONTENT_TYPE, asset.content_type)], asset.body).into_response()
    };
    let h = response.headers_mut();
    if let Ok(tag) = HeaderValue::from_str(&tag) {
        h.insert(ETAG, tag);
    }
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        HeaderName::from_static("cross-origin-resource-policy"),
        HeaderValue::from_static("same-origin"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_has_a_distinct_name_and_a_stable_tag() {
        for (i, a) in ASSETS.iter().enumerate() {
            assert!(ASSETS[..i].iter().all(|b| b.name != a.name), "{}", a.name);
            assert!(
                ASSETS[..i].iter().all(|b| etag(b.body) != etag(a.body)),
                "{}",
                a.name
            );
            assert!(!a.body.is_empty(), "{}", a.name);
        }
        // Stable: FNV-1a's published 64-bit test vectors, so a tag depends on
        // the body alone (not on the build, the process or a random seed) and
        // a browser's cached copy stays valid across controller restarts.
        assert_eq!(etag(""), "\"cbf29ce484222325\"");
        assert_eq!(etag("a"), "\"af63dc4c8601ec8c\"");
        assert_eq!(etag("foobar"), "\"85944171f73967e8\"");
        assert_ne!(etag("a"), etag("b"));
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let html = INDEX.body;
        assert!(!html.contains("<script>"), "inline script");
        assert!(!html.contains("style="), "inline style");
        assert!(!html.contains("<style"), "inline style");
        assert!(!html.contains("http://") && !html.contains("https://"));
        for a in &ASSETS {
            assert!(!a.body.contains("localStorage"), "{}", a.name);
            assert!(!a.body.contains("document.cookie"), "{}", a.name);
            assert!(!a.body.contains("innerHTML"), "{}", a.name);
        }
    }
}
