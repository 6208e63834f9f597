//! The mesh's public-key infrastructure, defined once for its three users: the
//! bundle (creates the CA, issues the broker's certificate), the controller
//! (connectivity signs nodes' CSRs; the API's HTTPS certificate) and the host
//! agent (its own key, its CSRs, checking what it was issued).
//!
//! Keys are ECDSA P-256, generated where they are used: a node's key never
//! leaves the node (it sends a CSR, [`csr`]); the CA's key never leaves the
//! controller's host. The join pin ([`MeshCa::pin`], [`pin_of`]) is the
//! SHA-256 of the CA certificate's SubjectPublicKeyInfo, as kubeadm's
//! `--discovery-token-ca-cert-hash`.
//!
//! Crypto: rcgen (with ring) to build and sign, x509-parser to read and to
//! verify signatures. Nothing here does network I/O.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use sha2::{Digest, Sha256};
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate};

use crate::Secret;

/// What went wrong with a key, a CSR or a certificate. Never carries key material.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("not a PEM {expected}")]
    NotPem { expected: &'static str },
    #[error("the CSR cannot be read or its signature does not verify: {0}")]
    BadCsr(String),
    #[error("the certificate cannot be read: {0}")]
    BadCertificate(String),
    #[error("the key cannot be read: {0}")]
    BadKey(String),
    #[error("`{0}` is not a DNS name or IP address a certificate can carry")]
    BadName(String),
    #[error("the certificate does not chain to the mesh CA: {0}")]
    NotIssuedByCa(String),
    #[error("the certificate is not valid now (valid {not_before} to {not_after})")]
    Expired {
        not_before: DateTime<Utc>,
        not_after: DateTime<Utc>,
    },
    #[error("the lifetime {0:?} is out of range (1 s to 10 years)")]
    Lifetime(Duration),
    #[error("signing failed: {0}")]
    Sign(String),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] crate::CredentialsError),
}

/// Lifetime of the mesh CA's own certificate.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Longest lifetime anything here signs.
const MAX_LIFETIME: Duration = CA_LIFETIME;
/// Certificates start up to this long before "now", for clocks a little
/// behind; a tenth of the lifetime when that is shorter, so a holder that
/// renews two thirds from `not_before` ([`CertInfo::renew_at`]) renews a
/// little before two thirds of the lifetime from issue, never after, and a
/// short-lived certificate (a test's seconds) is not due at once.
const BACKDATE: Duration = Duration::from_secs(300);

/// A new ECDSA P-256 key, as PKCS#8 PEM.
pub fn new_key() -> Result<Secret<String>, PkiError> {
    let key = KeyPair::generate().map_err(|e| PkiError::Sign(e.to_string()))?;
    Ok(Secret::new(key.serialize_pem()))
}

fn key_pair(key_pem: &str) -> Result<KeyPair, PkiError> {
    KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))
}

/// The SubjectPublicKeyInfo (DER) of a key.
pub fn public_key_der(key_pem: &str) -> Result<Vec<u8>, PkiError> {
    use rcgen::PublicKeyData as _;
    Ok(key_pair(key_pem)?.subject_public_key_info())
}

fn san(name: &str) -> Result<SanType, PkiError> {
    match name.parse::<IpAddr>() {
        Ok(ip) => Ok(SanType::IpAddress(ip)),
        Err(_) => {
            Ok(SanType::DnsName(name.to_owned().try_into().map_err(
                |_| PkiError::BadName(name.chars().take(80).collect()),
            )?))
        }
    }
}

/// A CSR for `common_name` and `names` (DNS names or IP addresses), signed by
/// the key `key_pem`: what a node sends so that its key never leaves it.
pub fn csr(key_pem: &str, common_name: &str, names: &[String]) -> Result<String, PkiError> {
    let key = key_pair(key_pem)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.subject_alt_names = names.iter().map(|n| san(n)).collect::<Result<_, _>>()?;
    params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| PkiError::Sign(e.to_string()))
}

/// A parsed CSR whose self-signature verified: proof that its sender holds
/// the key it asks a certificate for.
pub struct Csr {
    params: CertificateSigningRequestParams,
    common_name: Option<String>,
    names: Vec<String>,
}

