//! `rollbox key ...`: API keys, through the daemon (an admin key's to run): add one for a
//! tenant (or an admin), list them, revoke one.

use clap::Subcommand;
use serde_json::json;

use rollbox::daemon::api::KeyInfo;

use super::conn::{parse, print_json, CliError, Conn};

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Make a key; it is printed once (the daemon keeps only its hash).
    Add {
        /// The tenant the key is for: it sees and touches only its own sandboxes and snapshots.
        #[arg(long, required_unless_present = "admin", conflicts_with = "admin")]
        tenant: Option<String>,
        /// An admin key instead (templates, keys, metrics, every tenant's sandboxes).
        #[arg(long)]
        admin: bool,
    },
    /// The keys added with `key add` (never the keys themselves).
    #[command(alias = "ls")]
    List,
    /// Revoke a key by its id: its next request gets 401.
    Revoke { id: String },
}

pub fn run(conn: &Conn, command: KeyCommand) -> Result<(), CliError> {
    match command {
        KeyCommand::Add { tenant, admin } => {
            let body = match tenant {
                Some(tenant) => json!({ "tenant": tenant }),
                None => json!({ "admin": admin }),
            };
            let response = conn.call("POST", "/keys", Some(body))?;
            if conn.json {
                print_json(&response);
            } else {
                let key: KeyInfo = parse(&response)?;
                let who = key.tenant.as_deref().unwrap_or("(admin)");
                eprintln!(
                    "key {} for {who}; this is the only time it is shown:",
                    key.id
                );
                println!("{}", key.key.unwrap_or_default());
            }
        }
        KeyCommand::List => {
            let response = conn.call("GET", "/keys", None)?;
            if conn.json {
                print_json(&response);
            } else {
                #[derive(serde::Deserialize)]
                struct List {
                    keys: Vec<KeyInfo>,
                }
                let list: List = parse(&response)?;
                println!("{:<22} {:<7} {:<24} CREATED_AT_MS", "ID", "ROLE", "TENANT");
                for key in list.keys {
                    println!(
                        "{:<22} {:<7} {:<24} {}",
                        key.id,
                        key.role,
                        key.tenant.as_deref().unwrap_or("-"),
                        key.created_at_ms
                    );
                }
            }
        }
        KeyCommand::Revoke { id } => {
            conn.call("DELETE", &format!("/keys/{id}"), None)?;
            if !conn.json {
                println!("key {id} revoked");
            }
        }
    }
    Ok(())
}
