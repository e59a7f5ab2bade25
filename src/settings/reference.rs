//! `docs/configuration.md` is rendered from the clap schema of `mqstate serve`; this test fails when the
//! committed file is out of date, so the reference cannot drift from [`super::Settings`].

use std::path::Path;

use clap::CommandFactory;

const REGENERATE: &str = "MQSTATE_UPDATE_DOCS=1 cargo test --bin mqstate configuration_reference";

/// The example settings file shipped in `packaging/`, shown in the reference and checked here.
const EXAMPLE: &str = include_str!("../../packaging/mqstate.toml");

fn serve_command() -> clap::Command {
    crate::Cli::command()
        .find_subcommand("serve")
        .expect("the serve subcommand exists")
        .clone()
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// Splits `"What it is. Default X"` (clap drops the final period) into the description and `X`.
fn split_default(help: &str) -> (String, &str) {
    match help.rsplit_once(". Default") {
        Some((what, default)) => (format!("{what}."), default.trim_start_matches(':').trim()),
        None => (help.to_owned(), ""),
    }
}

fn render() -> String {
    let mut out = format!(
        "# Configuration reference\n\n\
         <!-- Generated from src/settings.rs; do not edit. Regenerate with `{REGENERATE}`. -->\n\n\
         `mqstate serve` reads each setting from, lowest precedence first: the settings file \
         (`--config FILE`: TOML, or JSON when the name ends in `.json`), an `MQSTATE_*` environment \
         variable, and a command-line flag. File keys are the flag names in snake_case. Unknown file keys \
         and invalid values stop the server with an error that names them.\n\n\
         | File key | Flag | Environment | Default | Description |\n\
         |---|---|---|---|---|\n"
    );
    for arg in serve_command().get_arguments() {
        let Some(long) = arg.get_long() else {
            continue; // --help
        };
        let value = arg
            .get_value_names()
            .and_then(|names| names.first())
            .map(|name| format!(" {name}"))
            .unwrap_or_default();
        let key = if arg.get_id() == "config" {
            "—".to_owned()
        } else {
            format!("`{}`", arg.get_id())
        };
        let env = arg
            .get_env()
            .map(|env| format!("`{}`", env.to_string_lossy()))
            .unwrap_or_default();
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let (mut help, default) = split_default(&help);
        let possible: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !possible.is_empty() {
            help.push_str(&format!(" Values: {}.", possible.join(", ")));
        }
        out.push_str(&format!(
            "| {key} | `--{long}{value}` | {env} | {} | {} |\n",
            cell(default),
            cell(&help)
        ));
    }
    out.push_str(&format!(
        "\n## Example settings file\n\n`packaging/mqstate.toml`:\n\n```toml\n{EXAMPLE}```\n"
    ));
    out
}

#[test]
fn configuration_reference_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let rendered = render();
    if std::env::var_os("MQSTATE_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &rendered).expect("write docs/configuration.md");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "docs/configuration.md is out of date with src/settings.rs; regenerate it with `{REGENERATE}`"
    );
}

#[test]
fn every_setting_documents_its_default() {
    for arg in serve_command().get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "config") {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(
            !split_default(&help).1.is_empty(),
            "the help of `{id}` does not end in `. Default <value>`: {help:?}"
        );
    }
}

#[test]
fn the_example_settings_file_is_valid() {
    let rendered = render();
    let example = rendered
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("an example in the reference");
    let settings: super::Settings = toml::from_str(example).expect("the example parses");
    let resolved = settings.resolve().expect("the example resolves");
    crate::auth::check_exposure(&resolved).expect("the example may listen beyond loopback");
}

/// What a help text says the default is, in a form comparable with the value the code uses:
/// backquotes, thousands separators and explanations after ` (` dropped, `N KiB|MiB|GiB` and `N days`
/// converted to bytes and seconds, and `none …` or `off` read as `none`.
fn normalize(default: &str) -> String {
    let text = default.trim().trim_end_matches('.').replace('`', "");
    let lower = text.to_ascii_lowercase();
    if lower.starts_with("none") || lower == "off" {
        return "none".to_owned();
    }
    let head = text.split(" (").next().unwrap_or(&text).trim();
    if let Some((number, unit)) = head.split_once(' ') {
        if let Ok(n) = number.replace(',', "").parse::<u64>() {
            let factor = match unit {
                "KiB" => Some(1 << 10),
                "MiB" => Some(1 << 20),
                "GiB" => Some(1 << 30),
                "days" => Some(86_400),
                _ => None,
            };
            if let Some(factor) = factor {
                return (n * factor).to_string();
            }
        }
    }
    let digits = head.replace(',', "");
    if digits.parse::<u64>().is_ok() {
        return digits;
    }
    head.to_owned()
}