impl Csr {
    pub fn parse(pem: &str) -> Result<Csr, PkiError> {
        if !pem.contains("-----BEGIN CERTIFICATE REQUEST-----") {
            return Err(PkiError::NotPem {
                expected: "CERTIFICATE REQUEST",
            });
        }
        let params = CertificateSigningRequestParams::from_pem(pem)
            .map_err(|e| PkiError::BadCsr(e.to_string()))?;
        let common_name = params
            .params
            .distinguished_name
            .get(&DnType::CommonName)
            .map(dn_text);
        let names = params
            .params
            .subject_alt_names
            .iter()
            .map(|s| match s {
                SanType::DnsName(n) => Ok(n.as_str().to_owned()),
                SanType::IpAddress(ip) => Ok(ip.to_string()),
                _ => Err(PkiError::BadCsr(
                    "only DNS names and IP addresses may be requested".into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Csr {
            params,
            common_name,
            names,
        })
    }

    /// The subject's common name, if it has one.
    pub fn common_name(&self) -> Option<&str> {
        self.common_name.as_deref()
    }

    /// The subject alternative names asked for (DNS names and IP addresses).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The SubjectPublicKeyInfo (DER) of the key the CSR is for.
    pub fn public_key_der(&self) -> Vec<u8> {
        use rcgen::PublicKeyData as _;
        self.params.public_key.subject_public_key_info()
    }
}

fn dn_text(v: &rcgen::DnValue) -> String {
    match v {
        rcgen::DnValue::Utf8String(s) => s.clone(),
        rcgen::DnValue::PrintableString(s) => s.as_str().to_owned(),
        rcgen::DnValue::Ia5String(s) => s.as_str().to_owned(),
        other => format!("{other:?}"),
    }
}

/// A certificate the CA signed for a CSR.
#[derive(Debug, Clone)]
pub struct Issued {
    pub certificate_pem: String,
    /// Hex serial number.
    pub serial: String,
    pub not_before: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
}

/// A certificate the CA issued with a key made here, for a server on the CA's
/// own host (the broker, the controller's HTTPS).
pub struct IssuedKey {
    pub certificate_pem: String,
    pub key_pem: Secret<String>,
    pub serial: String,
    pub not_before: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
}

/// The mesh's certificate authority: its certificate and its key.
pub struct MeshCa {
    certificate_pem: String,
    key_pem: Secret<String>,
}

impl std::fmt::Debug for MeshCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshCa")
            .field("pin", &self.pin())
            .field("key", &"[redacted]")
            .finish()
    }
}

fn to_time(t: DateTime<Utc>) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(t.timestamp())
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn window(lifetime: Duration) -> Result<(DateTime<Utc>, DateTime<Utc>), PkiError> {
    if lifetime < Duration::from_secs(1) || lifetime > MAX_LIFETIME {
        return Err(PkiError::Lifetime(lifetime));
    }
    let now = Utc::now();
    let back = chrono::Duration::from_std(BACKDATE.min(lifetime / 10)).unwrap_or_default();
    let life = chrono::Duration::from_std(lifetime).map_err(|_| PkiError::Lifetime(lifetime))?;
    // Whole seconds: what X.509 times carry.
    let now = DateTime::from_timestamp(now.timestamp(), 0).unwrap_or(now);
    Ok((now - back, now + life))
}

fn random_serial() -> (SerialNumber, String) {
    let mut bytes: [u8; 16] = rand::random();
    // Positive and without a leading zero byte: the DER integer is these 16 bytes.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    (SerialNumber::from_slice(&bytes), hex::encode(bytes))
}

impl MeshCa {
    /// A new CA, valid for [`CA_LIFETIME`].
    pub fn generate(common_name: &str) -> Result<MeshCa, PkiError> {
        let key = KeyPair::generate().map_err(|e| PkiError::Sign(e.to_string()))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let (not_before, not_after) = window(CA_LIFETIME)?;
        params.not_before = to_time(not_before);
        params.not_after = to_time(not_after);
        params.serial_number = Some(random_serial().0);
        let cert = params
            .self_signed(&key)
            .map_err(|e| PkiError::Sign(e.to_string()))?;
        Ok(MeshCa {
            certificate_pem: cert.pem(),
            key_pem: Secret::new(key.serialize_pem()),
        })
    }

