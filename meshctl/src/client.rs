//! The HTTP side of `meshctl`: the verified client, one call per request, and
//! the API's `application/problem+json` errors turned into readable ones.

use anyhow::{Context as _, bail};
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// What a request carries.
pub enum Body {
    None,
    Json(Value),
    /// Raw bytes, sent as `application/octet-stream`.
    Bytes(Vec<u8>),
}

/// An API error: its problem (`{type,title,status,detail,field?}`) or, when
/// the answer was not one, the status and what came back.
#[derive(Debug)]
pub struct ApiError {
    pub method: Method,
    pub path: String,
    pub status: StatusCode,
    pub title: Option<String>,
    pub detail: Option<String>,
    pub field: Option<String>,
}

impl ApiError {
    /// The error for a failed answer with `body` (a problem or anything else).
    pub fn from_answer(method: Method, path: &str, status: StatusCode, body: &[u8]) -> Self {
        let problem: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let text = |k: &str| problem.get(k).and_then(Value::as_str).map(str::to_owned);
        let mut detail = text("detail");
        if problem.is_null() && !body.is_empty() {
            // Not JSON (a proxy's page, say): a short, one-line excerpt.
            let raw = String::from_utf8_lossy(body);
            let one_line: String = raw.split_whitespace().collect::<Vec<_>>().join(" ");
            detail = Some(one_line.chars().take(200).collect());
        }
        ApiError {
            method,
            path: path.to_owned(),
            status,
            title: text("title"),
            detail,
            field: match problem.get("field") {
                None | Some(Value::Null) => None,
                Some(Value::String(f)) => Some(f.clone()),
                Some(other) => Some(other.to_string()),
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.method, self.path, self.status.as_u16())?;
        match &self.title {
            Some(t) => write!(f, " {t}")?,
            None => write!(f, " {}", self.status.canonical_reason().unwrap_or(""))?,
        }
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        if let Some(field) = &self.field {
            write!(f, " (field: {field})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

pub struct Api {
    http: reqwest::Client,
    /// For streams (`GET /v1/events`): no total timeout, a read timeout
    /// longer than the server's keep-alive comments instead.
    stream_http: reqwest::Client,
    pub base: String,
    token: Option<String>,
}

/// How long a stream may stay silent before it is taken as lost (the
/// server sends a keep-alive comment every 15 s).
const STREAM_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(45);

impl Api {
    pub fn new(api: &str, ca: &std::path::Path, token: Option<String>) -> anyhow::Result<Self> {
        let base =
            || reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(10));
        Ok(Api {
            http: client(api, ca, base().timeout(std::time::Duration::from_secs(30)))?,
            stream_http: client(api, ca, base().read_timeout(STREAM_READ_TIMEOUT))?,
            base: api.trim_end_matches('/').to_owned(),
            token,
        })
    }

    /// One request; the answer's JSON (`null` when it had none, as a 204).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let body = match body {
            Some(v) => Body::Json(v),
            None => Body::None,
        };
        Ok(self.send(method, path, body).await?.1)
    }

    /// One request; the success status too (201 created, 200 already there).
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Body,
    ) -> anyhow::Result<(StatusCode, Value)> {
        let (status, _, value) = self.send_with(method, path, body, &[]).await?;
        Ok((status, value))
    }

    /// One request with extra `headers` (`If-Match`, say); the success
    /// status, the answer's headers and its JSON.
    pub async fn send_with(
        &self,
        method: Method,
        path: &str,
        body: Body,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(StatusCode, reqwest::header::HeaderMap, Value)> {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req = match body {
            Body::None => req,
            Body::Json(v) => req.json(&v),
            // An upload takes as long as its size needs, not the usual 30 s.
            Body::Bytes(b) => req
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .timeout(std::time::Duration::from_secs(600))
                .body(b),
        };
        let resp = req
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("{method} {path}: {}", chain(&e.without_url())))?;
        let status = resp.status();
        let answer_headers = resp.headers().clone();
        let bytes = resp.bytes().await.map_err(|e| {
            anyhow::anyhow!("{method} {path}: reading the answer: {}", e.without_url())
        })?;
        if !status.is_success() {
            return Err(ApiError::from_answer(method, path, status, &bytes).into());
        }
        if bytes.is_empty() {
            return Ok((status, answer_headers, Value::Null));
        }
        let value = serde_json::from_slice(&bytes)
            .with_context(|| format!("{method} {path}: {status}: the answer is not JSON"))?;
        Ok((status, answer_headers, value))
    }

    /// Opens a server-sent events stream at `path`, resuming after
    /// `last_event_id` when given. A refused or failed answer is
    /// [`StreamError::Api`]; a transport failure [`StreamError::Transport`].
    pub async fn open_stream(
        &self,
        path: &str,
        last_event_id: Option<&str>,
    ) -> Result<reqwest::Response, StreamError> {
        let mut req = self
            .stream_http
            .get(format!("{}{path}", self.base))
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id);
        }
        let resp = req.send().await.map_err(|e| {
            StreamError::Transport(format!("GET {path}: {}", chain(&e.without_url())))
        })?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(StreamError::Api(ApiError::from_answer(
                Method::GET,
                path,
                status,
                &bytes,
            )));
        }
        Ok(resp)
    }
}