/// The default of every setting as the server uses it: settings resolved with nothing set, then turned
/// into the broker's, the store's and the service's configurations by the code `serve` runs.
fn defaults_in_use() -> std::collections::BTreeMap<&'static str, String> {
    use clap::ValueEnum;

    use super::{Fsync, Settings};

    fn none_or<T: ToString>(value: Option<T>) -> String {
        value.map_or_else(|| "none".to_owned(), |v| v.to_string())
    }
    fn name<T: ValueEnum>(value: T) -> String {
        value
            .to_possible_value()
            .expect("not skipped")
            .get_name()
            .to_owned()
    }

    let single = Settings::default().resolve().expect("the defaults resolve");
    let broker = crate::serve::broker_config(&single);
    let limits = crate::serve::store_limits(&single);
    let tls = Settings {
        listen: vec!["tls://127.0.0.1:8883".to_owned()],
        tls_cert: Some("cert.pem".into()),
        tls_key: Some("key.pem".into()),
        ..Settings::default()
    }
    .resolve()
    .expect("a TLS listener resolves")
    .listen[0]
        .tls
        .clone()
        .expect("a tls:// listener has TLS settings");
    let cluster = Settings {
        node_id: Some(1),
        cluster_listen: Some("127.0.0.1:7001".to_owned()),
        peers: vec!["1=127.0.0.1:7001".to_owned()],
        ..Settings::default()
    }
    .resolve()
    .expect("a one-node cluster resolves")
    .cluster
    .expect("cluster settings");
    assert_eq!(single.listen.len(), 1);
    let global_tls = single.listen[0].tls.as_ref();
    let notify = &single.notify;
    [
        ("listen", single.listen[0].addr.to_string()),
        ("metrics_listen", none_or(single.metrics_listen)),
        ("data_dir", single.data_dir.display().to_string()),
        (
            "fsync",
            match single.fsync {
                Fsync::Always => "always".to_owned(),
                Fsync::Never => "never".to_owned(),
                Fsync::Interval(every) => format!("interval({})", every.as_millis()),
            },
        ),
        ("persistence", name(single.persistence)),
        ("log_format", name(single.log_format)),
        ("log", single.log.clone()),
        ("max_packet_size", broker.max_packet_size.to_string()),
        ("receive_maximum", broker.receive_maximum.to_string()),
        (
            "max_queued_messages",
            broker.max_queued_messages.to_string(),
        ),
        ("max_queued_bytes", broker.max_queued_bytes.to_string()),
        (
            "session_expiry_max",
            broker.session_expiry_max_secs.to_string(),
        ),
        (
            "snapshot_threshold_bytes",
            single.snapshot_threshold_bytes.to_string(),
        ),
        ("max_keys", limits.max_keys.to_string()),
        ("max_bytes", limits.max_total_bytes.to_string()),
        ("max_key_bytes", limits.max_key_bytes.to_string()),
        (
            "max_value_bytes",
            if limits.max_value_bytes == u64::from(broker.max_packet_size) {
                "the maximum packet size".to_owned()
            } else {
                limits.max_value_bytes.to_string()
            },
        ),
        (
            "password_file",
            none_or(single.password_file.as_ref().map(|p| p.display())),
        ),
        (
            "jwt_public_key",
            none_or(single.jwt_public_key.as_ref().map(|p| p.display())),
        ),
        (
            "jwt_audience",
            single
                .jwt_audience
                .clone()
                .unwrap_or_else(|| "not checked".to_owned()),
        ),
        (
            "allow_anonymous",
            match single.allow_anonymous {
                None => "true only when no authentication".to_owned(),
                Some(allow) => allow.to_string(),
            },
        ),
        (
            "acl_file",
            none_or(single.acl_file.as_ref().map(|p| p.display())),
        ),
        ("auth_failure_limit", broker.auth_failure_burst.to_string()),
        (
            "auth_failure_refill",
            broker.auth_failure_refill.as_secs().to_string(),
        ),
        ("tls_cert", none_or(global_tls.map(|t| t.cert.display()))),
        ("tls_key", none_or(global_tls.map(|t| t.key.display()))),
        (
            "tls_client_ca",
            none_or(tls.client_ca.as_ref().map(|p| p.display())),
        ),
        ("tls_client_auth", name(tls.client_auth)),
        ("tls_identity", name(tls.identity)),
        (
            "use_identity_as_client_id",
            tls.use_identity_as_client_id.to_string(),
        ),
        ("max_connections", broker.max_connections.to_string()),
        (
            "max_connections_per_address",
            broker.max_connections_per_address.to_string(),
        ),
        (
            "connect_timeout",
            broker.connect_timeout.as_secs().to_string(),
        ),
        (
            "max_subscriptions_per_session",
            broker.max_subscriptions_per_session.to_string(),
        ),
        ("max_topic_length", broker.max_topic_length.to_string()),
        ("max_topic_levels", broker.max_topic_levels.to_string()),
        (
            "slow_consumer_timeout",
            broker.slow_consumer_timeout.as_secs().to_string(),
        ),
        ("server_keep_alive", none_or(broker.server_keep_alive_secs)),
        (
            "statestore_requests_per_second",
            single.statestore_requests_per_second.to_string(),
        ),
        ("runtime_threads", single.runtime_threads.to_string()),
        ("notify_node_id", notify.node_id.clone()),
        (
            "notify_reservation_timeout_ms",
            notify.reservation_timeout.as_millis().to_string(),
        ),
        (
            "notify_walk_interval_ms",
            notify.walk_interval.as_millis().to_string(),
        ),
        (
            "notify_lock_expiry_ms",
            notify.lock_expiry.as_millis().to_string(),
        ),
        (
            "notify_retry_min_ms",
            notify.retry_min.as_millis().to_string(),
        ),
        (
            "notify_retry_max_ms",
            notify.retry_max.as_millis().to_string(),
        ),
        ("notify_batch", notify.batch_max.to_string()),
        ("notify_linger_ms", notify.linger.as_millis().to_string()),
        (
            "notify_tls_ca_file",
            none_or(notify.tls_ca_file.as_ref().map(|p| p.display())),
        ),
        (
            "node_id",
            none_or(single.cluster.as_ref().map(|c| c.node_id)),
        ),
        ("node_id_from_hostname", "false".to_owned()),
        (
            "cluster_listen",
            none_or(single.cluster.as_ref().map(|c| c.listen)),
        ),
        (
            "peers",
            none_or(single.cluster.as_ref().map(|c| c.peers.len())),
        ),
        ("join", cluster.join.to_string()),
        ("cluster_partitions", cluster.partitions.to_string()),
        ("replication_factor", cluster.replication_factor.to_string()),
        ("cluster_lease", cluster.lease.as_secs().to_string()),
        (
            "cluster_clock_factor",
            cluster.clock_factor.as_secs().to_string(),
        ),
        (
            "cluster_election_timeout",
            cluster.election_timeout.as_millis().to_string(),
        ),
        (
            "cluster_tls_cert",
            none_or(cluster.tls.as_ref().map(|t| t.cert.display())),
        ),
        (
            "cluster_tls_key",
            none_or(cluster.tls.as_ref().map(|t| t.key.display())),
        ),
        (
            "cluster_tls_ca",
            none_or(cluster.tls.as_ref().map(|t| t.ca.display())),
        ),
        ("cluster_plaintext", cluster.plaintext.to_string()),
        ("test_clock_offset_ms", single.clock_offset_ms.to_string()),
    ]
    .into_iter()
    .collect()
}

