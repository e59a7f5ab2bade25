//! The official AIO SDK (`azure_iot_operations_services`) as a test client: a Session running in the
//! background plus a state-store client on it, with every call bounded in time.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use azure_iot_operations_mqtt::aio::connection_settings::MqttConnectionSettingsBuilder;
use azure_iot_operations_mqtt::session::reconnect_policy::ExponentialBackoffWithJitter;
use azure_iot_operations_mqtt::session::{
    Session, SessionError, SessionExitHandle, SessionMonitor, SessionOptionsBuilder,
};
use azure_iot_operations_protocol::application::ApplicationContextBuilder;
use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::{
    self, ErrorKind, KeyObservation, ServiceError, SetCondition, SetOptions,
};
use tokio::task::JoinHandle;

/// Upper bound for one wait inside a test (a reply, a notification, a reconnect).
pub const WAIT: Duration = Duration::from_secs(15);
/// The SDK's request timeout (it rounds up to whole seconds and sends it as Message Expiry).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Reconnect quickly while a test restarts the server (the default backs off up to 60 s).
const RECONNECT_MAX_WAIT: Duration = Duration::from_millis(250);

pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {WAIT:?}"))
}

/// Runs a whole test within `bound`: a hang guard, not a performance claim.
pub async fn bounded<T>(bound: Duration, test: impl Future<Output = T>) -> T {
    tokio::time::timeout(bound, test)
        .await
        .expect("test exceeded its time bound")
}

pub async fn next_notification(observation: &mut KeyObservation) -> state_store::KeyNotification {
    within("notification", observation.recv_notification())
        .await
        .expect("notification channel closed")
        .0
}

/// A version as something ordered: later versions compare greater.
pub fn hlc_order(h: &HybridLogicalClock) -> (SystemTime, u64, String) {
    (h.timestamp, h.counter, h.node_id.clone())
}

/// A fencing token `offset_ms` after a wall time 30 s in the past, in whole milliseconds (the
/// text form carries no more).
pub fn token_at(offset_ms: i64, counter: u64) -> HybridLogicalClock {
    let base = SystemTime::now() - Duration::from_secs(30);
    let timestamp = if offset_ms >= 0 {
        base + Duration::from_millis(offset_ms as u64)
    } else {
        base - Duration::from_millis(offset_ms.unsigned_abs())
    };
    let ms = timestamp
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    HybridLogicalClock {
        timestamp: SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
        counter,
        node_id: "sdk-test".into(),
    }
}

pub fn service_error(err: &state_store::Error) -> &ServiceError {
    match err.kind() {
        ErrorKind::ServiceError(e) => e,
        other => panic!("expected a state store service error, got {other:?}"),
    }
}

pub fn with_condition(set_condition: SetCondition) -> SetOptions {
    SetOptions {
        set_condition,
        ..SetOptions::default()
    }
}

/// One SDK client: a Session running in the background plus a state-store client on it.
pub struct SdkClient {
    pub id: String,
    pub store: Arc<state_store::Client>,
    pub monitor: SessionMonitor,
    exit: SessionExitHandle,
    session: JoinHandle<Result<(), SessionError>>,
}

impl SdkClient {
    pub async fn connect(port: u16, id: &str) -> SdkClient {
        let settings = MqttConnectionSettingsBuilder::default()
            .client_id(id)
            .hostname("127.0.0.1")
            .tcp_port(port)
            .use_tls(false)
            .build()
            .unwrap();
        let options = SessionOptionsBuilder::default()
            .connection_settings(settings)
            .reconnect_policy(Box::new(ExponentialBackoffWithJitter {
                max_wait: RECONNECT_MAX_WAIT,
                max_reconnect_attempts: None,
            }))
            .build()
            .unwrap();
        let session = Session::new(options).unwrap();
        let store = state_store::Client::new(
            ApplicationContextBuilder::default().build().unwrap(),
            session.create_managed_client(),
            session.create_session_monitor(),
            state_store::ClientOptionsBuilder::default()
                .build()
                .unwrap(),
        )
        .unwrap();
        let monitor = session.create_session_monitor();
        let exit = session.create_exit_handle();
        let session = tokio::spawn(session.run());
        let mut client = SdkClient {
            id: id.to_string(),
            store: Arc::new(store),
            monitor,
            exit,
            session,
        };
        client.wait_connected().await;
        client
    }

    /// Waits for the session to be connected; fails at once, with the reason, if the session ended
    /// (the SDK ends it with SessionLost when a reconnect's CONNACK has Session Present = 0).
    pub async fn wait_connected(&mut self) {
        let id = self.id.clone();
        within(&format!("{id} connect"), async {
            tokio::select! {
                () = self.monitor.connected() => {}
                ended = &mut self.session => panic!("{id}: session ended before connecting: {ended:?}"),
            }
        })
        .await;
    }

    pub async fn shutdown(self) {
        self.store.shutdown().await.unwrap();
        self.exit.try_exit().unwrap();
        let result = within("session exit", self.session).await.unwrap();
        assert!(result.is_ok(), "{}: session ended with {result:?}", self.id);
    }

    pub async fn set(
        &self,
        key: &[u8],
        value: &[u8],
        options: SetOptions,
    ) -> state_store::Response<bool> {
        self.set_fenced(key, value, None, options).await.unwrap()
    }

    pub async fn set_fenced(
        &self,
        key: &[u8],
        value: &[u8],
        token: Option<HybridLogicalClock>,
        options: SetOptions,
    ) -> Result<state_store::Response<bool>, state_store::Error> {
        within(
            "SET",
            self.store.set(
                key.to_vec(),
                value.to_vec(),
                REQUEST_TIMEOUT,
                token,
                options,
            ),
        )
        .await
    }

    pub async fn get(&self, key: &[u8]) -> state_store::Response<Option<Vec<u8>>> {
        within("GET", self.store.get(key.to_vec(), REQUEST_TIMEOUT))
            .await
            .unwrap()
    }

    pub async fn del(
        &self,
        key: &[u8],
        token: Option<HybridLogicalClock>,
    ) -> Result<state_store::Response<i64>, state_store::Error> {
        within("DEL", self.store.del(key.to_vec(), token, REQUEST_TIMEOUT)).await
    }

    pub async fn vdel(&self, key: &[u8], value: &[u8]) -> i64 {
        within(
            "VDEL",
            self.store
                .vdel(key.to_vec(), value.to_vec(), None, REQUEST_TIMEOUT),
        )
        .await
        .unwrap()
        .response
    }

    pub async fn observe(&self, key: &[u8]) -> KeyObservation {
        within("observe", self.store.observe(key.to_vec(), REQUEST_TIMEOUT))
            .await
            .unwrap()
            .response
    }
}
