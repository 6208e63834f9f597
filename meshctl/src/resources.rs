//! `meshctl get <kind>`: every page of a list endpoint, as a table or as the
//! API's objects; `-l` label selectors where the kind has labels (nodes);
//! the filters of grants (`--module`, `--resource`, `--kind`, `--state`);
//! `label`, `drain` and `undrain` of a node.

use crate::client::{Api, Body, urlencode};
use crate::output::{self, Format, age, labels, s};
use anyhow::{Context as _, bail};
use chrono::Utc;
use clap::ValueEnum;
use reqwest::Method;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// What `get` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    #[value(alias = "node", alias = "no")]
    Nodes,
    #[value(alias = "module", alias = "mod")]
    Modules,
    #[value(alias = "file")]
    Files,
    #[value(alias = "setting", alias = "layers")]
    Settings,
    #[value(alias = "secret")]
    Secrets,
    #[value(alias = "alert")]
    Alerts,
    #[value(alias = "run")]
    Runs,
    #[value(alias = "token")]
    Tokens,
    #[value(alias = "grant")]
    Grants,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Nodes => "nodes",
            Kind::Modules => "modules",
            Kind::Files => "files",
            Kind::Settings => "settings",
            Kind::Secrets => "secrets",
            Kind::Alerts => "alerts",
            Kind::Runs => "runs",
            Kind::Tokens => "tokens",
            Kind::Grants => "grants",
        }
    }

    /// The list endpoint and the key of its items in the answer.
    fn endpoint(self) -> (&'static str, &'static str) {
        match self {
            Kind::Nodes => ("/v1/nodes", "nodes"),
            Kind::Modules => ("/v1/modules", "modules"),
            Kind::Files => ("/v1/files", "files"),
            Kind::Settings => ("/v1/settings", "layers"),
            Kind::Secrets => ("/v1/secrets", "secrets"),
            Kind::Alerts => ("/v1/alerts", "alerts"),
            Kind::Runs => ("/v1/runs", "runs"),
            Kind::Tokens => ("/v1/tokens", "tokens"),
            Kind::Grants => ("/v1/grants", "grants"),
        }
    }

    /// Whether a label selector means something for this kind: only nodes
    /// carry labels (files' and settings' selectors say which nodes they
    /// target, they are not labels of their own).
    pub fn has_labels(self) -> bool {
        matches!(self, Kind::Nodes)
    }

    /// Table headers; `wide` adds columns.
    fn headers(self, wide: bool) -> Vec<&'static str> {
        let (base, more): (&[&str], &[&str]) = match self {
            Kind::Nodes => (
                &["NAME", "STATE", "LAST SEEN", "LABELS"],
                &["HOSTNAME", "HEARTBEAT"],
            ),
            Kind::Modules => (
                &["NAME", "REPLICAS", "HEALTHY", "HEALTH", "PLACEMENT"],
                &["COMMAND", "STATEFUL", "REVISION", "ERROR"],
            ),
            Kind::Files => (
                &["NAME", "PATH", "MODE", "TARGET", "REVISION"],
                &["SIZE", "UPDATED"],
            ),
            Kind::Settings => (
                &["SCOPE", "NAME", "SELECTOR", "KEYS", "REVISION"],
                &["UPDATED"],
            ),
            Kind::Secrets => (&["NAME", "VERSION", "GRANTS", "UPDATED"], &["CREATED BY"]),
            Kind::Alerts => (
                &["SEVERITY", "KIND", "SUBJECT", "SINCE", "MESSAGE"],
                &["STATE", "ID"],
            ),
            Kind::Runs => (
                &["ID", "MODULE", "NODE", "STATE", "STEP", "UPDATED"],
                &["ROLLOUT", "REVISION", "LAST RECEIPT"],
            ),
            Kind::Tokens => (
                &["ID", "NAME", "ROLE", "CREATED", "EXPIRES", "REVOKED"],
                &["LAST USED", "CREATED BY", "ROTATED FROM"],
            ),
            Kind::Grants => (
                &[
                    "CONSUMER",
                    "REQUIREMENT",
                    "KIND",
                    "PROVIDER",
                    "STATE",
                    "AGE",
                ],
                &["RESOURCE", "USER", "VERSION", "ID", "REASON"],
            ),
        };
        let mut h = base.to_vec();
        if wide {
            h.extend_from_slice(more);
        }
        h
    }

    /// One item's cells, as [`Kind::headers`] orders them.
    pub fn row(self, v: &Value, wide: bool) -> Vec<String> {
        let now = Utc::now();
        let at = |k: &str| age(v.get(k).and_then(Value::as_str), now);
        let (mut base, more): (Vec<String>, Vec<String>) = match self {
            Kind::Nodes => (
                vec![
                    s(v, "id"),
                    s(v, "state"),
                    at("last_seen"),
                    labels(v.get("labels")),
                ],
                vec![
                    s(v, "hostname"),
                    v.get("heartbeat_interval_ms")
                        .and_then(Value::as_u64)
                        .map_or("-".to_owned(), output::millis),
                ],
            ),
            Kind::Modules => {
                let assigned = v
                    .get("assignments")
                    .and_then(Value::as_array)
                    .map_or(0, |a| a.iter().filter(|x| x["role"] == "active").count());
                let healthy = v["health"]["replicas"]
                    .as_array()
                    .map(|r| r.iter().filter(|x| x["health"] == "healthy").count());
                (
                    vec![
                        s(v, "name"),
                        format!("{assigned}/{}", s(v, "effective_replicas")),
                        healthy.map_or("-".to_owned(), |h| h.to_string()),
                        v["health"]
                            .get("health")
                            .and_then(Value::as_str)
                            .unwrap_or("-")
                            .to_owned(),
                        placement(v.get("placement")),
                    ],
                    vec![
                        s(&v["unit"], "command"),
                        s(v, "stateful"),
                        s(v, "revision"),
                        s(v, "placement_error"),
                    ],
                )
            }
            Kind::Files => (
                vec![
                    s(v, "name"),
                    s(v, "path"),
                    s(v, "mode"),
                    target(v),
                    s(v, "revision"),
                ],
                vec![s(v, "size"), at("updated_at")],
            ),
            Kind::Settings => (
                vec![
                    s(v, "scope"),
                    s(v, "name"),
                    labels(v.get("selector")),
                    v.get("values")
                        .and_then(Value::as_object)
                        .map_or(0, |m| m.len())
                        .to_string(),
                    s(v, "revision"),
                ],
                vec![at("updated_at")],
            ),
            Kind::Secrets => (
                vec![
                    s(v, "name"),
                    s(v, "version"),
                    v.get("grants")
                        .and_then(Value::as_array)
                        .map_or(0, Vec::len)
                        .to_string(),
                    at("updated_at"),
                ],
                vec![s(v, "created_by")],
            ),
            Kind::Alerts => (
                vec![
                    s(v, "severity"),
                    s(v, "kind"),
                    s(v, "subject"),
                    at("since"),
                    s(v, "message"),
                ],
                vec![s(v, "state"), s(v, "id")],
            ),
            Kind::Runs => (
                vec![
                    s(v, "id"),
                    s(v, "module"),
                    s(v, "node"),
                    s(v, "state"),
                    s(v, "step"),
                    at("updated_at"),
                ],
                vec![
                    s(v, "rollout"),
                    s(v, "revision"),
                    v.get("last_receipt")
                        .filter(|r| !r.is_null())
                        .map_or("-".to_owned(), |r| s(r, "kind")),
                ],
            ),
            Kind::Tokens => (
                vec![
                    s(v, "id"),
                    s(v, "name"),
                    s(v, "role"),
                    at("created_at"),
                    expires(v.get("expires_at").and_then(Value::as_str), now),
                    match v.get("revoked_at").and_then(Value::as_str) {
                        Some(t) => age(Some(t), now),
                        None => "-".to_owned(),
                    },
                ],
                vec![at("last_used_at"), s(v, "created_by"), s(v, "rotated_from")],
            ),
            Kind::Grants => (
                vec![
                    s(v, "consumer"),
                    s(v, "requirement"),
                    s(v, "kind"),
                    s(v, "provider"),
                    s(v, "state"),
                    at("created_at"),
                ],
                vec![
                    s(v, "resource"),
                    s(v, "user"),
                    s(v, "credential_version"),
                    s(v, "id"),
                    one_line(&s(v, "reason")),
                ],
            ),
        };
        if wide {
            base.extend(more);
        }
        base
    }
}

