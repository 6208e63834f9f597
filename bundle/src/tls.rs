//! The mesh CA and the broker's server certificate on the first host
//! (`mesh-bundle tls`, run by `bundle/up` before the broker is configured).
//!
//! - The CA ([`ensure_ca`]): `$MESH_ETC/ca.pem` (0644) and `$MESH_ETC/ca.key`
//!   (0600, owned by root, the user the controller runs as), made once and kept:
//!   every node pins its public key at its join, so a new CA means every node
//!   joins again.
//! - The broker's certificate ([`ensure_broker_certificate`]): a fresh key and
//!   a certificate for the advertised address, `127.0.0.1`, `localhost` and
//!   the hostname, valid [`BROKER_CERT_LIFETIME`], in [`BROKER_TLS_DIR`]
//!   (`ca.pem`, `broker.pem`, `broker.key` 0600; `bundle/up` gives the
//!   directory to the `rabbitmq` user). It is issued again when a third of its
//!   lifetime remains, when its names differ from the wanted ones, or when it
//!   is not this CA's; each `bundle/up` run checks, so run it at least every
//!   [`BROKER_CERT_LIFETIME`] / 3 (a timer). After a re-issue `bundle/up` makes
//!   RabbitMQ re-read the files (`ssl:clear_pem_cache()`): new connections get
//!   the new certificate, open ones keep theirs.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_credentials::pki::{self, CertInfo, MeshCa, PkiError};

/// The CA's certificate in the etc directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// The CA's private key in the etc directory (0600).
pub const CA_KEY_FILE: &str = "ca.key";
/// Where RabbitMQ reads its TLS files from.
pub const BROKER_TLS_DIR: &str = "/etc/rabbitmq/mesh-tls";
/// The broker certificate's file in [`BROKER_TLS_DIR`].
pub const BROKER_CERT_FILE: &str = "broker.pem";
/// The broker key's file in [`BROKER_TLS_DIR`] (0600).
pub const BROKER_KEY_FILE: &str = "broker.key";
/// Lifetime of the broker's certificate: 90 days, issued again with 30 left.
pub const BROKER_CERT_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);
/// The CA's common name.
pub const CA_COMMON_NAME: &str = "mesh CA";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Half a CA: refuse to guess (a new key would orphan every node's pin).
    #[error(
        "{present} exists but {missing} does not: restore {missing} from a backup, or remove {present} to make a new CA (every node must then join again)"
    )]
    HalfCa { present: PathBuf, missing: PathBuf },
    #[error(transparent)]
    Credentials(#[from] mesh_credentials::CredentialsError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The CA's paths in `etc`: (certificate, key).
pub fn ca_paths(etc: &Path) -> (PathBuf, PathBuf) {
    (etc.join(CA_CERT_FILE), etc.join(CA_KEY_FILE))
}

/// Loads the CA from `etc`, or makes it when neither file exists. `true` when
/// it was made now.
pub fn ensure_ca(etc: &Path) -> Result<(MeshCa, bool), TlsError> {
    let (cert, key) = ca_paths(etc);
    match (cert.exists(), key.exists()) {
        (true, true) => Ok((MeshCa::load(&cert, &key)?, false)),
        (false, false) => {
            std::fs::create_dir_all(etc).map_err(io(etc))?;
            let ca = MeshCa::generate(CA_COMMON_NAME)?;
            ca.write(&cert, &key)?;
            Ok((ca, true))
        }
        (true, false) => Err(TlsError::HalfCa {
            present: cert,
            missing: key,
        }),
        (false, true) => Err(TlsError::HalfCa {
            present: key,
            missing: cert,
        }),
    }
}

/// The names the broker's certificate carries: the advertised address, the
/// loopback names and the hostname, de-duplicated, in a stable order.
pub fn broker_names(advertise: Option<&str>, hostname: Option<&str>) -> Vec<String> {
    let mut names = Vec::new();
    for n in [advertise, Some("127.0.0.1"), Some("localhost"), hostname]
        .into_iter()
        .flatten()
    {
        let n = n.trim().trim_start_matches('[').trim_end_matches(']');
        if !n.is_empty() && !names.iter().any(|m: &String| m.eq_ignore_ascii_case(n)) {
            names.push(n.to_ascii_lowercase());
        }
    }
    names
}

/// What [`ensure_broker_certificate`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerCertificate {
    /// Why it was issued now; `None` when the one in place was kept.
    pub issued_because: Option<String>,
    pub not_after: DateTime<Utc>,
    /// When the next `bundle/up` run issues it again.
    pub renew_at: DateTime<Utc>,
    /// Whether the CA's copy in the directory was (re)written.
    pub ca_copy_written: bool,
}

/// Why the certificate in `dir` must be issued again, if it must.
fn reissue_reason(
    ca: &MeshCa,
    cert_path: &Path,
    key_path: &Path,
    names: &[String],
    now: DateTime<Utc>,
) -> Option<String> {
    let Ok(pem) = std::fs::read_to_string(cert_path) else {
        return Some(format!("{} is missing", cert_path.display()));
    };
    let Ok(key) = std::fs::read_to_string(key_path) else {
        return Some(format!("{} is missing", key_path.display()));
    };
    let info = match CertInfo::parse(&pem) {
        Ok(i) => i,
        Err(e) => return Some(format!("{}: {e}", cert_path.display())),
    };
    match pki::public_key_der(&key) {
        Ok(k) if k == info.public_key_der => {}
        _ => {
            return Some(format!(
                "{} is not the certificate's key",
                key_path.display()
            ));
        }
    }
    if let Err(e) = pki::verify_chain(&pem, ca.certificate_pem()) {
        return Some(format!("it is not valid for this CA: {e}"));
    }
    let have: BTreeSet<String> = info
        .dns_names
        .iter()
        .map(|d| d.to_ascii_lowercase())
        .chain(info.ip_addresses.iter().map(IpAddr::to_string))
        .collect();
    let want: BTreeSet<String> = names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => ip.to_string(),
            Err(_) => n.to_ascii_lowercase(),
        })
        .collect();
    if have != want {
        return Some(format!(
            "its names {:?} are not the wanted {:?}",
            have, want
        ));
    }
    if now >= info.renew_at() {
        return Some(format!(
            "a third of its lifetime or less remains (valid until {})",
            info.not_after
        ));
    }
    None
}

