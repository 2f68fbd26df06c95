//! The `rollbox` command line: one module per command ([`image`], [`exec`], [`net`],
//! [`serve`], [`sandbox`] with [`guest`], [`template`], [`key`], [`node`], [`volume`]), and
//! [`conn`], how the daemon's commands talk to it.

mod conn;
mod exec;
mod gpu;
mod guest;
mod image;
mod key;
mod kube;
mod lease;
mod net;
mod node;
mod sandbox;
mod serve;
mod template;
mod untar;
mod volume;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "rollbox", version, about = "Sandboxes for RL rollouts")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Images: turn Docker/OCI images into sandbox root filesystems.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Run a command in a sandbox through its agent (over the sandbox's vsock Unix socket).
    Exec(exec::ExecArgs),
    /// Per-sandbox host networking: tap, /30 lease, NAT and egress policy (needs root).
    #[command(subcommand)]
    Net(net::NetCommand),
    /// The daemon: an HTTP/JSON API (bearer key) for sandboxes and templates.
    Serve(Box<serve::ServeArgs>),
    /// Sandboxes, through the daemon.
    Sandbox {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: sandbox::SandboxCommand,
    },
    /// Templates (what sandboxes boot), through the daemon.
    Template {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: template::TemplateCommand,
    },
    /// API keys (tenants' and admins'), through the daemon; needs an admin key.
    Key {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: key::KeyCommand,
    },
    /// This daemon as a node: slots, memory, CPU fingerprint, drain; needs an admin key.
    Node {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: node::NodeCommand,
    },
    /// Hold one sandbox while this runs and serve its E2B/envd API: the container of an
    /// agent-sandbox pod (docs/kubernetes.md). SIGTERM deletes the sandbox.
    Lease(Box<lease::LeaseArgs>),
    /// Named shared volumes (virtio-fs) that sandboxes mount, and their files, through the
    /// daemon.
    Volume {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: volume::VolumeCommand,
    },
    /// The node's GPUs (PCI devices bound to vfio-pci) that sandboxes get with `--gpu`.
    Gpu {
        #[command(flatten)]
        conn: conn::ConnArgs,
        #[command(subcommand)]
        command: gpu::GpuCommand,
    },
}

impl Cli {
    /// The name the log lines of a long-running command carry (the daemon, a lease); None
    /// for a command that only prints.
    pub fn logs_as(&self) -> Option<&'static str> {
        match self.command {
            Command::Serve(_) => Some("rollbox serve"),
            Command::Lease(_) => Some("rollbox lease"),
            _ => None,
        }
    }
}

/// Runs the command line's command.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Image(command) => image::run(command),
        Command::Exec(args) => exec::run(args),
        Command::Net(command) => net::run(command),
        Command::Serve(args) => serve::serve(*args),
        Command::Lease(args) => match lease::run(*args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&e),
        },
        Command::Sandbox { conn, command } => {
            match conn::Conn::new(&conn).and_then(|conn| sandbox::run(&conn, command)) {
                Ok(code) => ExitCode::from(code),
                Err(e) => fail(&e),
            }
        }
        Command::Template { conn, command } => {
            match conn::Conn::new(&conn).and_then(|conn| template::run(&conn, command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Key { conn, command } => {
            match conn::Conn::new(&conn).and_then(|conn| key::run(&conn, command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Node { conn, command } => {
            let conn = if command.needs_key() {
                conn::Conn::new(&conn)
            } else {
                conn::Conn::keyless(&conn)
            };
            match conn.and_then(|conn| node::run(&conn, command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Volume { conn, command } => {
            match conn::Conn::new(&conn).and_then(|conn| volume::run(&conn, command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        Command::Gpu { conn, command } => {
            match conn::Conn::new(&conn).and_then(|conn| gpu::run(&conn, command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

/// A daemon command's error, on stderr.
fn fail(error: &conn::CliError) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::FAILURE
}
