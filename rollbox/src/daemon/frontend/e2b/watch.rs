//! envd's directory watches over the agent's `watch` op: the `WatchDir` stream, and the
//! watchers of `CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`, which live here in the
//! daemon, each on its own agent connection, until removed or their sandbox is killed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::client::{AgentClient, ClientError, RawRequest};
use rollbox_agent_protocol::messages::{
    ClientMessage, FsEvent, FsEventKind, ServerMessage, WatchRequest,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::connect::{Code, RpcError};
use super::entry::entry;

/// Most events a polled watcher keeps for `GetWatcherEvents`; past this it stops, and says
/// events were lost.
pub const MAX_QUEUED_EVENTS: usize = 10_000;
/// How long an ended polled watcher keeps its last events and its end for `GetWatcherEvents`.
const KEEP_ENDED: Duration = Duration::from_secs(600);

/// One watch on its own agent connection (dropping it closes the connection, which ends
/// the watch in the agent).
pub struct AgentWatch {
    client: AgentClient,
    request: RawRequest,
    root: String,
    include_entry: bool,
}

/// What a watch produced next: envd `FilesystemEvent`s, or its end.
pub enum Next {
    Events(Vec<Value>),
    Ended(RpcError),
}

impl AgentWatch {
    /// Starts watching `root` (absolute) through `client`, which the watch then owns.
    pub async fn start(
        client: AgentClient,
        root: String,
        recursive: bool,
        include_entry: bool,
        allow_network_mounts: bool,
    ) -> Result<Self, ClientError> {
        let request = client
            .watch(WatchRequest {
                path: root.clone(),
                recursive,
                refuse_network_mounts: !allow_network_mounts,
            })
            .await?;
        Ok(Self {
            client,
            request,
            root,
            include_entry,
        })
    }

    pub async fn next(&mut self) -> Next {
        match self.request.recv_raw().await {
            Ok(ServerMessage::FsEvents { events }) => {
                let mut out = Vec::with_capacity(events.len());
                for event in &events {
                    let entry = match (self.include_entry, event.kind) {
                        (true, FsEventKind::Create | FsEventKind::Write | FsEventKind::Chmod) => {
                            let path =
                                format!("{}/{}", self.root.trim_end_matches('/'), event.name);
                            // The entry may be gone again already; the event goes without it.
                            self.client.lstat(&path).await.ok().map(|info| entry(&info))
                        }
                        _ => None,
                    };
                    out.push(event_json(event, entry));
                }
                Next::Events(out)
            }
            Ok(ServerMessage::Notice { message }) => Next::Ended(RpcError::new(
                Code::ResourceExhausted,
                format!("{message}; the watch stopped"),
            )),
            Ok(ServerMessage::WatchEnded { reason }) => Next::Ended(RpcError::new(
                Code::NotFound,
                format!("watch {}: {reason}", self.root),
            )),
            Ok(ServerMessage::Error(info)) => Next::Ended(RpcError::new(
                Code::Internal,
                format!("watch {}: {}", self.root, info.message),
            )),
            Ok(other) => Next::Ended(RpcError::new(
                Code::Internal,
                format!("watch {}: the agent answered {other:?}", self.root),
            )),
            Err(e) => Next::Ended(RpcError::new(
                Code::Unavailable,
                format!("watch {}: the agent connection broke: {e}", self.root),
            )),
        }
    }

    /// Runs the watch in a task that hands its results over a channel (so a reader may wait
    /// on it and on other things at once); the watch ends when the receiver is dropped.
    pub fn pump(mut self) -> mpsc::Receiver<Next> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = self.next() => next,
                    () = tx.closed() => break,
                };
                let last = matches!(next, Next::Ended(_));
                if tx.send(next).await.is_err() || last {
                    break;
                }
            }
            let _ = self.request.send(ClientMessage::Cancel).await;
            let _ = self.client.close().await;
        });
        rx
    }
}

/// envd's `FilesystemEvent` JSON.
fn event_json(event: &FsEvent, entry: Option<Value>) -> Value {
    let kind = match event.kind {
        FsEventKind::Create => "EVENT_TYPE_CREATE",
        FsEventKind::Write => "EVENT_TYPE_WRITE",
        FsEventKind::Remove => "EVENT_TYPE_REMOVE",
        FsEventKind::Rename => "EVENT_TYPE_RENAME",
        FsEventKind::Chmod => "EVENT_TYPE_CHMOD",
    };
    let mut value = json!({ "name": event.name, "type": kind });
    if let Some(entry) = entry {
        value["entry"] = entry;
    }
    value
}

/// Polled watchers by id.
pub type Watchers = HashMap<String, Arc<Watcher>>;

/// A `CreateWatcher` watcher: its sandbox, the events not yet collected, and its end.
pub struct Watcher {
    pub sandbox: String,
    state: Arc<Mutex<Queue>>,
    task: tokio::task::AbortHandle,
}

#[derive(Default)]
struct Queue {
    events: Vec<Value>,
    ended: Option<(RpcError, Instant)>,
}

fn lock(queue: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    queue.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watcher {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        lock(&self.state)
    }

    /// Starts collecting `watch`'s events for watcher `id`.
    pub fn spawn(id: String, sandbox: String, mut watch: AgentWatch) -> Arc<Self> {
        let state = Arc::new(Mutex::new(Queue::default()));
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let next = watch.next().await;
                let mut queue = lock(&shared);
                match next {
                    Next::Events(events)
                        if queue.events.len() + events.len() > MAX_QUEUED_EVENTS =>
                    {
                        let error = RpcError::new(
                            Code::ResourceExhausted,
                            format!("watcher {id}: more than {MAX_QUEUED_EVENTS} events waited uncollected, so later events were lost and the watcher stopped; collect events more often, then create a new watcher"),
                        );
                        queue.ended = Some((error, Instant::now()));
                        break;
                    }
                    Next::Events(events) => queue.events.extend(events),
                    Next::Ended(error) => {
                        queue.ended = Some((error, Instant::now()));
                        break;
                    }
                }
            }
            // Dropping the watch closes its agent connection.
        });
        Arc::new(Watcher {
            sandbox,
            state,
            task: task.abort_handle(),
        })
    }

    /// The events since the last call; once they are all collected, the watcher's end.
    pub fn take(&self) -> Result<Vec<Value>, RpcError> {
        let mut queue = self.queue();
        if queue.events.is_empty() {
            if let Some((error, _)) = &queue.ended {
                return Err(error.clone());
            }
        }
        Ok(std::mem::take(&mut queue.events))
    }

    /// True for a watcher that ended long enough ago to be forgotten.
    pub fn expired(&self) -> bool {
        self.queue()
            .ended
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() >= KEEP_ENDED)
    }

    /// Stops the watch (its agent connection closes with the task).
    pub fn stop(&self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_use_envd_names() {
        let event = FsEvent {
            name: "sub/a.txt".into(),
            kind: FsEventKind::Rename,
        };
        assert_eq!(
            event_json(&event, None),
            json!({"name": "sub/a.txt", "type": "EVENT_TYPE_RENAME"})
        );
        let event = FsEvent {
            name: "b".into(),
            kind: FsEventKind::Chmod,
        };
        assert_eq!(
            event_json(&event, Some(json!({"name": "b"}))),
            json!({"name": "b", "type": "EVENT_TYPE_CHMOD", "entry": {"name": "b"}})
        );
    }
}
