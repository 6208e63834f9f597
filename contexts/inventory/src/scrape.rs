//! Prometheus' service discovery (issue 35): `GET /v1/prometheus/targets`
//! answers the HTTP SD format (`http_sd_configs`): a JSON array of target
//! groups, `{"targets": ["host:port"], "labels": {...}}`.
//!
//! The groups are the controller's own metrics endpoint (job
//! `mesh-controller`, when the controller told inventory where it serves
//! them), every node whose agent serves metrics (job `mesh-agent`, at the
//! node's scrape address: its metrics listener's own address, else its
//! advertised one), and every placed replica of a module whose spec has
//! `metrics: {port, path}` (job `mesh-module`, on its node's scrape host).
//! Labels come from inventory's own tables only: `node`, `hostname`,
//! `state`, the operator labels as `label_<key>` (a key's characters outside
//! `[a-zA-Z0-9_]` become `_`), and `module`/`replica` for a module's.
//!
//! Paging: Prometheus fetches one URL and reads no `next`, so a page holds
//! up to `max_page` (1000) nodes by default; a fleet larger than that names
//! one `http_sd_configs` entry per page (`?after=<node>`), and the answer's
//! `Link: <…?after=<node>>; rel="next"` header says where the next page
//! starts. The controller's own group is on the first page only.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::http::header::LINK;
use axum::response::{IntoResponse, Response};
use mesh_plumbing::api::Problem;
use mesh_plumbing::openapi::{BadRequest, Unprocessable};
use mesh_plumbing::page::{ListQuery, NoFilters, Page};
use mesh_protocol::{Hello, Labels};
use serde::Serialize;
use sqlx::types::Json as SqlJson;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::{Error, Inventory};

/// Where the controller serves its own metrics, as Prometheus reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerTarget {
    /// `host:port`.
    pub address: String,
    /// `http` or `https`.
    pub scheme: String,
}

/// One HTTP SD target group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TargetGroup {
    /// `host:port` of each target.
    pub targets: Vec<String>,
    /// The group's labels (`job`, `node`, `state`, `label_<key>`, and
    /// Prometheus' `__scheme__`/`__metrics_path__` where they differ from
    /// `http` and `/metrics`).
    #[schema(value_type = BTreeMap<String, String>)]
    pub labels: BTreeMap<String, String>,
}

/// The scrape host and metrics port a hello states: the listener's own
/// address when it names one, else the node's advertised address (its
/// overlay endpoint's host), else none.
pub(crate) fn scrape_address(hello: &Hello) -> (Option<String>, Option<i32>) {
    let listener: Option<SocketAddr> = hello.metrics.as_deref().and_then(|m| m.parse().ok());
    let advertised: Option<IpAddr> = hello
        .overlay
        .as_ref()
        .and_then(|o| o.endpoint.as_deref())
        .and_then(|e| e.parse::<SocketAddr>().ok())
        .map(|e| e.ip());
    let host = match listener {
        Some(l) if !l.ip().is_unspecified() => Some(l.ip()),
        _ => advertised,
    };
    (
        host.map(|ip| SocketAddr::new(ip, 0).ip().to_string()),
        listener.map(|l| i32::from(l.port())),
    )
}

