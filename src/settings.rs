//! The one settings schema of `mqstate serve`.
//!
//! Every setting can come from three places, lowest precedence first: the settings file
//! (`--config FILE`, TOML or JSON; default `<data-dir>/../mqstate.settings.json` is *not* implied — a file
//! is read only when named), `MQSTATE_*` environment variables, and command-line flags. One struct,
//! [`Settings`], is both the clap argument group and the serde file schema, so the three cannot drift
//! apart; [`Settings::layer`] merges them field by field and [`Settings::resolve`] applies defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Defaults, named so docs and code agree.
pub mod defaults {
    pub const LISTEN: &str = "127.0.0.1:1883";
    pub const DATA_DIR: &str = "./data";
    pub const MAX_PACKET_SIZE_BYTES: u32 = 1024 * 1024;
    /// Snapshot once the log has grown by this much since the last one.
    pub const SNAPSHOT_THRESHOLD_BYTES: u64 = 64 * 1024 * 1024;
}

/// `fsync` policy of the write-ahead log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// Acknowledge only after `fdatasync` (group commit). The default: nothing acknowledged is lost.
    Always,
    /// `fdatasync` at most every N ms; acknowledged writes of the last interval can be lost in a power cut.
    Interval(Duration),
    /// Leave flushing to the OS; a crash of the machine can lose acknowledged writes.
    Never,
}

impl std::str::FromStr for Fsync {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "always" => Ok(Fsync::Always),
            "never" => Ok(Fsync::Never),
            other => {
                let ms = other
                    .strip_prefix("interval(")
                    .and_then(|r| r.strip_suffix(')'))
                    .or_else(|| other.strip_prefix("interval:"))
                    .ok_or_else(|| {
                        format!(
                            "invalid fsync policy {s:?}: expected always, never or interval(MS)"
                        )
                    })?;
                let ms: u64 = ms.trim().trim_end_matches("ms").parse().map_err(|_| {
                    format!(
                        "invalid fsync interval in {s:?}: expected milliseconds, e.g. interval(10)"
                    )
                })?;
                if ms == 0 {
                    return Err(
                        "fsync interval must be at least 1 ms; use `always` for per-batch fsync"
                            .into(),
                    );
                }
                Ok(Fsync::Interval(Duration::from_millis(ms)))
            }
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Which state-store keys are durable (spec §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Persistence {
    /// Every key is written to the log (the default).
    All,
    /// Only SETs carrying `aio-persistence: true` are written to the log, as in AIO.
    OptIn,
}

/// The settings schema: every field optional here; [`Settings::resolve`] fills defaults.
#[derive(Debug, Clone, Default, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields, rename_all = "snake_case")]
pub struct Settings {
    /// Address to accept MQTT over TCP on (repeatable). Default 127.0.0.1:1883.
    #[arg(
        long = "listen",
        env = "MQSTATE_LISTEN",
        value_delimiter = ',',
        value_name = "ADDR"
    )]
    pub listen: Vec<String>,

    /// Address of the HTTP endpoint with Prometheus `/metrics`, `/health` and `/ready`. Default: off.
    #[arg(long, env = "MQSTATE_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<String>,

    /// Directory of the durable state (log, snapshot, metadata). Default ./data.
    #[arg(long, env = "MQSTATE_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// When to fsync the log: always | interval(MS) | never. Default always.
    #[arg(long, env = "MQSTATE_FSYNC", value_name = "POLICY")]
    pub fsync: Option<String>,

    /// Which state-store keys are durable: all | opt-in. Default all.
    #[arg(long, env = "MQSTATE_PERSISTENCE", value_enum)]
    pub persistence: Option<Persistence>,

    /// Log format: text | json. Default text.
    #[arg(long, env = "MQSTATE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,

    /// Log filter in RUST_LOG syntax (e.g. `info,mqstate_broker=debug`). Default `info`.
    #[arg(long, env = "MQSTATE_LOG", value_name = "FILTER")]
    pub log: Option<String>,

    /// Largest MQTT packet accepted and advertised, in bytes. Default 1 MiB.
    #[arg(long, env = "MQSTATE_MAX_PACKET_SIZE", value_name = "BYTES")]
    pub max_packet_size: Option<u32>,