    /// A CA from its certificate and key; refuses a pair that does not match.
    pub fn from_pem(certificate_pem: &str, key_pem: &str) -> Result<MeshCa, PkiError> {
        let info = CertInfo::parse(certificate_pem)?;
        if info.public_key_der != public_key_der(key_pem)? {
            return Err(PkiError::BadKey(
                "the key is not the CA certificate's key".into(),
            ));
        }
        Ok(MeshCa {
            certificate_pem: certificate_pem.to_owned(),
            key_pem: Secret::new(key_pem.to_owned()),
        })
    }

    pub fn load(certificate_path: &Path, key_path: &Path) -> Result<MeshCa, PkiError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| PkiError::Io {
                path: p.to_owned(),
                source,
            })
        };
        MeshCa::from_pem(&read(certificate_path)?, &read(key_path)?)
    }

    /// Write the certificate (mode 0644) and the key (mode 0600), atomically.
    pub fn write(&self, certificate_path: &Path, key_path: &Path) -> Result<(), PkiError> {
        crate::write_secret_file(key_path, self.key_pem.expose())?;
        crate::write_secret_file(certificate_path, &self.certificate_pem)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(certificate_path, std::fs::Permissions::from_mode(0o644)).map_err(
            |source| PkiError::Io {
                path: certificate_path.to_owned(),
                source,
            },
        )
    }

    pub fn certificate_pem(&self) -> &str {
        &self.certificate_pem
    }

    /// The join pin: `sha256:<hex>` of the CA certificate's SubjectPublicKeyInfo.
    pub fn pin(&self) -> String {
        pin_of(&self.certificate_pem).unwrap_or_default()
    }

    fn issuer(&self) -> Result<Issuer<'static, KeyPair>, PkiError> {
        Issuer::from_ca_cert_pem(&self.certificate_pem, key_pair(self.key_pem.expose())?)
            .map_err(|e| PkiError::BadCertificate(e.to_string()))
    }

    fn leaf_params(
        common_name: &str,
        names: &[String],
        lifetime: Duration,
    ) -> Result<(CertificateParams, String, DateTime<Utc>, DateTime<Utc>), PkiError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.subject_alt_names = names.iter().map(|n| san(n)).collect::<Result<_, _>>()?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let (not_before, not_after) = window(lifetime)?;
        params.not_before = to_time(not_before);
        params.not_after = to_time(not_after);
        let (serial, hex) = random_serial();
        params.serial_number = Some(serial);
        Ok((params, hex, not_before, not_after))
    }

    /// Sign the key of `csr` for `common_name` and `names`, which the caller
    /// decided after checking what the CSR asks for (the CSR's own subject and
    /// extensions are not copied).
    pub fn sign(
        &self,
        csr: &Csr,
        common_name: &str,
        names: &[String],
        lifetime: Duration,
    ) -> Result<Issued, PkiError> {
        let (params, serial, not_before, not_after) =
            Self::leaf_params(common_name, names, lifetime)?;
        let cert = params
            .signed_by(&csr.params.public_key, &self.issuer()?)
            .map_err(|e| PkiError::Sign(e.to_string()))?;
        Ok(Issued {
            certificate_pem: cert.pem(),
            serial,
            not_before,
            not_after,
        })
    }

    /// A certificate for `names` with a key made here.
    pub fn issue_server(
        &self,
        names: &[String],
        lifetime: Duration,
    ) -> Result<IssuedKey, PkiError> {
        let key = KeyPair::generate().map_err(|e| PkiError::Sign(e.to_string()))?;
        let cn = names.first().map_or("mesh", String::as_str);
        let (params, serial, not_before, not_after) = Self::leaf_params(cn, names, lifetime)?;
        let cert = params
            .signed_by(&key, &self.issuer()?)
            .map_err(|e| PkiError::Sign(e.to_string()))?;
        Ok(IssuedKey {
            certificate_pem: cert.pem(),
            key_pem: Secret::new(key.serialize_pem()),
            serial,
            not_before,
            not_after,
        })
    }
}

/// What a certificate says, read from its PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// Hex serial number (no leading zeros beyond the DER's).
    pub serial: String,
    pub common_name: Option<String>,
    pub not_before: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<IpAddr>,
    /// SubjectPublicKeyInfo, DER.
    pub public_key_der: Vec<u8>,
    pub is_ca: bool,
}

