//! Test certificates, made with rcgen: a CA and a leaf for `localhost` and 127.0.0.1, as
//! PEM files in a temporary directory removed on drop.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

pub struct TestPki {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestPki {
    /// A fresh CA and a server certificate it signed.
    pub fn new() -> TestPki {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-pki-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "idemgate test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &issuer).unwrap();
        let pki = TestPki {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            dir,
        };
        std::fs::write(&pki.ca, ca_cert.pem()).unwrap();
        std::fs::write(&pki.cert, &pki.cert_pem).unwrap();
        std::fs::write(&pki.key, &pki.key_pem).unwrap();
        pki
    }

    /// A rustls server configuration for this certificate (for test upstreams).
    pub fn server_config(&self) -> std::sync::Arc<rustls::ServerConfig> {
        idemgate::tls::server_config(&self.cert, &self.key).unwrap()
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
