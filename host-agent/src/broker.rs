//! The agent's broker connection: AMQPS verified against the mesh CA, or plain
//! AMQP to a loopback broker.
//!
//! An `amqps://` URL is connected with rustls (the `ring` provider) trusting
//! exactly one certificate: the mesh CA the node pinned at its join
//! ([`AgentCredentials::ca_certificate`]). No system roots, no bundled roots:
//! a broker whose certificate does not chain to the mesh CA, or does not name
//! the host the URL names, fails the handshake and is refused before the
//! node's password is sent. A plain `amqp://` URL is accepted only for a
//! loopback host (the local mesh, tests): the broker's plain listener is on
//! loopback only (docs/decisions/0028).

use std::time::Duration;

use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use mesh_credentials::AgentCredentials;
use mesh_credentials::advertise::is_loopback_host;

/// Why the agent could not open its broker connection.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The URL is not an AMQP URL (never echoed: it holds the password).
    #[error("the broker URL in the credentials is not an AMQP URL: {0}")]
    BadUrl(String),
    #[error(
        "plain amqp:// to {host} refused: plain AMQP is for a loopback broker only; the node needs the amqps:// endpoint and the mesh CA (join again)"
    )]
    PlainNotLoopback { host: String },
    #[error(
        "amqps:// to {host} needs the mesh CA (`ca_certificate` in the credentials); join again"
    )]
    NoCa { host: String },
    /// The TLS handshake failed on the broker's certificate.
    #[error(
        "the broker at {endpoint} presented a certificate that does not verify against the mesh CA ({detail}): refused, nothing was sent"
    )]
    Untrusted { endpoint: String, detail: String },
    /// Nothing answered in time (`connect_timeout`): the TCP connect, the
    /// TLS handshake or the AMQP handshake was still waiting.
    #[error(
        "broker at {endpoint}: no answer within {}s (TCP connect, TLS and AMQP handshakes)",
        .within.as_secs_f64()
    )]
    TimedOut { endpoint: String, within: Duration },
    #[error("broker at {endpoint}: {source}")]
    Amqp {
        endpoint: String,
        source: lapin::Error,
    },
}

/// Connects as the node of `creds`, asking for an AMQP heartbeat of
/// `heartbeat` unless the URL names one, the whole attempt (TCP connect, TLS
/// and AMQP handshakes) within `deadline` ([`mesh_amqp::connect`]). With `endpoint`, the broker at that
/// host and port (one of the agent's `brokers`, a node of the same cluster)
/// instead of the URL's: the same user, password, vhost and scheme, and the
/// same rules (amqps verifies the certificate against the mesh CA and the
/// endpoint's host; plain amqp only to a loopback endpoint).
pub async fn connect(
    creds: &AgentCredentials,
    endpoint: Option<&(String, u16)>,
    heartbeat: Duration,
    deadline: Duration,
    props: ConnectionProperties,
) -> Result<Connection, BrokerError> {
    let mut uri: AMQPUri = creds
        .broker_url
        .expose()
        .parse()
        .map_err(|e: String| BrokerError::BadUrl(scrub(&e)))?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(u16::try_from(heartbeat.as_secs()).unwrap_or(u16::MAX));
    }
    if let Some((host, port)) = endpoint {
        uri.authority.host = host.clone();
        uri.authority.port = *port;
    }
    let host = uri.authority.host.clone();
    let endpoint = format!("{}:{}", host, uri.authority.port);
    let tls = match uri.scheme {
        AMQPScheme::AMQP => {
            if !is_loopback_host(&host) {
                return Err(BrokerError::PlainNotLoopback { host });
            }
            OwnedTLSConfig::default()
        }
        AMQPScheme::AMQPS => {
            let ca = creds
                .ca_certificate
                .clone()
                .ok_or_else(|| BrokerError::NoCa { host: host.clone() })?;
            OwnedTLSConfig {
                identity: None,
                // The only trust anchor: lapin's rustls connector starts from an
                // empty root store (no root store feature is enabled).
                cert_chain: Some(ca),
            }
        }
    };
    match mesh_amqp::connect(uri, props, tls, deadline).await {
        Ok(conn) => Ok(conn),
        Err(mesh_amqp::ConnectError::TimedOut(within)) => {
            Err(BrokerError::TimedOut { endpoint, within })
        }
        Err(mesh_amqp::ConnectError::Amqp(source)) => Err(classify(endpoint, source)),
    }
}

/// A handshake refused on the certificate reads as [`BrokerError::Untrusted`].
fn classify(endpoint: String, source: lapin::Error) -> BrokerError {
    let text = source.to_string();
    if let Some(at) = text.find("invalid peer certificate") {
        return BrokerError::Untrusted {
            endpoint,
            detail: text[at..].to_owned(),
        };
    }
    BrokerError::Amqp { endpoint, source }
}

/// The `<host>:<port>` the credentials' broker URL names, for logs (never
/// the password); `None` when it does not parse.
pub fn url_endpoint(creds: &AgentCredentials) -> Option<String> {
    let uri: AMQPUri = creds.broker_url.expose().parse().ok()?;
    Some(format!("{}:{}", uri.authority.host, uri.authority.port))
}

