//! The E2B server's state: the core it runs actions on, the key, and what envd keeps between
//! requests (the processes started through it, the polled directory watchers, who requests
//! run as).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::client::AgentClient;
use serde_json::Value;
use tokio::sync::mpsc;

use super::super::super::api::Volume;
use super::super::super::core::Core;
use super::watch;

/// The E2B server's state.
pub struct E2b {
    pub core: Arc<Core>,
    /// The `--api-key-file` (admin) key: where envd access tokens come from (a request's
    /// `X-API-KEY` is checked by the core's keys).
    pub api_key: String,
    /// The `domain` sandboxes report.
    pub domain: String,
    pub processes: Mutex<Processes>,
    /// `CreateWatcher` watchers, by id.
    pub watchers: Mutex<watch::Watchers>,
    /// Numbers watcher ids.
    pub next_watcher: std::sync::atomic::AtomicU64,
    /// Who requests run as, by (sandbox id, the user a request named).
    pub accounts: Mutex<Accounts>,
}

/// Who a request runs as: the agent's user (None: the agent's own, root) and the home its
/// paths resolve in (`call.rs` decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub user: Option<String>,
    pub home: String,
}

/// (sandbox id, the user a request named) → who it runs as.
pub type Accounts = HashMap<(String, Option<String>), RunAs>;
/// Remembered accounts beyond which the table starts over (sandboxes that ended uncounted).
const MAX_ACCOUNTS: usize = 4096;

impl E2b {
    pub fn processes(&self) -> MutexGuard<'_, Processes> {
        self.processes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn accounts(&self) -> MutexGuard<'_, Accounts> {
        self.accounts.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn remember_account(&self, key: (String, Option<String>), run_as: RunAs) {
        let mut accounts = self.accounts();
        if accounts.len() >= MAX_ACCOUNTS {
            accounts.clear();
        }
        accounts.insert(key, run_as);
    }

    pub fn watchers(&self) -> MutexGuard<'_, watch::Watchers> {
        self.watchers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The envd access token of sandbox `id`: derived from the API key, so it survives a
    /// daemon restart and needs no storage.
    pub fn access_token(&self, id: &str) -> String {
        use sha2::Digest as _;
        let mut hash = sha2::Sha256::new();
        hash.update(b"rollbox-e2b-envd\0");
        hash.update(self.api_key.trim().as_bytes());
        hash.update(b"\0");
        hash.update(id.as_bytes());
        crate::images::digest::to_hex(&hash.finalize()[..16])
    }

    /// The traffic access token of sandbox `id` (E2B's `trafficAccessToken`): what a request
    /// to its other ports carries as `e2b-traffic-access-token` when it is not public. An HMAC
    /// of the id under the API key, so it survives a restart and needs no storage.
    pub fn traffic_token(&self, id: &str) -> String {
        super::signature::derived_token(&self.api_key, "rollbox-e2b-traffic", id)
    }

    /// The token of an E2B volume (`VolumeAndToken.token`): an HMAC of its name, creation
    /// time and tenant under the API key, so a volume made again under the same name (by
    /// anyone) gets another. Stored nowhere; a restart gives the same.
    pub fn volume_token(&self, volume: &Volume) -> String {
        let id = format!(
            "{}\0{}\0{}",
            volume.name,
            volume.created_at_ms,
            volume.tenant.as_deref().unwrap_or("")
        );
        super::signature::derived_token(&self.api_key, "rollbox-e2b-volume", &id)
    }

    /// Drops the process table entries and stops the watchers of a sandbox that ended; the
    /// streams of its running processes end with the error envd's proxy answers (the
    /// sandbox was not found), which the SDK raises as `SandboxNotRunningException`.
    pub fn forget_processes(&self, id: &str) {
        let gone = gone_event(id);
        self.processes().retain(|(sandbox, _), process| {
            if sandbox != id {
                return true;
            }
            let mut state = process.subscribers();
            if state.ended.is_none() {
                // A stream whose queue is full gets the end when its client reads again.
                for subscriber in state.subscribers.drain(..) {
                    let gone = gone.clone();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(SUBSCRIBER_STALL, subscriber.send(gone)).await;
                    });
                }
                state.ended = Some((gone.clone(), Instant::now()));
            }
            false
        });
        self.accounts().retain(|(sandbox, _), _| sandbox != id);
        self.watchers().retain(|_, watcher| {
            let keep = watcher.sandbox != id;
            if !keep {
                watcher.stop();
            }
            keep
        });
    }
}

/// The key of the event that ends a process's streams because its sandbox is gone.
pub const GONE_KEY: &str = "sandboxGone";

/// The event that ends a process's streams when its sandbox was killed: its message is what
/// envd's proxy answers for a sandbox that is not there ("was not found").
pub fn gone_event(id: &str) -> Value {
    serde_json::json!({
        GONE_KEY: format!("The sandbox {id} was not found: it was killed while the process ran")
    })
}

/// Processes started through envd: (sandbox id, pid) → the process.
pub type Processes = HashMap<(String, u32), Arc<Process>>;

/// A process started through envd's `Start`.
pub struct Process {
    /// `ProcessConfig` as `List` shows it.
    pub config: Value,
    pub tag: Option<String>,
    pub stdin: bool,
    /// Runs on a terminal (`Start` with `pty`).
    pub pty: bool,
    pub client: AgentClient,
    /// The exec's request id on `client`: where the agent takes stdin and signals.
    pub request: u64,
    pub state: Mutex<Subscribers>,
}

/// Events queued for one stream (output events are at most 64 KiB of data each).
pub const SUBSCRIBER_EVENTS: usize = 32;
/// How long the pump waits for a stream to take an event before dropping it (its stream
/// ends): one stuck client cannot stop the process's output to the others for longer.
pub const SUBSCRIBER_STALL: Duration = Duration::from_secs(30);

/// Who gets a process's events, and its end once it ended.
#[derive(Default)]
pub struct Subscribers {
    /// Each stream's bounded queue (`process.rs` waits for room).
    pub subscribers: Vec<mpsc::Sender<Value>>,
    /// The `end` event, once the process ended, and when.
    pub ended: Option<(Value, Instant)>,
}

impl Process {
    pub fn subscribers(&self) -> MutexGuard<'_, Subscribers> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
