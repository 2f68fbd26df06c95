//! The daemon's core: the one typed action interface both frontends sit on. [`Core::handle`]
//! runs an [`Action`] on the service it is for and answers its [`Reply`]; uploads, guest TCP
//! connections and agent connections (what a frontend streams itself) have a method each.

use std::sync::Arc;

use rollbox_agent_protocol::client::AgentClient;

use super::api::{Action, ApiError, FileOp, Reply, State};
use super::guest::Guest;
use super::sandboxes::Sandboxes;
use super::snapshots::Snapshots;
use super::store::Db;
use super::templates::Templates;
use super::usage::{self, Counters};

/// The services, behind the action interface.
pub struct Core {
    db: Arc<Db>,
    counters: Arc<Counters>,
    sandboxes: Arc<Sandboxes>,
    snapshots: Arc<Snapshots>,
    templates: Arc<Templates>,
    guest: Arc<Guest>,
}

impl Core {
    pub fn new(
        db: Arc<Db>,
        counters: Arc<Counters>,
        sandboxes: Arc<Sandboxes>,
        snapshots: Arc<Snapshots>,
        templates: Arc<Templates>,
        guest: Arc<Guest>,
    ) -> Core {
        Core {
            db,
            counters,
            sandboxes,
            snapshots,
            templates,
            guest,
        }
    }

    /// Runs one action.
    pub async fn handle(&self, action: Action) -> Result<Reply, ApiError> {
        match action {
            Action::Health => Ok(Reply::Health),
            Action::ListTemplates => self.templates.list(),
            Action::AddTemplate(request) => self.templates.add(request).await,
            Action::GetTemplate(name) => self.templates.get(&name),
            Action::RemoveTemplate(name) => self.templates.remove(&name).await,
            Action::ListSandboxes(query) => self.sandboxes.list(&query),
            Action::CreateSandbox(request) => self.sandboxes.create(request).await,
            Action::CreateBatch { count, create } => {
                self.sandboxes.create_batch(count, create).await
            }
            Action::DeleteSandboxes(query) => self.sandboxes.delete_matching(query).await,
            Action::Usage(id) => usage::usage(&self.db, &id),
            Action::Metrics => usage::metrics(&self.db, &self.counters),
            Action::GetSandbox(id) => self.sandboxes.get(&id),
            Action::DeleteSandbox(id) => {
                self.sandboxes
                    .end(&id, State::Deleted, "deleted by the API")
                    .await?;
                Ok(Reply::NoContent)
            }
            Action::Keepalive { id, ttl_s } => self.sandboxes.keepalive(&id, ttl_s),
            Action::Pause(id) => self.sandboxes.pause_resume(&id, true).await,
            Action::Resume(id) => self.sandboxes.pause_resume(&id, false).await,
            Action::Exec { id, exec, stream } => self.guest.exec(&id, exec, stream).await,
            Action::Signal {
                id,
                pid,
                signal,
                group,
            } => self.guest.signal(&id, pid, signal, group).await,
            Action::Stdin {
                id,
                pid,
                data,
                close,
            } => self.guest.write_stdin(&id, pid, data, close).await,
            Action::File { id, op } => self.guest.file(&id, op).await,
            Action::Snapshot {
                id,
                stop,
                ttl_s,
                name,
            } => self.snapshots.snapshot(&id, stop, ttl_s, name).await,
            Action::ListSnapshots { sandbox } => self.snapshots.list(sandbox.as_deref()),
            Action::GetSnapshot(id) => self.snapshots.get(&id),
            Action::DeleteSnapshot(id) => self.snapshots.delete(&id).await,
            Action::Fork {
                id,
                count,
                ttl_s,
                labels,
            } => self.snapshots.fork(&id, count, ttl_s, labels).await,
            Action::Reset { id, snapshot } => self.snapshots.reset(&id, snapshot).await,
            Action::PortConnect { id, port } => Err(ApiError::BadRequest(format!(
                "GET /sandboxes/{id}/ports/{port} is an HTTP upgrade: send `Connection: Upgrade` and `Upgrade: tcp`"
            ))),
        }
    }

    /// An upload (a file or a tar archive): `body` streams into the sandbox's agent.
    pub async fn upload<R>(&self, id: &str, op: FileOp, body: R) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        self.guest.upload(id, op, body).await
    }

    /// A byte pipe to TCP `port` on the sandbox's loopback, through its agent.
    pub async fn guest_tcp(&self, id: &str, port: u16) -> Result<tokio::net::UnixStream, ApiError> {
        self.guest.guest_tcp(id, port).await
    }

    /// A connection of its own to a running sandbox's agent (the E2B data plane speaks the
    /// agent's protocol itself).
    pub async fn agent(&self, id: &str) -> Result<AgentClient, ApiError> {
        self.guest.agent(id).await
    }
}
