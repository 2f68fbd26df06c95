//! envd's `filesystem.Filesystem`: Stat, ListDir, MakeDir, Move, Remove, and directory
//! watches: the `WatchDir` stream and the polled watchers (`CreateWatcher`, `GetWatcherEvents`,
//! `RemoveWatcher`; see watch.rs).

use std::sync::Arc;
use std::time::Duration;

use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use rollbox_agent_protocol::messages::FileKind;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::super::api::{Chunk, MAX_BODY};
use super::super::transport::Out;
use super::call::{connect_stream_response, decode, keepalive_of, read_body, rpc_error, Call};
use super::connect::{self, Code, RpcError};
use super::entry::entry;
use super::watch::{AgentWatch, Next, Watcher};

/// Deepest `ListDir` recursion.
const MAX_DEPTH: u32 = 32;
/// The most entries one `ListDir` answers (a guest's directories are the guest's to fill).
pub const MAX_LIST_ENTRIES: usize = 50_000;
/// The most JSON bytes of entries one `ListDir` answers.
pub const MAX_LIST_BYTES: usize = 32 << 20;

/// Counts a listing's entries and bytes against [`MAX_LIST_ENTRIES`] and [`MAX_LIST_BYTES`].
#[derive(Default)]
struct ListBudget {
    entries: usize,
    bytes: usize,
}

impl ListBudget {
    /// Takes `entry` (its JSON) out of the budget; past a cap, the error says which, and how
    /// to ask for less.
    fn take(&mut self, entry: &Value, path: &str, depth: u32) -> Result<(), RpcError> {
        self.entries += 1;
        self.bytes += entry.to_string().len();
        let over = if self.entries > MAX_LIST_ENTRIES {
            format!("more than {MAX_LIST_ENTRIES} entries")
        } else if self.bytes > MAX_LIST_BYTES {
            format!("more than {MAX_LIST_BYTES} bytes of entries")
        } else {
            return Ok(());
        };
        Err(RpcError::new(
            Code::InvalidArgument,
            format!("path {path}: the listing at depth {depth} has {over} (the cap of one ListDir); list a subdirectory or pass a smaller depth"),
        ))
    }
}

#[derive(Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, rename = "includeEntry", alias = "include_entry")]
    include_entry: bool,
    /// Watch a directory on a network file system too (envd 0.6.4; refused by default).
    #[serde(default, rename = "allowNetworkMounts", alias = "allow_network_mounts")]
    allow_network_mounts: bool,
    #[serde(default, rename = "watcherId", alias = "watcher_id")]
    watcher_id: String,
    #[serde(default)]
    depth: Option<u32>,
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

