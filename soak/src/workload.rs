//! The workload: operators' requests through the public HTTP API, as the
//! schedule says, one at a time, each recorded (invoked, answered) in the
//! history with the `x-request-id` it was sent with (the audit entry carries
//! it). Files and settings layers for label selectors, secrets rotated (and
//! granted to `m0`, whose nodes get them), modules with an exec probe scaled
//! up and down, nodes drained and undrained, a freeze set and lifted.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::history::{Event, History, excerpt, hash};
use crate::schedule::{MODULES, Op, OpKind, ROLES, SECRETS};

/// What the workload needs of the mesh: the API, an admin token, the nodes.
#[derive(Clone)]
pub struct Client {
    pub api: String,
    pub token: String,
    pub http: reqwest::Client,
    /// Node id of each agent index.
    pub nodes: Vec<String>,
}

/// The answer to one request: its status (None: no answer).
pub struct Answer {
    pub status: Option<u16>,
    pub body: Value,
}

impl Client {
    pub fn new(api: &str, token: &str, nodes: Vec<String>) -> anyhow::Result<Client> {
        Ok(Client {
            api: api.to_owned(),
            token: token.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            nodes,
        })
    }

    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        request_id: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> Answer {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.api))
            .bearer_auth(&self.token)
            .header("x-request-id", request_id);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        if let Some(b) = body {
            r = r.json(b);
        }
        match r.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let text = resp.text().await.unwrap_or_default();
                Answer {
                    status: Some(status),
                    body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
                }
            }
            Err(e) => Answer {
                status: None,
                body: Value::String(e.to_string()),
            },
        }
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        let r = self
            .http
            .get(format!("{}{path}", self.api))
            .bearer_auth(&self.token)
            .send()
            .await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }
}

/// A module's spec: sleepers with an exec probe on `replicas` nodes of `role`.
pub fn module_spec(module: usize, replicas: u32, role: &str) -> Value {
    let mut spec = json!({
        "unit": {
            "command": "sleep",
            "args": ["100000"],
            "probes": [{"name": "alive", "exec": {"command": "/bin/true"},
                        "interval_secs": 2, "timeout_secs": 1}],
        },
        "placement": {"match_labels": {"labels": {"role": role}, "replicas": replicas}},
    });
    if module == 0 {
        spec["settings_files"] = json!([{"name": "app.env", "format": "env"}]);
    }
    spec
}

/// One operation: method, path, body, and what the checker expects of the
/// final state if it took effect.
pub struct Request {
    pub method: reqwest::Method,
    pub path: String,
    pub body: Option<Value>,
    /// The body as the history shows it (secrets hashed).
    pub shown: Value,
    pub expect: Value,
    /// Replace-or-create (If-Match: *, then none).
    pub upsert: bool,
}

/// The request for `op`; `secret` is the value a rotation sets.
pub fn request_for(op: &Op, seed: u64, nodes: &[String], secret: &str) -> Request {
    use reqwest::Method;
    let stamp = format!("op {} seed {seed}", op.id);
    let put = |path: String, body: Value, expect: Value| Request {
        method: Method::PUT,
        path,
        shown: body.clone(),
        body: Some(body),
        expect,
        upsert: true,
    };
    match &op.kind {
        OpKind::FilePut { file, role } => {
            let selector = role
                .as_ref()
                .map(|r| json!({"role": r}))
                .unwrap_or(json!({}));
            let content = format!("soak file f{file}: {stamp}\n");
            put(
                format!("/v1/files/f{file}"),
                json!({"path": format!("/etc/soak/f{file}"), "content": content,
                       "mode": "0644", "selector": selector}),
                json!({"kind": "file", "key": format!("f{file}"), "content": content,
                       "selector": selector}),
            )
        }
        OpKind::FileDelete { file } => Request {
            method: Method::DELETE,
            path: format!("/v1/files/f{file}"),
            body: None,
            shown: Value::Null,
            expect: json!({"kind": "file", "key": format!("f{file}"), "deleted": true}),
            upsert: false,
        },
        OpKind::SettingsPut { layer, role } => {
            let values = json!({format!("SOAK_L{layer}"): format!("v{}", op.id)});
            put(
                format!("/v1/settings/labels/l{layer}"),
                json!({"values": values, "selector": {"role": role}}),
                json!({"kind": "layer", "key": format!("l{layer}"), "values": values,
                       "selector": {"role": role}}),
            )
        }
        OpKind::SecretRotate { secret: k } => {
            let h = hash(secret);
            Request {
                method: Method::PUT,
                path: format!("/v1/secrets/s{k}"),
                body: Some(json!({"value": secret})),
                shown: json!({"value_sha256": h}),
                expect: json!({"kind": "secret", "key": format!("s{k}"), "sha256": h}),
                upsert: true,
            }
        }
        OpKind::ModuleScale {
            module,
            replicas,
            role,
        } => put(
            format!("/v1/modules/m{module}"),
            module_spec(*module, *replicas, role),
            json!({"kind": "module", "key": format!("m{module}"), "replicas": replicas,
                   "role": role}),
        ),
        OpKind::Drain { agent } | OpKind::Undrain { agent } => {
            let drain = matches!(op.kind, OpKind::Drain { .. });
            let node = nodes.get(*agent).cloned().unwrap_or_default();
            Request {
                method: Method::POST,
                path: format!(
                    "/v1/nodes/{node}/{}",
                    if drain { "drain" } else { "undrain" }
                ),
                body: None,
                shown: Value::Null,
                expect: json!({"kind": "drain", "key": node, "drained": drain}),
                upsert: false,
            }
        }
        OpKind::FreezeSet => Request {
            method: Method::PUT,
            path: "/v1/freeze".into(),
            body: Some(json!({"reason": format!("soak {stamp}")})),
            shown: json!({"reason": format!("soak {stamp}")}),
            expect: json!({"kind": "freeze", "key": "freeze", "frozen": true}),
            upsert: false,
        },
        OpKind::FreezeLift => Request {
            method: Method::DELETE,
            path: "/v1/freeze".into(),
            body: None,
            shown: Value::Null,
            expect: json!({"kind": "freeze", "key": "freeze", "frozen": false}),
            upsert: false,
        },
    }
}

