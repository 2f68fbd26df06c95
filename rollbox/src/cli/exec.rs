//! `rollbox exec`: a command in a sandbox straight through its agent (the sandbox's vsock Unix
//! socket), without the daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

#[derive(Args)]
pub struct ExecArgs {
    /// The sandbox's vsock Unix socket (rollbox-vmm --vsock-uds, or the TCG harness's).
    #[arg(long, value_name = "PATH")]
    vsock_uds: PathBuf,
    /// The agent's vsock port.
    #[arg(long, default_value_t = 1024)]
    port: u32,
    /// Working directory in the guest.
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variable, NAME=VALUE (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// User name or uid in the guest.
    #[arg(long)]
    user: Option<String>,
    /// Hard timeout in seconds (SIGTERM, then SIGKILL to the process group).
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Keep retrying the connection this long while the guest boots.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    wait: f64,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    argv: Vec<String>,
}

/// Runs the command; exits with its status.
pub fn run(args: ExecArgs) -> ExitCode {
    let options = rollbox::exec::ExecOptions {
        uds: args.vsock_uds,
        port: args.port,
        argv: args.argv,
        cwd: args.cwd,
        env: args.env,
        user: args.user,
        timeout: args.timeout.map(std::time::Duration::from_secs_f64),
        wait: std::time::Duration::from_secs_f64(args.wait.max(0.0)),
    };
    match rollbox::exec::run(&options) {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