/// Free text (a server's refusal, say) on one line, for a table cell.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A module's placement in a few words.
fn placement(p: Option<&Value>) -> String {
    let Some(p) = p else { return "-".into() };
    if let Some(e) = p.get("exact_node") {
        return format!("node {}", s(e, "node"));
    }
    if let Some(m) = p.get("match_labels") {
        return format!("labels {}", labels(m.get("labels")));
    }
    if p.get("controller_node").is_some() {
        return "controller node".into();
    }
    p.to_string()
}

/// A file's or a layer's target: `node/<id>` or its selector.
fn target(v: &Value) -> String {
    match v.get("node").and_then(Value::as_str) {
        Some(n) => format!("node/{n}"),
        None => match labels(v.get("selector")).as_str() {
            "-" => "every node".to_owned(),
            sel => sel.to_owned(),
        },
    }
}

/// Parses `-l key=value[,key=value]` (also given several times) into the
/// pairs every item must have; an empty key, a pair without `=` or a key
/// given twice with two values is an error naming it.
pub fn parse_selector(args: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for arg in args {
        for pair in arg.split(',') {
            let Some((k, v)) = pair.split_once('=') else {
                bail!("-l `{pair}`: a selector is key=value pairs joined by commas");
            };
            if k.is_empty() {
                bail!("-l `{pair}`: the key is empty");
            }
            if let Some(old) = out.insert(k.to_owned(), v.to_owned())
                && old != v
            {
                bail!("-l: key `{k}` is given twice, as `{old}` and `{v}`");
            }
        }
    }
    Ok(out)
}

