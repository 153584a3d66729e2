//! The trust roots of Hangar's TLS clients: webhooks sent over `https`
//! and Redis reached over `rediss`.
//!
//! Certificates are verified by rustls (with *ring* as its cryptography;
//! no OpenSSL). A server's certificate must chain to a trusted root and
//! name the host the client was asked for. The trusted roots are, by
//! default, the Mozilla root program's CAs as the `webpki-roots` crate
//! compiles them into the binary — chosen over the platform's store
//! (`rustls-native-certs`) because it is the same set on every machine: a
//! slim container image often has no `/etc/ssl/certs` at all, and what
//! Hangar trusts should be decided in its configuration, not by whatever
//! an image installed. The set changes with a Hangar release.
//!
//! A private CA (an internal webhook receiver, a Redis with its own
//! certificate) is given as a PEM file, a [`CaFile`]: read and checked
//! when the configuration is loaded, so a missing or malformed file is an
//! error naming the setting and the path before anything starts.
//! Webhooks trust it in addition to the default roots; Redis trusts only
//! it (docs/cluster.md).

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// Why a CA file cannot be used. Each names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaFileError {
    /// A relative path: the servers that read it may run from another
    /// directory than the one it was written for.
    #[error("`{0}` is a relative path: give the CA file's absolute path")]
    Relative(PathBuf),
    /// The file cannot be read.
    #[error("cannot read the CA file `{path}`: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A `CERTIFICATE` block that is not valid PEM.
    #[error("the CA file `{path}` is not valid PEM: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What the PEM parser said.
        reason: String,
    },
    /// No `-----BEGIN CERTIFICATE-----` block in the file.
    #[error("the CA file `{0}` holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)")]
    Empty(PathBuf),
    /// A certificate that cannot serve as a trust root.
    #[error("certificate {index} of the CA file `{path}` cannot be a trust root: {reason}")]
    NotARoot {
        /// The file.
        path: PathBuf,
        /// 1-based position of the certificate in the file.
        index: usize,
        /// What rustls said.
        reason: String,
    },
}

/// The certificates of a PEM file of CAs to trust, checked: at least one,
/// each usable as a trust root.
#[derive(Clone)]
pub struct CaFile {
    path: PathBuf,
    pem: Vec<u8>,
    certificates: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for CaFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaFile")
            .field("path", &self.path)
            .field("certificates", &self.certificates.len())
            .finish()
    }
}

impl CaFile {
    /// Reads and checks the PEM file at `path` (absolute). Blocks other
    /// than `CERTIFICATE` (a key, a comment) are skipped.
    pub fn load(path: &Path) -> Result<CaFile, CaFileError> {
        if path.is_relative() {
            return Err(CaFileError::Relative(path.to_owned()));
        }
        let pem =
            std::fs::read(path).map_err(|source| CaFileError::Read { path: path.to_owned(), source })?;
        let certificates = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CaFileError::Pem { path: path.to_owned(), reason: e.to_string() })?;
        if certificates.is_empty() {
            return Err(CaFileError::Empty(path.to_owned()));
        }
        let mut store = rustls::RootCertStore::empty();
        for (i, certificate) in certificates.iter().enumerate() {
            store.add(certificate.clone()).map_err(|e| CaFileError::NotARoot {
                path: path.to_owned(),
                index: i + 1,
                reason: e.to_string(),
            })?;
        }
        Ok(CaFile { path: path.to_owned(), pem, certificates })
    }

    /// Where it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its certificates (DER), in file order.
    pub fn certificates(&self) -> &[CertificateDer<'static>] {
        &self.certificates
    }

    /// The file as read.
    pub fn pem(&self) -> &[u8] {
        &self.pem
    }
}

/// Makes *ring* the process's rustls cryptography unless one is set
/// already: a client built with rustls's defaults then never depends on
/// which provider features the rest of the build happens to enable.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(feature = "test-ca")]
pub use test_ca::TestCa;

