//! `rollbox net ...`: per-sandbox host networking through the [`rollbox::net`] library, each
//! answer printed as JSON.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum NetCommand {
    /// Create sandbox NAME's tap, lease, NAT and egress rules; print them as JSON.
    Up(NetUpArgs),
    /// Remove everything `up` made for sandbox NAME (nothing to remove is not an error).
    Down {
        name: String,
        #[command(flatten)]
        state: NetStateArg,
    },
    /// Print the leases as a JSON array.
    List {
        #[command(flatten)]
        state: NetStateArg,
    },
    /// Remove what sandboxes whose state is gone left behind (unfinished leases, and taps and
    /// rules in the pool that no lease accounts for).
    Gc {
        /// Only interfaces and rules of this pool are considered.
        #[arg(long, value_name = "CIDR", default_value = rollbox::net::DEFAULT_POOL)]
        pool: String,
        #[command(flatten)]
        state: NetStateArg,
    },
}

#[derive(Args)]
pub struct NetStateArg {
    /// Lease directory [default: $ROLLBOX_NET_STATE, else /run/rollbox/net].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
}

impl NetStateArg {
    fn dir(self) -> rollbox::net::StateDir {
        rollbox::net::StateDir::new(
            self.state_dir
                .unwrap_or_else(rollbox::net::default_state_dir),
        )
    }
}

#[derive(Args)]
pub struct NetUpArgs {
    /// The sandbox's name: 1-64 bytes of A-Z a-z 0-9 _ . - (starting with a letter or digit).
    name: String,
    /// The pool each sandbox's /30 comes from.
    #[arg(long, value_name = "CIDR", default_value = rollbox::net::DEFAULT_POOL)]
    pool: String,
    /// none, all, or an allow-list: CIDR[:PORT[-PORT]],... (TCP and UDP to those ports).
    #[arg(long, value_name = "POLICY", default_value = "none")]
    egress: String,
    /// A DNS server the guest may reach (port 53), also passed in the kernel's ip= argument.
    #[arg(long, value_name = "IP")]
    dns: Option<String>,
    /// Forward host TCP port HOSTPORT to the guest's GUESTPORT (repeatable).
    #[arg(long, value_name = "HOSTPORT:GUESTPORT", num_args = 1..)]
    expose: Vec<String>,
    /// Expose the ports on this host address only (repeatable; 127.0.0.1: the host itself).
    /// Without it: on every local address but loopback.
    #[arg(long, value_name = "IP")]
    expose_on: Vec<String>,
    /// Tests only: instead of a tap, a veth pair whose peer, configured as the guest, sits in
    /// this network namespace (the rules are the same).
    #[arg(long, value_name = "NETNS", hide = true)]
    veth_netns: Option<String>,
    #[command(flatten)]
    state: NetStateArg,
}

fn net(command: NetCommand) -> Result<(), rollbox::net::NetError> {
    use rollbox::net;
    let json = |value: serde_json::Value| println!("{value}");
    match command {
        NetCommand::Up(args) => {
            let options = net::UpOptions {
                name: args.name,
                pool: args.pool,
                egress: args.egress,
                dns: args.dns,
                expose: args.expose,
                expose_on: args.expose_on,
                link: match args.veth_netns {
                    Some(netns) => net::LinkKind::Veth { netns },
                    None => net::LinkKind::Tap,
                },
            };
            let request = net::LeaseRequest::parse(&options)?;
            let info = net::lease(&args.state.dir(), &request)?;
            json(serde_json::json!(info));
        }
        NetCommand::Down { name, state } => {
            if !net::release(&state.dir(), &name)? {
                eprintln!("{name}: no network to remove");
            }
        }
        NetCommand::List { state } => json(serde_json::json!(net::leases(&state.dir())?)),
        NetCommand::Gc { pool, state } => {
            let state = state.dir();
            let pool = net::Pool::parse(&pool)?;
            json(serde_json::json!({ "removed": net::gc(&state, &pool)? }))
        }
    }
    Ok(())
}

/// Runs one subcommand.
pub fn run(command: NetCommand) -> ExitCode {
    match net(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
