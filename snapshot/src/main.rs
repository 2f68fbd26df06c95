//! `rollbox-snapshot`: inspect snapshot files and fold a diff chain into one full snapshot.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use snapshot::format::{read_state_file, write_state_file};
use snapshot::memory::{fold, relative_to, resolve_in, MemoryLayer};

/// Snapshot tools for rollbox-vmm.
#[derive(Parser, Debug)]
#[command(name = "rollbox-snapshot", version)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Prints a snapshot's memory size, vCPUs and memory layers.
    Info {
        /// Snapshot directory or state file.
        snapshot: PathBuf,
    },
    /// Folds a snapshot whose memory is a chain of diff layers into one full snapshot.
    Fold {
        /// Snapshot directory or state file (its chain is read from it).
        snapshot: PathBuf,
        /// Output directory (gets `vmstate` and `memory`).
        #[arg(long, short)]
        output: PathBuf,
    },
}

fn state_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("vmstate")
    } else {
        path.to_path_buf()
    }
}

/// The directory relative layer paths in the state file at `path` start from.
fn state_dir(path: &Path) -> PathBuf {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => dir.to_path_buf(),
        None => PathBuf::from("."),
    }
}

/// The fields this tool needs, layer paths resolved against `dir`; everything else in the
/// state is carried through untouched.
fn layers_of(state: &ciborium::Value, dir: &Path) -> Result<(Vec<MemoryLayer>, u64), String> {
    let map = state.as_map().ok_or("state is not a map")?;
    let field = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_text() == Some(name))
            .map(|(_, v)| v.clone())
    };
    let mut layers: Vec<MemoryLayer> = field("memory_layers")
        .ok_or("state has no memory_layers")?
        .deserialized()
        .map_err(|e| format!("memory_layers: {e}"))?;
    for layer in &mut layers {
        layer.path = resolve_in(dir, &layer.path);
    }
    let regions: Vec<(u64, u64)> = field("regions")
        .ok_or("state has no regions")?
        .deserialized()
        .map_err(|e| format!("regions: {e}"))?;
    Ok((layers, regions.iter().map(|(_, len)| len).sum()))
}

fn run(args: Args) -> Result<(), String> {
    match args.command {
        Cmd::Info { snapshot } => {
            let path = state_path(&snapshot);
            let state: ciborium::Value = read_state_file(&path).map_err(|e| e.to_string())?;
            let (layers, guest_len) = layers_of(&state, &state_dir(&path))?;
            println!("state file: {}", path.display());
            println!("guest memory: {} MiB", guest_len >> 20);
            for (i, layer) in layers.iter().enumerate() {
                let kind = match &layer.dirty {
                    None => "full".to_string(),
                    Some(r) => format!(
                        "diff, {} KiB in {} ranges",
                        r.iter().map(|x| x.1).sum::<u64>() >> 10,
                        r.len()
                    ),
                };
                println!(
                    "layer {i}: {} ({kind}, id {:#x})",
                    layer.path.display(),
                    layer.id
                );
            }
            Ok(())
        }
        Cmd::Fold { snapshot, output } => {
            let path = state_path(&snapshot);
            let state: ciborium::Value = read_state_file(&path).map_err(|e| e.to_string())?;
            let (layers, guest_len) = layers_of(&state, &state_dir(&path))?;
            std::fs::create_dir_all(&output).map_err(|e| format!("{}: {e}", output.display()))?;
            let memory = output.join("memory");
            let mut folded = fold(&layers, guest_len, &memory).map_err(|e| e.to_string())?;
            // Stored relative to the output directory, so it can move.
            folded.path =
                relative_to(&output, &memory).map_err(|e| format!("{}: {e}", memory.display()))?;
            let mut state = state;
            if let ciborium::Value::Map(entries) = &mut state {
                for (key, value) in entries.iter_mut() {
                    if key.as_text() == Some("memory_layers") {
                        *value = ciborium::Value::serialized(&vec![folded.clone()])
                            .map_err(|e| e.to_string())?;
                    }
                }
            }
            write_state_file(&output.join("vmstate"), &state).map_err(|e| e.to_string())?;
            println!("{}", output.display());
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rollbox-snapshot: error: {e}");
            ExitCode::FAILURE
        }
    }
}