#[cfg(feature = "test-ca")]
mod test_ca {
    use std::path::Path;

    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

    /// A throwaway certificate authority for tests and benchmarks (with
    /// the `test-ca` feature): a fresh key and self-signed CA certificate
    /// each time, issuing server certificates for the names asked.
    pub struct TestCa {
        issuer: CertifiedIssuer<'static, KeyPair>,
    }

    impl std::fmt::Debug for TestCa {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("TestCa").finish_non_exhaustive()
        }
    }

    impl TestCa {
        /// A new CA called `name` (its certificate's common name).
        pub fn new(name: &str) -> TestCa {
            let mut params = CertificateParams::new(Vec::new()).expect("no names to parse");
            params.distinguished_name.push(DnType::CommonName, name);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate().expect("ring generates a P-256 key");
            TestCa { issuer: CertifiedIssuer::self_signed(params, key).expect("a CA signs itself") }
        }

        /// The CA certificate, PEM.
        pub fn pem(&self) -> String {
            self.issuer.pem()
        }

        /// A server certificate for `names` (host names or IP addresses,
        /// as subject alternative names) and its private key, both PEM.
        pub fn issue(&self, names: &[&str]) -> (String, String) {
            let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("test names are valid");
            let key = KeyPair::generate().expect("ring generates a P-256 key");
            let certificate = params.signed_by(&key, &self.issuer).expect("the CA signs");
            (certificate.pem(), key.serialize_pem())
        }

        /// A rustls server configuration (with *ring*) presenting a
        /// certificate for `names` that this CA issued: what a test's
        /// `https` server needs.
        pub fn server_config(&self, names: &[&str]) -> rustls::ServerConfig {
            use rustls::pki_types::pem::PemObject;
            use rustls::pki_types::{CertificateDer, PrivateKeyDer};
            let (cert, key) = self.issue(names);
            let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .expect("ring supports the default versions")
                .with_no_client_auth()
                .with_single_cert(
                    vec![CertificateDer::from_pem_slice(cert.as_bytes()).expect("rcgen writes PEM")],
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("rcgen writes PEM"),
                )
                .expect("the key matches its certificate")
        }

        /// Writes the CA certificate to `path`.
        pub fn write(&self, path: &Path) -> std::io::Result<()> {
            std::fs::write(path, self.pem())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_is_checked_when_loaded_and_each_refusal_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("hangar test CA");
        let good = dir.path().join("ca.pem");
        // A key block beside the certificate is skipped.
        let (_, key) = ca.issue(&["localhost"]);
        std::fs::write(&good, format!("{key}{}", ca.pem())).unwrap();
        let loaded = CaFile::load(&good).unwrap();
        assert_eq!(loaded.certificates().len(), 1);
        assert_eq!(loaded.path(), good);

        let e = CaFile::load(Path::new("ca.pem")).unwrap_err();
        assert!(matches!(e, CaFileError::Relative(_)), "{e}");
        let missing = dir.path().join("missing.pem");
        let e = CaFile::load(&missing).unwrap_err().to_string();
        assert!(e.contains("cannot read") && e.contains("missing.pem"), "{e}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, key).unwrap();
        let e = CaFile::load(&empty).unwrap_err().to_string();
        assert!(e.contains("no PEM certificate") && e.contains("empty.pem"), "{e}");
        let garbled = dir.path().join("garbled.pem");
        std::fs::write(&garbled, "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
            .unwrap();
        let e = CaFile::load(&garbled).unwrap_err().to_string();
        assert!(e.contains("garbled.pem"), "{e}");
        let not_der = dir.path().join("not-der.pem");
        std::fs::write(&not_der, "-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n")
            .unwrap();
        let e = CaFile::load(&not_der).unwrap_err();
        assert!(matches!(e, CaFileError::NotARoot { index: 1, .. }), "{e}");
    }
}
