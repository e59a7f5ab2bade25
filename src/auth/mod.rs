//! Authentication and authorization as configured: the password file ([`passwd`]), `K8S-SAT` tokens
//! ([`jwt`]) and the ACL file ([`acl`]), plugged into the broker's ports and the state store's key
//! check. Without any of them the server is open (anonymous clients may do everything), as before.

pub mod acl;
pub mod jwt;
pub mod passwd;

use std::sync::Arc;

use anyhow::bail;
use mqstate_broker::auth::{AllowAll, ConnectAttempt, Refusal};
use mqstate_broker::{Authenticator, Authorizer, Identity, Security};
use mqstate_statestore::access::KeyAccess;
use mqstate_statestore::guard::Guarded;

use crate::settings::Resolved;

/// Whether clients can prove who they are in some way: passwords, tokens, or client certificates
/// on some TLS listener. When they can, anonymous access is off unless `allow_anonymous` says so.
pub fn auth_configured(settings: &Resolved) -> bool {
    settings.password_file.is_some()
        || settings.jwt_public_key.is_some()
        || settings
            .listen
            .iter()
            .any(|l| l.tls.as_ref().is_some_and(|t| t.client_ca.is_some()))
}

/// Refuses to serve anonymous clients on an address beyond this machine unless the operator asked for it
/// (`allow_anonymous = true`), like Mosquitto 2: with no authentication configured, anyone who can reach
/// such a listener could read and write every key and topic. Loopback listeners stay open, so
/// `mqstate serve` on 127.0.0.1 needs no configuration (decision 0024).
pub fn check_exposure(settings: &Resolved) -> anyhow::Result<()> {
    if settings.allow_anonymous.is_some() || auth_configured(settings) {
        return Ok(());
    }
    let exposed: Vec<String> = settings
        .listen
        .iter()
        .filter(|l| !l.addr.ip().is_loopback())
        .map(ToString::to_string)
        .collect();
    if exposed.is_empty() {
        return Ok(());
    }
    bail!(
        "refusing to listen on {} without authentication: anyone who can reach it could read and write \
         everything. Configure passwords (`mqstate passwd -c FILE USER`, then password_file = FILE, \
         --password-file, MQSTATE_PASSWORD_FILE), tokens (jwt_public_key) or client certificates \
         (tls_client_ca); or, to allow anonymous clients on purpose, set allow_anonymous = true \
         (--allow-anonymous true, MQSTATE_ALLOW_ANONYMOUS=true); or listen on 127.0.0.1 only",
        exposed.join(", ")
    )
}

/// The policies `serve` installs: topic rules for the broker, key rules for the state store.
pub struct Policy {
    pub security: Security,
    pub key_access: KeyAccess,
}

pub fn load(settings: &Resolved) -> anyhow::Result<Policy> {
    let allow_anonymous = settings
        .allow_anonymous
        .unwrap_or(!auth_configured(settings));
    if !allow_anonymous && !auth_configured(settings) {
        bail!("allow_anonymous is false but no authentication is configured (password_file, jwt_public_key, tls_client_ca): no client could connect");
    }
    let authenticator: Arc<dyn Authenticator> = if auth_configured(settings) || !allow_anonymous {
        let passwords = match &settings.password_file {
            Some(path) => {
                let file = passwd::PasswordFile::load(path)?;
                tracing::info!(users = file.len(), file = %path.display(), "password file loaded");
                Some(file)
            }
            None => None,
        };
        let tokens = match &settings.jwt_public_key {
            Some(path) => Some(jwt::TokenVerifier::load(
                path,
                settings.jwt_audience.as_deref(),
            )?),
            None => None,
        };
        Arc::new(Configured {
            passwords,
            tokens,
            allow_anonymous,
        })
    } else {
        Arc::new(AllowAll)
    };
    let (topics, key_access): (Arc<dyn Authorizer>, KeyAccess) = match &settings.acl_file {
        Some(path) => {
            let acl = Arc::new(acl::Acl::load(path)?);
            tracing::info!(file = %path.display(), "ACL file loaded");
            (acl.clone(), KeyAccess(acl))
        }
        None => (Arc::new(AllowAll), KeyAccess::default()),
    };
    Ok(Policy {
        security: Security {
            authenticator,
            // The state store's built-in rules hold whatever the ACL says.
            authorizer: Arc::new(Guarded::new(topics)),
        },
        key_access,
    })
}