impl Call {
    pub async fn filesystem_call(&self, method: &str, body: &[u8]) -> Result<Value, RpcError> {
        let request: PathRequest = decode(body, method)?;
        match method {
            "CreateWatcher" => return self.create_watcher(&request).await,
            "GetWatcherEvents" => {
                let watcher = self.watcher(&request.watcher_id)?;
                let taken = watcher.take();
                if taken.is_err() {
                    // The end is told once; the watcher is gone after it.
                    self.e2b.watchers().remove(&request.watcher_id);
                }
                return taken.map(|events| json!({ "events": events }));
            }
            "RemoveWatcher" => {
                let watcher = self.watcher(&request.watcher_id)?;
                watcher.stop();
                self.e2b.watchers().remove(&request.watcher_id);
                return Ok(json!({}));
            }
            "WatchDir" => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    "filesystem.Filesystem/WatchDir is a server stream: send it as application/connect+json",
                ))
            }
            _ => {}
        }
        let client = self.agent().await?;
        let fail = |e| rpc_error(self.id(), e);
        let result = match method {
            "Stat" => {
                let info = client
                    .lstat(&self.resolve(&request.path))
                    .await
                    .map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "ListDir" => {
                let depth = request.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
                let root = self.resolve(&request.path);
                let mut budget = ListBudget::default();
                let mut entries = Vec::new();
                let mut dirs = vec![(root.clone(), 1)];
                while let Some((dir, level)) = dirs.pop() {
                    for info in client.list(&dir).await.map_err(fail)? {
                        if info.kind == FileKind::Dir && level < depth {
                            dirs.push((info.path.clone(), level + 1));
                        }
                        let value = entry(&info);
                        if let Err(e) = budget.take(&value, &root, depth) {
                            let _ = client.close().await;
                            return Err(e);
                        }
                        entries.push(value);
                    }
                }
                Ok(json!({ "entries": entries }))
            }
            "MakeDir" => {
                let path = self.resolve(&request.path);
                if client.lstat(&path).await.is_ok() {
                    return Err(RpcError::new(
                        Code::AlreadyExists,
                        format!("path: {path} already exists"),
                    ));
                }
                // envd gives the directory, and the parents it makes, to the user.
                client
                    .mkdir_owned(&path, true, self.user.as_deref())
                    .await
                    .map_err(fail)?;
                let info = client.lstat(&path).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Move" => {
                let (from, to) = (
                    self.resolve(&request.source),
                    self.resolve(&request.destination),
                );
                client.rename(&from, &to).await.map_err(fail)?;
                let info = client.lstat(&to).await.map_err(fail)?;
                Ok(json!({ "entry": entry(&info) }))
            }
            "Remove" => {
                client
                    .remove(&self.resolve(&request.path), true)
                    .await
                    .map_err(fail)?;
                Ok(json!({}))
            }
            other => Err(RpcError::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other}: no such method"),
            )),
        };
        let _ = client.close().await;
        result
    }

    /// Starts a watch of `request.path` on a new agent connection.
    async fn open_watch(&self, request: &PathRequest) -> Result<(String, AgentWatch), RpcError> {
        let path = self.resolve(&request.path);
        let client = self.agent().await?;
        let watch = AgentWatch::start(
            client,
            path.clone(),
            request.recursive,
            request.include_entry,
            request.allow_network_mounts,
        )
        .await
        .map_err(|e| rpc_error(self.id(), e))?;
        Ok((path, watch))
    }

    /// `WatchDir`: `start`, then `filesystem` events (and `keepalive`s) until the client goes
    /// or the watch ends, which the end envelope reports.
    pub async fn watch_dir(&self, request: Request<Incoming>) -> Response<Out> {
        let keepalive = keepalive_of(&request);
        let (tx, rx) = mpsc::channel::<Chunk>(16);
        let opened = match read_body(request, MAX_BODY).await {
            Err(e) => Err(RpcError::new(Code::InvalidArgument, e)),
            Ok(body) => match connect::first_message(&body) {
                Err(e) => Err(RpcError::new(Code::InvalidArgument, e.to_string())),
                Ok(message) => match decode::<PathRequest>(message, "WatchDirRequest") {
                    Ok(request) => self.open_watch(&request).await,
                    Err(e) => Err(e),
                },
            },
        };
        match opened {
            Ok((_, watch)) => {
                tokio::spawn(forward_watch(watch.pump(), tx, keepalive));
            }
            Err(error) => {
                let _ = tx.try_send(Ok(Bytes::from(connect::end_stream(Some(&error)))));
            }
        }
        connect_stream_response(Out::Stream(rx))
    }

    async fn create_watcher(&self, request: &PathRequest) -> Result<Value, RpcError> {
        let (_, watch) = self.open_watch(request).await?;
        let number = self
            .e2b
            .next_watcher
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}-watcher-{number}", self.id());
        let watcher = Watcher::spawn(id.clone(), self.id().to_string(), watch);
        let mut watchers = self.e2b.watchers();
        watchers.retain(|_, w| !w.expired());
        watchers.insert(id.clone(), watcher);
        Ok(json!({ "watcherId": id }))
    }

    fn watcher(&self, id: &str) -> Result<Arc<Watcher>, RpcError> {
        self.e2b
            .watchers()
            .get(id)
            .filter(|w| w.sandbox == self.id())
            .cloned()
            .ok_or_else(|| {
                RpcError::new(
                    Code::NotFound,
                    format!(
                        "watcher {id:?}: not found in sandbox {} (removed, ended and collected, or never made)",
                        self.id()
                    ),
                )
            })
    }
}

/// Writes a watch's events to a `WatchDir` stream: `start`, `filesystem` events, `keepalive`
/// after `keepalive` of silence, then the end envelope. Returns when the client is gone
/// (dropping `events` ends the watch).
async fn forward_watch(
    mut events: mpsc::Receiver<Next>,
    tx: mpsc::Sender<Chunk>,
    keepalive: Duration,
) {
    let send = |value: Value| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Bytes::from(connect::message(&value))))
                .await
                .is_ok()
        }
    };
    if !send(json!({ "start": {} })).await {
        return;
    }
    loop {
        let next = tokio::select! {
            next = events.recv() => next,
            () = tokio::time::sleep(keepalive) => {
                if !send(json!({ "keepalive": {} })).await {
                    return;
                }
                continue;
            }
            () = tx.closed() => return,
        };
        match next {
            Some(Next::Events(batch)) => {
                for event in batch {
                    if !send(json!({ "filesystem": event })).await {
                        return;
                    }
                }
            }
            Some(Next::Ended(error)) => {
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
            None => {
                let error = RpcError::new(Code::Unavailable, "the watch's event pump stopped");
                let _ = tx
                    .send(Ok(Bytes::from(connect::end_stream(Some(&error)))))
                    .await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_budget_names_its_cap() {
        let mut budget = ListBudget::default();
        let small = json!({ "name": "a" });
        for _ in 0..MAX_LIST_ENTRIES {
            budget.take(&small, "/d", 2).expect("under the cap");
        }
        let e = budget
            .take(&small, "/d", 2)
            .expect_err("over the entry cap");
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("/d") && e.message.contains("50000 entries"),
            "{}",
            e.message
        );
        let mut budget = ListBudget::default();
        let big = json!({ "name": "x".repeat(1 << 20) });
        let mut over = None;
        for _ in 0..40 {
            if let Err(e) = budget.take(&big, "/b", 1) {
                over = Some(e);
                break;
            }
        }
        let e = over.expect("over the byte cap");
        assert!(e.message.contains("bytes of entries"), "{}", e.message);
    }
}
