//! `rollbox volume ...`: named shared volumes (virtio-fs), through the daemon: make, list,
//! show and remove them, and read, write and archive their files from the host. Also the
//! `NAME:/mount/path[:ro]` parser of `rollbox sandbox create --volume`.

use std::io::{IsTerminal as _, Read, Write};
use std::path::{Path, PathBuf};

use clap::Subcommand;
use serde::Deserialize;
use serde_json::json;

use rollbox::daemon::api::{FileInfo, FileKind};

use super::conn::{absolute, encode, local_error, parse, print_json, CliError, Conn};

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Make a volume: its files live under the daemon's state directory, or in an existing
    /// host directory with --host-path (an admin key's).
    Create {
        name: String,
        /// An existing directory on the daemon's host to share (left as it is on `rm`).
        #[arg(long, value_name = "DIR", conflicts_with = "size_limit_mib")]
        host_path: Option<PathBuf>,
        /// A size limit: the volume is an ext4 file system of this many MiB.
        #[arg(long, value_name = "MIB")]
        size_limit_mib: Option<u64>,
    },
    /// List volumes, by name.
    #[command(alias = "list")]
    Ls,
    /// Show one volume and the live sandboxes that mount it.
    Info { name: String },
    /// Remove a volume (refused while a live sandbox mounts it); one under the state
    /// directory loses its files, a --host-path directory is left as it is.
    Rm { name: String },
    /// Print a file of the volume (or write it to -o FILE); a directory prints its listing.
    Get {
        name: String,
        /// Relative to the volume's root ("/" is the root).
        path: String,
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Write a file into the volume from FILE, or from stdin without FILE or with `-`
    /// (missing parent directories are made).
    Put {
        name: String,
        /// Relative to the volume's root.
        path: String,
        file: Option<PathBuf>,
    },
    /// A tar archive of a directory of the volume [default: its root], to -o FILE.tar or
    /// stdout.
    Tar {
        name: String,
        path: Option<String>,
        #[arg(short = 'o', long = "output", value_name = "FILE.tar")]
        output: Option<PathBuf>,
    },
}

pub use rollbox::daemon::api::{Volume, VolumeMount};

/// `NAME:/mount/path[:ro]` (`--volume`). Only the shape is checked here; the daemon checks
/// the name and path rules and names the field it refuses.
pub fn parse_mount(spec: &str) -> Result<VolumeMount, String> {
    let usage = || format!("{spec:?}: expected NAME:/mount/path or NAME:/mount/path:ro");
    let (name, rest) = spec.split_once(':').ok_or_else(usage)?;
    // A mount path has no ':', so a second one can only start the `ro` flag.
    let (mount_path, readonly) = match rest.split_once(':') {
        None => (rest, false),
        Some((path, "ro")) => (path, true),
        Some(_) => return Err(usage()),
    };
    if name.is_empty() || !mount_path.starts_with('/') {
        return Err(usage());
    }
    Ok(VolumeMount {
        name: name.to_string(),
        mount_path: mount_path.to_string(),
        readonly,
    })
}

/// Runs one subcommand.
pub fn run(conn: &Conn, command: VolumeCommand) -> Result<(), CliError> {
    match command {
        VolumeCommand::Create {
            name,
            host_path,
            size_limit_mib,
        } => create(conn, &name, host_path, size_limit_mib),
        VolumeCommand::Ls => ls(conn),
        VolumeCommand::Info { name } => info(conn, &name),
        VolumeCommand::Rm { name } => rm(conn, &name),
        VolumeCommand::Get { name, path, output } => get(conn, &name, &path, output.as_deref()),
        VolumeCommand::Put { name, path, file } => put(conn, &name, &path, file.as_deref()),
        VolumeCommand::Tar { name, path, output } => {
            tar(conn, &name, path.as_deref(), output.as_deref())
        }
    }
}

/// `rollbox volume create`.
fn create(
    conn: &Conn,
    name: &str,
    host_path: Option<PathBuf>,
    size_limit_mib: Option<u64>,
) -> Result<(), CliError> {
    let mut body = json!({ "name": name });
    if let Some(dir) = host_path {
        body["host_path"] = json!(absolute(dir));
    }
    if let Some(mib) = size_limit_mib {
        body["size_limit_mib"] = json!(mib);
    }
    let response = conn.call("POST", "/volumes", Some(body))?;
    if conn.json {
        print_json(&response);
    } else {
        let volume: Volume = parse(&response)?;
        println!(
            "volume {} created at {}",
            volume.name,
            volume.host_path.display()
        );
    }
    Ok(())
}

