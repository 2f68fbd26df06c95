//! The daemon's state: templates, sandboxes and snapshots in one SQLite file. The tables hold
//! rows of their own (`rows.rs`), mapped to and from the API's model at this boundary; the
//! queries are by table (`sandboxes.rs`, `templates.rs`, `snapshots.rs`, `volumes.rs`). [`Db`] is the store
//! behind the lock the services share.

mod keys;
mod rows;
mod sandboxes;
mod snapshots;
mod templates;
mod volumes;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rusqlite::Connection;

pub use keys::KeyRow;
pub use rows::UsageRow;
pub use volumes::VolumeRow;

/// A failed database operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state database {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("state database: bad JSON in column {column}: {source}")]
    Json {
        column: &'static str,
        source: serde_json::Error,
    },
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sandboxes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    idempotency_key TEXT UNIQUE,
    template TEXT NOT NULL,
    state TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    labels TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    idle_ttl_s INTEGER,
    last_active_at_ms INTEGER NOT NULL,
    pid INTEGER,
    pid_start_time INTEGER,
    dir TEXT NOT NULL,
    ended_at_ms INTEGER,
    end_reason TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    sandbox TEXT NOT NULL,
    spec TEXT NOT NULL
);
-- The snapshot each sandbox was restored (or last reset) from.
CREATE TABLE IF NOT EXISTS sandbox_sources (
    sandbox TEXT PRIMARY KEY,
    snapshot TEXT NOT NULL
);
";

/// Schema upgrades, in order: step N brings `PRAGMA user_version` from N to N + 1, so a
/// database file of an older daemon is upgraded in place when it is opened.
const MIGRATIONS: &[&str] = &[
    "
ALTER TABLE sandboxes ADD COLUMN env TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sandboxes ADD COLUMN cpu_limit REAL;
-- Usage: milliseconds spent running before `running_since_ms` (set while it runs).
ALTER TABLE sandboxes ADD COLUMN run_ms INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN running_since_ms INTEGER;
-- CPU time of the sandbox's ended VMMs (utime + stime), in ms.
ALTER TABLE sandboxes ADD COLUMN cpu_ms INTEGER NOT NULL DEFAULT 0;
UPDATE sandboxes SET running_since_ms = CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)
    WHERE state = 'running';
",
    "
ALTER TABLE sandboxes ADD COLUMN deterministic INTEGER NOT NULL DEFAULT 0;
",
    "
-- What the TTL does (kill, pause), whether a request resumes it, and the TTL it was made with.
ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'kill';
ALTER TABLE sandboxes ADD COLUMN auto_resume INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN ttl_s INTEGER NOT NULL DEFAULT 0;
-- A snapshot's name, unique among snapshots.
ALTER TABLE snapshots ADD COLUMN name TEXT;
CREATE UNIQUE INDEX snapshots_name ON snapshots(name) WHERE name IS NOT NULL;
",
    "
-- Tenants (issue 25): the tenant whose key made a sandbox (NULL: an admin key's), and the
-- API keys added with POST /keys, by the SHA-256 of the key (never the key itself).
ALTER TABLE sandboxes ADD COLUMN tenant TEXT;
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    hash TEXT NOT NULL UNIQUE,
    created_at_ms INTEGER NOT NULL
);
",
    "
-- A snapshot taken by a fork: it goes when no live sandbox restores from it any more, or at
-- `--fork-snapshot-ttl` (see retention.rs).
ALTER TABLE snapshots ADD COLUMN fork INTEGER NOT NULL DEFAULT 0;
",
    "
-- Shared volumes (issue 23): each sandbox's mounts (JSON), and the named volumes; `managed`:
-- its directory is under the state dir (removed with it), not an admin's host path.
ALTER TABLE sandboxes ADD COLUMN volumes TEXT NOT NULL DEFAULT '[]';
CREATE TABLE volumes (
    name TEXT PRIMARY KEY,
    host_path TEXT NOT NULL,
    managed INTEGER NOT NULL,
    tenant TEXT,
    created_at_ms INTEGER NOT NULL,
    -- A size-limited volume is an ext4 image of this size, loop-mounted at host_path.
    size_limit_mib INTEGER
);
",
    "
