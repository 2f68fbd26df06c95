//! The daemon's core: the one typed action interface both frontends sit on. [`Core::handle_as`]
//! runs an [`Action`] for a [`Caller`] on the service it is for and answers its [`Reply`];
//! uploads, guest TCP connections and agent connections (what a frontend streams itself) have a
//! method each.
//!
//! Who may do what is decided here, once for both frontends: an admin key everything; a tenant
//! key no admin action (403) and only its own sandboxes and snapshots, another tenant's
//! answering exactly as an unknown id does (404), before any service touches them.

use std::sync::Arc;

use rollbox_agent_protocol::client::AgentClient;

use super::api::{Action, ApiError, CreateSandbox, FileOp, Reply, Snapshot, State};
use super::gpus::Gpus;
use super::guest::Guest;
use super::keys::{Caller, Keys};
use super::node::Node;
use super::sandboxes::Sandboxes;
use super::snapshots::Snapshots;
use super::store::Db;
use super::templates::Templates;
use super::usage::{self, Counters};
use super::util::internal;
use super::volumes::Volumes;

/// The services, behind the action interface.
pub struct Core {
    db: Arc<Db>,
    counters: Arc<Counters>,
    sandboxes: Arc<Sandboxes>,
    snapshots: Arc<Snapshots>,
    templates: Arc<Templates>,
    guest: Arc<Guest>,
    keys: Arc<Keys>,
    node: Arc<Node>,
    volumes: Arc<Volumes>,
    gpus: Arc<Gpus>,
}

/// The services a [`Core`] runs on.
pub struct Services {
    pub db: Arc<Db>,
    pub counters: Arc<Counters>,
    pub sandboxes: Arc<Sandboxes>,
    pub snapshots: Arc<Snapshots>,
    pub templates: Arc<Templates>,
    pub guest: Arc<Guest>,
    pub keys: Arc<Keys>,
    pub node: Arc<Node>,
    pub volumes: Arc<Volumes>,
    pub gpus: Arc<Gpus>,
}

/// What a tenant gets for a sandbox it may not see: exactly what an unknown id gets.
fn no_sandbox(id: &str) -> ApiError {
    ApiError::NotFound(format!("no sandbox {id}"))
}

/// What a tenant gets for a snapshot it may not see: exactly what an unknown one gets.
fn no_snapshot(id: &str) -> ApiError {
    ApiError::NotFound(format!("no snapshot {id}"))
}

impl Core {
    /// GET /node: the node's figures and the sandboxes service's warm pool.
    fn node_info(&self) -> Result<super::api::NodeInfo, ApiError> {
        let mut info = self.node.info()?;
        info.warm_pool = self.sandboxes.warm_pool_status();
        Ok(info)
    }

    pub fn new(services: Services) -> Core {
        let Services {
            db,
            counters,
            sandboxes,
            snapshots,
            templates,
            guest,
            keys,
            node,
            volumes,
            gpus,
        } = services;
        Core {
            db,
            counters,
            sandboxes,
            snapshots,
            templates,
            guest,
            keys,
            node,
            volumes,
            gpus,
        }
    }

    /// Whether the node takes new sandboxes (`/readyz`; `/livez` needs nothing).
    pub fn ready(&self) -> bool {
        self.node.ready()
    }

    /// A stop with `--drain-on-sigterm`: drains with `deadline_s`, and returns once no
    /// sandbox is live (or the deadline's ends had a minute more to finish).
    pub async fn drain_then_stop(&self, deadline_s: u64) {
        if let Err(e) = self.drain(Some(deadline_s)) {
            log::error!("drain on stop: {e}");
        }
        let give_up = std::time::Instant::now()
            + std::time::Duration::from_secs(deadline_s.saturating_add(60));
        loop {
            match self.db.lock().live_totals() {
                Ok((0, _)) => break,
                Ok(_) => {}
                Err(e) => {
                    log::error!("drain on stop: {e}");
                    break;
                }
            }
            if std::time::Instant::now() > give_up {
                log::error!("drain on stop: sandboxes still live a minute past the deadline");
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// POST /node/drain: no new sandboxes; with a deadline, what is left then is ended.
    fn drain(&self, deadline_s: Option<u64>) -> Result<Reply, ApiError> {
        let generation = self.node.start_drain(deadline_s);
        if let Some(seconds) = deadline_s {
            let (node, sandboxes) = (Arc::clone(&self.node), Arc::clone(&self.sandboxes));
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(seconds)).await;
                if node.drain_expired(generation) {
                    sandboxes
                        .end_all_live("ended by the node's drain deadline (POST /node/drain)")
                        .await;
                }
            });
        }
        Ok(Reply::Node(self.node_info()?))
    }

    /// Who `key` (as a request gave it) belongs to; None: nobody's (401). No state is read
    /// but the keys in memory.
    pub fn authenticate(&self, key: &str) -> Option<Caller> {
        self.keys.authenticate(key)
    }

