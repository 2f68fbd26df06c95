//! The templates service: templates registered from files, or built from an OCI/Docker image
//! (the rootfs goes to `STATE/templates/NAME/rootfs.ext4`), optionally with a boot snapshot:
//! the template is booted once (a sandbox of the [`Sandboxes`] service), the daemon waits for
//! its agent, snapshots it, and later creates restore that snapshot instead of booting.
//!
//! The host files a template names (rootfs, initrd, image archive or layout), which the daemon
//! reads as root and hands to guests, must resolve (symlinks followed) under a
//! `--template-dir` or the state's own templates directory; a registry pull must be of a
//! `--registry-allow` registry when that list is given ([`TemplatePolicy`]).
//!
//! A pull authenticates with the request's `image.auth` (used for that build only: never
//! stored, logged or answered), else with the entry of `--registry-auth FILE` for the
//! registry, else anonymously; a registry that refuses is a 403 naming it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::api::{
    AddTemplate, ApiError, CreateSandbox, ImageAuth, ImageSource, Reply, State, Template,
};
use super::guest::Guest;
use super::sandboxes::Sandboxes;
use super::snapshots::Snapshots;
use super::store::Db;
use super::util::{internal, now_ms, remove_dir};
use crate::images::auth::{Auth, AuthFile, Credentials};
use crate::images::registry::RegistryError;
use crate::images::{self, progress::Progress, BuildOptions, ImageError, SourceSpec};

/// The TTL of the sandbox booted for a boot snapshot (it is deleted once snapshotted).
const BOOT_TTL_S: u64 = 900;
/// The label that marks the sandbox booted for a template's boot snapshot.
pub const BOOT_LABEL: &str = "rollbox.boot-snapshot-of";

/// Where a template's files may come from.
#[derive(Debug, Clone, Default)]
pub struct TemplatePolicy {
    /// Canonical directories a template's host files must resolve under.
    pub dirs: Vec<PathBuf>,
    /// Registries images may be pulled from (host, or host:port); empty: any.
    pub registries: Vec<String>,
}

impl TemplatePolicy {
    /// `path` with every symlink resolved, when that lies under one of [`Self::dirs`]: 400 when
    /// it cannot be resolved, 403 naming it when it lies elsewhere.
    fn confine(&self, path: &Path, field: &str) -> Result<PathBuf, ApiError> {
        let resolved = std::fs::canonicalize(path)
            .map_err(|e| ApiError::BadRequest(format!("{field}: {}: {e}", path.display())))?;
        if self.dirs.iter().any(|dir| resolved.starts_with(dir)) {
            return Ok(resolved);
        }
        let dirs: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        let via = if resolved == path {
            String::new()
        } else {
            format!(" (it resolves to {})", resolved.display())
        };
        Err(ApiError::Forbidden(format!(
            "{field}: {}{via} is outside the template directories ({}); start the daemon with --template-dir DIR to allow a directory",
            path.display(),
            dirs.join(", ")
        )))
    }

