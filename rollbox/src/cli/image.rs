//! `rollbox image build`: a sandbox rootfs from a Docker/OCI image, and where the guest agent
//! it installs comes from.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};

use rollbox::images::auth::{Auth, AuthFile};
use rollbox::images::registry::RegistryError;
use rollbox::images::{self, progress::Progress, BuildOptions, SourceSpec};

/// Where `cargo xtask` (or the agent's build script) leaves the static guest agent.
const DEFAULT_AGENT: &str = "target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent";

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Build an ext4 rootfs from an image and print its path and size.
    Build(BuildArgs),
}

#[derive(Args)]
pub struct BuildArgs {
    /// Image reference, e.g. 127.0.0.1:5000/busybox:latest. With --from-docker-archive or
    /// --from-oci-layout it picks one image when the file holds several.
    reference: Option<String>,
    /// Read the image from a `docker save` tarball instead of a registry.
    #[arg(long, value_name = "FILE", conflicts_with = "from_oci_layout")]
    from_docker_archive: Option<PathBuf>,
    /// Read the image from an OCI image layout directory instead of a registry.
    #[arg(long, value_name = "DIR")]
    from_oci_layout: Option<PathBuf>,
    /// Also copy the image to FILE (its metadata goes to FILE with extension .image.json).
    #[arg(long, short, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Size of the ext4 image in MiB (default: the content plus 64 MiB free).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    size: Option<u64>,
    /// The static guest agent to install as init [default: $ROLLBOX_AGENT, else
    /// target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent].
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// Cache directory [default: $XDG_CACHE_HOME/rollbox, else /var/cache/rollbox/images].
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Use plain HTTP for this registry (loopback registries always use it).
    #[arg(long)]
    insecure: bool,
    /// Registry credentials: a Docker config.json-format file (`auths`: `auth`, or `username`
    /// and `password`, or `registrytoken`, under the registry's host[:port]). Without it the
    /// pull is anonymous.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["from_docker_archive", "from_oci_layout"])]
    registry_auth: Option<PathBuf>,
    /// Stop when one layer's uncompressed tar stream passes this many bytes [default: 16 GiB].
    #[arg(long, value_name = "BYTES")]
    max_layer_bytes: Option<u64>,
    /// Stop when one layer passes this many tar entries [default: 2000000].
    #[arg(long, value_name = "N")]
    max_layer_entries: Option<u64>,
    /// Stop when all layers together pass this many uncompressed bytes [default: 16 GiB].
    #[arg(long, value_name = "BYTES")]
    max_image_bytes: Option<u64>,
    /// Stop when all layers together pass this many tar entries [default: 2000000].
    #[arg(long, value_name = "N")]
    max_image_entries: Option<u64>,
}

/// `--agent`, else `$ROLLBOX_AGENT`, else the build output: relative to the current
/// directory, or to the workspace that holds this binary (target/<profile>/rollbox); else a
/// static `rollbox-agent` beside this binary (scripts/install.sh puts one there; a dynamic one
/// beside it is the workspace's host build, which no guest image can run).
pub(crate) fn agent_path(flag: Option<PathBuf>) -> PathBuf {
    if let Some(path) = flag {
        return path;
    }
    if let Some(path) = std::env::var_os("ROLLBOX_AGENT").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let relative = Path::new(DEFAULT_AGENT);
    if relative.exists() {
        return relative.to_path_buf();
    }
    let from_workspace = std::env::current_exe().ok().and_then(|exe| {
        exe.parent()?
            .parent()?
            .parent()
            .map(|root| root.join(DEFAULT_AGENT))
    });
    if let Some(path) = from_workspace.filter(|path| path.exists()) {
        return path;
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("rollbox-agent")));
    match beside {
        Some(path)
            if rollbox_jailer::elf::shared_libraries(&path).is_ok_and(|libs| libs.is_empty()) =>
        {
            path
        }
        _ => relative.to_path_buf(),
    }
}

fn build(args: BuildArgs) -> Result<(), images::ImageError> {
    let source = match (args.from_docker_archive, args.from_oci_layout) {
        (Some(file), _) => SourceSpec::DockerArchive(file),
        (None, Some(dir)) => SourceSpec::OciLayout(dir),
        (None, None) => SourceSpec::Registry {
            insecure: args.insecure,
            auth: match &args.registry_auth {
                Some(file) => Auth::File(Arc::new(
                    AuthFile::load(file).map_err(RegistryError::Credentials)?,
                )),
                None => Auth::Anonymous,
            },
        },
    };
    let defaults = images::BuildLimits::default();
    let limits = images::BuildLimits {
        layer_bytes: args.max_layer_bytes.unwrap_or(defaults.layer_bytes),
        layer_entries: args.max_layer_entries.unwrap_or(defaults.layer_entries),
        image_bytes: args.max_image_bytes.unwrap_or(defaults.image_bytes),
        image_entries: args.max_image_entries.unwrap_or(defaults.image_entries),
    };
    let options = BuildOptions {
        reference: args.reference,
        source,
        agent: agent_path(args.agent),
        cache_dir: args.cache_dir.unwrap_or_else(images::default_cache_dir),
        output: args.output,
        size_mib: args.size,
        progress: Progress::for_stderr(),
        limits,
        share_layers: false,
    };
    let started = std::time::Instant::now();
    let built = images::build(&options)?;
    if let Some(interpreter) = &built.agent_interpreter {
        eprintln!(
            "warning: agent {} is dynamically linked ({interpreter}); as the guest's init it needs a static build",
            options.agent.display()
        );
    }
    eprintln!(
        "{} {} in {:.2}s",
        if built.cached { "cached" } else { "built" },
        built.image_digest,
        started.elapsed().as_secs_f64()
    );
    println!("rootfs: {}", built.rootfs.display());
    println!(
        "size: {} bytes ({} MiB)",
        built.size_bytes,
        built.size_bytes.div_ceil(1024 * 1024)
    );
    println!("metadata: {}", built.metadata.display());
    println!("digest: {}", built.image_digest);
    Ok(())
}

/// Runs one subcommand; a full disk gets a hint.
pub fn run(command: ImageCommand) -> ExitCode {
    let ImageCommand::Build(args) = command;
    match build(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            if error.is_no_space() {
                eprintln!("hint: the disk holding the cache or output is full; free space or pass --cache-dir on a larger disk");
            }
            ExitCode::FAILURE
        }
    }
}