/// Makes sure `dir` holds a broker certificate of `ca` for `names` with more
/// than a third of its lifetime left, its key (0600) and a copy of the CA's
/// certificate; issues a new one (a fresh key) otherwise. Idempotent: a
/// second run right after the first changes nothing.
pub fn ensure_broker_certificate(
    ca: &MeshCa,
    dir: &Path,
    names: &[String],
    lifetime: Duration,
    now: DateTime<Utc>,
) -> Result<BrokerCertificate, TlsError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(dir)
        .map_err(io(dir))?;
    let cert_path = dir.join(BROKER_CERT_FILE);
    let key_path = dir.join(BROKER_KEY_FILE);
    let ca_path = dir.join(CA_CERT_FILE);
    let public = |path: &Path| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).map_err(io(path))
    };
    // Public files (0644): written (atomically) only when their content differs.
    let ca_copy_written =
        std::fs::read_to_string(&ca_path).ok().as_deref() != Some(ca.certificate_pem());
    if ca_copy_written {
        mesh_credentials::write_secret_file(&ca_path, ca.certificate_pem())?;
        public(&ca_path)?;
    }
    let issued_because = reissue_reason(ca, &cert_path, &key_path, names, now);
    if issued_because.is_some() {
        let issued = ca.issue_server(names, lifetime)?;
        mesh_credentials::write_secret_file(&key_path, issued.key_pem.expose())?;
        mesh_credentials::write_secret_file(&cert_path, &issued.certificate_pem)?;
        public(&cert_path)?;
    }
    let pem = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
    let info = CertInfo::parse(&pem)?;
    Ok(BrokerCertificate {
        issued_because,
        not_after: info.not_after,
        renew_at: info.renew_at(),
        ca_copy_written,
    })
}

/// This host's name (`/proc/sys/kernel/hostname`), lower case; `None` when
/// unreadable.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_made_once_and_half_a_ca_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, made) = ensure_ca(dir.path()).unwrap();
        assert!(made);
        let (again, made) = ensure_ca(dir.path()).unwrap();
        assert!(!made);
        assert_eq!(again.pin(), ca.pin());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = ensure_ca(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("ca.key") && err.contains("join again"),
            "{err}"
        );
    }

    #[test]
    fn names_are_deduplicated() {
        assert_eq!(
            broker_names(Some("192.0.2.2"), Some("VM")),
            vec!["192.0.2.2", "127.0.0.1", "localhost", "vm"]
        );
        assert_eq!(
            broker_names(Some("127.0.0.1"), Some("localhost")),
            vec!["127.0.0.1", "localhost"]
        );
    }

    #[test]
    fn broker_certificate_kept_then_reissued_for_each_reason() {
        let etc = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (ca, _) = ensure_ca(etc.path()).unwrap();
        let names = broker_names(Some("192.0.2.2"), Some("vm"));
        let now = Utc::now();
        let life = Duration::from_secs(90 * 24 * 3600);
        let first = ensure_broker_certificate(&ca, dir.path(), &names, life, now).unwrap();
        assert!(first.issued_because.unwrap().contains("missing"));
        assert!(first.ca_copy_written);
        let pem = std::fs::read_to_string(dir.path().join(BROKER_CERT_FILE)).unwrap();
        pki::verify_chain(&pem, ca.certificate_pem()).unwrap();
        let info = CertInfo::parse(&pem).unwrap();
        assert!(info.dns_names.contains(&"localhost".to_string()));
        assert!(info.ip_addresses.contains(&"192.0.2.2".parse().unwrap()));

        let second = ensure_broker_certificate(&ca, dir.path(), &names, life, now).unwrap();
        assert_eq!(second.issued_because, None, "a second run changes nothing");
        assert!(!second.ca_copy_written);
        assert_eq!(
            std::fs::read_to_string(dir.path().join(BROKER_CERT_FILE)).unwrap(),
            pem
        );

        // Two thirds into its life: issued again.
        let later = first.renew_at + chrono::Duration::seconds(1);
        let renewed = ensure_broker_certificate(&ca, dir.path(), &names, life, later).unwrap();
        assert!(renewed.issued_because.unwrap().contains("third"));

        // Another advertised address: issued again.
        let moved = broker_names(Some("192.0.2.3"), Some("vm"));
        let r = ensure_broker_certificate(&ca, dir.path(), &moved, life, now).unwrap();
        assert!(r.issued_because.unwrap().contains("names"));

        // Another CA: issued again.
        let other_etc = tempfile::tempdir().unwrap();
        let (other, _) = ensure_ca(other_etc.path()).unwrap();
        let r = ensure_broker_certificate(&other, dir.path(), &moved, life, now).unwrap();
        assert!(r.issued_because.unwrap().contains("CA"));
        assert!(r.ca_copy_written);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(BROKER_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