    /// Receive Maximum advertised to clients. Default 1024.
    #[arg(long, env = "MQSTATE_RECEIVE_MAXIMUM", value_name = "N")]
    pub receive_maximum: Option<u16>,

    /// Messages queued per session while the client is away or slow. Default 1000.
    #[arg(long, env = "MQSTATE_MAX_QUEUED_MESSAGES", value_name = "N")]
    pub max_queued_messages: Option<usize>,

    /// Upper bound on the Session Expiry Interval a client may ask for, in seconds. Default 7 days.
    #[arg(long, env = "MQSTATE_SESSION_EXPIRY_MAX", value_name = "SECS")]
    pub session_expiry_max: Option<u32>,

    /// Take a snapshot (and drop the log it covers) once the log grew by this many bytes. Default 64 MiB.
    #[arg(long, env = "MQSTATE_SNAPSHOT_THRESHOLD", value_name = "BYTES")]
    pub snapshot_threshold_bytes: Option<u64>,

    /// State store: maximum number of keys. Default 10,000,000.
    #[arg(long, env = "MQSTATE_MAX_KEYS", value_name = "N")]
    pub max_keys: Option<u64>,

    /// State store: maximum total bytes of keys + values. Default 1 GiB.
    #[arg(long, env = "MQSTATE_MAX_BYTES", value_name = "BYTES")]
    pub max_bytes: Option<u64>,

    /// State store: maximum key size in bytes. Default 65536.
    #[arg(long, env = "MQSTATE_MAX_KEY_BYTES", value_name = "BYTES")]
    pub max_key_bytes: Option<u64>,

    /// State store: maximum value size in bytes. Default: the maximum packet size.
    #[arg(long, env = "MQSTATE_MAX_VALUE_BYTES", value_name = "BYTES")]
    pub max_value_bytes: Option<u64>,
}

/// Settings with every default applied and every value checked.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub listen: Vec<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub data_dir: PathBuf,
    pub fsync: Fsync,
    pub persistence: Persistence,
    pub log_format: LogFormat,
    pub log: String,
    pub max_packet_size: u32,
    /// The rest default to the broker's and the store's own documented defaults when unset.
    pub receive_maximum: Option<u16>,
    pub max_queued_messages: Option<usize>,
    pub session_expiry_max: Option<u32>,
    pub max_keys: Option<u64>,
    pub max_bytes: Option<u64>,
    pub max_key_bytes: Option<u64>,
    pub max_value_bytes: u64,
    pub snapshot_threshold_bytes: u64,
}

