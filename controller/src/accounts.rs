//! Node broker accounts for the identity context, through the RabbitMQ
//! management API ([`mesh_broker_admin`]) as the identity management user.
//! Identity knows only the [`BrokerAccounts`] trait; this is where it meets the
//! broker.

use mesh_broker_admin::Management;
use mesh_identity::{BoxFuture, BrokerAccounts, BrokerError};
use mesh_protocol::NodeId;
use mesh_protocol::topology::node_permissions;

use crate::config::{ConfigError, Credentials};

pub struct RabbitAccounts {
    api: Management,
    vhost: String,
    /// `scheme://host:port` nodes connect to: the advertised AMQPS endpoint,
    /// else the controller's own broker address (a loopback-only mesh).
    base: String,
}

impl RabbitAccounts {
    /// From the controller's credentials: the management account, and the vhost
    /// of its own broker URL. Nodes are handed `amqps://<advertised_broker>`,
    /// or, without one, the host and port of the controller's own URL.
    pub fn from_credentials(
        creds: &Credentials,
        advertised_broker: Option<&str>,
    ) -> Result<RabbitAccounts, ConfigError> {
        let m = creds.broker_management()?;
        let bad = |message: String| ConfigError::Parse {
            path: "broker_url".into(),
            message,
        };
        let url = url::Url::parse(creds.broker_url.expose())
            .map_err(|e| bad(format!("broker_url is not a URL: {e}")))?;
        let vhost = urlencoding::decode(url.path().trim_start_matches('/'))
            .map_err(|e| bad(format!("broker_url vhost: {e}")))?
            .into_owned();
        let host = url.host_str().unwrap_or("127.0.0.1");
        let base = match (advertised_broker, url.port()) {
            (Some(endpoint), _) => format!("amqps://{endpoint}"),
            (None, Some(p)) => format!("{}://{host}:{p}", url.scheme()),
            (None, None) => format!("{}://{host}", url.scheme()),
        };
        Ok(RabbitAccounts {
            api: Management::new(&m.url, &m.user, m.password.expose()),
            vhost,
            base,
        })
    }
}

fn broker(e: mesh_broker_admin::Error) -> BrokerError {
    BrokerError(e.to_string())
}

impl BrokerAccounts for RabbitAccounts {
    fn create_node_user<'a>(
        &'a self,
        node: &'a NodeId,
        password: &'a str,
    ) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(async move {
            let p = node_permissions(node);
            let n = node.as_str();
            self.api.put_user(n, password, "").await.map_err(broker)?;
            self.api
                .put_permissions(&self.vhost, n, &p.configure, &p.write, &p.read)
                .await
                .map_err(broker)?;
            self.api
                .put_topic_permissions(
                    &self.vhost,
                    n,
                    p.topic_exchange,
                    &p.topic_write,
                    &p.topic_read,
                )
                .await
                .map_err(broker)?;
            Ok(())
        })
    }

    fn delete_node_user<'a>(
        &'a self,
        node: &'a NodeId,
    ) -> BoxFuture<'a, Result<bool, BrokerError>> {
        Box::pin(async move { self.api.delete_user(node.as_str()).await.map_err(broker) })
    }

    fn close_connections<'a>(
        &'a self,
        node: &'a NodeId,
    ) -> BoxFuture<'a, Result<usize, BrokerError>> {
        Box::pin(async move {
            self.api
                .close_connections_of(&self.vhost, node.as_str(), "node revoked or re-enrolled")
                .await
                .map_err(broker)
        })
    }

    fn node_broker_url(&self, node: &NodeId, password: &str) -> String {
        format!(
            "{}/{}",
            self.base
                .replacen("://", &format!("://{node}:{password}@"), 1),
            urlencoding::encode(&self.vhost)
        )
    }
}