/// Record where Prometheus scrapes the nodes of `hellos` (after their rows
/// exist): one statement; a hello older than the node's newest changes
/// nothing.
pub(crate) async fn record(
    tx: &mut sqlx::PgConnection,
    hellos: &[(&mesh_protocol::Envelope<mesh_protocol::Report>, &Hello)],
) -> Result<(), Error> {
    let mut ids = Vec::with_capacity(hellos.len());
    let mut hosts = Vec::with_capacity(hellos.len());
    let mut ports = Vec::with_capacity(hellos.len());
    let mut sent = Vec::with_capacity(hellos.len());
    for (env, hello) in hellos {
        let (host, port) = scrape_address(hello);
        ids.push(env.node.as_str().to_owned());
        hosts.push(host);
        ports.push(port);
        sent.push(crate::nodes::clamp(env.sent_at));
    }
    sqlx::query(
        "UPDATE inventory.nodes n SET scrape_host = u.host, metrics_port = u.port \
         FROM UNNEST($1::text[], $2::text[], $3::integer[], $4::timestamptz[]) \
              AS u(id, host, port, sent_at) \
         WHERE n.id = u.id AND n.hello_at <= u.sent_at",
    )
    .bind(ids)
    .bind(hosts)
    .bind(ports)
    .bind(sent)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// `host:port`, with an IPv6 host bracketed.
fn host_port(host: &str, port: i64) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A Prometheus label name for an operator label key: `label_<key>`, each
/// character outside `[a-zA-Z0-9_]` as `_`.
pub(crate) fn label_name(key: &str) -> String {
    let key: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("label_{key}")
}

impl Inventory {
    /// The target groups of the nodes after `after` (by id, at most `limit`
    /// nodes), and the last node's id when the page is full.
    pub async fn scrape_targets(
        &self,
        after: Option<&str>,
        limit: i64,
    ) -> Result<(Vec<TargetGroup>, Option<String>), Error> {
        type NodeRow = (
            String,
            String,
            String,
            SqlJson<Labels>,
            Option<String>,
            Option<i32>,
        );
        let after = after.map(str::to_owned);
        let nodes: Vec<NodeRow> = self
            .reads
            .lag_tolerant(|pool| {
                let after = after.clone();
                async move {
                    sqlx::query_as(
                        "SELECT id, hostname, CASE WHEN admin_state = 'revoked' THEN 'revoked' \
                         WHEN state = 'unreachable' THEN 'unreachable' \
                         WHEN admin_state IN ('draining', 'drained') THEN admin_state ELSE 'alive' END, \
                         operator_labels, scrape_host, metrics_port FROM inventory.nodes \
                         WHERE ($1::text IS NULL OR id > $1) ORDER BY id LIMIT $2",
                    )
                    .bind(after)
                    .bind(limit)
                    .fetch_all(&pool)
                    .await
                }
            })
            .await?;
        let next = mesh_plumbing::page::next(&nodes, limit, |n| n.0.clone());
        let ids: Vec<String> = nodes.iter().map(|n| n.0.clone()).collect();
        type ReplicaRow = (String, String, i32, SqlJson<crate::module::ModuleMetrics>);
        let replicas: Vec<ReplicaRow> = self
            .reads
            .lag_tolerant(|pool| {
                let ids = ids.clone();
                async move {
                    sqlx::query_as(
                        "SELECT a.node, a.module, a.replica, m.spec->'metrics' \
                         FROM inventory.assignments a JOIN inventory.modules m ON m.name = a.module \
                         WHERE a.node = ANY($1) AND a.role = 'active' \
                         AND jsonb_typeof(m.spec->'metrics') = 'object' \
                         ORDER BY a.node, a.module, a.replica",
                    )
                    .bind(ids)
                    .fetch_all(&pool)
                    .await
                }
            })
            .await?;

        let mut groups = Vec::new();
        if after.is_none()
            && let Some(c) = &self.settings.controller_metrics
        {
            let mut labels = BTreeMap::from([("job".to_owned(), "mesh-controller".to_owned())]);
            if c.scheme != "http" {
                labels.insert("__scheme__".to_owned(), c.scheme.clone());
            }
            groups.push(TargetGroup {
                targets: vec![c.address.clone()],
                labels,
            });
        }
        let mut hosts = BTreeMap::new();
        for (id, hostname, state, operator, host, port) in nodes {
            let mut labels: BTreeMap<String, String> = operator
                .0
                .iter()
                .map(|(k, v)| (label_name(k), v.clone()))
                .collect();
            labels.insert("node".to_owned(), id.clone());
            labels.insert("hostname".to_owned(), hostname);
            labels.insert("state".to_owned(), state);
            if let (Some(host), Some(port)) = (&host, port) {
                let mut agent = labels.clone();
                agent.insert("job".to_owned(), "mesh-agent".to_owned());
                groups.push(TargetGroup {
                    targets: vec![host_port(host, i64::from(port))],
                    labels: agent,
                });
            }
            if let Some(host) = host {
                hosts.insert(id, (host, labels));
            }
        }
        for (node, module, replica, metrics) in replicas {
            let Some((host, node_labels)) = hosts.get(&node) else {
                continue;
            };
            let mut labels = node_labels.clone();
            labels.insert("job".to_owned(), "mesh-module".to_owned());
            labels.insert("module".to_owned(), module);
            labels.insert("replica".to_owned(), replica.to_string());
            if metrics.0.path != "/metrics" {
                labels.insert("__metrics_path__".to_owned(), metrics.0.path.clone());
            }
            groups.push(TargetGroup {
                targets: vec![host_port(host, i64::from(metrics.0.port))],
                labels,
            });
        }
        Ok((groups, next))
    }
}

/// The discovery route, with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Inventory>> {
    OpenApiRouter::new().routes(routes!(prometheus_targets))
}