-- GPUs (issue 23): the PCI addresses a sandbox holds (JSON).
ALTER TABLE sandboxes ADD COLUMN gpus TEXT NOT NULL DEFAULT '[]';
",
    "
-- Networks (issue 24): a sandbox's network as it was made (JSON); NULL: none.
ALTER TABLE sandboxes ADD COLUMN network TEXT;
",
];

/// Adds the running time since `running_since_ms` to `run_ms` (an UPDATE's SET clause).
const RUN_MS_UNTIL_NOW: &str = "run_ms = run_ms + \
    MAX(0, COALESCE(CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) - running_since_ms, 0))";

/// SQLite's clock in Unix milliseconds (for usage accounting inside one statement).
const SQL_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// What [`Store::insert_sandbox`] did.
pub enum Inserted {
    New,
    /// A sandbox with the same idempotency key exists already.
    Existing(Box<super::api::Sandbox>),
}

/// The open database.
pub struct Store {
    conn: Connection,
}

fn json_column<T: serde::de::DeserializeOwned>(
    text: &str,
    column: &'static str,
) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|source| StoreError::Json { column, source })
}

fn to_json<T: serde::Serialize>(value: &T, column: &'static str) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|source| StoreError::Json { column, source })
}

/// Runs the [`MIGRATIONS`] the file has not had, each in one transaction.
fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    loop {
        let version: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
        let Some(step) = usize::try_from(version)
            .ok()
            .and_then(|v| MIGRATIONS.get(v))
        else {
            return Ok(());
        };
        let tx = conn.transaction()?;
        tx.execute_batch(step)?;
        tx.pragma_update(None, "user_version", version + 1)?;
        tx.commit()?;
    }
}

impl Store {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let open = |path: &Path| -> rusqlite::Result<Connection> {
            let mut conn = Connection::open(path)?;
            // WAL: a killed daemon loses nothing it committed.
            conn.pragma_update(None, "journal_mode", "WAL")?;
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.execute_batch(SCHEMA)?;
            migrate(&mut conn)?;
            Ok(conn)
        };
        let conn = open(path).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Store { conn })
    }
}

/// The store behind the one lock every service shares. A panic while holding it leaves SQLite
/// consistent (each call is one statement or one transaction), so a poisoned lock is still
/// usable.
pub struct Db(Mutex<Store>);

impl Db {
    pub fn new(store: Store) -> Db {
        Db(Mutex::new(store))
    }

    pub fn lock(&self) -> MutexGuard<'_, Store> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_of_the_first_schema_is_upgraded_in_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        {
            let conn = Connection::open(&path).expect("open");
            conn.execute_batch(SCHEMA).expect("old schema");
            conn.execute(
                "INSERT INTO sandboxes (id, template, state, vcpus, memory_mib, labels, metadata, \
                 created_at_ms, expires_at_ms, last_active_at_ms, dir) \
                 VALUES ('old', 't', 'running', 2, 64, '{}', '{}', 1, 2, 1, '/x')",
                [],
            )
            .expect("old row");
        }
        let store = Store::open(&path).expect("upgrade");
        let old = store.sandbox("old").expect("read").expect("row kept");
        assert_eq!((old.vcpus, old.memory_mib, old.cpu_limit), (2, 64, None));
        assert!(old.env.is_empty());
        assert_eq!(
            (old.on_timeout, old.auto_resume, old.ttl_s),
            (super::super::api::OnTimeout::Kill, false, 0)
        );
        let version: i64 = store
            .conn
            .pragma_query_value(None, "user_version", |row| row.get(0))
            .expect("version");
        assert_eq!(usize::try_from(version).ok(), Some(MIGRATIONS.len()));
        drop(store);
        // Opening again runs nothing twice.
        let store = Store::open(&path).expect("reopen");
        assert!(store.sandbox("old").expect("read").is_some());
    }
}