fn der_of(pem: &str) -> Result<Vec<u8>, PkiError> {
    let (_, p) =
        x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|_| PkiError::NotPem {
            expected: "CERTIFICATE",
        })?;
    if p.label != "CERTIFICATE" {
        return Err(PkiError::NotPem {
            expected: "CERTIFICATE",
        });
    }
    Ok(p.contents)
}

fn with_cert<T>(
    pem: &str,
    f: impl FnOnce(&X509Certificate<'_>) -> Result<T, PkiError>,
) -> Result<T, PkiError> {
    let der = der_of(pem)?;
    let (_, cert) =
        X509Certificate::from_der(&der).map_err(|e| PkiError::BadCertificate(e.to_string()))?;
    f(&cert)
}

fn utc(t: x509_parser::time::ASN1Time) -> DateTime<Utc> {
    DateTime::from_timestamp(t.timestamp(), 0).unwrap_or_default()
}

impl CertInfo {
    pub fn parse(pem: &str) -> Result<CertInfo, PkiError> {
        with_cert(pem, |c| {
            let mut dns_names = Vec::new();
            let mut ip_addresses = Vec::new();
            let mut is_ca = false;
            for ext in c.extensions() {
                match ext.parsed_extension() {
                    ParsedExtension::SubjectAlternativeName(san) => {
                        for n in &san.general_names {
                            match n {
                                GeneralName::DNSName(d) => dns_names.push((*d).to_owned()),
                                GeneralName::IPAddress(b) => {
                                    if let Ok(a) = <[u8; 4]>::try_from(*b) {
                                        ip_addresses.push(IpAddr::from(a));
                                    } else if let Ok(a) = <[u8; 16]>::try_from(*b) {
                                        ip_addresses.push(IpAddr::from(a));
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    ParsedExtension::BasicConstraints(bc) => is_ca = bc.ca,
                    _ => {}
                }
            }
            let common_name = c
                .subject()
                .iter_common_name()
                .next()
                .and_then(|cn| cn.as_str().ok())
                .map(str::to_owned);
            Ok(CertInfo {
                serial: hex::encode(c.raw_serial()),
                common_name,
                not_before: utc(c.validity().not_before),
                not_after: utc(c.validity().not_after),
                dns_names,
                ip_addresses,
                public_key_der: c.public_key().raw.to_vec(),
                is_ca,
            })
        })
    }

    /// When a holder should renew: two thirds into the validity window. For a
    /// certificate signed here that is a little before two thirds of its
    /// lifetime from issue (the window starts at most a tenth earlier).
    pub fn renew_at(&self) -> DateTime<Utc> {
        self.not_before + (self.not_after - self.not_before) * 2 / 3
    }
}

/// The join pin of a certificate: `sha256:<hex>` of its SubjectPublicKeyInfo.
pub fn pin_of(certificate_pem: &str) -> Result<String, PkiError> {
    let info = CertInfo::parse(certificate_pem)?;
    Ok(pin_of_spki(&info.public_key_der))
}

/// The join pin of a SubjectPublicKeyInfo (DER).
pub fn pin_of_spki(spki_der: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(spki_der)))
}

/// Check that `certificate_pem` was signed by the CA of `ca_pem`, names it as
/// issuer, and is valid now.
pub fn verify_chain(certificate_pem: &str, ca_pem: &str) -> Result<(), PkiError> {
    let ca_der = der_of(ca_pem)?;
    let (_, ca) =
        X509Certificate::from_der(&ca_der).map_err(|e| PkiError::BadCertificate(e.to_string()))?;
    with_cert(certificate_pem, |c| {
        if c.issuer() != ca.subject() {
            return Err(PkiError::NotIssuedByCa(
                "its issuer is not the CA's subject".into(),
            ));
        }
        c.verify_signature(Some(ca.public_key()))
            .map_err(|e| PkiError::NotIssuedByCa(format!("the signature does not verify ({e})")))?;
        let (not_before, not_after) = (utc(c.validity().not_before), utc(c.validity().not_after));
        let now = Utc::now();
        if now < not_before || now > not_after {
            return Err(PkiError::Expired {
                not_before,
                not_after,
            });
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_csr_signed_by_the_ca_chains_to_it_and_certifies_the_csr_key() {
        let ca = MeshCa::generate("mesh CA").unwrap();
        let key = new_key().unwrap();
        let pem = csr(
            key.expose(),
            "node-a",
            &names(&["node-a", "node-a.mesh.internal"]),
        )
        .unwrap();
        let req = Csr::parse(&pem).unwrap();
        assert_eq!(req.common_name(), Some("node-a"));
        assert_eq!(req.names(), names(&["node-a", "node-a.mesh.internal"]));
        let issued = ca
            .sign(
                &req,
                "node-a",
                &names(&["node-a"]),
                Duration::from_secs(3600),
            )
            .unwrap();
        verify_chain(&issued.certificate_pem, ca.certificate_pem()).unwrap();
        let info = CertInfo::parse(&issued.certificate_pem).unwrap();
        assert_eq!(info.common_name.as_deref(), Some("node-a"));
        assert_eq!(info.dns_names, names(&["node-a"]));
        assert_eq!(info.public_key_der, public_key_der(key.expose()).unwrap());
        assert_eq!(info.serial, issued.serial);
        assert_eq!(info.not_after, issued.not_after);
        assert!(!info.is_ca);
        let life = (info.not_after - info.not_before).num_seconds();
        assert_eq!(life, 3600 + 300);
        assert!(info.renew_at() < info.not_after && info.renew_at() > info.not_before);
        // Renewal falls before two thirds from issue, for a short life too.
        let short = ca
            .sign(&req, "node-a", &[], Duration::from_secs(30))
            .unwrap();
        let short_info = CertInfo::parse(&short.certificate_pem).unwrap();
        let issued_at = short_info.not_before + chrono::Duration::seconds(3);
        assert!(short_info.renew_at() > issued_at);
        assert!(short_info.renew_at() <= issued_at + chrono::Duration::seconds(20));
    }

    #[test]
    fn another_ca_does_not_verify_and_a_tampered_csr_is_refused() {
        let ca = MeshCa::generate("mesh CA").unwrap();
        let other = MeshCa::generate("mesh CA").unwrap();
        let server = other
            .issue_server(&names(&["127.0.0.1", "localhost"]), Duration::from_secs(60))
            .unwrap();
        assert!(matches!(
            verify_chain(&server.certificate_pem, ca.certificate_pem()),
            Err(PkiError::NotIssuedByCa(_))
        ));
        verify_chain(&server.certificate_pem, other.certificate_pem()).unwrap();
        let info = CertInfo::parse(&server.certificate_pem).unwrap();
        assert_eq!(
            info.ip_addresses,
            vec!["127.0.0.1".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(info.dns_names, names(&["localhost"]));
        assert_ne!(ca.pin(), other.pin());
        assert!(ca.pin().starts_with("sha256:") && ca.pin().len() == 7 + 64);

        let key = new_key().unwrap();
        let pem = csr(key.expose(), "node-a", &[]).unwrap();
        // Flip one character of the base64 body: the signature no longer verifies.
        let mut lines: Vec<String> = pem.lines().map(str::to_owned).collect();
        let mid = lines.len() / 2;
        let mut chars: Vec<char> = lines[mid].chars().collect();
        chars[10] = if chars[10] == 'A' { 'B' } else { 'A' };
        lines[mid] = chars.into_iter().collect();
        assert!(Csr::parse(&lines.join("\n")).is_err());
        assert!(matches!(Csr::parse("hello"), Err(PkiError::NotPem { .. })));
    }

    #[test]
    fn the_ca_round_trips_through_its_files_and_refuses_a_foreign_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
        let ca = MeshCa::generate("mesh CA").unwrap();
        ca.write(&cert, &key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = MeshCa::load(&cert, &key).unwrap();
        assert_eq!(again.pin(), ca.pin());
        let foreign = new_key().unwrap();
        assert!(MeshCa::from_pem(ca.certificate_pem(), foreign.expose()).is_err());
        assert!(!format!("{ca:?}").contains("PRIVATE"));
        assert!(CertInfo::parse(ca.certificate_pem()).unwrap().is_ca);
    }
}