    /// The template's host files, confined and resolved, and the registry of a pull.
    fn check(
        &self,
        template: &mut Template,
        image: Option<&mut ImageSource>,
    ) -> Result<(), ApiError> {
        if let Some(rootfs) = &template.rootfs {
            template.rootfs = Some(self.confine(rootfs, "rootfs")?);
        }
        if let Some(initrd) = &template.initrd {
            template.initrd = Some(self.confine(initrd, "initrd")?);
        }
        let Some(image) = image else {
            return Ok(());
        };
        if let Some(archive) = &image.docker_archive {
            image.docker_archive = Some(self.confine(archive, "image.docker_archive")?);
        }
        if let Some(layout) = &image.oci_layout {
            image.oci_layout = Some(self.confine(layout, "image.oci_layout")?);
        }
        let pulled = image.docker_archive.is_none() && image.oci_layout.is_none();
        if let (true, Some(reference), false) =
            (pulled, &image.reference, self.registries.is_empty())
        {
            let registry = registry_of(reference)?;
            if !self
                .registries
                .iter()
                .any(|allowed| allowed.eq_ignore_ascii_case(&registry))
            {
                return Err(ApiError::Forbidden(format!(
                    "image.reference: registry {registry:?} of {reference:?} is not allowed (--registry-allow: {})",
                    self.registries.join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// The registry (host, or host:port) an image reference pulls from; Docker Hub's is
/// `docker.io`.
fn registry_of(reference: &str) -> Result<String, ApiError> {
    let parsed: oci_client::Reference =
        reference.parse().map_err(|e: oci_client::ParseError| {
            ApiError::BadRequest(format!(
                "image.reference: {reference:?} is not an image reference: {e}"
            ))
        })?;
    Ok(parsed.registry().to_string())
}

/// What [`Templates::build_rootfs`] made.
struct BuiltRootfs {
    rootfs: PathBuf,
    base: Option<PathBuf>,
    /// `reference@digest`, or the digest alone.
    described: String,
}

/// The template's own name for the image cache's shared base `cached`: a hard link, so every
/// template on it costs the base once (a copy when the cache is on another file system).
fn link_base(cached: &Path, to: &Path) -> Result<PathBuf, ImageError> {
    let linked = match std::fs::hard_link(cached, to) {
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            images::ext4::sparse_copy(cached, to).map(|_| ())
        }
        other => other.map_err(|source| images::ext4::Ext4Error::Copy {
            from: cached.display().to_string(),
            to: to.display().to_string(),
            source,
        }),
    };
    linked.map_err(ImageError::Ext4)?;
    // A jailed VMM (another uid) opens it read-only through its bind mount. The mode is the
    // inode's, so the cache's name for it gets 0644 too: the image's layers are then as
    // private as the directories above each name (0700 when this daemon made them).
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o644)).map_err(|source| {
        ImageError::Io {
            action: "make readable to jailed VMMs",
            path: to.display().to_string(),
            source,
        }
    })?;
    Ok(to.to_path_buf())
}

/// Where the templates service keeps and finds files.
pub struct TemplateOptions {
    /// `STATE/templates`.
    pub dir: PathBuf,
    /// The static guest agent installed into rootfs images built for templates.
    pub agent: Option<PathBuf>,
    /// The image builder's cache.
    pub image_cache: PathBuf,
    pub policy: TemplatePolicy,
    /// `--registry-auth`: registry credentials for pulls whose request gives none (read again
    /// for each build, so rotated credentials need no restart).
    pub registry_auth: Option<PathBuf>,
    /// Templates built from images that share their first layers share one base file (off
    /// with `--no-layer-sharing`).
    pub share_layers: bool,
}

/// The templates.
pub struct Templates {
    db: Arc<Db>,
    sandboxes: Arc<Sandboxes>,
    snapshots: Arc<Snapshots>,
    guest: Arc<Guest>,
    /// `STATE/templates`: one directory per template built from an image.
    dir: PathBuf,
    /// The static guest agent installed into rootfs images built for templates.
    agent: Option<PathBuf>,
    /// The image builder's cache.
    image_cache: PathBuf,
    policy: TemplatePolicy,
    registry_auth: Option<PathBuf>,
    share_layers: bool,
}

impl Templates {
    pub fn new(
        db: Arc<Db>,
        sandboxes: Arc<Sandboxes>,
        snapshots: Arc<Snapshots>,
        guest: Arc<Guest>,
        options: TemplateOptions,
    ) -> Templates {
        let TemplateOptions {
            dir,
            agent,
            image_cache,
            policy,
            registry_auth,
            share_layers,
        } = options;
        Templates {
            db,
            sandboxes,
            snapshots,
            guest,
            dir,
            agent,
            image_cache,
            policy,
            registry_auth,
            share_layers,
        }
    }

    pub fn list(&self) -> Result<Reply, ApiError> {
        Ok(Reply::Templates(
            self.db.lock().templates().map_err(internal)?,
        ))
    }

    pub fn get(&self, name: &str) -> Result<Reply, ApiError> {
        match self.db.lock().template(name).map_err(internal)? {
            Some(template) => Ok(Reply::Template {
                created: false,
                template,
            }),
            None => Err(ApiError::NotFound(format!("no template {name:?}"))),
        }
    }

    /// POST /templates: checks the files, builds the rootfs from an image when one is given,
    /// registers the template, and takes its boot snapshot when asked. On any error nothing of
    /// the template is left.
    pub async fn add(&self, request: AddTemplate) -> Result<Reply, ApiError> {
        let AddTemplate {
            mut template,
            mut image,
            boot_snapshot,
        } = request;
        self.policy.check(&mut template, image.as_mut())?;
        check_files(&template)?;
        // Its volumes exist (and this server can serve volumes).
        self.sandboxes.mounts(&template.volumes, None)?;
        if self
            .db
            .lock()
            .template(&template.name)
            .map_err(internal)?
            .is_some()
        {
            return Err(name_taken(&template.name));
        }
        let dir = self.dir.join(&template.name);
        if let Some(image) = image {
            match self
                .build_rootfs(&template.name, &dir, image, template.docker)
                .await
            {
                Ok(built) => {
                    template.rootfs = Some(built.rootfs);
                    template.base_rootfs = built.base;
                    template.image = Some(built.described);
                }
                Err(e) => {
                    let _ = remove_dir(&dir);
                    return Err(e);
                }
            }
        }
        template.created_at_ms = now_ms();
        if !self.db.lock().add_template(&template).map_err(internal)? {
            let _ = remove_dir(&dir);
            return Err(name_taken(&template.name));
        }
        if boot_snapshot {
            match self.take_boot_snapshot(&template.name).await {
                Ok(snapshot) => template.boot_snapshot = Some(snapshot),
                Err(e) => {
                    let _ = self.db.lock().remove_template(&template.name);
                    let _ = remove_dir(&dir);
                    return Err(e);
                }
            }
            self.db
                .lock()
                .update_template(&template)
                .map_err(internal)?;
        }
        Ok(Reply::Template {
            created: true,
            template,
        })
    }

    /// DELETE /templates/NAME: the template, its built rootfs and its boot snapshot. Sandboxes
    /// of it keep running (each has its own rootfs copy).
    pub async fn remove(&self, name: &str) -> Result<Reply, ApiError> {
        let Some(template) = self.db.lock().template(name).map_err(internal)? else {
            return Err(ApiError::NotFound(format!("no template {name:?}")));
        };
        self.db.lock().remove_template(name).map_err(internal)?;
        if let Some(snapshot) = &template.boot_snapshot {
            self.snapshots.remove_files(snapshot).await?;
        }
        let dir = self.dir.join(name);
        tokio::task::spawn_blocking(move || remove_dir(&dir))
            .await
            .map_err(internal)?
            .map_err(internal)?;
        Ok(Reply::NoContent)
    }

    /// Builds the template's rootfs from `image` into `dir`: `rootfs.ext4`, and `base.ext4` (a
    /// hard link of the image cache's shared base) when the image shares its first layers with
    /// one built before. Not for Docker templates: dockerd's overlay2 cannot sit on the
    /// overlay root a shared base makes.
    async fn build_rootfs(
        &self,
        name: &str,
        dir: &std::path::Path,
        image: ImageSource,
        docker: bool,
    ) -> Result<BuiltRootfs, ApiError> {
        let agent = self.agent.clone().ok_or_else(|| {
            ApiError::BadRequest(format!(
                "image: this server has no guest agent to install (start it with --agent PATH) so template {name:?} cannot be built from an image"
            ))
        })?;
        let source = match (&image.docker_archive, &image.oci_layout) {
            (Some(file), _) => SourceSpec::DockerArchive(file.clone()),
            (None, Some(layout)) => SourceSpec::OciLayout(layout.clone()),
            (None, None) => SourceSpec::Registry {
                insecure: image.insecure,
                auth: self.pull_auth(image.auth.as_ref())?,
            },
        };
        let rootfs = dir.join("rootfs.ext4");
        let options = BuildOptions {
            reference: image.reference.clone(),
            source,
            agent,
            cache_dir: self.image_cache.clone(),
            output: Some(rootfs.clone()),
            size_mib: image.size_mib,
            progress: Progress::new(false),
            limits: images::BuildLimits::default(),
            share_layers: self.share_layers && !docker,
        };
        let dir = dir.to_path_buf();
        let (built, base) = tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|source| ImageError::Io {
                action: "create",
                path: dir.display().to_string(),
                source,
            })?;
            let built = images::build(&options)?;
            let base = match &built.base {
                Some(cached) => Some(link_base(cached, &dir.join("base.ext4"))?),
                None => None,
            };
            Ok::<_, ImageError>((built, base))
        })
        .await
        .map_err(internal)?
        .map_err(|e| build_error(name, &e))?;
        let described = match &image.reference {
            Some(reference) => format!("{reference}@{}", built.image_digest),
            None => built.image_digest,
        };
        Ok(BuiltRootfs {
            rootfs,
            base,
            described,
        })
    }

    /// What a registry pull authenticates with: the request's credentials, else
    /// `--registry-auth`'s file, else none.
    fn pull_auth(&self, given: Option<&ImageAuth>) -> Result<Auth, ApiError> {
        if let Some(given) = given {
            let credentials = match (&given.username, &given.password, &given.token) {
                (Some(username), Some(password), _) => Credentials::Basic {
                    username: username.clone(),
                    password: password.clone(),
                },
                (_, _, Some(token)) => Credentials::Token(token.clone()),
                // Validation lets no other shape through.
                _ => {
                    return Err(ApiError::BadRequest(
                        "image.auth: give username and password, or token alone".into(),
                    ))
                }
            };
            return Ok(Auth::Given(credentials));
        }
        match &self.registry_auth {
            Some(file) => AuthFile::load(file)
                .map(|f| Auth::File(Arc::new(f)))
                .map_err(|e| internal(format!("--registry-auth: {e}"))),
            None => Ok(Auth::Anonymous),
        }
    }

    /// Boots the template in a sandbox of its own, waits for its agent, snapshots it and ends
    /// the sandbox. Returns the snapshot's id.
    async fn take_boot_snapshot(&self, name: &str) -> Result<String, ApiError> {
        let request = CreateSandbox {
            template: name.to_string(),
            ttl_s: Some(BOOT_TTL_S),
            labels: BTreeMap::from([(BOOT_LABEL.to_string(), name.to_string())]),
            ..CreateSandbox::default()
        };
        let sandbox = match self.sandboxes.create(request).await? {
            Reply::Sandbox { sandbox, .. } => sandbox,
            other => return Err(internal(format!("unexpected reply {other:?}"))),
        };
        let id = sandbox.id;
        let taken = async {
            self.guest.wait_for_agent(&id, name).await?;
            self.snapshots.for_template(&id).await
        }
        .await;
        let reason = match &taken {
            Ok(snapshot) => format!("boot snapshot {snapshot} of template {name} taken"),
            Err(e) => format!("boot snapshot of template {name} failed: {e}"),
        };
        self.sandboxes.end(&id, State::Deleted, &reason).await?;
        taken
    }
}

/// A failed build: 403 when the registry refused the credentials (or their absence), else
/// 400.
fn build_error(name: &str, error: &ImageError) -> ApiError {
    let message = format!("image: building template {name:?} failed: {error}");
    match error {
        ImageError::Registry(RegistryError::Auth { .. } | RegistryError::NeedsAuth { .. }) => {
            ApiError::Forbidden(message)
        }
        _ => ApiError::BadRequest(message),
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
