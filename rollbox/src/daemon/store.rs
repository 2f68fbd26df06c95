//! The daemon's state: templates and sandboxes in one SQLite file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::api::{ListQuery, Sandbox, Snapshot, State, Template};

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
];

/// Adds the running time since `running_since_ms` to `run_ms` (an UPDATE's SET clause).
const RUN_MS_UNTIL_NOW: &str = "run_ms = run_ms + \
    MAX(0, COALESCE(CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER) - running_since_ms, 0))";

/// SQLite's clock in Unix milliseconds (for usage accounting inside one statement).
const SQL_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

const COLUMNS: &str = "seq, id, idempotency_key, template, state, vcpus, memory_mib, labels, \
    metadata, created_at_ms, expires_at_ms, idle_ttl_s, last_active_at_ms, pid, pid_start_time, \
    dir, ended_at_ms, end_reason, env, cpu_limit, deterministic";

/// The open database.
pub struct Store {
    pub(super) conn: Connection,
}

/// What [`Store::insert_sandbox`] did.
pub enum Inserted {
    New,
    /// A sandbox with the same idempotency key exists already.
    Existing(Box<Sandbox>),
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

/// One row as read, before the JSON columns are decoded.
struct RawRow {
    seq: i64,
    sandbox: Sandbox,
    labels: String,
    metadata: String,
    env: String,
    state: String,
}

fn raw_row(row: &Row) -> rusqlite::Result<RawRow> {
    let dir: String = row.get(15)?;
    Ok(RawRow {
        seq: row.get(0)?,
        labels: row.get(7)?,
        metadata: row.get(8)?,
        env: row.get(18)?,
        state: row.get(4)?,
        sandbox: Sandbox {
            id: row.get(1)?,
            idempotency_key: row.get(2)?,
            template: row.get(3)?,
            state: State::Failed,
            vcpus: row.get(5)?,
            memory_mib: row.get(6)?,
            labels: BTreeMap::new(),
            metadata: BTreeMap::new(),
            created_at_ms: row.get(9)?,
            expires_at_ms: row.get(10)?,
            idle_ttl_s: row.get(11)?,
            last_active_at_ms: row.get(12)?,
            pid: row.get(13)?,
            pid_start_time: row.get(14)?,
            dir: PathBuf::from(dir),
            ended_at_ms: row.get(16)?,
            end_reason: row.get(17)?,
            env: BTreeMap::new(),
            cpu_limit: row.get(19)?,
            deterministic: row.get(20)?,
        },
    })
}

fn finish(raw: RawRow) -> Result<(i64, Sandbox), StoreError> {
    let mut sandbox = raw.sandbox;
    sandbox.labels = json_column(&raw.labels, "labels")?;
    sandbox.metadata = json_column(&raw.metadata, "metadata")?;
    sandbox.env = json_column(&raw.env, "env")?;
    // A state this build does not know reads as failed.
    sandbox.state = State::parse(&raw.state).unwrap_or(State::Failed);
    Ok((raw.seq, sandbox))
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

    /// Adds a template; false if the name is taken.
    pub fn add_template(&self, template: &Template) -> Result<bool, StoreError> {
        let spec = to_json(template, "spec")?;
        let changed = self.conn.execute(
            "INSERT INTO templates (name, spec) VALUES (?1, ?2) ON CONFLICT(name) DO NOTHING",
            params![template.name, spec],
        )?;
        Ok(changed == 1)
    }

    pub fn template(&self, name: &str) -> Result<Option<Template>, StoreError> {
        let spec: Option<String> = self
            .conn
            .query_row(
                "SELECT spec FROM templates WHERE name = ?1",
                params![name],
                |row| row.get(0),
            )
            .optional()?;
        spec.map(|s| json_column(&s, "spec")).transpose()
    }

    pub fn templates(&self) -> Result<Vec<Template>, StoreError> {
        let mut statement = self
            .conn
            .prepare("SELECT spec FROM templates ORDER BY name")?;
        let specs = statement
            .query_map([], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        specs.iter().map(|s| json_column(s, "spec")).collect()
    }

    /// Replaces a template's spec (its boot snapshot once taken).
    pub fn update_template(&self, template: &Template) -> Result<bool, StoreError> {
        let spec = to_json(template, "spec")?;
        let changed = self.conn.execute(
            "UPDATE templates SET spec = ?2 WHERE name = ?1",
            params![template.name, spec],
        )?;
        Ok(changed == 1)
    }

    /// Removes a template; false if there was none.
    pub fn remove_template(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .execute("DELETE FROM templates WHERE name = ?1", params![name])?
            == 1)
    }

    /// Inserts a new sandbox row, unless its idempotency key is taken (in one transaction, so
    /// two racing creates with one key make one row).
    pub fn insert_sandbox(&mut self, sandbox: &Sandbox) -> Result<Inserted, StoreError> {
        let tx = self.conn.transaction()?;
        if let Some(key) = &sandbox.idempotency_key {
            let existing = tx
                .query_row(
                    &format!("SELECT {COLUMNS} FROM sandboxes WHERE idempotency_key = ?1"),
                    params![key],
                    raw_row,
                )
                .optional()?;
            if let Some(raw) = existing {
                return Ok(Inserted::Existing(Box::new(finish(raw)?.1)));
            }
        }
        tx.execute(
            "INSERT INTO sandboxes (id, idempotency_key, template, state, vcpus, memory_mib, \
             labels, metadata, created_at_ms, expires_at_ms, idle_ttl_s, last_active_at_ms, \
             pid, pid_start_time, dir, ended_at_ms, end_reason, env, cpu_limit, deterministic) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
             ?18, ?19, ?20)",
            params![
                sandbox.id,
                sandbox.idempotency_key,
                sandbox.template,
                sandbox.state.as_str(),
                sandbox.vcpus,
                sandbox.memory_mib,
                to_json(&sandbox.labels, "labels")?,
                to_json(&sandbox.metadata, "metadata")?,
                sandbox.created_at_ms,
                sandbox.expires_at_ms,
                sandbox.idle_ttl_s,
                sandbox.last_active_at_ms,
                sandbox.pid,
                sandbox.pid_start_time,
                sandbox.dir.to_string_lossy(),
                sandbox.ended_at_ms,
                sandbox.end_reason,
                to_json(&sandbox.env, "env")?,
                sandbox.cpu_limit,
                sandbox.deterministic,
            ],
        )?;
        tx.commit()?;
        Ok(Inserted::New)
    }