/// A secret's new value: random, never in the history (its hash is).
pub fn new_secret() -> String {
    format!("soak-secret-{:032x}", rand::random::<u128>())
}

/// Send `req` as operation `id`, recording invoke and answer.
pub async fn perform(client: &Client, history: &History, id: usize, req: &Request) -> Answer {
    let request_id = uuid::Uuid::now_v7().to_string();
    history.record(Event::Invoke {
        op: id,
        request_id: request_id.clone(),
        method: req.method.to_string(),
        path: req.path.clone(),
        body: req.shown.clone(),
        expect: req.expect.clone(),
    });
    let mut answer = if req.upsert {
        let a = client
            .send(
                req.method.clone(),
                &req.path,
                &request_id,
                &[("if-match", "*")],
                req.body.as_ref(),
            )
            .await;
        if a.status == Some(412) {
            // Nothing to replace: create. The same request id: one
            // operation, one audit entry (a refused precondition is not a
            // mutation).
            client
                .send(
                    req.method.clone(),
                    &req.path,
                    &request_id,
                    &[],
                    req.body.as_ref(),
                )
                .await
        } else {
            a
        }
    } else {
        client
            .send(
                req.method.clone(),
                &req.path,
                &request_id,
                &[],
                req.body.as_ref(),
            )
            .await
    };
    if let Value::String(s) = &answer.body {
        answer.body = Value::String(excerpt(s, 300));
    }
    history.record(Event::Answer {
        op: id,
        status: answer.status,
        excerpt: excerpt(&answer.body.to_string(), 300),
    });
    answer
}

/// The state every run starts from: the secrets, the modules (one replica
/// each), the secrets granted to `m0`. Operation ids from `base` on.
/// Returns the secret values set.
pub async fn setup(
    client: &Client,
    history: &History,
    base: usize,
) -> anyhow::Result<BTreeMap<usize, String>> {
    let mut id = base;
    let mut secrets = BTreeMap::new();
    for k in 0..SECRETS {
        let value = new_secret();
        let op = Op {
            id,
            at_ms: 0,
            kind: OpKind::SecretRotate { secret: k },
        };
        let a = perform(client, history, id, &request_for(&op, 0, &[], &value)).await;
        anyhow::ensure!(
            a.status.is_some_and(|s| s == 200 || s == 201),
            "setup: secret s{k}: {:?} {}",
            a.status,
            a.body
        );
        secrets.insert(id, value);
        id += 1;
    }
    for m in 0..MODULES {
        let op = Op {
            id,
            at_ms: 0,
            kind: OpKind::ModuleScale {
                module: m,
                replicas: 1,
                role: ROLES[m % ROLES.len()].to_owned(),
            },
        };
        let a = perform(client, history, id, &request_for(&op, 0, &[], "")).await;
        anyhow::ensure!(
            a.status.is_some_and(|s| s == 200 || s == 201),
            "setup: module m{m}: {:?} {}",
            a.status,
            a.body
        );
        id += 1;
    }
    for k in 0..SECRETS {
        let req = Request {
            method: reqwest::Method::PUT,
            path: format!("/v1/modules/m0/grants/s{k}"),
            body: Some(json!({})),
            shown: json!({}),
            expect: json!({"kind": "grant", "key": format!("m0/s{k}")}),
            upsert: true,
        };
        let a = perform(client, history, id, &req).await;
        anyhow::ensure!(
            a.status.is_some_and(|s| s == 200 || s == 201),
            "setup: grant s{k} to m0: {:?} {}",
            a.status,
            a.body
        );
        id += 1;
    }
    Ok(secrets)
}

/// Run the schedule's operations from `start` until done or `stop`.
/// Returns every secret value set (op id → value), for the leak check.
pub async fn run(
    client: &Client,
    history: &History,
    ops: &[Op],
    seed: u64,
    start: Instant,
    stop: tokio::sync::watch::Receiver<bool>,
) -> BTreeMap<usize, String> {
    let mut secrets = BTreeMap::new();
    for op in ops {
        let at = start + Duration::from_millis(op.at_ms);
        let mut stop2 = stop.clone();
        if *stop.borrow() {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(at.into()) => {}
            _ = stop2.changed() => break,
        }
        let value = match op.kind {
            OpKind::SecretRotate { .. } => new_secret(),
            _ => String::new(),
        };
        let req = request_for(op, seed, &client.nodes, &value);
        perform(client, history, op.id, &req).await;
        if !value.is_empty() {
            secrets.insert(op.id, value);
        }
    }
    secrets
}