/// The `selector` query parameter of a parsed selector.
pub fn selector_query(selector: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    urlencode(&pairs.join(","))
}

/// Every item of `kind` (following `next` over every page), with `query`
/// (`k=v` pairs, already encoded) on each request; the first page's answer
/// too (the nodes list carries the fleet's heartbeat budget).
pub async fn list(api: &Api, kind: Kind, query: &[String]) -> anyhow::Result<(Vec<Value>, Value)> {
    let (path, key) = kind.endpoint();
    let mut items = Vec::new();
    let mut after: Option<String> = None;
    let mut first = Value::Null;
    // A bound on pages: a server that kept answering the same `next` would
    // otherwise loop forever.
    for _ in 0..100_000 {
        let mut q = query.to_vec();
        if let Some(a) = &after {
            q.push(format!("after={}", urlencode(a)));
        }
        let url = if q.is_empty() {
            path.to_owned()
        } else {
            format!("{path}?{}", q.join("&"))
        };
        let mut page = api.call(Method::GET, &url, None).await?;
        let got = page
            .get_mut(key)
            .and_then(Value::as_array_mut)
            .map(std::mem::take)
            .with_context(|| format!("GET {url}: no `{key}` list in the answer"))?;
        items.extend(got);
        let next = page.get("next").and_then(|n| match n {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        });
        if first.is_null() {
            first = page;
        }
        match next {
            Some(n) if Some(&n) != after.as_ref() => after = Some(n),
            _ => return Ok((items, first)),
        }
    }
    bail!("GET {path}: more than 100000 pages")
}

