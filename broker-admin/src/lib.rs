//! A small client of the RabbitMQ management HTTP API, as a user with the
//! `administrator` tag: users, permissions, topic permissions, vhosts,
//! exchanges and connections.
//!
//! The bundle uses it to provision an environment (with the admin user); the
//! controller uses it to create, delete and disconnect node users at enrolment and
//! revocation (with its own management user, see docs/decisions/). It never
//! speaks AMQP and never prints a password: errors name the request, not the
//! credentials.

use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("rabbitmq management api: {what}: {source}")]
    Http {
        what: String,
        source: reqwest::Error,
    },
    #[error("rabbitmq management api: {what}: HTTP {status}: {body}")]
    Api {
        what: String,
        status: u16,
        body: String,
    },
    #[error("rabbitmq management api: {0}")]
    Check(String),
}

impl Error {
    /// The HTTP status the API answered with, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// A client of the management API. Cheap to clone.
#[derive(Clone)]
pub struct Management {
    http: reqwest::Client,
    api: String,
    user: String,
    password: String,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("api", &self.api)
            .field("user", &self.user)
            .field("password", &"[redacted]")
            .finish()
    }
}

/// A user as the API lists it.
#[derive(Deserialize, Debug, Clone)]
pub struct UserInfo {
    pub name: String,
    /// A comma-separated string (3.x before 3.10) or a list (3.10+).
    #[serde(default)]
    pub tags: serde_json::Value,
}

impl UserInfo {
    pub fn tag_list(&self) -> Vec<String> {
        match &self.tags {
            serde_json::Value::String(s) => s
                .split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect(),
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            _ => vec![],
        }
    }
}

#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub configure: String,
    pub write: String,
    pub read: String,
}

#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct TopicPermission {
    pub exchange: String,
    pub write: String,
    pub read: String,
}

/// A policy as the API lists it: which objects (`apply_to`: `exchanges`,
/// `queues` or `all`) whose names match `pattern` get `definition`.
#[derive(Deserialize, Debug, Clone, PartialEq)]
pub struct Policy {
    pub pattern: String,
    #[serde(rename = "apply-to")]
    pub apply_to: String,
    pub definition: serde_json::Map<String, serde_json::Value>,
    pub priority: i64,
}

/// A connection as the API lists it.
#[derive(Deserialize, Debug, Clone)]
pub struct ConnectionInfo {
    pub name: String,
    #[serde(default)]
    pub user: String,
    #[serde(default)]
    pub vhost: String,
}

#[derive(Deserialize, Debug)]
struct NamedItem {
    name: String,
}

/// How many times `close_connections_of` tries while connections remain.
const CLOSE_ATTEMPTS: u32 = 3;

/// One path segment, percent-encoded (vhost and user names may hold `/`).
pub fn seg(s: &str) -> String {
    urlencoding::encode(s).into_owned()
}

impl Management {
    /// `api` is the base URL (`http://127.0.0.1:15672`).
    pub fn new(api: &str, user: &str, password: &str) -> Management {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default();
        Management {
            http,
            api: api.trim_end_matches('/').to_string(),
            user: user.to_string(),
            password: password.to_string(),
        }
    }

    pub fn user(&self) -> &str {
        &self.user
    }

    fn url(&self, path: &str) -> String {
        format!("{}/api/{path}", self.api)
    }

