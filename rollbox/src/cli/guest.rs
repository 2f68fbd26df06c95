//! `rollbox sandbox exec`, `cp` and `port-forward`: the subcommands that reach into a running
//! guest (a streamed exec, file and tar transfers, upgraded TCP connections).

use std::time::Duration;

use serde_json::{json, Value};

use clap::Args;

use super::conn::{encode, key_values, local_error, parse, CliError, Conn};

/// `exec`'s arguments.
#[derive(Args)]
pub struct ExecArgs {
    pub id: String,
    /// NAME=VALUE (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Working directory in the sandbox (absolute).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// User name or uid in the sandbox.
    #[arg(long)]
    pub user: Option<String>,
    /// Kill the command's process group after this many seconds.
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<f64>,
    /// The command and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub cmd: Vec<String>,
}

/// `cp`'s arguments.
#[derive(Args)]
pub struct CpArgs {
    pub src: String,
    pub dest: String,
    /// From a sandbox: stop with an error past this many bytes (files together).
    #[arg(long, value_name = "BYTES", default_value_t = super::untar::DEFAULT_MAX_BYTES)]
    pub max_bytes: u64,
    /// From a sandbox: stop with an error past this many archive entries.
    #[arg(long, value_name = "N", default_value_t = super::untar::DEFAULT_MAX_ENTRIES)]
    pub max_entries: u64,
}

/// `port-forward`'s arguments.
#[derive(Args)]
pub struct PortForwardArgs {
    pub id: String,
    /// The guest port (1-65535).
    #[arg(value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Where to listen on the host (port 0: any free port).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    pub listen: std::net::SocketAddr,
}

/// `rollbox sandbox exec`.
pub fn exec(conn: &Conn, args: ExecArgs) -> Result<u8, CliError> {
    let ExecArgs {
        id,
        env,
        cwd,
        user,
        timeout,
        cmd,
    } = args;
    let mut body = json!({ "cmd": cmd, "env": Value::Object(key_values(&env, "env")?) });
    if let Some(cwd) = cwd {
        body["cwd"] = json!(cwd);
    }
    if let Some(user) = user {
        body["user"] = json!(user);
    }
    if let Some(timeout) = timeout {
        body["timeout_s"] = json!(timeout);
    }
    exec_streaming(conn, &id, body)
}

/// Streams an exec's output to stdout and stderr; returns its exit status.
fn exec_streaming(conn: &Conn, id: &str, body: Value) -> Result<u8, CliError> {
    use rollbox::daemon::api::{decode_bytes, ExecLine, ExecRecord};
    use std::io::{BufRead, Write};
    let text = body.to_string();
    let mut source = text.as_bytes();
    let len = source.len() as u64;
    let response = conn.open(
        "POST",
        &format!("/sandboxes/{id}/exec?stream=true"),
        Some((&mut source, len)),
        "application/json",
    )?;
    let mut lines = std::io::BufReader::new(response);
    let mut line = String::new();
    loop {
        line.clear();
        let n = lines
            .read_line(&mut line)
            .map_err(|e| CliError::Stream(e.to_string()))?;
        if n == 0 {
            return Err(CliError::Stream("it ended before the exit line".into()));
        }
        let parsed: ExecLine = serde_json::from_str(&line).map_err(CliError::Answer)?;
        match parsed.record {
            ExecRecord::Started { .. } => {}
            ExecRecord::Stdout { data, encoding } => {
                let mut out = std::io::stdout().lock();
                let bytes = decode_bytes(&data, encoding).unwrap_or_default();
                let _ = out.write_all(&bytes).and_then(|()| out.flush());
            }
            ExecRecord::Stderr { data, encoding } => {
                let mut err = std::io::stderr().lock();
                let bytes = decode_bytes(&data, encoding).unwrap_or_default();
                let _ = err.write_all(&bytes).and_then(|()| err.flush());
            }
            ExecRecord::Exit(exit) => {
                if exit.oom {
                    eprintln!("rollbox: the OOM killer killed the command");
                }
                if exit.truncated {
                    eprintln!("rollbox: output beyond the cap was dropped");
                }
                return Ok(if exit.timed_out {
                    eprintln!("rollbox: timed out; the process group was killed");
                    124
                } else if let Some(signal) = exit.signal {
                    128u8.saturating_add(u8::try_from(signal).unwrap_or(127))
                } else {
                    exit.exit_code
                        .and_then(|c| u8::try_from(c & 0xff).ok())
                        .unwrap_or(1)
                });
            }
            ExecRecord::Error { message } => return Err(CliError::Stream(message)),
        }
    }
}

/// `ID:/path` → (id, path); anything else is a host path.
fn remote(spec: &str) -> Option<(&str, &str)> {
    let (id, path) = spec.split_once(':')?;
    (id.starts_with("sb-") && path.starts_with('/')).then_some((id, path))
}

fn base_name(path: &str) -> Result<&str, CliError> {
    std::path::Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| CliError::Usage(format!("{path:?} names no file")))
}

