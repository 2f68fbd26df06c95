//! `rollbox`: the user-facing command line ([`cli`]); the daemon's logger ([`logger`]) is set
//! up here, since process-wide state belongs to the binary.

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod logger;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    if let Some(name) = cli.logs_as() {
        logger::init(name);
    }
    cli::run(cli)
}
