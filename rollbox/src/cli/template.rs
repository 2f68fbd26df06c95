//! `rollbox template ...`: register a template from files, build one from an image (the daemon
//! builds it), list and remove them.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::json;

use rollbox::daemon::api::Template;
use rollbox::daemon::client::Response;
use rollbox::images::auth::{AuthFile, Credentials};

use super::conn::{absolute, parse, print_json, CliError, Conn};

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Register a template from a kernel (and optional rootfs image and initrd).
    Add(AddArgs),
    /// Build a template from an OCI/Docker image: the daemon builds the rootfs (with the guest
    /// agent as init) and, with --boot-snapshot, boots it once and snapshots it.
    Build(BuildArgs),
    Ls,
    Rm {
        name: String,
    },
}

/// `add`'s arguments.
#[derive(Args)]
pub struct AddArgs {
    pub name: String,
    #[arg(long, value_name = "PATH")]
    pub kernel: PathBuf,
    /// A raw/ext4 root disk image (each sandbox gets its own copy), e.g. from `rollbox
    /// image build`.
    #[arg(long, value_name = "PATH")]
    pub rootfs: Option<PathBuf>,
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    #[arg(long, default_value = "")]
    pub cmdline: String,
    #[arg(long)]
    pub vcpus: Option<i64>,
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<i64>,
    /// Boot it once and keep a snapshot; creates then restore it (needs the agent).
    #[arg(long)]
    pub boot_snapshot: bool,
    #[command(flatten)]
    pub commands: StartCommands,
    #[command(flatten)]
    pub mounts: TemplateMounts,
}

/// `build`'s arguments.
#[derive(Args)]
pub struct BuildArgs {
    /// Image reference, e.g. 127.0.0.1:5000/busybox:latest (with an archive or layout,
    /// it picks one of several images).
    pub image: Option<String>,
    /// The template's name [default: the image's repository name].
    #[arg(long)]
    pub name: Option<String>,
    #[arg(long, value_name = "PATH")]
    pub kernel: PathBuf,
    /// Read the image from a `docker save` tarball.
    #[arg(long, value_name = "FILE", conflicts_with = "from_oci_layout")]
    pub from_docker_archive: Option<PathBuf>,
    /// Read the image from an OCI image layout directory.
    #[arg(long, value_name = "DIR")]
    pub from_oci_layout: Option<PathBuf>,
    /// Plain HTTP to the registry.
    #[arg(long)]
    pub insecure: bool,
    /// Registry credentials for this build: a Docker config.json-format file, whose entry
    /// for the image's registry is sent with the request (used for this build only, never
    /// stored). Without it the daemon uses its own --registry-auth, else pulls anonymously.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["from_docker_archive", "from_oci_layout"])]
    pub registry_auth: Option<PathBuf>,
    /// Root disk size in MiB [default: the content plus room to write].
    #[arg(long, value_name = "MIB")]
    pub size: Option<u64>,
    /// Kernel command line [default: serial console, the agent as init].
    #[arg(long)]
    pub cmdline: Option<String>,
    #[arg(long)]
    pub vcpus: Option<i64>,
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<i64>,
    /// Boot it once and keep a snapshot; creates then restore it.
    #[arg(long)]
    pub boot_snapshot: bool,
    #[command(flatten)]
    pub commands: StartCommands,
    #[command(flatten)]
    pub mounts: TemplateMounts,
}

/// The volumes every sandbox of a template mounts, and its network (its boot snapshot has
/// them).
#[derive(clap::Args)]
pub struct TemplateMounts {
    /// Mount a volume (`rollbox volume create`) in every sandbox of the template, at an
    /// absolute path, read-only with `:ro` (repeatable). A create that names volumes gets
    /// those instead.
    #[arg(long = "volume", value_name = "NAME:/PATH[:ro]", value_parser = super::volume::parse_mount)]
    volumes: Vec<super::volume::VolumeMount>,
    /// Every sandbox of the template has a network (the server's `--default-egress` unless
    /// its create names one).
    #[arg(long)]
    network: bool,
    /// Every sandbox of the template has a network with this egress (none, all, or
    /// CIDR|HOST[:PORT[-PORT]],...), unless its create names another.
    #[arg(long, value_name = "POLICY")]
    egress: Option<String>,
    /// Every sandbox of the template exposes this guest TCP port on a host port of its own
    /// (repeatable; implies a network), unless its create names other ports.
    #[arg(long = "expose", value_name = "PORT")]
    expose: Vec<u16>,
}