/// `rollbox sandbox cp`. What comes from a guest is unpacked or written within the caps, and
/// an archive may not put anything outside `dest` (see [`super::untar`]).
pub fn copy(conn: &Conn, args: &CpArgs) -> Result<(), CliError> {
    let (src, dest) = (args.src.as_str(), args.dest.as_str());
    let caps = super::untar::Caps {
        bytes: args.max_bytes,
        entries: args.max_entries,
    };
    let local = local_error;
    match (remote(src), remote(dest)) {
        (None, Some((id, to))) => {
            let from = std::path::Path::new(src);
            let meta = std::fs::metadata(from).map_err(local(from))?;
            if meta.is_dir() {
                let mut archive = tar::Builder::new(Vec::new());
                archive.follow_symlinks(false);
                archive.append_dir_all(".", from).map_err(local(from))?;
                let data = archive.into_inner().map_err(local(from))?;
                let len = data.len() as u64;
                conn.open(
                    "PUT",
                    &format!("/sandboxes/{id}/tar?path={}", encode(to)),
                    Some((&mut data.as_slice(), len)),
                    "application/x-tar",
                )?
                .into_response()
                .map_err(CliError::Request)?;
            } else {
                let to = if to.ends_with('/') {
                    format!("{to}{}", base_name(src)?)
                } else {
                    to.to_string()
                };
                let mut file = std::fs::File::open(from).map_err(local(from))?;
                conn.open(
                    "PUT",
                    &format!("/sandboxes/{id}/files?path={}&parents=true", encode(&to)),
                    Some((&mut file, meta.len())),
                    "application/octet-stream",
                )?
                .into_response()
                .map_err(CliError::Request)?;
            }
            Ok(())
        }
        (Some((id, from)), None) => {
            let info = conn.call(
                "GET",
                &format!("/sandboxes/{id}/files/stat?path={}", encode(from)),
                None,
            )?;
            let info: rollbox::daemon::api::FileInfo = parse(&info)?;
            let to = std::path::Path::new(dest);
            let broken = |e: std::io::Error| CliError::Stream(e.to_string());
            if info.kind == rollbox::daemon::api::FileKind::Dir {
                std::fs::create_dir_all(to).map_err(local(to))?;
                let response = conn.open(
                    "GET",
                    &format!("/sandboxes/{id}/tar?path={}", encode(from)),
                    None,
                    "application/json",
                )?;
                super::untar::unpack(response, to, caps)?;
            } else {
                let target = if to.is_dir() {
                    to.join(base_name(from)?)
                } else {
                    to.to_path_buf()
                };
                let mut response = conn.open(
                    "GET",
                    &format!("/sandboxes/{id}/files?path={}", encode(from)),
                    None,
                    "application/json",
                )?;
                let mut file = std::fs::File::create(&target).map_err(local(&target))?;
                use std::io::Read as _;
                let mut capped = (&mut response).take(caps.bytes.saturating_add(1));
                let copied = std::io::copy(&mut capped, &mut file).map_err(broken)?;
                if copied > caps.bytes {
                    drop(file);
                    let _ = std::fs::remove_file(&target);
                    return Err(super::untar::UntarError::FileBytes {
                        file: format!("{id}:{from}"),
                        limit: caps.bytes,
                        removed: target,
                    }
                    .into());
                }
            }
            Ok(())
        }
        _ => Err(CliError::Usage(format!(
            "cp {src} {dest}: exactly one side must be ID:/absolute/path in a sandbox"
        ))),
    }
}

/// `rollbox sandbox port-forward`: one thread per accepted connection, each with its own
/// upgraded daemon connection (`GET /sandboxes/{id}/ports/{port}`).
pub fn port_forward(
    conn: &Conn,
    id: &str,
    port: u16,
    listen: std::net::SocketAddr,
) -> Result<(), CliError> {
    // A sandbox that is not there fails now, not at the first connection.
    conn.call("GET", &format!("/sandboxes/{id}"), None)?;
    let listener = std::net::TcpListener::bind(listen).map_err(|source| CliError::Listen {
        address: listen,
        source,
    })?;
    let local = listener.local_addr().map_err(|source| CliError::Listen {
        address: listen,
        source,
    })?;
    println!("forwarding {local} -> sandbox {id} port {port}");
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    let path = format!("/sandboxes/{id}/ports/{port}");
    let auth = format!("Bearer {}", conn.key);
    loop {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("rollbox sandbox port-forward: accept on {local}: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let endpoint = conn.endpoint.clone();
        let (path, auth) = (path.clone(), auth.clone());
        std::thread::spawn(move || {
            let upgraded = endpoint.upgrade(
                &path,
                &[("Authorization", &auth)],
                "tcp",
                Duration::from_secs(30),
            );
            match upgraded {
                Ok(Ok(guest)) => splice(client, guest),
                Ok(Err(refusal)) => eprintln!(
                    "rollbox sandbox port-forward: {}: {} ({})",
                    path,
                    refusal.error_message(),
                    refusal.status
                ),
                Err(e) => eprintln!("rollbox sandbox port-forward: {path}: {e}"),
            }
        });
    }
}

/// Copies both ways until both directions ended, passing each end of input on.
fn splice(client: std::net::TcpStream, guest: rollbox::daemon::client::Upgraded) {
    let (Ok(mut client_out), Ok(mut guest_in)) = (client.try_clone(), guest.try_clone()) else {
        eprintln!("rollbox sandbox port-forward: cannot duplicate a connection's descriptor");
        return;
    };
    let upstream = std::thread::spawn(move || {
        let mut client = client;
        let _ = std::io::copy(&mut client, &mut guest_in);
        let _ = guest_in.shutdown_write();
    });
    let mut guest = guest;
    let _ = std::io::copy(&mut guest, &mut client_out);
    let _ = client_out.shutdown(std::net::Shutdown::Write);
    let _ = upstream.join();
}