/// Password file, tokens, client certificates and (if allowed) anonymous clients, in that order.
struct Configured {
    passwords: Option<passwd::PasswordFile>,
    tokens: Option<jwt::TokenVerifier>,
    allow_anonymous: bool,
}

impl Authenticator for Configured {
    fn authenticate(&self, a: &ConnectAttempt) -> Result<Identity, Refusal> {
        let identity = |user: Option<Arc<str>>| Identity {
            user: user.or_else(|| a.cert_identity.clone()),
            cert: a.cert_identity.clone(),
        };
        if let Some(method) = a.auth_method.as_deref() {
            let Some(tokens) = self.tokens.as_ref().filter(|_| method == jwt::METHOD) else {
                tracing::info!(peer = %a.peer, client_id = %a.client_id, method, "unsupported authentication method");
                return Err(Refusal::BadAuthenticationMethod);
            };
            return match tokens.verify(a.auth_data.as_deref().unwrap_or_default()) {
                Ok(sub) => Ok(identity(sub.map(Arc::from))),
                Err(why) => {
                    tracing::info!(peer = %a.peer, client_id = %a.client_id, "K8S-SAT token refused: {why}");
                    Err(Refusal::NotAuthorized)
                }
            };
        }
        if let (Some(user), Some(passwords)) = (&a.username, &self.passwords) {
            let password = a.password.as_deref().unwrap_or_default();
            return if passwords.verify(user, password) {
                Ok(identity(Some(user.clone())))
            } else {
                tracing::info!(peer = %a.peer, client_id = %a.client_id, %user, "wrong password or unknown user");
                Err(Refusal::BadCredentials)
            };
        }
        if a.cert_identity.is_some() {
            return Ok(identity(None));
        }
        if self.allow_anonymous {
            // A user name nobody verified is not an identity.
            return Ok(Identity::default());
        }
        tracing::info!(peer = %a.peer, client_id = %a.client_id, "anonymous client refused");
        Err(Refusal::NotAuthorized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Settings;

    fn resolved(toml_text: &str) -> Resolved {
        let file: Settings = toml::from_str(toml_text).unwrap();
        Settings::default().layer(file).resolve().unwrap()
    }

    #[test]
    fn loopback_without_authentication_needs_no_configuration() {
        assert!(check_exposure(&resolved("")).is_ok());
        assert!(check_exposure(&resolved(r#"listen = ["127.0.0.1:1", "[::1]:2"]"#)).is_ok());
    }

    #[test]
    fn other_addresses_without_authentication_are_refused_naming_the_settings() {
        let err = check_exposure(&resolved(r#"listen = ["127.0.0.1:1", "0.0.0.0:1883"]"#))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tcp://0.0.0.0:1883"), "{err}");
        assert!(!err.contains("127.0.0.1:1"), "{err}");
        assert!(err.contains("allow_anonymous = true"), "{err}");
        assert!(err.contains("password_file"), "{err}");
    }

    #[test]
    fn explicit_anonymous_or_authentication_opens_other_addresses() {
        let anonymous = resolved("listen = [\"0.0.0.0:1883\"]\nallow_anonymous = true");
        assert!(check_exposure(&anonymous).is_ok());
        let passwords = resolved("listen = [\"0.0.0.0:1883\"]\npassword_file = \"/p\"");
        assert!(check_exposure(&passwords).is_ok());
        // `false` is explicit too: then nobody anonymous gets in anywhere (`load` checks the rest).
        let closed = resolved("listen = [\"0.0.0.0:1883\"]\nallow_anonymous = false");
        assert!(check_exposure(&closed).is_ok());
    }
}
