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