impl TemplateMounts {
    fn add_to(self, body: &mut serde_json::Value) {
        if !self.volumes.is_empty() {
            body["volumes"] = json!(self.volumes);
        }
        if let Some(network) = super::sandbox::network_body(self.network, self.egress, self.expose)
        {
            body["network"] = network;
        }
    }
}

/// What a template runs once its agent answers after a boot (before a boot snapshot).
#[derive(clap::Args)]
pub struct StartCommands {
    /// A shell command started in the background after boot, e.g. a server (its output goes
    /// to the guest's /var/log/rollbox-start.log).
    #[arg(long, value_name = "COMMAND")]
    start_cmd: Option<String>,
    /// A shell command run until it exits 0; creates return once it has (needs --start-cmd).
    #[arg(long, value_name = "COMMAND", requires = "start_cmd")]
    ready_cmd: Option<String>,
    /// How long --ready-cmd may take to first exit 0, and dockerd to come up with --docker
    /// [default: 300] (needs one of them; the daemon says so otherwise).
    #[arg(long, value_name = "SECONDS")]
    ready_timeout: Option<i64>,
    /// Start dockerd in the guest after each boot, before --start-cmd and the boot snapshot
    /// (the rootfs must have dockerd, e.g. Debian with docker.io).
    #[arg(long)]
    docker: bool,
}

impl StartCommands {
    fn add_to(self, body: &mut serde_json::Value) {
        if let Some(c) = self.start_cmd {
            body["start_cmd"] = json!(c);
        }
        if let Some(c) = self.ready_cmd {
            body["ready_cmd"] = json!(c);
        }
        if let Some(s) = self.ready_timeout {
            body["ready_timeout_s"] = json!(s);
        }
        if self.docker {
            body["docker"] = json!(true);
        }
    }
}