    /// Runs one action for `caller`: refused (403) when it is an admin's to run, and for a
    /// tenant scoped to what the tenant owns.
    pub async fn handle_as(&self, caller: &Caller, action: Action) -> Result<Reply, ApiError> {
        let Caller::Tenant(tenant) = caller else {
            return self.handle(action).await;
        };
        if action.admin_only() {
            return Err(ApiError::Forbidden(format!(
                "the key of tenant {tenant:?} may not do this: templates' writes, keys and /metrics need an admin key"
            )));
        }
        let action = self.scoped(caller, action)?;
        let reply = self.handle(action).await?;
        Ok(match reply {
            Reply::Snapshots(snapshots) => Reply::Snapshots(
                snapshots
                    .into_iter()
                    .filter(|s| caller.sees(s.tenant.as_deref()))
                    .collect(),
            ),
            // Which sandbox holds a GPU is an admin's to see.
            Reply::Gpus(gpus) => Reply::Gpus(
                gpus.into_iter()
                    .map(|g| crate::daemon::api::Gpu { holder: None, ..g })
                    .collect(),
            ),
            Reply::Volumes(volumes) => Reply::Volumes(
                volumes
                    .into_iter()
                    .filter(|v| caller.sees(v.tenant.as_deref()))
                    .collect(),
            ),
            other => other,
        })
    }

    /// Checks that the caller may see volume `name` (another tenant's is 404, as an unknown
    /// one).
    fn own_volume(&self, caller: &Caller, name: &str) -> Result<(), ApiError> {
        if *caller == Caller::Admin {
            return Ok(());
        }
        match self.db.lock().volume(name).map_err(internal)? {
            Some(row) if caller.sees(row.volume.tenant.as_deref()) => Ok(()),
            _ => Err(ApiError::NotFound(format!("no volume {name}"))),
        }
    }

    /// Checks that a tenant owns the sandbox `id` (an admin owns every one).
    fn own_sandbox(&self, caller: &Caller, id: &str) -> Result<(), ApiError> {
        if *caller == Caller::Admin {
            return Ok(());
        }
        let sandbox = self.db.lock().sandbox(id).map_err(internal)?;
        match sandbox {
            Some(s) if caller.sees(s.tenant.as_deref()) => Ok(()),
            _ => Err(no_sandbox(id)),
        }
    }

    /// The snapshot `id_or_name` (an id, else a name in the caller's namespace) if the caller
    /// may see it.
    fn visible_snapshot(
        &self,
        caller: &Caller,
        id_or_name: &str,
    ) -> Result<Option<Snapshot>, ApiError> {
        let store = self.db.lock();
        let found = match store.snapshot(id_or_name).map_err(internal)? {
            Some(snapshot) => Some(snapshot),
            None => store
                .snapshot_named(id_or_name, caller.tenant())
                .map_err(internal)?,
        };
        Ok(found.filter(|s| caller.sees(s.tenant.as_deref())))
    }

    /// A create of a tenant: its sandboxes are the tenant's, from its own snapshots only.
    fn scoped_create(
        &self,
        caller: &Caller,
        mut create: CreateSandbox,
    ) -> Result<CreateSandbox, ApiError> {
        if let Some(snapshot) = &create.snapshot {
            let found = self.db.lock().snapshot(snapshot).map_err(internal)?;
            if !found.is_some_and(|s| caller.sees(s.tenant.as_deref())) {
                // The create's own words for a snapshot that is not there.
                return Err(ApiError::BadRequest(format!(
                    "snapshot: no snapshot {snapshot:?} (list them with GET /snapshots)"
                )));
            }
        }
        create.tenant = caller.tenant().map(str::to_string);
        Ok(create)
    }

