//! The mesh's current endpoints, as the controller tells every node in its
//! inventory section (decision 0044): the broker's `<host>:<port>` endpoints
//! and the API's `https://` URLs. An agent keeps the list it was last given in
//! its local store and, when its configured brokers do not answer, tries the
//! stored ones with its own credentials: how a node follows the controller
//! to a new home without a DNS name.
//!
//! The one definition of an acceptable `<host>:<port>` lives here
//! ([`parse_host_port`]); the credential files' checks call it.

use serde::{Deserialize, Serialize};

use crate::DecodeError;

/// Most endpoints of one kind (brokers, API) in one declaration.
pub const MAX_ENDPOINTS: usize = 16;

/// Longest endpoint, in bytes: a DNS name (253) with a scheme and a port.
pub const MAX_ENDPOINT_BYTES: usize = 300;

/// Where the mesh is reached now: its broker endpoints (the advertised one
/// first) and its API's URLs. Absent from a section: the controller declares
/// none (an older controller, or one that knows no endpoint to advertise).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Endpoints {
    /// `<host>:<port>` of the broker's nodes (an IPv6 address in brackets), in
    /// the order to try them. No scheme, no credentials: a node connects with
    /// its own user, password, vhost and TLS rules.
    #[serde(default)]
    pub brokers: Vec<String>,
    /// `https://<host>[:<port>]` of the API.
    #[serde(default)]
    pub api: Vec<String>,
}

impl Endpoints {
    /// At most [`MAX_ENDPOINTS`] of each kind, each well formed; the error
    /// names the entry (`<field>.brokers[1]`).
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        for (name, list) in [("brokers", &self.brokers), ("api", &self.api)] {
            if list.len() > MAX_ENDPOINTS {
                return Err(DecodeError::invalid(
                    format!("{field}.{name}"),
                    format!("more than {MAX_ENDPOINTS} endpoints"),
                ));
            }
        }
        for (i, b) in self.brokers.iter().enumerate() {
            parse_host_port(b)
                .map_err(|m| DecodeError::invalid(format!("{field}.brokers[{i}]"), m))?;
        }
        for (i, a) in self.api.iter().enumerate() {
            check_api_endpoint(a)
                .map_err(|m| DecodeError::invalid(format!("{field}.api[{i}]"), m))?;
        }
        Ok(())
    }
}

/// The first 120 characters of `value`, for an error message.
fn shown(value: &str) -> String {
    value.chars().take(120).collect()
}

/// A host name (letters, digits, `.` and `-`) or an IP address; an IPv6
/// address in brackets.
fn is_host(host: &str) -> bool {
    if let Some(inner) = host.strip_prefix('[') {
        return inner
            .strip_suffix(']')
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok());
    }
    !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
}

/// Parses `<host>:<port>` (an IPv6 address in brackets): a host and a port
/// 1 to 65535, no scheme. Returns the host (without brackets) and the port;
/// the error says what is wrong and quotes the value.
pub fn parse_host_port(value: &str) -> Result<(String, u16), String> {
    let v = shown(value);
    if value.len() > MAX_ENDPOINT_BYTES {
        return Err(format!("`{v}…`: longer than {MAX_ENDPOINT_BYTES} bytes"));
    }
    if value.contains("://") {
        return Err(format!("`{v}`: must be <host>:<port>, without a scheme"));
    }
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| format!("`{v}`: must be <host>:<port> (the port is missing)"))?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("`{v}`: `{port}` is not a port (1 to 65535)"))?;
    if !is_host(host) {
        return Err(format!(
            "`{v}`: `{host}` is not a host name or an IP address"
        ));
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Ok((bare.to_owned(), port))
}

/// `host` and `port` written as [`parse_host_port`] reads them (an IPv6
/// address in brackets).
pub fn format_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Checks an API endpoint: `https://<host>[:<port>]`, at most a trailing `/`
/// after it, no user, path, query or fragment.
pub fn check_api_endpoint(value: &str) -> Result<(), String> {
    let v = shown(value);
    if value.len() > MAX_ENDPOINT_BYTES {
        return Err(format!("`{v}…`: longer than {MAX_ENDPOINT_BYTES} bytes"));
    }
    let authority = value
        .strip_prefix("https://")
        .ok_or_else(|| format!("`{v}`: must be https://<host>[:<port>]"))?;
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.contains(['/', '?', '#', '@']) {
        return Err(format!(
            "`{v}`: must be only scheme, host and port (no user, path, query or fragment)"
        ));
    }
    let host_only = authority.ends_with(']') || !authority.contains(':');
    if host_only {
        if !is_host(authority) {
            return Err(format!(
                "`{v}`: `{authority}` is not a host name or an IP address"
            ));
        }
        return Ok(());
    }
    parse_host_port(authority).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ports() {
        assert_eq!(
            parse_host_port("192.0.2.2:5671").unwrap(),
            ("192.0.2.2".into(), 5671)
        );
        assert_eq!(
            parse_host_port("[2001:db8::1]:5671").unwrap(),
            ("2001:db8::1".into(), 5671)
        );
        assert_eq!(format_host_port("2001:db8::1", 5671), "[2001:db8::1]:5671");
        assert_eq!(format_host_port("h.example", 1), "h.example:1");
        for bad in [
            "192.0.2.2",
            "192.0.2.2:0",
            "192.0.2.2:x",
            "amqps://192.0.2.2:5671",
            ":5671",
            "2001:db8::1:5671",
            "[zz]:1",
            "a b:1",
            "u:p@h:1",
        ] {
            let err = parse_host_port(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
        assert!(parse_host_port(&format!("{}:1", "a".repeat(400))).is_err());
    }

    #[test]
    fn api_endpoints() {
        for good in [
            "https://192.0.2.2:7443",
            "https://ctl.example.org/",
            "https://[::1]:7443",
            "https://[::1]",
        ] {
            check_api_endpoint(good).unwrap();
        }
        for bad in [
            "http://192.0.2.2:7700",
            "https://u:p@h:1",
            "https://h:1/v1",
            "https://h:1?x=1",
            "192.0.2.2:7443",
            "https://",
            "https://h:0",
        ] {
            assert!(check_api_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validate_names_the_entry_and_bounds_the_lists() {
        let mut e = Endpoints {
            brokers: vec!["127.0.0.1:5672".into(), "rabbit-2.example:5671".into()],
            api: vec!["https://ctl.example:7443".into()],
        };
        e.validate("body.items.endpoints").unwrap();
        e.brokers.push("amqp://h:1".into());
        let err = e.validate("body.items.endpoints").unwrap_err().to_string();
        assert!(err.contains("body.items.endpoints.brokers[2]"), "{err}");
        e.brokers.pop();
        e.api.push("http://h:1".into());
        let err = e.validate("body.items.endpoints").unwrap_err().to_string();
        assert!(err.contains("body.items.endpoints.api[1]"), "{err}");
        e.api.pop();
        e.brokers = (0..=MAX_ENDPOINTS).map(|i| format!("h{i}:1")).collect();
        let err = e.validate("body.items.endpoints").unwrap_err().to_string();
        assert!(err.contains("body.items.endpoints.brokers"), "{err}");
    }
}
