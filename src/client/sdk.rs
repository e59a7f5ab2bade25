//! A connected AIO SDK state-store client: the path our users' applications take, so every command
//! that the SDK covers goes through it.

use std::sync::Arc;

use azure_iot_operations_mqtt::session::{
    Session, SessionError, SessionExitHandle, SessionMonitor, SessionOptionsBuilder,
};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_protocol::common::aio_protocol_error::AIOProtocolErrorKind;
use azure_iot_operations_services::state_store;
use tokio::task::JoinHandle;

use super::connection::ConnectionArgs;
use super::error::{is_fencing_rejection, CliError};

/// A state-store client over a running SDK session.
pub struct Store {
    pub client: Arc<state_store::Client>,
    pub client_id: String,
    monitor: SessionMonitor,
    exit: SessionExitHandle,
    session: JoinHandle<Result<(), SessionError>>,
    addr: String,
}

impl Store {
    /// Starts the session and waits until it is connected (or fails, or `--timeout` passes).
    pub async fn connect(conn: &ConnectionArgs) -> Result<Store, CliError> {
        let client_id = conn.client_id("mqstate");
        let addr = conn.addr();
        let connect_error = |reason: String| CliError::Connect {
            addr: addr.clone(),
            reason,
        };
        let options = SessionOptionsBuilder::default()
            .connection_settings(conn.sdk_settings(&client_id)?)
            // Generic MQTT brokers do not know the AIO broker's extensions.
            .aio_broker_features(None)
            .build()
            .map_err(|e| connect_error(e.to_string()))?;
        let session = Session::new(options).map_err(|e| connect_error(e.to_string()))?;
        let context = ApplicationContextBuilder::default()
            .build()
            .map_err(|e| connect_error(e.to_string()))?;
        let client = state_store::Client::new(
            context,
            session.create_managed_client(),
            session.create_session_monitor(),
            state_store::ClientOptionsBuilder::default()
                .build()
                .map_err(|e| connect_error(e.to_string()))?,
        )
        .map_err(|e| connect_error(e.to_string()))?;
        let monitor = session.create_session_monitor();
        let exit = session.create_exit_handle();
        let mut task = tokio::spawn(session.run());
        let connected = tokio::select! {
            () = monitor.connected() => Ok(()),
            ended = &mut task => Err(match ended {
                Ok(Ok(())) => "session ended".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(e) => e.to_string(),
            }),
            () = tokio::time::sleep(conn.timeout()) => {
                Err(format!("not connected within {} s", conn.timeout))
            }
        };
        if let Err(reason) = connected {
            exit.force_exit();
            task.abort();
            return Err(connect_error(reason));
        }
        Ok(Store {
            client: Arc::new(client),
            client_id,
            monitor,
            exit,
            session: task,
            addr,
        })
    }

    /// Resolves when the connection drops (for long-running commands that must notice).
    pub async fn disconnected(&self) -> CliError {
        self.monitor.disconnected().await;
        CliError::ConnectionLost {
            addr: self.addr.clone(),
            reason: "the broker closed the connection".into(),
        }
    }

    /// Shuts the client down and ends the session (DISCONNECT with session expiry 0).
    pub async fn close(self) {
        let _ = self.client.shutdown().await;
        self.exit.force_exit();
        let _ = self.session.await;
    }
}

/// Maps an SDK state-store error for `command` onto the CLI's error.
pub fn map_error(
    command: &str,
    addr: &str,
    timeout_s: u64,
    error: &state_store::Error,
) -> CliError {
    match error.kind() {
        state_store::ErrorKind::ServiceError(service) => {
            let text = service.to_string();
            CliError::Service {
                command: command.to_owned(),
                condition: is_fencing_rejection(&text),
                text,
            }
        }
        state_store::ErrorKind::AIOProtocolError(e) if e.kind == AIOProtocolErrorKind::Timeout => {
            CliError::Timeout {
                command: command.to_owned(),
                timeout_s,
            }
        }
        state_store::ErrorKind::AIOProtocolError(e)
            if matches!(
                e.kind,
                AIOProtocolErrorKind::ClientError | AIOProtocolErrorKind::Cancellation
            ) =>
        {
            CliError::ConnectionLost {
                addr: addr.to_owned(),
                reason: e.to_string(),
            }
        }
        state_store::ErrorKind::InvalidArgument(reason) => CliError::usage(command, reason.clone()),
        other => CliError::Protocol {
            command: command.to_owned(),
            detail: other.to_string(),
        },
    }
}