/// A template name from an image reference: its last path component without tag or digest.
fn name_from_image(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    let bare = last.split(['@', ':']).next().unwrap_or(last);
    bare.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// Runs one subcommand.
pub fn run(conn: &Conn, command: TemplateCommand) -> Result<(), CliError> {
    match command {
        TemplateCommand::Add(args) => add(conn, args),
        TemplateCommand::Build(args) => build(conn, args),
        TemplateCommand::Ls => ls(conn),
        TemplateCommand::Rm { name } => rm(conn, &name),
    }
}

/// How long the CLI waits for a template build (an image pull, a rootfs, a boot).
const TEMPLATE_BUILD_TIMEOUT: Duration = Duration::from_secs(1800);

fn print_template(conn: &Conn, response: &Response, done: &str) -> Result<(), CliError> {
    if conn.json {
        print_json(response);
        return Ok(());
    }
    let template: Template = parse(response)?;
    println!("template {} {done}", template.name);
    if let Some(image) = &template.image {
        println!("image: {image}");
    }
    if let Some(snapshot) = &template.boot_snapshot {
        println!("boot snapshot: {snapshot}");
    }
    if template.docker {
        println!("docker: dockerd started after each boot");
    }
    if let Some(command) = &template.start_cmd {
        println!("start command: {command}");
    }
    Ok(())
}

/// `rollbox template add`.
fn add(conn: &Conn, args: AddArgs) -> Result<(), CliError> {
    let AddArgs {
        name,
        kernel,
        rootfs,
        initrd,
        cmdline,
        vcpus,
        memory_mib,
        boot_snapshot,
        commands,
        mounts,
    } = args;
    let mut body = json!({
        "name": name,
        "kernel": absolute(kernel),
        "cmdline": cmdline,
        "boot_snapshot": boot_snapshot,
    });
    commands.add_to(&mut body);
    mounts.add_to(&mut body);
    if let Some(p) = rootfs {
        body["rootfs"] = json!(absolute(p));
    }
    if let Some(p) = initrd {
        body["initrd"] = json!(absolute(p));
    }
    if let Some(v) = vcpus {
        body["vcpus"] = json!(v);
    }
    if let Some(v) = memory_mib {
        body["memory_mib"] = json!(v);
    }
    let response = conn.call_within("POST", "/templates", Some(body), TEMPLATE_BUILD_TIMEOUT)?;
    print_template(conn, &response, "added")?;
    Ok(())
}

/// `rollbox template build`: the daemon builds the rootfs (and the boot snapshot).
fn build(conn: &Conn, args: BuildArgs) -> Result<(), CliError> {
    let BuildArgs {
        image,
        name,
        kernel,
        from_docker_archive,
        from_oci_layout,
        insecure,
        registry_auth,
        size,
        cmdline,
        vcpus,
        memory_mib,
        boot_snapshot,
        commands,
        mounts,
    } = args;
    let name = match (name, &image, &from_docker_archive) {
        (Some(name), _, _) => name,
        (None, Some(image), _) => name_from_image(image),
        (None, None, Some(archive)) => name_from_image(
            &archive
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
        (None, None, None) => {
            return Err(CliError::Usage(
                "give an image reference, --from-docker-archive or --name".into(),
            ))
        }
    };
    let mut source = json!({ "insecure": insecure });
    if let Some(file) = registry_auth {
        if let Some(auth) = request_auth(&file, image.as_deref())? {
            source["auth"] = auth;
        }
    }
    if let Some(image) = image {
        source["reference"] = json!(image);
    }
    if let Some(p) = from_docker_archive {
        source["docker_archive"] = json!(absolute(p));
    }
    if let Some(p) = from_oci_layout {
        source["oci_layout"] = json!(absolute(p));
    }
    if let Some(mib) = size {
        source["size_mib"] = json!(mib);
    }
    let mut body = json!({
        "name": name,
        "kernel": absolute(kernel),
        "image": source,
        "boot_snapshot": boot_snapshot,
    });
    commands.add_to(&mut body);
    mounts.add_to(&mut body);
    if let Some(c) = cmdline {
        body["cmdline"] = json!(c);
    }
    if let Some(v) = vcpus {
        body["vcpus"] = json!(v);
    }
    if let Some(v) = memory_mib {
        body["memory_mib"] = json!(v);
    }
    let what = if boot_snapshot {
        format!("building template {name} (image, then a boot and a snapshot)")
    } else {
        format!("building template {name}")
    };
    let spinner = rollbox::images::progress::Progress::for_stderr().spinner(what);
    let response = conn.call_within("POST", "/templates", Some(body), TEMPLATE_BUILD_TIMEOUT);
    spinner.finish_and_clear();
    print_template(conn, &response?, "built")?;
    Ok(())
}

/// `image.auth` for a build of `image` from the entry of `file` for its registry; None (with
/// a warning) when the file has none.
fn request_auth(
    file: &std::path::Path,
    image: Option<&str>,
) -> Result<Option<serde_json::Value>, CliError> {
    let image = image.ok_or_else(|| {
        CliError::Usage("--registry-auth: give the image reference to pull".into())
    })?;
    let reference: oci_client::Reference = image
        .parse()
        .map_err(|e| CliError::Usage(format!("{image:?} is not an image reference: {e}")))?;
    let registry = reference.registry();
    let auth = match AuthFile::load(file)?.for_registry(registry)? {
        Some(Credentials::Basic { username, password }) => {
            json!({ "username": username, "password": password })
        }
        Some(Credentials::Token(token)) => json!({ "token": token }),
        None => {
            eprintln!(
                "warning: {} has no credentials for registry {registry}; the daemon pulls with its own --registry-auth, else anonymously",
                file.display()
            );
            return Ok(None);
        }
    };
    Ok(Some(auth))
}

/// `rollbox template ls`.
fn ls(conn: &Conn) -> Result<(), CliError> {
    let response = conn.call("GET", "/templates", None)?;
    if conn.json {
        print_json(&response);
    } else {
        #[derive(serde::Deserialize)]
        struct List {
            templates: Vec<Template>,
        }
        let list: List = parse(&response)?;
        println!(
            "{:<20} {:>5} {:>7}  {:<40}  ROOTFS",
            "NAME", "VCPUS", "MEM_MIB", "KERNEL"
        );
        for t in list.templates {
            println!(
                "{:<20} {:>5} {:>7}  {:<40}  {}",
                t.name,
                t.vcpus,
                t.memory_mib,
                t.kernel.display(),
                t.rootfs
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "-".into())
            );
        }
    }
    Ok(())
}

/// `rollbox template rm`.
fn rm(conn: &Conn, name: &str) -> Result<(), CliError> {
    conn.call("DELETE", &format!("/templates/{name}"), None)?;
    if !conn.json {
        println!("template {name} removed");
    }
    Ok(())
}