/// Where a broker endpoint the agent tries comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointSource {
    /// The credentials' broker URL (written at join).
    Credentials,
    /// The config's `brokers`.
    Config,
    /// The mesh's endpoints the controller declared, kept in the store
    /// (decision 0044).
    Learned,
}

impl EndpointSource {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointSource::Credentials => "credentials",
            EndpointSource::Config => "config",
            EndpointSource::Learned => "learned",
        }
    }
}

/// One broker endpoint to try: `target` none for the credentials' URL as it
/// is, else a host and port to connect to with the URL's user, password,
/// vhost and scheme ([`connect`]); `endpoint` as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub target: Option<(String, u16)>,
    pub endpoint: String,
    pub source: EndpointSource,
}

/// The endpoints to try, in order, each once: the credentials' URL, the
/// configured `brokers`, then the `learned` ones (an endpoint named twice is
/// tried where it first appears).
pub fn candidates(
    creds: &AgentCredentials,
    configured: &[(String, u16)],
    learned: &[(String, u16)],
) -> Vec<Candidate> {
    let own = url_host_port(creds);
    let mut out = vec![Candidate {
        target: None,
        endpoint: own.as_ref().map_or_else(
            || "the credentials' broker".to_owned(),
            |(h, p)| mesh_protocol::format_host_port(h, *p),
        ),
        source: EndpointSource::Credentials,
    }];
    let named = configured
        .iter()
        .map(|e| (e, EndpointSource::Config))
        .chain(learned.iter().map(|e| (e, EndpointSource::Learned)));
    for ((host, port), source) in named {
        let endpoint = mesh_protocol::format_host_port(host, *port);
        if out.iter().any(|c| c.endpoint == endpoint) {
            continue;
        }
        out.push(Candidate {
            target: Some((host.clone(), *port)),
            endpoint,
            source,
        });
    }
    out
}

/// The host (without brackets) and port the credentials' broker URL names.
fn url_host_port(creds: &AgentCredentials) -> Option<(String, u16)> {
    let uri: AMQPUri = creds.broker_url.expose().parse().ok()?;
    let host = uri
        .authority
        .host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    Some((host, uri.authority.port))
}

/// lapin's URL parse errors may quote the URL: keep only the words before it.
fn scrub(e: &str) -> String {
    match e.find("amqp") {
        Some(at) => e[..at].trim_end_matches([' ', ':', '"', '`']).to_owned(),
        None => e.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_protocol::{NodeId, PublicKey, Secret};

    fn creds(url: &str, ca: Option<String>) -> AgentCredentials {
        AgentCredentials {
            node: NodeId::parse("node-a").unwrap(),
            broker_url: Secret::new(url.into()),
            controller_key: PublicKey::from_hex(
                &mesh_protocol::DeclarationSigner::from_seed([1; 32]).public_key_hex(),
            )
            .unwrap(),
            ca_certificate: ca,
            api_url: None,
        }
    }

    #[test]
    fn candidates_are_the_url_then_configured_then_learned_each_once() {
        let c = creds("amqp://node-a:pw@127.0.0.1:5672/mesh", None);
        let list = candidates(
            &c,
            &[("127.0.0.1".into(), 5673)],
            &[
                ("127.0.0.1".into(), 5672),
                ("127.0.0.1".into(), 5674),
                ("127.0.0.1".into(), 5673),
                ("::1".into(), 5675),
            ],
        );
        let shown: Vec<(&str, &str)> = list
            .iter()
            .map(|c| (c.endpoint.as_str(), c.source.as_str()))
            .collect();
        assert_eq!(
            shown,
            vec![
                ("127.0.0.1:5672", "credentials"),
                ("127.0.0.1:5673", "config"),
                ("127.0.0.1:5674", "learned"),
                ("[::1]:5675", "learned"),
            ]
        );
        assert_eq!(list[0].target, None);
        assert_eq!(list[2].target, Some(("127.0.0.1".into(), 5674)));
        assert!(list.iter().all(|c| !c.endpoint.contains("pw")));
    }

    #[tokio::test]
    async fn plain_amqp_only_to_loopback_and_amqps_only_with_the_ca() {
        let err = connect(
            &creds("amqp://node-a:pw@192.0.2.2:5672/mesh", None),
            None,
            Duration::from_secs(10),
            Duration::from_secs(10),
            ConnectionProperties::default(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("loopback") && !err.contains("pw"), "{err}");
        let err = connect(
            &creds("amqps://node-a:pw@192.0.2.2:5671/mesh", None),
            None,
            Duration::from_secs(10),
            Duration::from_secs(10),
            ConnectionProperties::default(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("mesh CA") && !err.contains("pw"), "{err}");
        // An alternate endpoint follows the same rules as the URL's own host.
        let err = connect(
            &creds("amqp://node-a:pw@127.0.0.1:5672/mesh", None),
            Some(&("192.0.2.3".to_owned(), 5672)),
            Duration::from_secs(10),
            Duration::from_secs(10),
            ConnectionProperties::default(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("192.0.2.3") && err.contains("loopback") && !err.contains("pw"),
            "{err}"
        );
    }
}