/// `rollbox volume ls`.
fn ls(conn: &Conn) -> Result<(), CliError> {
    let response = conn.call("GET", "/volumes", None)?;
    if conn.json {
        print_json(&response);
        return Ok(());
    }
    #[derive(Deserialize)]
    struct List {
        volumes: Vec<Volume>,
    }
    let list: List = parse(&response)?;
    println!("{:<32} {:<16} {:>7}  HOST_PATH", "NAME", "TENANT", "MOUNTS");
    for v in list.volumes {
        println!(
            "{:<32} {:<16} {:>7}  {}",
            v.name,
            v.tenant.as_deref().unwrap_or("-"),
            v.mounted_by.len(),
            v.host_path.display()
        );
    }
    Ok(())
}

/// `rollbox volume info`.
fn info(conn: &Conn, name: &str) -> Result<(), CliError> {
    let response = conn.call("GET", &format!("/volumes/{}", encode(name)), None)?;
    if conn.json {
        print_json(&response);
        return Ok(());
    }
    let v: Volume = parse(&response)?;
    println!("name:       {}", v.name);
    println!("host_path:  {}", v.host_path.display());
    println!("created_at: {} ms since the epoch", v.created_at_ms);
    println!("tenant:     {}", v.tenant.as_deref().unwrap_or("(admin)"));
    if v.mounted_by.is_empty() {
        println!("mounted_by: -");
    }
    for id in &v.mounted_by {
        println!("mounted_by: {id}");
    }
    Ok(())
}

/// `rollbox volume rm`.
fn rm(conn: &Conn, name: &str) -> Result<(), CliError> {
    conn.call("DELETE", &format!("/volumes/{}", encode(name)), None)?;
    if !conn.json {
        println!("volume {name} removed");
    }
    Ok(())
}

/// `/volumes/NAME/WHAT?path=PATH`.
fn route(name: &str, what: &str, path: Option<&str>) -> String {
    match path {
        Some(path) => format!("/volumes/{}/{what}?path={}", encode(name), encode(path)),
        None => format!("/volumes/{}/{what}", encode(name)),
    }
}

/// Copies a download to `output` (removed again when the copy fails), else to stdout.
fn save(mut from: impl Read, output: Option<&Path>, what: &str) -> Result<(), CliError> {
    let broken = |e: std::io::Error| CliError::Stream(format!("{what}: {e}"));
    match output {
        Some(path) => {
            let local = local_error(path);
            let mut file = std::fs::File::create(path).map_err(&local)?;
            if let Err(e) = std::io::copy(&mut from, &mut file).and_then(|_| file.flush()) {
                drop(file);
                let _ = std::fs::remove_file(path);
                return Err(broken(e));
            }
            Ok(())
        }
        None => {
            let mut out = std::io::stdout().lock();
            std::io::copy(&mut from, &mut out)
                .and_then(|_| out.flush())
                .map(|_| ())
                .map_err(broken)
        }
    }
}

/// `rollbox volume get`: the answer's content type tells a file (bytes) from a directory
/// (a JSON listing).
fn get(conn: &Conn, name: &str, path: &str, output: Option<&Path>) -> Result<(), CliError> {
    let response = conn.open(
        "GET",
        &route(name, "files", Some(path)),
        None,
        "application/json",
    )?;
    let is_listing = response
        .headers
        .iter()
        .any(|(n, v)| n == "content-type" && v.starts_with("application/json"));
    if !is_listing {
        return save(response, output, &format!("{name}:{path}"));
    }
    if let Some(file) = output {
        return Err(CliError::Usage(format!(
            "{name}:{path} is a directory, so nothing was written to {}; archive it with `rollbox volume tar {name} {path} -o FILE.tar`",
            file.display()
        )));
    }
    let response = response.into_response().map_err(CliError::Request)?;
    if conn.json {
        print_json(&response);
        return Ok(());
    }
    #[derive(Deserialize)]
    struct Listing {
        entries: Vec<FileInfo>,
    }
    let listing: Listing = parse(&response)?;
    for entry in &listing.entries {
        println!("{}", listing_line(entry));
    }
    Ok(())
}

