//! TLS on every hop, with rustls and the ring provider only.
//!
//! - The listener (`server.tls`): a certificate chain and key from PEM files; ALPN offers
//!   `h2` and `http/1.1`.
//! - Upstreams (`https://` URLs): verified against the CA file in the upstream's `tls.ca`,
//!   or without one against the platform's roots (see [`platform_roots`]).
//! - PostgreSQL (`store.postgres.tls.mode`): `disable`; `require` (encrypted, the server's
//!   certificate not checked, as libpq's `sslmode=require`); `verify-full` (the chain checked
//!   against `tls.ca` or the platform's roots, and the host name against the certificate).
//!
//! Files are read when the configuration is applied, and a problem names the file. No
//! bundle path is hard-coded: the platform's roots are found where the distribution keeps
//! them, or where `SSL_CERT_FILE` / `SSL_CERT_DIR` say, and finding none is a config error.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad certificate in {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", path.display()));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("cannot read a private key from {}: {e}", path.display()))
}

/// The listener's certificate and key, replaceable while serving: every handshake takes
/// the pair in place at that moment, so after [`ListenerCert::reload`] (SIGHUP) new
/// connections get the new certificate and open ones keep theirs.
#[derive(Debug)]
pub struct ListenerCert {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    current: std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>,
}

impl ListenerCert {
    /// Reads the pair; a problem names the file.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<ListenerCert>, String> {
        Ok(Arc::new(ListenerCert {
            current: std::sync::RwLock::new(certified(cert, key)?),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        }))
    }

    /// Reads the files again; on a problem the pair in place stays, and the error says why.
    pub fn reload(&self) -> Result<(), String> {
        let fresh = certified(&self.cert, &self.key)?;
        *self.current.write().expect("certificate lock") = fresh;
        Ok(())
    }

    /// The listener's TLS with this certificate: ALPN `h2` then `http/1.1`.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, String> {
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn rustls::server::ResolvesServerCert>);
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

impl rustls::server::ResolvesServerCert for ListenerCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(Arc::clone(&self.current.read().expect("certificate lock")))
    }
}

/// A chain and its key, checked to be a pair.
fn certified(cert: &Path, key: &Path) -> Result<Arc<rustls::sign::CertifiedKey>, String> {
    rustls::sign::CertifiedKey::from_der(load_certs(cert)?, load_key(key)?, &provider())
        .map(Arc::new)
        .map_err(|e| {
            format!(
                "{} and {} do not make a key pair: {e}",
                cert.display(),
                key.display()
            )
        })
}

/// The listener's TLS for a chain and key read once (see [`ListenerCert`] for one that
/// reloads).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    ListenerCert::load(cert, key)?.server_config()
}

/// Roots from a CA file, or the platform's roots without one.
pub fn roots(ca: Option<&Path>) -> Result<RootCertStore, String> {
    let Some(path) = ca else {
        return platform_roots();
    };
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots
            .add(cert)
            .map_err(|e| format!("bad CA certificate in {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// The platform's trusted roots: the files named by `SSL_CERT_FILE` and `SSL_CERT_DIR` when
/// either is set, otherwise the distribution's own store wherever it keeps it (Debian,
/// Red Hat, Alpine, SUSE... each in its own place; the macOS and Windows stores). Read anew
/// each time (at load and at each reload), so a renewed bundle is picked up by a reload.
///
/// None at all is an error, never an empty store: an empty store refuses every certificate,
/// and an operator would see only 502s, far from the cause.
pub fn platform_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _unusable) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let mut msg = "no trusted roots found; set tls.ca or SSL_CERT_FILE".to_string();
        if !found.errors.is_empty() {
            let why: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
            msg.push_str(&format!(" ({})", why.join("; ")));
        }
        return Err(msg);
    }
    for e in &found.errors {
        tracing::warn!(error = %e, "some of the platform's certificates could not be read");
    }
    Ok(roots)
}

/// A verifying client configuration (upstreams, Postgres `verify-full`).
pub fn client_config(ca: Option<&Path>) -> Result<ClientConfig, String> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth())
}

/// An encrypting, not authenticating, client configuration (Postgres `require`).
pub fn unverified_client_config() -> Result<ClientConfig, String> {
    let provider = provider();
    Ok(ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(provider)))
        .with_no_client_auth())
}

/// Accepts any server certificate but still checks the handshake signatures, so the
/// channel is encrypted to whoever holds the key: `sslmode=require`, no more.
#[derive(Debug)]
struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
