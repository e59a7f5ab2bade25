//! TLS of `https://` and `mqtts://` endpoints (rustls with the ring provider, like the CLI and the
//! broker): trusting the CA certificates of `notify_tls_ca_file`, or the system's roots without one.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
pub use rustls::ClientConfig;
use rustls::RootCertStore;

/// The client configuration of TLS endpoints; the error says what is wrong with the CA file.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("{}: invalid PEM: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("{}: no PEM CERTIFICATE in it", path.display()));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| format!("{}: not a usable CA certificate: {e}", path.display()))?;
            }
        }
        None => {
            let certs = rustls_native_certs::load_native_certs()
                .map_err(|e| format!("cannot read the system's CA certificates: {e}"))?;
            let (added, _unusable) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(
                    "no usable CA certificate among the system's: set notify_tls_ca_file".into(),
                );
            }
        }
    }
    // Explicit provider: no reliance on a process-wide default being installed.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_ca_file_is_named_in_the_error() {
        let dir = std::env::temp_dir().join(format!("mqstate-notify-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = client_config(Some(&empty)).unwrap_err();
        assert!(
            error.contains("empty.pem") && error.contains("no PEM CERTIFICATE"),
            "{error}"
        );
        let missing = dir.join("missing.pem");
        assert!(client_config(Some(&missing))
            .unwrap_err()
            .contains("missing.pem"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
