//! `K8S-SAT` enhanced authentication: the CONNECT's Authentication Data is a signed JWT (a Kubernetes
//! service-account token), verified against one configured public key (RS256 or ES256, PEM). The
//! signature, `exp` (required), `nbf` (when present) and, when configured, `aud` are checked with
//! jsonwebtoken's default 60 s clock-skew leeway. The token's `sub` becomes the user name.

use std::path::Path;

use anyhow::Context;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

/// The Authentication Method the AIO SDKs send with a service-account token.
pub const METHOD: &str = "K8S-SAT";

pub struct TokenVerifier {
    key: DecodingKey,
    validation: Validation,
}

#[derive(Deserialize)]
struct Claims {
    sub: Option<String>,
}

impl TokenVerifier {
    pub fn load(path: &Path, audience: Option<&str>) -> anyhow::Result<TokenVerifier> {
        let pem = std::fs::read(path)
            .with_context(|| format!("cannot read the JWT public key {}", path.display()))?;
        TokenVerifier::from_pem(&pem, audience)
            .with_context(|| format!("invalid JWT public key {}", path.display()))
    }

    pub fn from_pem(pem: &[u8], audience: Option<&str>) -> anyhow::Result<TokenVerifier> {
        let (key, algorithm) = match DecodingKey::from_rsa_pem(pem) {
            Ok(key) => (key, Algorithm::RS256),
            Err(_) => (
                DecodingKey::from_ec_pem(pem)
                    .context("expected an RSA (RS256) or P-256 EC (ES256) public key in PEM")?,
                Algorithm::ES256,
            ),
        };
        let mut validation = Validation::new(algorithm);
        validation.set_required_spec_claims(&["exp"]);
        validation.validate_nbf = true;
        match audience {
            Some(aud) => validation.set_audience(&[aud]),
            None => validation.validate_aud = false,
        }
        Ok(TokenVerifier { key, validation })
    }

    /// The token's subject, if the token is valid. `Err` says why not (for the log, never the client).
    pub fn verify(&self, token: &[u8]) -> Result<Option<String>, String> {
        let token = std::str::from_utf8(token)
            .map_err(|_| "token is not UTF-8".to_owned())?
            .trim();
        jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation)
            .map(|data| data.claims.sub)
            .map_err(|e| e.to_string())
    }
}