    async fn send(&self, what: &str, req: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        req.basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|source| Error::Http {
                what: what.to_string(),
                source: source.without_url(),
            })
    }

    async fn fail(what: &str, resp: reqwest::Response) -> Error {
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap_or_default();
        Error::Api {
            what: what.to_string(),
            status,
            body: body.chars().take(500).collect(),
        }
    }

    /// GET; `Ok(None)` on 404.
    pub async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<Option<T>> {
        let what = format!("GET /api/{path}");
        let resp = self.send(&what, self.http.get(self.url(path))).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(Self::fail(&what, resp).await);
        }
        resp.json().await.map(Some).map_err(|source| Error::Http {
            what,
            source: source.without_url(),
        })
    }

    pub async fn put(&self, path: &str, body: serde_json::Value) -> Result<()> {
        let what = format!("PUT /api/{path}");
        let resp = self
            .send(&what, self.http.put(self.url(path)).json(&body))
            .await?;
        if !resp.status().is_success() {
            return Err(Self::fail(&what, resp).await);
        }
        Ok(())
    }

    /// POST a JSON body (e.g. `definitions`: an import of users, vhosts,
    /// permissions, queues, exchanges, bindings and policies).
    pub async fn post(&self, path: &str, body: &serde_json::Value) -> Result<()> {
        let what = format!("POST /api/{path}");
        let resp = self
            .send(&what, self.http.post(self.url(path)).json(body))
            .await?;
        if !resp.status().is_success() {
            return Err(Self::fail(&what, resp).await);
        }
        Ok(())
    }

    /// DELETE; `Ok(false)` when it did not exist.
    pub async fn delete(&self, path: &str) -> Result<bool> {
        self.delete_within(path, None).await
    }

    /// `DELETE /api/{path}`, waiting up to `timeout` instead of the client's
    /// usual 30 s. False if it was not there.
    async fn delete_within(&self, path: &str, timeout: Option<Duration>) -> Result<bool> {
        let what = format!("DELETE /api/{path}");
        let mut req = self.http.delete(self.url(path));
        if let Some(timeout) = timeout {
            req = req.timeout(timeout);
        }
        let resp = self.send(&what, req).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(false);
        }
        if !resp.status().is_success() {
            return Err(Self::fail(&what, resp).await);
        }
        Ok(true)
    }

    /// Waits until the API answers `GET /api/overview` as this user.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match self.get::<serde_json::Value>("overview").await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => return Err(Error::Check("GET /api/overview answered 404".into())),
                Err(Error::Api { status: 401, .. }) => {
                    return Err(Error::Check(format!(
                        "the management api refused user {} (401)",
                        self.user
                    )));
                }
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    pub async fn vhost_exists(&self, vhost: &str) -> Result<bool> {
        Ok(self
            .get::<serde_json::Value>(&format!("vhosts/{}", seg(vhost)))
            .await?
            .is_some())
    }

    pub async fn put_vhost(&self, vhost: &str) -> Result<()> {
        self.put(&format!("vhosts/{}", seg(vhost)), json!({})).await
    }

    /// Delete `vhost` and everything in it. A vhost with one queue per node of a
    /// large fleet takes minutes to delete (10,000 queues: about two), so this
    /// request waits up to ten minutes instead of the client's usual 30 s.
    pub async fn delete_vhost(&self, vhost: &str) -> Result<bool> {
        let path = format!("vhosts/{}", seg(vhost));
        self.delete_within(&path, Some(Duration::from_secs(600)))
            .await
    }

    /// All vhost names.
    pub async fn vhosts(&self) -> Result<Vec<String>> {
        Ok(self
            .get::<Vec<NamedItem>>("vhosts")
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(|u| u.name)
            .collect())
    }

    pub async fn user_info(&self, user: &str) -> Result<Option<UserInfo>> {
        self.get(&format!("users/{}", seg(user))).await
    }

    /// All user names.
    pub async fn users(&self) -> Result<Vec<String>> {
        Ok(self
            .get::<Vec<NamedItem>>("users")
            .await?
            .unwrap_or_default()
            .into_iter()
            .map(|u| u.name)
            .collect())
    }

    /// Create `user` or replace its password and tags (comma separated, may be empty).
    pub async fn put_user(&self, user: &str, password: &str, tags: &str) -> Result<()> {
        self.put(
            &format!("users/{}", seg(user)),
            json!({ "password": password, "tags": tags }),
        )
        .await
    }

    pub async fn delete_user(&self, user: &str) -> Result<bool> {
        self.delete(&format!("users/{}", seg(user))).await
    }

    pub async fn permissions(&self, vhost: &str, user: &str) -> Result<Option<Permissions>> {
        self.get(&format!("permissions/{}/{}", seg(vhost), seg(user)))
            .await
    }

    pub async fn put_permissions(
        &self,
        vhost: &str,
        user: &str,
        configure: &str,
        write: &str,
        read: &str,
    ) -> Result<()> {
        self.put(
            &format!("permissions/{}/{}", seg(vhost), seg(user)),
            json!({ "configure": configure, "write": write, "read": read }),
        )
        .await
    }

    pub async fn topic_permissions(&self, vhost: &str, user: &str) -> Result<Vec<TopicPermission>> {
        Ok(self
            .get(&format!("topic-permissions/{}/{}", seg(vhost), seg(user)))
            .await?
            .unwrap_or_default())
    }

    pub async fn put_topic_permissions(
        &self,
        vhost: &str,
        user: &str,
        exchange: &str,
        write: &str,
        read: &str,
    ) -> Result<()> {
        self.put(
            &format!("topic-permissions/{}/{}", seg(vhost), seg(user)),
            json!({ "exchange": exchange, "write": write, "read": read }),
        )
        .await
    }

    /// A durable exchange of `kind` (topic, direct, fanout) on `vhost`.
    pub async fn put_exchange(&self, vhost: &str, name: &str, kind: &str) -> Result<()> {
        self.put(
            &format!("exchanges/{}/{}", seg(vhost), seg(name)),
            json!({ "type": kind, "durable": true, "auto_delete": false, "internal": false, "arguments": {} }),
        )
        .await
    }

    /// The policy `name` on `vhost`, if there is one.
    pub async fn policy(&self, vhost: &str, name: &str) -> Result<Option<Policy>> {
        self.get(&format!("policies/{}/{}", seg(vhost), seg(name)))
            .await
    }

    /// Create or replace the policy `name` on `vhost`.
    pub async fn put_policy(&self, vhost: &str, name: &str, policy: &Policy) -> Result<()> {
        self.put(
            &format!("policies/{}/{}", seg(vhost), seg(name)),
            json!({
                "pattern": policy.pattern,
                "apply-to": policy.apply_to,
                "definition": policy.definition,
                "priority": policy.priority,
            }),
        )
        .await
    }

    /// Delete the policy `name` on `vhost`; false if there was none.
    pub async fn delete_policy(&self, vhost: &str, name: &str) -> Result<bool> {
        self.delete(&format!("policies/{}/{}", seg(vhost), seg(name)))
            .await
    }

    /// Connections open on `vhost`, as the management plugin's statistics list
    /// them: up to one statistics interval late (30 s on a broker set up by
    /// `bundle/up`). For one user's connections, [`Management::connections_of`] is
    /// immediate.
    pub async fn connections(&self, vhost: &str) -> Result<Vec<ConnectionInfo>> {
        Ok(self
            .get(&format!("vhosts/{}/connections", seg(vhost)))
            .await?
            .unwrap_or_default())
    }

    /// Connections `user` has open, on any vhost, from the broker's connection
    /// tracking (immediate, not from statistics).
    pub async fn connections_of(&self, user: &str) -> Result<Vec<ConnectionInfo>> {
        Ok(self
            .get(&format!("connections/username/{}", seg(user)))
            .await?
            .unwrap_or_default())
    }

    /// Close every connection `user` has open; returns how many there were on
    /// `vhost`. Uses the broker's connection tracking, so a connection opened a
    /// moment ago is closed too.
    pub async fn close_connections_of(
        &self,
        vhost: &str,
        user: &str,
        reason: &str,
    ) -> Result<usize> {
        let open = self
            .connections_of(user)
            .await?
            .iter()
            .filter(|c| c.vhost == vhost)
            .count();
        let what = format!("DELETE /api/connections/username/{}", seg(user));
        let mut attempt = 1;
        loop {
            let req = self
                .http
                .delete(self.url(&format!("connections/username/{}", seg(user))))
                .header("X-Reason", reason);
            let resp = self.send(&what, req).await?;
            if resp.status().is_success() || resp.status() == reqwest::StatusCode::NOT_FOUND {
                return Ok(open);
            }
            let failed = Self::fail(&what, resp).await;
            // Deleting a user makes the broker close the user's connections
            // itself; closing them here at the same moment can fail on one that
            // is already going (HTTP 500). It failed only if one is still open.
            let remaining = self.connections_of(user).await?;
            if remaining.is_empty() {
                return Ok(open);
            }
            if attempt == CLOSE_ATTEMPTS {
                return Err(failed);
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
