//! Templates: registered from files, or built from an OCI/Docker image (the rootfs goes to
//! `STATE/templates/NAME/rootfs.ext4`), optionally with a boot snapshot: the template is
//! booted once, the daemon waits for its agent, snapshots it, and later creates restore that
//! snapshot instead of booting.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rollbox_agent_protocol::{AgentClient, ExecRequest, DEFAULT_PORT};

use super::api::Reply;
use super::api::{AddTemplate, ApiError, CreateSandbox, ImageSource, State, Template};
use super::{internal, now_ms, remove_dir, Daemon};
use crate::images::{self, progress::Progress, BuildOptions, SourceSpec};

/// How long a template's first boot may take to reach an answering agent (Linux in the nested
/// lab takes tens of seconds).
const BOOT_AGENT_WAIT: Duration = Duration::from_secs(300);
/// The TTL of the sandbox booted for a boot snapshot (it is deleted once snapshotted).
const BOOT_TTL_S: u64 = 900;
/// How long a template's ready command may take to first exit 0, unless it says.
const READY_WAIT_S: u32 = 300;
/// How long one run of a ready command may take.
const READY_RUN_TIMEOUT_MS: u64 = 10_000;
/// Where the guest keeps the start command's output (`/dev/null` when /var/log is missing).
const START_LOG: &str = "/var/log/rollbox-start.log";
/// The label that marks the sandbox booted for a template's boot snapshot.
pub const BOOT_LABEL: &str = "rollbox.boot-snapshot-of";

impl Daemon {
    /// POST /templates: checks the files, builds the rootfs from an image when one is given,
    /// registers the template, and takes its boot snapshot when asked. On any error nothing of
    /// the template is left.
    pub(super) async fn add_template(
        self: &Arc<Self>,
        request: AddTemplate,
    ) -> Result<Reply, ApiError> {
        let AddTemplate {
            mut template,
            image,
            boot_snapshot,
        } = request;
        check_files(&template)?;
        if self
            .store()
            .template(&template.name)
            .map_err(internal)?
            .is_some()
        {
            return Err(name_taken(&template.name));
        }
        let dir = self.templates_dir.join(&template.name);
        if let Some(image) = image {
            match self.build_rootfs(&template.name, &dir, image).await {
                Ok((rootfs, described)) => {
                    template.rootfs = Some(rootfs);
                    template.image = Some(described);
                }
                Err(e) => {
                    let _ = remove_dir(&dir);
                    return Err(e);
                }
            }
        }
        template.created_at_ms = now_ms();
        if !self.store().add_template(&template).map_err(internal)? {
            let _ = remove_dir(&dir);
            return Err(name_taken(&template.name));
        }
        if boot_snapshot {
            match self.take_boot_snapshot(&template.name).await {
                Ok(snapshot) => template.boot_snapshot = Some(snapshot),
                Err(e) => {
                    let _ = self.store().remove_template(&template.name);
                    let _ = remove_dir(&dir);
                    return Err(e);
                }
            }
            self.store().update_template(&template).map_err(internal)?;
        }
        Ok(Reply::Template {
            created: true,
            template,
        })
    }

    /// DELETE /templates/NAME: the template, its built rootfs and its boot snapshot. Sandboxes
    /// of it keep running (each has its own rootfs copy).
    pub(super) async fn remove_template(&self, name: &str) -> Result<Reply, ApiError> {
        let Some(template) = self.store().template(name).map_err(internal)? else {
            return Err(ApiError::NotFound(format!("no template {name:?}")));
        };
        self.store().remove_template(name).map_err(internal)?;
        if let Some(snapshot) = &template.boot_snapshot {
            self.remove_snapshot_files(snapshot).await?;
        }
        let dir = self.templates_dir.join(name);
        tokio::task::spawn_blocking(move || remove_dir(&dir))
            .await
            .map_err(internal)?
            .map_err(internal)?;
        Ok(Reply::NoContent)
    }

    /// The template whose boot snapshot `snapshot` is, if any.
    pub(super) fn boot_snapshot_owner(&self, snapshot: &str) -> Result<Option<String>, ApiError> {
        Ok(self
            .store()
            .templates()
            .map_err(internal)?
            .into_iter()
            .find(|t| t.boot_snapshot.as_deref() == Some(snapshot))
            .map(|t| t.name))
    }

