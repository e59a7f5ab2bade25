//! A minimal application on the official AIO Rust SDK, configured the AIO way — from `AIO_*`
//! environment variables — and pointed at mqstate (see docs/getting-started.md):
//!
//! ```sh
//! AIO_BROKER_HOSTNAME=127.0.0.1 AIO_BROKER_TCP_PORT=1883 AIO_MQTT_USE_TLS=false \
//! AIO_MQTT_CLIENT_ID=example-app cargo run --example state_store_app
//! ```
//!
//! It sets `greeting`, reads it back, prints it and exits.

use std::time::Duration;

use anyhow::{anyhow, Context};
use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::{Session, SessionOptionsBuilder};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_services::state_store::{self, SetOptions};

const TIMEOUT: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = MqttConnectionSettingsBuilder::from_environment()
        .map_err(|e| anyhow!("invalid AIO_* environment: {e}"))?
        .build()
        .context(
            "incomplete connection settings: set AIO_BROKER_HOSTNAME and AIO_MQTT_CLIENT_ID",
        )?;
    let session = Session::new(
        SessionOptionsBuilder::default()
            .connection_settings(settings)
            // mqstate is a plain MQTT 5 broker, not the AIO broker with its extensions.
            .aio_broker_features(None)
            .build()?,
    )
    .map_err(|e| anyhow!("cannot create the MQTT session: {e}"))?;
    let store = state_store::Client::new(
        ApplicationContextBuilder::default().build()?,
        session.create_managed_client(),
        session.create_session_monitor(),
        state_store::ClientOptionsBuilder::default().build()?,
    )?;
    let exit = session.create_exit_handle();
    let running = tokio::spawn(session.run());

    store
        .set(
            b"greeting".to_vec(),
            b"hello from the AIO SDK".to_vec(),
            TIMEOUT,
            None,
            SetOptions::default(),
        )
        .await?;
    let value = store.get(b"greeting".to_vec(), TIMEOUT).await?.response;
    println!(
        "greeting = {}",
        String::from_utf8_lossy(&value.unwrap_or_default())
    );

    store.shutdown().await?;
    exit.force_exit();
    let _ = running.await;
    Ok(())
}