/// `get grants`' filters, sent as the API's query parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct GrantFilters {
    /// Grants: only those whose consumer or provider is this module.
    #[arg(long, help_heading = "Grant filters")]
    pub module: Option<String>,
    /// Grants: only those of this resource (its name on the provider's
    /// server, e.g. app-db).
    #[arg(long, help_heading = "Grant filters")]
    pub resource: Option<String>,
    /// Grants: only those of this kind (postgres.database, amqp.vhost,
    /// s3.bucket).
    #[arg(
        long = "kind",
        id = "grant_kind",
        value_name = "KIND",
        help_heading = "Grant filters"
    )]
    pub kind: Option<String>,
    /// Grants: only those in this state (requested, provisioning, ready,
    /// failed, revoked).
    #[arg(long, help_heading = "Grant filters")]
    pub state: Option<String>,
}

impl GrantFilters {
    /// The filters given, as (flag, API parameter, value).
    fn given(&self) -> Vec<(&'static str, &'static str, &str)> {
        [
            ("--module", "module", &self.module),
            ("--resource", "resource", &self.resource),
            ("--kind", "kind", &self.kind),
            ("--state", "state", &self.state),
        ]
        .into_iter()
        .filter_map(|(flag, param, v)| v.as_deref().map(|v| (flag, param, v)))
        .collect()
    }
}

/// The query parameters (`k=v`, encoded) of `meshctl get <kind>` with these
/// flags; a flag the kind has no use for is refused, naming it.
pub fn get_query(
    kind: Kind,
    selector: &[String],
    all: bool,
    filters: &GrantFilters,
) -> anyhow::Result<Vec<String>> {
    let mut query = Vec::new();
    if !selector.is_empty() {
        if !kind.has_labels() {
            bail!(
                "-l: {} have no labels to select on (label selectors apply to nodes)",
                kind.name()
            );
        }
        query.push(format!(
            "selector={}",
            selector_query(&parse_selector(selector)?)
        ));
    }
    if all {
        match kind {
            Kind::Alerts => query.push("state=all".to_owned()),
            _ => bail!("--all: only alerts have a state to widen (open by default)"),
        }
    }
    for (flag, param, value) in filters.given() {
        if kind != Kind::Grants {
            bail!(
                "{flag}: only grants are filtered by {param} (not {})",
                kind.name()
            );
        }
        if value.is_empty() {
            bail!("{flag}: the value is empty");
        }
        query.push(format!("{param}={}", urlencode(value)));
    }
    Ok(query)
}

/// `meshctl get`.
pub async fn get(
    api: &Api,
    kind: Kind,
    selector: &[String],
    all: bool,
    filters: &GrantFilters,
    format: Option<Format>,
) -> anyhow::Result<()> {
    let query = get_query(kind, selector, all, filters)?;
    let (items, _) = list(api, kind, &query).await?;
    print!("{}", render(kind, &items, format)?);
    Ok(())
}

/// A list in `format` (a table when none).
pub fn render(kind: Kind, items: &[Value], format: Option<Format>) -> anyhow::Result<String> {
    match format {
        Some(f @ (Format::Json | Format::Yaml)) => output::encode(f, &Value::Array(items.to_vec())),
        other => {
            let wide = other == Some(Format::Wide);
            let rows: Vec<Vec<String>> = items.iter().map(|v| kind.row(v, wide)).collect();
            Ok(output::table(&kind.headers(wide), &rows))
        }
    }
}

/// Parses `label` arguments: `key=value` sets, `key-` removes.
pub fn parse_label_changes(
    args: &[String],
) -> anyhow::Result<(BTreeMap<String, String>, Vec<String>)> {
    let mut set = BTreeMap::new();
    let mut remove = Vec::new();
    for arg in args {
        if let Some((k, v)) = arg.split_once('=') {
            if k.is_empty() {
                bail!("`{arg}`: the key is empty");
            }
            set.insert(k.to_owned(), v.to_owned());
        } else if let Some(k) = arg.strip_suffix('-').filter(|k| !k.is_empty()) {
            remove.push(k.to_owned());
        } else {
            bail!("`{arg}`: give key=value to set a label or key- to remove it");
        }
    }
    if let Some(k) = remove.iter().find(|k| set.contains_key(*k)) {
        bail!("`{k}` is both set and removed");
    }
    Ok((set, remove))
}

