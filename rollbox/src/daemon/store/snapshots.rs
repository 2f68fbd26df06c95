//! Queries of the `snapshots` table.

use std::collections::HashSet;

use rusqlite::{params, OptionalExtension};

use super::super::api::Snapshot;
use super::rows::{namespaced, unnamespaced, SnapshotRow};
use super::{json_column, to_json, Store, StoreError};

/// A snapshot from its `spec` and `name` columns (a name is unique per tenant: the column
/// holds it [`namespaced`]).
fn named(spec: &str, name: Option<String>) -> Result<Snapshot, StoreError> {
    let mut snapshot = Snapshot::from(json_column::<SnapshotRow>(spec, "spec")?);
    snapshot.name = name.map(unnamespaced);
    Ok(snapshot)
}

impl Store {
    /// Adds a snapshot (`fork`: taken by a fork, see [`Store::fork_snapshots`]); its name (if
    /// any) moves to it from the snapshot of its tenant that had it, in one transaction.
    pub fn add_snapshot(&mut self, snapshot: &Snapshot, fork: bool) -> Result<(), StoreError> {
        let spec = to_json(&SnapshotRow::from(snapshot), "spec")?;
        let name = snapshot
            .name
            .as_deref()
            .map(|name| namespaced(snapshot.tenant.as_deref(), name));
        let tx = self.conn.transaction()?;
        if let Some(name) = &name {
            tx.execute(
                "UPDATE snapshots SET name = NULL WHERE name = ?1",
                params![name],
            )?;
        }
        tx.execute(
            "INSERT INTO snapshots (id, sandbox, spec, name, fork) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![snapshot.id, snapshot.sandbox, spec, name, fork],
        )?;
        tx.commit()?;
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
        self.snapshot_where("SELECT spec, name FROM snapshots WHERE id = ?1", id)
    }

    /// The snapshot of `tenant` (None: the admins') that has name `name`.
    pub fn snapshot_named(
        &self,
        name: &str,
        tenant: Option<&str>,
    ) -> Result<Option<Snapshot>, StoreError> {
        self.snapshot_where(
            "SELECT spec, name FROM snapshots WHERE name = ?1",
            &namespaced(tenant, name),
        )
    }

    /// One snapshot by `sql`, a constant statement with one bound parameter.
    fn snapshot_where(
        &self,
        sql: &'static str,
        value: &str,
    ) -> Result<Option<Snapshot>, StoreError> {
        let found: Option<(String, Option<String>)> = self
            .conn
            .query_row(sql, params![value], |row| Ok((row.get(0)?, row.get(1)?)))
            .optional()?;
        found.map(|(spec, name)| named(&spec, name)).transpose()
    }

    /// Snapshots, oldest first; only those of `sandbox` when given.
    pub fn snapshots(&self, sandbox: Option<&str>) -> Result<Vec<Snapshot>, StoreError> {
        let mut statement = self.conn.prepare(
            "SELECT spec, name FROM snapshots WHERE ?1 IS NULL OR sandbox = ?1 ORDER BY seq",
        )?;
        let found = statement
            .query_map(params![sandbox], |row| Ok((row.get(0)?, row.get(1)?)))?
            .collect::<rusqlite::Result<Vec<(String, Option<String>)>>>()?;
        found
            .into_iter()
            .map(|(spec, name)| named(&spec, name))
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
        self.ids(
            "SELECT DISTINCT src.snapshot FROM sandbox_sources src \
             JOIN sandboxes s ON s.id = src.sandbox \
             WHERE s.state IN ('creating', 'running', 'paused')",
        )
    }

    /// Snapshots a sandbox is being created from right now.
    pub fn sources_of_creating(&self) -> Result<HashSet<String>, StoreError> {
        self.ids(
            "SELECT DISTINCT src.snapshot FROM sandbox_sources src \
             JOIN sandboxes s ON s.id = src.sandbox WHERE s.state = 'creating'",
        )
    }

    /// Snapshots taken by a fork (and given no name since).
    pub fn fork_snapshots(&self) -> Result<HashSet<String>, StoreError> {
        self.ids("SELECT id FROM snapshots WHERE fork = 1 AND name IS NULL")
    }

    /// The one column of `sql`, a constant statement without parameters.
    fn ids(&self, sql: &'static str) -> Result<HashSet<String>, StoreError> {
        let mut statement = self.conn.prepare(sql)?;
        let ids = statement
            .query_map(params![], |row| row.get::<_, String>(0))?
            .collect::<rusqlite::Result<HashSet<String>>>()?;
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn snapshot(id: &str, name: Option<&str>) -> Snapshot {
        Snapshot {
            id: id.into(),
            name: name.map(str::to_string),
            sandbox: "sb-1".into(),
            parent: None,
            template: "t".into(),
            vcpus: 1,
            memory_mib: 32,
            dir: PathBuf::from("/nowhere"),
            created_at_ms: 1,
            expires_at_ms: None,
            deterministic: false,
            tenant: None,
            volumes: Vec::new(),
            network: None,
            expose: Vec::new(),
        }
    }

    #[test]
    fn a_name_moves_to_the_newest_snapshot_that_takes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        store
            .add_snapshot(&snapshot("snap-a", Some("base")), false)
            .expect("a");
        store
            .add_snapshot(&snapshot("snap-b", None), true)
            .expect("b");
        assert_eq!(
            store
                .snapshot_named("base", None)
                .expect("named")
                .map(|s| s.id),
            Some("snap-a".into())
        );
        store
            .add_snapshot(&snapshot("snap-c", Some("base")), false)
            .expect("c");
        assert_eq!(
            store
                .snapshot_named("base", None)
                .expect("named")
                .map(|s| s.id),
            Some("snap-c".into())
        );
        let names: Vec<(String, Option<String>)> = store
            .snapshots(None)
            .expect("list")
            .into_iter()
            .map(|s| (s.id, s.name))
            .collect();
        assert_eq!(
            names,
            [
                ("snap-a".into(), None),
                ("snap-b".into(), None),
                ("snap-c".into(), Some("base".into()))
            ]
        );
        assert_eq!(
            store.snapshot("snap-c").expect("get").and_then(|s| s.name),
            Some("base".into())
        );
        assert!(store.snapshot_named("other", None).expect("none").is_none());
        assert_eq!(
            store.fork_snapshots().expect("forks"),
            HashSet::from(["snap-b".to_string()])
        );
    }

    #[test]
    fn names_are_unique_per_tenant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        let of = |id: &str, tenant: Option<&str>| Snapshot {
            tenant: tenant.map(str::to_string),
            ..snapshot(id, Some("base"))
        };
        store
            .add_snapshot(&of("snap-a", Some("a")), false)
            .expect("a");
        store
            .add_snapshot(&of("snap-b", Some("b")), false)
            .expect("b");
        store
            .add_snapshot(&of("snap-admin", None), false)
            .expect("admin");
        for (tenant, id) in [
            (Some("a"), "snap-a"),
            (Some("b"), "snap-b"),
            (None, "snap-admin"),
        ] {
            let found = store.snapshot_named("base", tenant).expect("named");
            assert_eq!(found.as_ref().map(|s| s.id.as_str()), Some(id));
            assert_eq!(found.and_then(|s| s.name).as_deref(), Some("base"));
        }
        assert!(store
            .snapshot_named("base", Some("c"))
            .expect("none")
            .is_none());
    }
}