/// Why a stream could not be opened.
#[derive(Debug)]
pub enum StreamError {
    /// The API answered, with an error.
    Api(ApiError),
    /// No answer: refused, reset, timed out (worth retrying).
    Transport(String),
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Api(e) => e.fmt(f),
            StreamError::Transport(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for StreamError {}

/// A conditional request's answer: status, ETag and JSON (`null` when none).
pub struct Answer {
    pub status: StatusCode,
    pub etag: Option<String>,
    pub value: Value,
}

impl Api {
    /// One JSON request with extra headers (`If-Match`, `If-None-Match`): the
    /// answer with its ETag; a failed answer is an [`ApiError`] (its status
    /// tells a 404 or a 412 apart).
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Answer> {
        let body = body.map_or(Body::None, |v| Body::Json(v.clone()));
        let (status, answer_headers, value) = self.send_with(method, path, body, headers).await?;
        let etag = answer_headers
            .get(reqwest::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Ok(Answer {
            status,
            etag,
            value,
        })
    }
}

impl Api {
    /// One GET whose error answers are wanted too (a problem that carries
    /// data, as the logs route's 504): the status and the body's bytes.
    pub async fn get_any(&self, path: &str) -> anyhow::Result<(StatusCode, Vec<u8>)> {
        let mut req = self.http.get(format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("GET {path}: {}", chain(&e.without_url())))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| anyhow::anyhow!("GET {path}: reading the answer: {}", e.without_url()))?;
        Ok((status, bytes.to_vec()))
    }
}

/// An error and its causes on one line (reqwest's own says only "error
/// sending request"; the cause tells refused, timed out, certificate…).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The HTTP client for `api`: an https:// API verified against the CA in
/// `ca` alone; plain http:// only to a loopback host.
fn client(
    api: &str,
    ca: &std::path::Path,
    builder: reqwest::ClientBuilder,
) -> anyhow::Result<reqwest::Client> {
    let url = reqwest::Url::parse(api).with_context(|| format!("--api `{api}` is not a URL"))?;
    match url.scheme() {
        "https" => {
            let pem = std::fs::read(ca).with_context(|| {
                format!(
                    "reading the mesh CA {} (--ca / MESH_CA) to verify {api}",
                    ca.display()
                )
            })?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .with_context(|| format!("{} is not a PEM certificate", ca.display()))?;
            Ok(builder
                .use_rustls_tls()
                .tls_built_in_root_certs(false)
                .add_root_certificate(cert)
                .https_only(true)
                .build()?)
        }
        "http" => {
            let host = url.host_str().unwrap_or_default();
            let loopback = host == "localhost"
                || host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                bail!(
                    "--api `{api}`: plain http:// would send your token in cleartext; it is for a loopback API only (use the controller's https:// URL and --ca)"
                );
            }
            Ok(builder.build()?)
        }
        other => bail!("--api `{api}`: scheme `{other}` is neither https nor http"),
    }
}

/// Percent-encodes `s` for a URL's path segment or query value.
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_prints_title_detail_and_field() {
        let body = br#"{"type":"about:blank","title":"Conflict","status":409,"detail":"frozen: release week","field":"module"}"#;
        let e = ApiError::from_answer(Method::POST, "/v1/rollouts", StatusCode::CONFLICT, body);
        assert_eq!(
            e.to_string(),
            "POST /v1/rollouts: 409 Conflict: frozen: release week (field: module)"
        );
    }

    #[test]
    fn a_non_json_error_keeps_the_status_and_an_excerpt() {
        let e = ApiError::from_answer(
            Method::GET,
            "/v1/x",
            StatusCode::BAD_GATEWAY,
            b"<html>\n bad gateway </html>",
        );
        assert_eq!(
            e.to_string(),
            "GET /v1/x: 502 Bad Gateway: <html> bad gateway </html>"
        );
    }
}