/// `meshctl label <node> k=v… k-…`: the node's operator labels read with
/// their ETag, changed, and written back with `If-Match` (a concurrent
/// change fails with 412 rather than being overwritten).
pub async fn label(api: &Api, node: &str, changes: &[String]) -> anyhow::Result<()> {
    let (set, remove) = parse_label_changes(changes)?;
    let path = format!("/v1/nodes/{}/labels", urlencode(node));
    let (_, headers, current) = api.send_with(Method::GET, &path, Body::None, &[]).await?;
    let etag = match headers
        .get(reqwest::header::ETAG)
        .and_then(|e| e.to_str().ok())
    {
        Some(e) => e.to_owned(),
        None => format!("\"{}\"", s(&current, "revision")),
    };
    let mut operator: BTreeMap<String, String> =
        serde_json::from_value(current["labels"]["operator"].clone()).unwrap_or_default();
    for k in &remove {
        if operator.remove(k).is_none() {
            eprintln!("meshctl: {node} has no operator label `{k}` (nothing removed)");
        }
    }
    operator.extend(set);
    let (_, _, now) = api
        .send_with(
            Method::PUT,
            &path,
            Body::Json(json!({ "labels": operator })),
            &[("If-Match", &etag)],
        )
        .await?;
    println!(
        "{node} labeled: {} (revision {})",
        labels(now["labels"].get("effective")),
        s(&now, "revision")
    );
    Ok(())
}

/// `meshctl drain|undrain <node>`.
pub async fn drain(api: &Api, node: &str, drain: bool) -> anyhow::Result<()> {
    let verb = if drain { "drain" } else { "undrain" };
    let v = api
        .call(
            Method::POST,
            &format!("/v1/nodes/{}/{verb}", urlencode(node)),
            None,
        )
        .await?;
    let state = v
        .get("admin_state")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| v.to_string());
    println!("{node}: {state}");
    if let Some(b) = v.get("drain_blocked").and_then(Value::as_str) {
        println!("  blocked: {b}");
    }
    Ok(())
}