    async fn build_rootfs(
        &self,
        name: &str,
        dir: &std::path::Path,
        image: ImageSource,
    ) -> Result<(PathBuf, String), ApiError> {
        let agent = self.options.agent.clone().ok_or_else(|| {
            ApiError::BadRequest(format!(
                "image: this server has no guest agent to install (start it with --agent PATH) so template {name:?} cannot be built from an image"
            ))
        })?;
        let source = match (&image.docker_archive, &image.oci_layout) {
            (Some(file), _) => SourceSpec::DockerArchive(file.clone()),
            (None, Some(layout)) => SourceSpec::OciLayout(layout.clone()),
            (None, None) => SourceSpec::Registry {
                insecure: image.insecure,
            },
        };
        let rootfs = dir.join("rootfs.ext4");
        let options = BuildOptions {
            reference: image.reference.clone(),
            source,
            agent,
            cache_dir: self.options.image_cache.clone(),
            output: Some(rootfs.clone()),
            size_mib: image.size_mib,
            progress: Progress::new(false),
        };
        let dir = dir.to_path_buf();
        let built = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            images::build(&options).map_err(|e| e.to_string())
        })
        .await
        .map_err(internal)?
        .map_err(|e| {
            ApiError::BadRequest(format!("image: building template {name:?} failed: {e}"))
        })?;
        let described = match &image.reference {
            Some(reference) => format!("{reference}@{}", built.image_digest),
            None => built.image_digest,
        };
        Ok((rootfs, described))
    }

    /// Boots the template in a sandbox of its own, waits for its agent, snapshots it and ends
    /// the sandbox. Returns the snapshot's id.
    async fn take_boot_snapshot(self: &Arc<Self>, name: &str) -> Result<String, ApiError> {
        let request = CreateSandbox {
            template: name.to_string(),
            ttl_s: Some(BOOT_TTL_S),
            labels: BTreeMap::from([(BOOT_LABEL.to_string(), name.to_string())]),
            ..CreateSandbox::default()
        };
        let sandbox = match self.create(request).await? {
            Reply::Sandbox { sandbox, .. } => sandbox,
            other => return Err(internal(format!("unexpected reply {other:?}"))),
        };
        let id = sandbox.id;
        let taken = async {
            self.wait_for_agent(&id, name).await?;
            self.snapshot_for_template(&id).await
        }
        .await;
        let reason = match &taken {
            Ok(snapshot) => format!("boot snapshot {snapshot} of template {name} taken"),
            Err(e) => format!("boot snapshot of template {name} failed: {e}"),
        };
        self.end(&id, State::Deleted, &reason).await?;
        taken
    }

    /// After a boot of `template`: waits for the agent, starts the template's start command in
    /// the background and runs its ready command until it exits 0. Nothing without a start
    /// command.
    pub(super) async fn start_template_command(
        &self,
        id: &str,
        template: &Template,
        env: &BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        let Some(start_cmd) = &template.start_cmd else {
            return Ok(());
        };
        let name = &template.name;
        self.wait_for_agent(id, name).await?;
        let client = AgentClient::connect_unix(self.agent_socket(id)?, DEFAULT_PORT)
            .await
            .map_err(|e| ApiError::Unavailable(format!("start_cmd: agent of {id}: {e}")))?;
        // The shell exits at once; its background child keeps running with its output in a
        // log, so the run's pipes close.
        let launcher = format!(
            "log={START_LOG}; [ -d /var/log ] || log=/dev/null; /bin/sh -c \"$1\" >>\"$log\" 2>&1 </dev/null &"
        );
        let mut request = ExecRequest::argv(["/bin/sh", "-c", &launcher, "sh", start_cmd]);
        request.env = env.clone();
        request.timeout_ms = Some(READY_RUN_TIMEOUT_MS);
        let started = client
            .run(request)
            .await
            .map_err(|e| ApiError::Unavailable(format!("start_cmd of template {name:?}: {e}")))?;
        if !started.status.success() {
            return Err(ApiError::Unavailable(format!(
                "start_cmd of template {name:?}: the launching shell failed ({:?}): {}",
                started.status,
                String::from_utf8_lossy(&started.stderr).trim()
            )));
        }
        let Some(ready_cmd) = &template.ready_cmd else {
            return Ok(());
        };
        let wait_s = template.ready_timeout_s.unwrap_or(READY_WAIT_S);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(wait_s.into());
        let mut last;
        loop {
            let mut request = ExecRequest::shell(ready_cmd.clone());
            request.env = env.clone();
            request.timeout_ms = Some(READY_RUN_TIMEOUT_MS);
            match client.run(request).await {
                Ok(output) if output.status.success() => return Ok(()),
                Ok(output) => {
                    last = format!(
                        "last run: {:?}, stderr {:?}",
                        output.status.code,
                        String::from_utf8_lossy(&output.stderr).trim()
                    );
                }
                Err(e) => last = format!("last run: {e}"),
            }
            if tokio::time::Instant::now() >= deadline || self.touch(id)?.state != State::Running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(ApiError::Unavailable(format!(
            "ready_cmd of template {name:?} did not exit 0 within {wait_s} s ({last}; the start command's output is in the guest's {START_LOG})"
        )))
    }

    async fn wait_for_agent(&self, id: &str, name: &str) -> Result<(), ApiError> {
        let socket = self.agent_socket(id)?;
        let deadline = tokio::time::Instant::now() + BOOT_AGENT_WAIT;
        let mut last = String::new();
        while tokio::time::Instant::now() < deadline {
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect_unix(&socket, DEFAULT_PORT).await?;
                client.health().await
            })
            .await;
            match attempt {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "no answer within 5 s".into(),
            }
            if self.touch(id)?.state != State::Running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(ApiError::Unavailable(format!(
            "boot_snapshot: the agent of template {name:?} did not answer within {} s ({last}); a boot snapshot needs a guest that runs rollbox-agent",
            BOOT_AGENT_WAIT.as_secs()
        )))
    }
}

fn name_taken(name: &str) -> ApiError {
    ApiError::Conflict(format!("name: template {name:?} exists; remove it first"))
}

fn check_files(template: &Template) -> Result<(), ApiError> {
    let files = [
        (Some(&template.kernel), "kernel"),
        (template.rootfs.as_ref(), "rootfs"),
        (template.initrd.as_ref(), "initrd"),
    ];
    for (path, field) in files {
        if let Some(path) = path {
            if !path.is_file() {
                return Err(ApiError::BadRequest(format!(
                    "{field}: {} is not a readable file",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}