    pub fn sandbox(&self, id: &str) -> Result<Option<Sandbox>, StoreError> {
        let raw = self
            .conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
                params![id],
                raw_row,
            )
            .optional()?;
        raw.map(|r| finish(r).map(|(_, s)| s)).transpose()
    }

    /// One page of sandboxes, oldest first, and the next page's token.
    pub fn list(&self, query: &ListQuery) -> Result<(Vec<Sandbox>, Option<String>), StoreError> {
        let mut sql = format!("SELECT {COLUMNS} FROM sandboxes WHERE seq > ?");
        let mut values: Vec<rusqlite::types::Value> = vec![query.after.unwrap_or(0).into()];
        if !query.ids.is_empty() {
            let marks = vec!["?"; query.ids.len()].join(", ");
            sql.push_str(&format!(" AND id IN ({marks})"));
            values.extend(query.ids.iter().map(|id| id.clone().into()));
        }
        if let Some(state) = query.state {
            sql.push_str(" AND state = ?");
            values.push(state.as_str().to_string().into());
        } else if !query.ids.is_empty() {
            // Sandboxes asked for by id show in any state.
        } else {
            // Ended sandboxes only show when asked for by state.
            sql.push_str(" AND state IN ('creating', 'running', 'paused')");
        }
        for (key, value) in &query.labels {
            // Keys are checked to be plain (no quotes), so the JSON path is safe to quote.
            sql.push_str(&format!(" AND json_extract(labels, '$.\"{key}\"') = ?"));
            values.push(value.clone().into());
        }
        sql.push_str(" ORDER BY seq LIMIT ?");
        values.push((i64::from(query.limit) + 1).into());
        let mut statement = self.conn.prepare(&sql)?;
        let raws = statement
            .query_map(rusqlite::params_from_iter(values), raw_row)?
            .collect::<rusqlite::Result<Vec<RawRow>>>()?;
        let mut rows = raws
            .into_iter()
            .map(finish)
            .collect::<Result<Vec<_>, _>>()?;
        let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
        let next = if rows.len() > limit {
            rows.truncate(limit);
            rows.last().map(|(seq, _)| seq.to_string())
        } else {
            None
        };
        Ok((rows.into_iter().map(|(_, s)| s).collect(), next))
    }

    /// Sandboxes that may have a VMM process (creating, running, paused).
    pub fn live(&self) -> Result<Vec<Sandbox>, StoreError> {
        let mut statement = self.conn.prepare(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE state IN ('creating', 'running', 'paused') ORDER BY seq"
        ))?;
        let raws = statement
            .query_map([], raw_row)?
            .collect::<rusqlite::Result<Vec<RawRow>>>()?;
        raws.into_iter()
            .map(|r| finish(r).map(|(_, s)| s))
            .collect()
    }

    /// Creating -> running with its process; false if the sandbox left `creating` meanwhile.
    pub fn set_running(&self, id: &str, pid: u32, start_time: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET state = 'running', pid = ?2, pid_start_time = ?3, \
                 running_since_ms = {SQL_NOW_MS} WHERE id = ?1 AND state = 'creating'"
            ),
            params![id, pid, start_time],
        )? == 1)
    }

    /// Moves a live sandbox from `from` to `to`; false if it was not in `from`.
    pub fn transition(&self, id: &str, from: State, to: State) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET state = ?3, {RUN_MS_UNTIL_NOW}, \
                 running_since_ms = CASE WHEN ?3 = 'running' THEN {SQL_NOW_MS} END \
                 WHERE id = ?1 AND state = ?2"
            ),
            params![id, from.as_str(), to.as_str()],
        )? == 1)
    }

    /// Ends a live sandbox; false if it had ended already.
    pub fn end(
        &self,
        id: &str,
        state: State,
        reason: &str,
        now_ms: u64,
    ) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            "UPDATE sandboxes SET state = ?2, end_reason = ?3, ended_at_ms = ?4, \
             run_ms = run_ms + MAX(0, ?4 - COALESCE(running_since_ms, ?4)), \
             running_since_ms = NULL \
             WHERE id = ?1 AND state IN ('creating', 'running', 'paused')",
            params![id, state.as_str(), reason, now_ms],
        )? == 1)
    }

    /// Records an API call on the sandbox (for the idle TTL).
    pub fn touch(&self, id: &str, now_ms: u64) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE sandboxes SET last_active_at_ms = ?2 WHERE id = ?1",
            params![id, now_ms],
        )?;
        Ok(())
    }

    pub fn add_snapshot(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO snapshots (id, sandbox, spec) VALUES (?1, ?2, ?3)",
            params![snapshot.id, snapshot.sandbox, to_json(snapshot, "spec")?],
        )?;
        Ok(())
    }

    /// Rewrites a snapshot's spec (its `expires_at_ms`).
    pub fn set_snapshot(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE snapshots SET spec = ?2 WHERE id = ?1",
            params![snapshot.id, to_json(snapshot, "spec")?],
        )?;
        Ok(())
    }

    pub fn snapshot(&self, id: &str) -> Result<Option<Snapshot>, StoreError> {
        let spec: Option<String> = self
            .conn
            .query_row(
                "SELECT spec FROM snapshots WHERE id = ?1",
                params![id],
                |row| row.get(0),
            )
            .optional()?;
        spec.map(|s| json_column(&s, "spec")).transpose()
    }

    /// Snapshots, oldest first; only those of `sandbox` when given.
    pub fn snapshots(&self, sandbox: Option<&str>) -> Result<Vec<Snapshot>, StoreError> {
        let mut statement = self
            .conn
            .prepare("SELECT spec FROM snapshots WHERE ?1 IS NULL OR sandbox = ?1 ORDER BY seq")?;
        let specs = statement
            .query_map(params![sandbox], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        specs.iter().map(|s| json_column(s, "spec")).collect()
    }

    /// Removes a snapshot's row; false if there was none.
    pub fn remove_snapshot(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .execute("DELETE FROM snapshots WHERE id = ?1", params![id])?
            == 1)
    }

    /// Records the snapshot a sandbox was restored or reset from.
    pub fn set_source(&self, sandbox: &str, snapshot: &str) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO sandbox_sources (sandbox, snapshot) VALUES (?1, ?2) \
             ON CONFLICT(sandbox) DO UPDATE SET snapshot = ?2",
            params![sandbox, snapshot],
        )?;
        Ok(())
    }

    pub fn source(&self, sandbox: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn
            .query_row(
                "SELECT snapshot FROM sandbox_sources WHERE sandbox = ?1",
                params![sandbox],
                |row| row.get(0),
            )
            .optional()?)
    }

    /// Points a live sandbox at a new VMM (after a reset); false if it is not live.
    pub fn set_vmm(&self, id: &str, pid: u32, start_time: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            &format!(
                "UPDATE sandboxes SET pid = ?2, pid_start_time = ?3, state = 'running', \
                 running_since_ms = COALESCE(running_since_ms, {SQL_NOW_MS}) \
                 WHERE id = ?1 AND state IN ('running', 'paused')"
            ),
            params![id, pid, start_time],
        )? == 1)
    }

    /// Sets a live sandbox's expiry; false if it is not live.
    pub fn set_expiry(&self, id: &str, expires_at_ms: u64) -> Result<bool, StoreError> {
        Ok(self.conn.execute(
            "UPDATE sandboxes SET expires_at_ms = ?2 \
             WHERE id = ?1 AND state IN ('creating', 'running', 'paused')",
            params![id, expires_at_ms],
        )? == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, key: Option<&str>, labels: &[(&str, &str)]) -> Sandbox {
        Sandbox {
            id: id.into(),
            template: "t".into(),
            state: State::Running,
            vcpus: 1,
            memory_mib: 32,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            metadata: BTreeMap::new(),
            idempotency_key: key.map(str::to_string),
            created_at_ms: 1,
            expires_at_ms: 2,
            idle_ttl_s: None,
            last_active_at_ms: 1,
            pid: None,
            pid_start_time: None,
            dir: PathBuf::from("/nowhere"),
            ended_at_ms: None,
            end_reason: None,
            env: BTreeMap::new(),
            cpu_limit: None,
            deterministic: false,
        }
    }

    #[test]
    fn idempotency_label_filter_and_pages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        assert!(matches!(
            store.insert_sandbox(&sandbox("a", Some("k"), &[("run", "1")])),
            Ok(Inserted::New)
        ));
        match store.insert_sandbox(&sandbox("b", Some("k"), &[])) {
            Ok(Inserted::Existing(s)) => assert_eq!(s.id, "a"),
            _ => panic!("second insert with one key"),
        }
        for id in ["c", "d", "e"] {
            assert!(matches!(
                store.insert_sandbox(&sandbox(id, None, &[("run", "1"), ("app.io/name", id)])),
                Ok(Inserted::New)
            ));
        }
        let dotted = ListQuery {
            labels: vec![("app.io/name".into(), "c".into())],
            limit: 10,
            ..ListQuery::default()
        };
        let (page, _) = store.list(&dotted).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
        assert!(store.end("d", State::Deleted, "gone", 5).expect("end"));
        assert!(!store
            .end("d", State::Deleted, "gone", 6)
            .expect("end again"));
        let mut query = ListQuery {
            labels: vec![("run".into(), "1".into())],
            limit: 2,
            ..ListQuery::default()
        };
        let (page, next) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        query.after = next.and_then(|t| t.parse().ok());
        let (page, next) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["e"]
        );
        assert_eq!(next, None);
        query.state = Some(State::Deleted);
        query.after = None;
        let (page, _) = store.list(&query).expect("list");
        assert_eq!(
            page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["d"]
        );
    }

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
