//! The password file: one `user:hash` per line, the hash an argon2id PHC string
//! (`$argon2id$v=19$m=19456,t=2,p=1$<salt>$<hash>`); blank lines and `#` comments are ignored. Like
//! `mosquitto_passwd`'s format with a modern hash. `mqstate passwd` maintains it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use mqstate_wal::layout::write_file_atomically;

/// Users and their password hashes.
#[derive(Debug, Clone, Default)]
pub struct PasswordFile {
    users: BTreeMap<String, String>,
}

impl PasswordFile {
    pub fn load(path: &Path) -> anyhow::Result<PasswordFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read password file {}", path.display()))?;
        PasswordFile::parse(&text)
            .with_context(|| format!("invalid password file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<PasswordFile> {
        let mut users = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((user, hash)) = line.split_once(':') else {
                bail!("line {}: expected `user:hash`", n + 1);
            };
            if user.is_empty() {
                bail!("line {}: empty user name", n + 1);
            }
            let parsed = PasswordHash::new(hash).map_err(|e| {
                anyhow::anyhow!("line {}: user {user}: not a PHC hash string: {e}", n + 1)
            })?;
            if parsed.algorithm.as_str() != "argon2id" {
                bail!(
                    "line {}: user {user}: hash algorithm {} is not argon2id; reset it with `mqstate passwd`",
                    n + 1,
                    parsed.algorithm
                );
            }
            if users.insert(user.to_owned(), hash.to_owned()).is_some() {
                bail!("line {}: user {user} appears twice", n + 1);
            }
        }
        Ok(PasswordFile { users })
    }

    /// Whether `password` is `user`'s. Slow on purpose (argon2id), for unknown users too.
    pub fn verify(&self, user: &str, password: &[u8]) -> bool {
        // An unknown user is checked against someone else's hash (and refused whatever the result),
        // so a miss costs as much as a wrong password and does not reveal which users exist.
        let (hash, known) = match self.users.get(user) {
            Some(hash) => (hash, true),
            None => match self.users.values().next() {
                Some(decoy) => (decoy, false),
                None => return false,
            },
        };
        let Ok(parsed) = PasswordHash::new(hash) else {
            return false;
        };
        Argon2::default().verify_password(password, &parsed).is_ok() && known
    }

    pub fn len(&self) -> usize {
        self.users.len()
    }

    fn render(&self) -> String {
        self.users
            .iter()
            .map(|(user, hash)| format!("{user}:{hash}\n"))
            .collect()
    }
}

/// An argon2id PHC string for `password` with a fresh salt and the crate's default (OWASP) cost.
pub fn hash_password(password: &[u8]) -> anyhow::Result<String> {
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default()
        .hash_password(password, &salt)
        .map(|h| h.to_string())
        .map_err(|e| anyhow::anyhow!("cannot hash the password: {e}"))
}

/// `mqstate passwd`: add, change or delete a user in a password file.
#[derive(Debug, clap::Args)]
pub struct PasswdArgs {
    /// Create the file (replacing an existing one) instead of updating it.
    #[arg(short = 'c', long = "create", conflicts_with = "delete")]
    create: bool,
    /// Delete the user instead of setting a password.
    #[arg(short = 'D', long = "delete")]
    delete: bool,
    /// Read the password from the first line of standard input instead of prompting (the default
    /// when standard input is not a terminal).
    #[arg(long)]
    password_stdin: bool,
    /// The password file.
    file: PathBuf,
    /// The user name (no `:`).
    user: String,
}

pub fn run(args: PasswdArgs) -> anyhow::Result<()> {
    if args.user.is_empty() || args.user.contains([':', '\n', '\r']) {
        bail!(
            "invalid user name {:?}: it must be non-empty and contain no `:` or line breaks",
            args.user
        );
    }
    let mut file = if args.create {
        PasswordFile::default()
    } else {
        PasswordFile::load(&args.file).context("use -c to create a new password file")?
    };
    if args.delete {
        if file.users.remove(&args.user).is_none() {
            bail!("user {} is not in {}", args.user, args.file.display());
        }
    } else {
        let from_stdin =
            args.password_stdin || !std::io::IsTerminal::is_terminal(&std::io::stdin());
        let password = read_password(from_stdin)?;
        file.users
            .insert(args.user.clone(), hash_password(password.as_bytes())?);
    }
    // Owner-only: the file holds password hashes.
    write_file_atomically(&args.file, file.render().as_bytes(), 0o600)
        .with_context(|| format!("cannot write {}", args.file.display()))
}

fn read_password(from_stdin: bool) -> anyhow::Result<String> {
    let password = if from_stdin {
        let mut line = String::new();
        std::io::stdin()
            .read_line(&mut line)
            .context("cannot read the password from standard input")?;
        let password = line.trim_end_matches(['\r', '\n']).to_owned();
        if password.is_empty() {
            bail!(
                "no password on standard input: pipe it in (`printf '%s\\n' \"$PASSWORD\" | mqstate passwd FILE USER`) or run from a terminal to be asked for it"
            );
        }
        password
    } else {
        let first = rpassword::prompt_password("Password: ").context("cannot read the password")?;
        let again =
            rpassword::prompt_password("Reenter password: ").context("cannot read the password")?;
        if first != again {
            bail!("passwords do not match");
        }
        first
    };
    if password.is_empty() {
        bail!("empty password refused");
    }
    Ok(password)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifies_known_users_only() {
        let hash = hash_password(b"s3cret").unwrap();
        assert!(hash.starts_with("$argon2id$"));
        let file = PasswordFile::parse(&format!("# users\nalice:{hash}\n\n")).unwrap();
        assert_eq!(file.len(), 1);
        assert!(file.verify("alice", b"s3cret"));
        assert!(!file.verify("alice", b"wrong"));
        assert!(
            !file.verify("bob", b"s3cret"),
            "alice's hash stands in for unknown users but never lets them in"
        );
    }

    #[test]
    fn bad_lines_name_the_line() {
        let err = PasswordFile::parse("alice\n").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
        let err = PasswordFile::parse("alice:plaintext\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("PHC"), "{err}");
        let h = hash_password(b"x").unwrap();
        let err = PasswordFile::parse(&format!("a:{h}\na:{h}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("twice"), "{err}");
    }
}
