//! Queries of the `snapshots` table.

use std::collections::HashSet;

use rusqlite::{params, OptionalExtension};

use super::super::api::Snapshot;
use super::rows::SnapshotRow;
use super::{json_column, to_json, Store, StoreError};

impl Store {
    pub fn add_snapshot(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO snapshots (id, sandbox, spec) VALUES (?1, ?2, ?3)",
            params![
                snapshot.id,
                snapshot.sandbox,
                to_json(&SnapshotRow::from(snapshot), "spec")?
            ],
        )?;
        Ok(())
    }

    /// Rewrites a snapshot's spec (its `expires_at_ms`).
    pub fn set_snapshot(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE snapshots SET spec = ?2 WHERE id = ?1",
            params![snapshot.id, to_json(&SnapshotRow::from(snapshot), "spec")?],
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
        spec.map(|s| json_column::<SnapshotRow>(&s, "spec").map(Snapshot::from))
            .transpose()
    }

    /// Snapshots, oldest first; only those of `sandbox` when given.
    pub fn snapshots(&self, sandbox: Option<&str>) -> Result<Vec<Snapshot>, StoreError> {
        let mut statement = self
            .conn
            .prepare("SELECT spec FROM snapshots WHERE ?1 IS NULL OR sandbox = ?1 ORDER BY seq")?;
        let specs = statement
            .query_map(params![sandbox], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<String>>>()?;
        specs
            .iter()
            .map(|s| json_column::<SnapshotRow>(s, "spec").map(Snapshot::from))
            .collect()
    }

    /// Removes a snapshot's row; false if there was none.
    pub fn remove_snapshot(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .execute("DELETE FROM snapshots WHERE id = ?1", params![id])?
            == 1)
    }

    /// Snapshots a live sandbox was restored or reset from.
    pub fn sources_of_live(&self) -> Result<HashSet<String>, StoreError> {
        let mut statement = self.conn.prepare(
            "SELECT DISTINCT src.snapshot FROM sandbox_sources src \
             JOIN sandboxes s ON s.id = src.sandbox \
             WHERE s.state IN ('creating', 'running', 'paused')",
        )?;
        let ids = statement
            .query_map(params![], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<HashSet<String>>>()?;
        Ok(ids)
    }
}
