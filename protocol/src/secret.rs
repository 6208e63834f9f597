//! `Secret`, a value whose `Debug` and `Display` print `[redacted]`; tokens
//! (`new_token`) and their one hash (`token_sha256_hex`: tokens are stored
//! only as hashes); `redact_url`, a URL with its password hidden.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// A value that must never be printed: its `Debug` and `Display` say `[redacted]`.
/// Read it with [`Secret::expose`], only where it is handed to the library that
/// needs it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Secret(value)
    }

    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Secret<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(Secret)
    }
}

/// `scheme://user:password@host/...` → `scheme://user:[redacted]@host/...`, for logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "[unparseable url]".to_owned();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:[redacted]@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

/// How bearer and join tokens are stored and looked up: the SHA-256 of the token
/// text, 64 hex digits. A token is 256 random bits, so a plain hash (no salt, no
/// stretching) is enough: there is nothing to guess.
pub fn token_sha256_hex(token: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A fresh bearer token: `<prefix>` and 256 random bits as 64 hex digits. The
/// prefix (`mesh_at_` for API tokens, `mesh_jt_` for join tokens) lets secret
/// scanners and people recognise one. `random` must come from a CSPRNG.
pub fn new_token(prefix: &str, random: [u8; 32]) -> String {
    format!("{prefix}{}", hex::encode(random))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_do_not_print() {
        let s = Secret::new("hunter2".to_owned());
        assert_eq!(format!("{s} {s:?}"), "[redacted] [redacted]");
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("amqp://node-a:hunter2@127.0.0.1:5672/mesh"),
            "amqp://node-a:[redacted]@127.0.0.1:5672/mesh"
        );
        assert!(!redact_url("garbage hunter2").contains("hunter2"));
    }
}
