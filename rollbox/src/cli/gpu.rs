//! `rollbox gpu ls`: the node's GPUs (PCI devices bound to vfio-pci) and who holds each.

use clap::Subcommand;
use serde::Deserialize;

use rollbox::daemon::api::Gpu;

use super::conn::{parse, print_json, CliError, Conn};

#[derive(Subcommand)]
pub enum GpuCommand {
    /// List the node's GPUs: address, name, IOMMU group, and the sandbox holding each (an
    /// admin key sees holders).
    Ls,
}

/// Runs one subcommand.
pub fn run(conn: &Conn, command: GpuCommand) -> Result<(), CliError> {
    match command {
        GpuCommand::Ls => ls(conn),
    }
}

fn ls(conn: &Conn) -> Result<(), CliError> {
    let response = conn.call("GET", "/gpus", None)?;
    if conn.json {
        print_json(&response);
        return Ok(());
    }
    #[derive(Deserialize)]
    struct List {
        gpus: Vec<Gpu>,
    }
    let list: List = parse(&response)?;
    println!("{:<13} {:>5}  {:<20} NAME", "BDF", "GROUP", "HOLDER");
    for gpu in list.gpus {
        println!(
            "{:<13} {:>5}  {:<20} {}",
            gpu.bdf,
            gpu.iommu_group,
            gpu.holder.as_deref().unwrap_or("-"),
            gpu.name
        );
    }
    Ok(())
}