/// One line of a directory listing: kind, mode, size, name (`/` after a directory, `->
/// target` after a symlink).
fn listing_line(entry: &FileInfo) -> String {
    let (kind, suffix) = match entry.kind {
        FileKind::File => ("file", String::new()),
        FileKind::Dir => ("dir", "/".to_string()),
        FileKind::Symlink => (
            "symlink",
            format!(" -> {}", entry.link_target.as_deref().unwrap_or("?")),
        ),
        FileKind::Other => ("other", String::new()),
    };
    format!(
        "{kind:<7} {:04o} {:>12}  {}{suffix}",
        entry.mode & 0o7777,
        entry.size,
        entry.name
    )
}

/// `rollbox volume put`: a file is streamed; stdin is read whole first (the request needs
/// its length).
fn put(conn: &Conn, name: &str, path: &str, file: Option<&Path>) -> Result<(), CliError> {
    let route = route(name, "files", Some(path));
    let content = "application/octet-stream";
    let response = match file.filter(|f| *f != Path::new("-")) {
        Some(from) => {
            let local = local_error(from);
            let meta = std::fs::metadata(from).map_err(&local)?;
            if !meta.is_file() {
                return Err(CliError::Usage(format!(
                    "{}: not a regular file (put writes one file)",
                    from.display()
                )));
            }
            let mut source = std::fs::File::open(from).map_err(local)?;
            conn.open("PUT", &route, Some((&mut source, meta.len())), content)?
        }
        None => {
            let mut data = Vec::new();
            std::io::stdin()
                .read_to_end(&mut data)
                .map_err(|source| CliError::Local {
                    path: PathBuf::from("(stdin)"),
                    source,
                })?;
            let len = data.len() as u64;
            conn.open("PUT", &route, Some((&mut data.as_slice(), len)), content)?
        }
    };
    let response = response.into_response().map_err(CliError::Request)?;
    if conn.json {
        print_json(&response);
    } else {
        #[derive(Deserialize)]
        struct Written {
            path: String,
            bytes: u64,
        }
        let written: Written = parse(&response)?;
        println!("{name}:{} ({} bytes)", written.path, written.bytes);
    }
    Ok(())
}

/// `rollbox volume tar`: refuses to write the archive to a terminal.
fn tar(conn: &Conn, name: &str, path: Option<&str>, output: Option<&Path>) -> Result<(), CliError> {
    if output.is_none() && std::io::stdout().is_terminal() {
        return Err(CliError::Usage(
            "volume tar: stdout is a terminal; give -o FILE.tar or redirect it".into(),
        ));
    }
    let response = conn.open("GET", &route(name, "tar", path), None, "application/json")?;
    save(response, output, &format!("{name}:{}", path.unwrap_or("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_flags_parse_and_bad_ones_name_the_input() {
        let mount = parse_mount("traj:/data").expect("plain");
        assert_eq!(
            mount,
            VolumeMount {
                name: "traj".into(),
                mount_path: "/data".into(),
                readonly: false
            }
        );
        let mount = parse_mount("traj:/mnt/in:ro").expect("ro");
        assert_eq!(
            (mount.mount_path.as_str(), mount.readonly),
            ("/mnt/in", true)
        );
        assert_eq!(
            serde_json::to_value(&mount).expect("json"),
            json!({"name": "traj", "mount_path": "/mnt/in", "readonly": true})
        );
        for bad in [
            "traj",
            ":/data",
            "traj:data",
            "traj:/data:rw",
            "traj:/a:ro:ro",
        ] {
            let error = parse_mount(bad).expect_err(bad);
            assert!(error.contains(&format!("{bad:?}")), "{error}");
        }
    }

    #[test]
    fn routes_encode_the_name_and_path() {
        assert_eq!(
            route("traj", "files", Some("/a b/c")),
            "/volumes/traj/files?path=%2Fa%20b%2Fc"
        );
        assert_eq!(route("traj", "tar", None), "/volumes/traj/tar");
    }

    #[test]
    fn volumes_and_listings_parse_the_daemons_json() {
        let v: Volume = serde_json::from_value(json!({
            "name": "traj",
            "host_path": "/var/lib/rollbox/volumes/traj",
            "created_at_ms": 1733300000000u64,
        }))
        .expect("an admin's volume");
        assert_eq!((v.tenant, v.mounted_by.len()), (None, 0));
        let entry: FileInfo = serde_json::from_value(json!({
            "name": "l", "path": "/d/l", "kind": "symlink", "size": 3, "mode": 0o100777,
            "uid": 0, "gid": 0, "mtime_ns": 0, "link_target": "../x"
        }))
        .expect("entry");
        assert_eq!(listing_line(&entry), "symlink 0777            3  l -> ../x");
    }
}