/// Prometheus' HTTP service discovery (`http_sd_configs`): the controller's
/// metrics endpoint, every agent's and every placed replica's of a module
/// that serves metrics, as target groups with the nodes' labels. Nodes by
/// id, a page at a time: `limit` defaults to and is cut to the inventory
/// settings' `max_page` (1000); `after` is a node's id; a full page has a
/// `Link: <...>; rel="next"` header (Prometheus reads one page: name one
/// `http_sd_configs` entry per page in a fleet larger than that).
#[utoipa::path(
    get,
    path = "/v1/prometheus/targets",
    params(Page),
    responses(
        (status = 200, description = "The target groups of a page of nodes", body = Vec<TargetGroup>),
        BadRequest,
        Unprocessable,
    )
)]
async fn prometheus_targets(
    State(inventory): State<Arc<Inventory>>,
    ListQuery(page, NoFilters {}): ListQuery<NoFilters>,
) -> Result<Response, Problem> {
    let max = inventory.settings.max_page;
    let limit = page.limit_capped(max, max)?;
    let (groups, next) = inventory
        .scrape_targets(page.after.as_deref(), limit)
        .await?;
    let mut response = Json(groups).into_response();
    if let Some(next) = next {
        // A node id is a URL's unreserved characters; any other is escaped.
        let after: String = next
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    char::from(b).to_string()
                }
                b => format!("%{b:02X}"),
            })
            .collect();
        let query = format!("after={after}&limit={limit}");
        if let Ok(link) =
            HeaderValue::from_str(&format!("</v1/prometheus/targets?{query}>; rel=\"next\""))
        {
            response.headers_mut().insert(LINK, link);
        }
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(metrics: Option<&str>, endpoint: Option<&str>) -> Hello {
        serde_json::from_value(serde_json::json!({
            "hostname": "h", "arch": "x86_64", "cpus": 1, "memory_bytes": 1,
            "labels": {}, "agent_version": "0", "applied": {},
            "metrics": metrics,
            "overlay": endpoint.map(|e| serde_json::json!({
                "public_key": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "endpoint": e
            })),
        }))
        .unwrap()
    }

    #[test]
    fn the_listener_address_else_the_advertised_one() {
        assert_eq!(
            scrape_address(&hello(Some("127.0.0.1:9464"), Some("10.0.0.5:51820"))),
            (Some("127.0.0.1".into()), Some(9464))
        );
        assert_eq!(
            scrape_address(&hello(Some("0.0.0.0:9464"), Some("10.0.0.5:51820"))),
            (Some("10.0.0.5".into()), Some(9464))
        );
        assert_eq!(
            scrape_address(&hello(Some("0.0.0.0:9464"), None)),
            (None, Some(9464))
        );
        assert_eq!(
            scrape_address(&hello(None, Some("10.0.0.5:51820"))),
            (Some("10.0.0.5".into()), None)
        );
        assert_eq!(host_port("::1", 9464), "[::1]:9464");
    }

    #[test]
    fn label_keys_become_prometheus_names() {
        assert_eq!(label_name("zone"), "label_zone");
        assert_eq!(label_name("mesh.io/role-x"), "label_mesh_io_role_x");
    }
}