#[test]
fn every_default_in_the_help_is_the_one_the_code_uses() {
    let mut in_use = defaults_in_use();
    let mut wrong: Vec<String> = Vec::new();
    for arg in serve_command().get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "config") {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let documented = normalize(split_default(&help).1);
        let used = in_use.remove(id).unwrap_or_else(|| {
            panic!("`{id}` is a new setting: add the default the code uses to defaults_in_use()")
        });
        if documented != used {
            wrong.push(format!(
                "`{id}`: the help says the default is {documented:?}, the code uses {used:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        in_use.is_empty(),
        "settings that no longer exist: {in_use:?}"
    );
}

#[test]
fn the_tools_connect_where_the_server_listens_by_default() {
    use mqstate_cli::connection::{DEFAULT_HOST, DEFAULT_PORT};
    assert_eq!(
        format!("{DEFAULT_HOST}:{DEFAULT_PORT}"),
        super::defaults::LISTEN
    );
}

#[test]
fn help_defaults_are_normalized() {
    assert_eq!(normalize("1 MiB"), "1048576");
    assert_eq!(normalize("67108864 (64 MiB)"), "67108864");
    assert_eq!(normalize("10,000,000"), "10000000");
    assert_eq!(normalize("7 days"), "604800");
    assert_eq!(normalize("`info`"), "info");
    assert_eq!(normalize("none: every client may do everything"), "none");
    assert_eq!(normalize("off"), "none");
    assert_eq!(
        normalize("the maximum packet size"),
        "the maximum packet size"
    );
}