impl Settings {
    /// Read a settings file: TOML, or JSON when the name ends in `.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Settings> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read settings file {}", path.display()))?;
        let parsed = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(anyhow::Error::from)
        } else {
            toml::from_str(&text).map_err(anyhow::Error::from)
        };
        parsed.with_context(|| format!("invalid settings file {}", path.display()))
    }

    /// `self` (flags and environment) over `lower` (the file): each field set here wins.
    pub fn layer(self, lower: Settings) -> Settings {
        Settings {
            listen: if self.listen.is_empty() {
                lower.listen
            } else {
                self.listen
            },
            metrics_listen: self.metrics_listen.or(lower.metrics_listen),
            data_dir: self.data_dir.or(lower.data_dir),
            fsync: self.fsync.or(lower.fsync),
            persistence: self.persistence.or(lower.persistence),
            log_format: self.log_format.or(lower.log_format),
            log: self.log.or(lower.log),
            max_packet_size: self.max_packet_size.or(lower.max_packet_size),
            receive_maximum: self.receive_maximum.or(lower.receive_maximum),
            max_queued_messages: self.max_queued_messages.or(lower.max_queued_messages),
            session_expiry_max: self.session_expiry_max.or(lower.session_expiry_max),
            max_keys: self.max_keys.or(lower.max_keys),
            max_bytes: self.max_bytes.or(lower.max_bytes),
            max_key_bytes: self.max_key_bytes.or(lower.max_key_bytes),
            max_value_bytes: self.max_value_bytes.or(lower.max_value_bytes),
            snapshot_threshold_bytes: self
                .snapshot_threshold_bytes
                .or(lower.snapshot_threshold_bytes),
        }
    }

    pub fn resolve(self) -> anyhow::Result<Resolved> {
        let listen_text = if self.listen.is_empty() {
            vec![defaults::LISTEN.to_owned()]
        } else {
            self.listen
        };
        let mut listen = Vec::with_capacity(listen_text.len());
        for addr in &listen_text {
            let parsed: SocketAddr = addr.parse().with_context(|| {
                format!("invalid listen address {addr:?}: expected IP:PORT, e.g. 127.0.0.1:1883")
            })?;
            listen.push(parsed);
        }
        let metrics_listen = match &self.metrics_listen {
            None => None,
            Some(addr) => Some(addr.parse().with_context(|| {
                format!("invalid metrics listen address {addr:?}: expected IP:PORT, e.g. 127.0.0.1:9090")
            })?),
        };
        let fsync = match self.fsync.as_deref() {
            None => Fsync::Always,
            Some(text) => text.parse().map_err(anyhow::Error::msg)?,
        };
        let max_packet_size = self
            .max_packet_size
            .unwrap_or(defaults::MAX_PACKET_SIZE_BYTES);
        if max_packet_size < 64 {
            bail!("max_packet_size {max_packet_size} is too small: at least 64 bytes");
        }
        if self.receive_maximum == Some(0) {
            bail!("receive_maximum must be at least 1 (MQTT 5 §3.2.2.3.3)");
        }
        Ok(Resolved {
            listen,
            metrics_listen,
            data_dir: self
                .data_dir
                .unwrap_or_else(|| PathBuf::from(defaults::DATA_DIR)),
            fsync,
            persistence: self.persistence.unwrap_or(Persistence::All),
            log_format: self.log_format.unwrap_or(LogFormat::Text),
            log: self.log.unwrap_or_else(|| "info".to_owned()),
            max_packet_size,
            receive_maximum: self.receive_maximum,
            max_queued_messages: self.max_queued_messages,
            session_expiry_max: self.session_expiry_max,
            max_keys: self.max_keys,
            max_bytes: self.max_bytes,
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes.unwrap_or(u64::from(max_packet_size)),
            snapshot_threshold_bytes: self
                .snapshot_threshold_bytes
                .unwrap_or(defaults::SNAPSHOT_THRESHOLD_BYTES),
        })
    }
}

#[cfg(test)]
mod reference;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let r = Settings::default().resolve().unwrap();
        assert_eq!(
            r.listen,
            vec!["127.0.0.1:1883".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(r.data_dir, PathBuf::from("./data"));
        assert_eq!(r.fsync, Fsync::Always);
        assert_eq!(r.metrics_listen, None);
        assert_eq!(
            r.max_value_bytes,
            u64::from(defaults::MAX_PACKET_SIZE_BYTES)
        );
    }

    #[test]
    fn flags_win_over_file_field_by_field() {
        let file: Settings =
            toml::from_str("listen = [\"127.0.0.1:2000\"]\ndata_dir = \"/f\"\nfsync = \"never\"")
                .unwrap();
        let flags = Settings {
            data_dir: Some("/flag".into()),
            ..Settings::default()
        };
        let r = flags.layer(file).resolve().unwrap();
        assert_eq!(r.data_dir, PathBuf::from("/flag"));
        assert_eq!(
            r.listen,
            vec!["127.0.0.1:2000".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(r.fsync, Fsync::Never);
    }

    #[test]
    fn json_file_uses_the_same_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mqstate.settings.json");
        std::fs::write(
            &path,
            r#"{"fsync": "interval(5)", "persistence": "opt-in"}"#,
        )
        .unwrap();
        let r = Settings::from_file(&path).unwrap().resolve().unwrap();
        assert_eq!(r.fsync, Fsync::Interval(Duration::from_millis(5)));
        assert_eq!(r.persistence, Persistence::OptIn);
    }

    #[test]
    fn unknown_file_keys_and_bad_values_are_errors_that_name_the_problem() {
        assert!(toml::from_str::<Settings>("lisen = []").is_err());
        let err = Settings {
            listen: vec!["nonsense".into()],
            ..Settings::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("nonsense"));
        let err = Settings {
            metrics_listen: Some("localhost".into()),
            ..Settings::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("invalid metrics listen address \"localhost\""));
        assert!("interval(x)"
            .parse::<Fsync>()
            .unwrap_err()
            .contains("milliseconds"));
        assert!("interval(0)".parse::<Fsync>().is_err());
    }
}