/// When a token ends, from `now`: `in 89d`, or `expired 2h ago`.
fn expires(at: Option<&str>, now: chrono::DateTime<chrono::Utc>) -> String {
    let Some(at) = at.and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok()) else {
        return "-".to_owned();
    };
    let secs = (at.with_timezone(&chrono::Utc) - now).num_seconds();
    if secs > 0 {
        format!("in {}", crate::output::duration(secs))
    } else {
        format!("expired {} ago", crate::output::duration(-secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn selectors_parse_and_encode() {
        let sel = parse_selector(&args(&["role=web,zone=eu", "tier=1"])).unwrap();
        assert_eq!(sel.len(), 3);
        assert_eq!(selector_query(&sel), "role%3Dweb%2Ctier%3D1%2Czone%3Deu");
        assert_eq!(parse_selector(&args(&["a=b=c"])).unwrap()["a"], "b=c");
        assert_eq!(parse_selector(&args(&["a=1", "a=1"])).unwrap().len(), 1);
        for bad in ["role", "=web", "a=1,a=2", "role=web,"] {
            assert!(parse_selector(&args(&[bad])).is_err(), "{bad}");
        }
    }

    #[test]
    fn label_changes() {
        let (set, remove) = parse_label_changes(&args(&["role=web", "zone-", "x="])).unwrap();
        assert_eq!(set.len(), 2);
        assert_eq!(set["x"], "");
        assert_eq!(remove, vec!["zone"]);
        for bad in [&["role"][..], &["-"], &["=v"], &["a=1", "a-"]] {
            assert!(parse_label_changes(&args(bad)).is_err(), "{bad:?}");
        }
    }

    fn filters(module: &str, resource: &str, kind: &str, state: &str) -> GrantFilters {
        let o = |v: &str| (!v.is_empty()).then(|| v.to_owned());
        GrantFilters {
            module: o(module),
            resource: o(resource),
            kind: o(kind),
            state: o(state),
        }
    }

    #[test]
    fn grant_filters_are_the_apis_query_parameters() {
        let none = GrantFilters::default();
        assert!(
            get_query(Kind::Grants, &[], false, &none)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            get_query(
                Kind::Grants,
                &[],
                false,
                &filters("app", "app-db", "postgres.database", "ready")
            )
            .unwrap(),
            [
                "module=app",
                "resource=app-db",
                "kind=postgres.database",
                "state=ready"
            ]
        );
        // Encoded: a value cannot add a parameter of its own.
        assert_eq!(
            get_query(Kind::Grants, &[], false, &filters("a&b=c d", "", "", "")).unwrap(),
            ["module=a%26b%3Dc%20d"]
        );
        assert_eq!(
            get_query(Kind::Grants, &[], false, &filters("", "", "", "failed")).unwrap(),
            ["state=failed"]
        );
        let empty = GrantFilters {
            state: Some(String::new()),
            ..GrantFilters::default()
        };
        let e = get_query(Kind::Grants, &[], false, &empty).unwrap_err();
        assert_eq!(e.to_string(), "--state: the value is empty");
        // Other kinds have no such filters: refused naming the flag.
        for (f, flag) in [
            (filters("web", "", "", ""), "--module"),
            (filters("", "x", "", ""), "--resource"),
            (filters("", "", "amqp.vhost", ""), "--kind"),
            (filters("", "", "", "ready"), "--state"),
        ] {
            let e = get_query(Kind::Runs, &[], false, &f)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(flag) && e.contains("runs"), "{e}");
        }
    }

    #[test]
    fn label_selectors_are_refused_for_grants_as_for_every_kind_but_nodes() {
        let sel = args(&["role=web"]);
        let e = get_query(Kind::Grants, &sel, false, &GrantFilters::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "-l: grants have no labels to select on (label selectors apply to nodes)"
        );
        for kind in Kind::value_variants() {
            let got = get_query(*kind, &sel, false, &GrantFilters::default());
            assert_eq!(got.is_ok(), kind.has_labels(), "{kind:?}");
        }
        assert_eq!(
            get_query(Kind::Nodes, &sel, false, &GrantFilters::default()).unwrap(),
            ["selector=role%3Dweb"]
        );
        assert!(get_query(Kind::Grants, &[], true, &GrantFilters::default()).is_err());
        assert_eq!(
            get_query(Kind::Alerts, &[], true, &GrantFilters::default()).unwrap(),
            ["state=all"]
        );
    }

    #[test]
    fn the_grants_table() {
        let ready = json!({
            "id": "0193a1b2-0000-7000-8000-000000000001", "consumer": "app", "requirement": "db",
            "kind": "postgres.database", "provider": "pg", "resource": "app-db", "user": "app-db",
            "options": {"encoding": "UTF8"}, "delete": false, "state": "ready", "reason": null,
            "credential_version": 1, "credential_file": "/modules/app/secrets/grant-db.env",
            "consumer_nodes": ["node-a"], "provider_nodes": [], "created_at": "2000-01-01T00:00:00Z",
            "updated_at": "2000-01-01T00:00:00Z", "revoked_at": null, "retain_until": null,
            "a_field_of_a_later_version": {"x": 1}});
        // Only what an older API sends: missing optional fields are `-`.
        let waiting = json!({"id": "0193a1b2-0000-7000-8000-000000000002", "consumer": "web",
            "requirement": "queue", "kind": "amqp.vhost", "state": "requested",
            "reason": "no module provides\namqp.vhost"});
        let items = vec![ready.clone(), waiting];
        let t = render(Kind::Grants, &items, None).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "CONSUMER   REQUIREMENT   KIND                PROVIDER   STATE       AGE"
        );
        assert!(
            lines[1].starts_with(
                "app        db            postgres.database   pg         ready       "
            ),
            "{t}"
        );
        assert!(lines[1].ends_with('d'), "an age in days: {t}");
        assert_eq!(
            lines[2],
            "web        queue         amqp.vhost          -          requested   -"
        );
        let w = render(Kind::Grants, &items, Some(Format::Wide)).unwrap();
        let lines: Vec<&str> = w.lines().collect();
        assert!(
            lines[0].ends_with(
                "   RESOURCE   USER     VERSION   ID                                     REASON"
            ),
            "{w}"
        );
        assert!(
            lines[1].ends_with(
                "app-db     app-db   1         0193a1b2-0000-7000-8000-000000000001   -"
            ),
            "{w}"
        );
        assert!(
            lines[2].ends_with("-          -        -         0193a1b2-0000-7000-8000-000000000002   no module provides amqp.vhost"),
            "the reason on one line: {w}"
        );
        // The machine formats are the API's objects, unknown fields kept.
        let j = render(Kind::Grants, &items, Some(Format::Json)).unwrap();
        let back: Value = serde_json::from_str(&j).unwrap();
        assert_eq!(back, Value::Array(items.clone()));
        assert_eq!(back[0]["a_field_of_a_later_version"]["x"], 1);
        let y = render(Kind::Grants, &items, Some(Format::Yaml)).unwrap();
        assert_eq!(
            serde_norway::from_str::<Value>(&y).unwrap(),
            Value::Array(items)
        );
        assert_eq!(
            render(Kind::Grants, &[], Some(Format::Json)).unwrap(),
            "[]\n"
        );
    }

    #[test]
    fn tables_of_each_kind() {
        let nodes = vec![json!({"id": "web-1", "hostname": "h1", "state": "alive",
            "labels": {"role": "web"}, "last_seen": "2000-01-01T00:00:00Z", "heartbeat_interval_ms": 1500})];
        let t = render(Kind::Nodes, &nodes, None).unwrap();
        assert!(t.starts_with("NAME    STATE   LAST SEEN   LABELS\n"), "{t}");
        assert!(
            t.contains("web-1   alive   ") && t.contains("role=web"),
            "{t}"
        );
        let w = render(Kind::Nodes, &nodes, Some(Format::Wide)).unwrap();
        assert!(
            w.contains("HOSTNAME") && w.contains("h1") && w.contains("1.5s"),
            "{w}"
        );
        let j = render(Kind::Nodes, &nodes, Some(Format::Json)).unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&j).unwrap(),
            Value::Array(nodes)
        );

        let module = json!({"name": "web", "effective_replicas": 2,
            "placement": {"match_labels": {"labels": {"role": "web"}, "replicas": 2}},
            "assignments": [{"role": "active"}, {"role": "active"}, {"role": "retiring"}],
            "health": {"health": "degraded", "replicas": [{"health": "healthy"}, {"health": "unhealthy"}]},
            "unit": {"command": "/bin/web"}});
        assert_eq!(
            Kind::Modules.row(&module, false),
            vec!["web", "2/2", "1", "degraded", "labels role=web"]
        );
        let file = json!({"name": "motd", "path": "/etc/motd", "mode": "0644", "selector": {}, "revision": 3});
        assert_eq!(Kind::Files.row(&file, false)[3], "every node");
        let file = json!({"name": "motd", "path": "/etc/motd", "mode": "0644", "node": "web-1", "revision": 3});
        assert_eq!(Kind::Files.row(&file, false)[3], "node/web-1");
        for kind in Kind::value_variants() {
            let h = kind.headers(true).len();
            assert_eq!(kind.row(&json!({}), true).len(), h, "{kind:?}");
            assert_eq!(
                kind.row(&json!({}), false).len(),
                kind.headers(false).len(),
                "{kind:?}"
            );
        }
    }
}