    /// A tenant's action, checked and narrowed to what the tenant owns.
    fn scoped(&self, caller: &Caller, action: Action) -> Result<Action, ApiError> {
        Ok(match action {
            Action::CreateSandbox(create) => {
                Action::CreateSandbox(self.scoped_create(caller, create)?)
            }
            Action::CreateBatch { count, create } => Action::CreateBatch {
                count,
                create: self.scoped_create(caller, create)?,
            },
            Action::ListSandboxes(mut query) => {
                query.tenant = caller.tenant().map(str::to_string);
                Action::ListSandboxes(query)
            }
            Action::DeleteSandboxes(mut query) => {
                query.tenant = caller.tenant().map(str::to_string);
                Action::DeleteSandboxes(query)
            }
            Action::GetSnapshot(id) => match self.visible_snapshot(caller, &id)? {
                Some(snapshot) => Action::GetSnapshot(snapshot.id),
                None => return Err(no_snapshot(&id)),
            },
            Action::DeleteSnapshot(id) => match self.visible_snapshot(caller, &id)? {
                Some(snapshot) => Action::DeleteSnapshot(snapshot.id),
                // The native delete of a snapshot that is gone succeeds.
                None => return Err(no_snapshot(&id)),
            },
            Action::ExportSnapshot(id) => match self.visible_snapshot(caller, &id)? {
                Some(snapshot) => Action::ExportSnapshot(snapshot.id),
                None => return Err(no_snapshot(&id)),
            },
            Action::Reset { id, snapshot } => {
                self.own_sandbox(caller, &id)?;
                let snapshot = match snapshot {
                    Some(s) => match self.visible_snapshot(caller, &s)? {
                        Some(found) => Some(found.id),
                        None => {
                            return Err(ApiError::BadRequest(format!(
                                "snapshot: no snapshot {s:?} (it was deleted?)"
                            )))
                        }
                    },
                    None => None,
                };
                Action::Reset { id, snapshot }
            }
            Action::ListSnapshots { sandbox } => Action::ListSnapshots { sandbox },
            Action::CreateVolume(mut create) => {
                if create.host_path.is_some() {
                    return Err(ApiError::Forbidden(
                        "host_path: only an admin key may name a host directory".into(),
                    ));
                }
                create.tenant = caller.tenant().map(str::to_string);
                Action::CreateVolume(create)
            }
            Action::Volume { ref name, .. } => {
                self.own_volume(caller, name)?;
                action
            }
            Action::Health
            | Action::ListTemplates
            | Action::GetTemplate(_)
            | Action::ListVolumes
            | Action::ListGpus
            | Action::ImportSnapshot => action,
            Action::Usage(ref id)
            | Action::GetSandbox(ref id)
            | Action::DeleteSandbox(ref id)
            | Action::Keepalive { ref id, .. }
            | Action::SetNetwork { ref id, .. }
            | Action::Pause(ref id)
            | Action::Resume(ref id)
            | Action::Exec { ref id, .. }
            | Action::Signal { ref id, .. }
            | Action::Stdin { ref id, .. }
            | Action::File { ref id, .. }
            | Action::Snapshot { ref id, .. }
            | Action::Fork { ref id, .. }
            | Action::PortConnect { ref id, .. } => {
                self.own_sandbox(caller, id)?;
                action
            }
            Action::AddTemplate(_)
            | Action::RemoveTemplate(_)
            | Action::Metrics
            | Action::AddKey(_)
            | Action::ListKeys
            | Action::RevokeKey(_)
            | Action::GetNode
            | Action::Drain { .. }
            | Action::Undrain => return Err(ApiError::Forbidden("an admin key's action".into())),
        })
    }

    /// Runs one action as the admin: for the frontends' own follow-up calls on a sandbox the
    /// caller was already checked for (the E2B data plane, whose per-sandbox token names it).
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
            Action::Metrics => usage::metrics(&self.db, &self.counters, &self.node_info()?),
            Action::GetSandbox(id) => self.sandboxes.get(&id),
            Action::DeleteSandbox(id) => {
                self.sandboxes
                    .end(&id, State::Deleted, "deleted by the API")
                    .await?;
                Ok(Reply::NoContent)
            }
            Action::Keepalive { id, ttl_s } => self.sandboxes.keepalive(&id, ttl_s),
            Action::SetNetwork { id, network } => self.sandboxes.set_network(&id, &network).await,
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
            Action::ExportSnapshot(id) => self.snapshots.export(&id).await,
            Action::ImportSnapshot => Err(ApiError::BadRequest(
                "POST /snapshots/import takes the archive as its body (an upload)".into(),
            )),
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
            Action::AddKey(new) => self.keys.add(new),
            Action::ListKeys => Ok(self.keys.list()),
            Action::RevokeKey(id) => self.keys.revoke(&id),
            Action::GetNode => Ok(Reply::Node(self.node_info()?)),
            Action::Drain { deadline_s } => self.drain(deadline_s),
            Action::Undrain => {
                self.node.undrain();
                Ok(Reply::Node(self.node_info()?))
            }
            Action::ListVolumes => self.volumes.list(),
            Action::ListGpus => Ok(self.gpus.list()),
            Action::CreateVolume(create) => self.volumes.create(create).await,
            Action::Volume { name, op } => self.volumes.handle(&name, op).await,
        }
    }

    /// An upload into a volume (PUT /volumes/{name}/files) for `caller`.
    pub async fn volume_upload_as<R>(
        &self,
        caller: &Caller,
        name: &str,
        path: String,
        body: R,
    ) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        self.own_volume(caller, name)?;
        self.volumes.upload(name, path, body).await
    }

    /// [`Core::upload`] for `caller`.
    pub async fn upload_as<R>(
        &self,
        caller: &Caller,
        id: &str,
        op: FileOp,
        body: R,
    ) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        self.own_sandbox(caller, id)?;
        self.upload(id, op, body).await
    }

    /// POST /snapshots/import for `caller`: the snapshot is the caller's (a tenant's own).
    pub async fn import_snapshot_as<R>(&self, caller: &Caller, body: R) -> Result<Reply, ApiError>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        self.snapshots
            .import(body, caller.tenant().map(str::to_string))
            .await
    }

    /// [`Core::guest_tcp`] for `caller`.
    pub async fn guest_tcp_as(
        &self,
        caller: &Caller,
        id: &str,
        port: u16,
    ) -> Result<tokio::net::UnixStream, ApiError> {
        self.own_sandbox(caller, id)?;
        self.guest_tcp(id, port).await
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
