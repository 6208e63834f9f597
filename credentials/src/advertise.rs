//! The endpoints a mesh advertises to nodes and operators, as its credential
//! files hold them: the API's `https://<host>:<port>` and the broker's AMQPS
//! `<host>:<port>`. One definition of what is acceptable, shared by the files'
//! checks, the controller and the agent.
//!
//! Plain (unencrypted) endpoints are for loopback only: [`is_loopback_host`]
//! is the one test of it.

use std::net::IpAddr;

/// `true` for `localhost`, `127.0.0.0/8` and `::1` (brackets allowed): the
/// hosts a plain `http://` or `amqp://` endpoint may name.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Checks an advertised API URL: `https://<host>[:<port>]`, nothing after the
/// authority but an optional `/`. Returns the parsed URL; the error says what
/// is wrong.
pub fn check_api_url(value: &str) -> Result<url::Url, String> {
    let u = url::Url::parse(value).map_err(|e| format!("`{value}` is not a URL ({e})"))?;
    if u.scheme() != "https" {
        return Err(format!(
            "`{value}`: must be https:// (plain HTTP is served on loopback only)"
        ));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(format!("`{value}`: has no host"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(format!("`{value}`: must not hold a user or password"));
    }
    if u.path() != "/" || u.query().is_some() || u.fragment().is_some() {
        return Err(format!(
            "`{value}`: must be only scheme, host and port (no path, query or fragment)"
        ));
    }
    Ok(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback() {
        for h in [
            "localhost",
            "LOCALHOST",
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in ["192.0.2.2", "10.0.0.1", "example.org", "::2", "0.0.0.0", ""] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn api_urls() {
        assert_eq!(
            check_api_url("https://192.0.2.2:7443").unwrap().port(),
            Some(7443)
        );
        assert!(check_api_url("https://ctl.example.org/").is_ok());
        for bad in [
            "http://192.0.2.2:7700",
            "https://u:p@h:1",
            "https://h:1/v1",
            "https://h:1?x=1",
            "192.0.2.2:7443",
        ] {
            assert!(check_api_url(bad).is_err(), "{bad}");
        }
    }
}
