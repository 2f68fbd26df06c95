//! Queries of the `volumes` table, and of which live sandboxes mount a volume (their
//! `volumes` column).

use std::path::PathBuf;

use rusqlite::{params, OptionalExtension};

use super::super::api::Volume;
use super::{Store, StoreError};

/// A volume's row: the API's volume without `mounted_by`, and whether its directory is the
/// daemon's own (under the state dir).
pub struct VolumeRow {
    pub volume: Volume,
    pub managed: bool,
}

fn read(row: &rusqlite::Row) -> rusqlite::Result<VolumeRow> {
    Ok(VolumeRow {
        volume: Volume {
            name: row.get(0)?,
            host_path: PathBuf::from(row.get::<_, String>(1)?),
            tenant: row.get(3)?,
            created_at_ms: row.get(4)?,
            size_limit_mib: row.get(5)?,
            mounted_by: Vec::new(),
        },
        managed: row.get(2)?,
    })
}

/// The live sandboxes that mount volume `name` (the store's or a transaction's connection).
fn mounted_by(conn: &rusqlite::Connection, name: &str) -> Result<Vec<String>, StoreError> {
    let mut statement = conn.prepare(
        "SELECT DISTINCT s.id FROM sandboxes s, json_each(s.volumes) m \
         WHERE s.state IN ('creating', 'running', 'paused') \
         AND json_extract(m.value, '$.name') = ?1 ORDER BY s.id",
    )?;
    let ids = statement
        .query_map(params![name], |row| row.get::<_, String>(0))?
        .collect::<rusqlite::Result<Vec<String>>>()?;
    Ok(ids)
}

const COLUMNS: &str = "name, host_path, managed, tenant, created_at_ms, size_limit_mib";

impl Store {
    /// Adds a volume; false if the name is taken.
    pub fn add_volume(&self, volume: &Volume, managed: bool) -> Result<bool, StoreError> {
        let changed = self.conn.execute(
            "INSERT INTO volumes (name, host_path, managed, tenant, created_at_ms, size_limit_mib) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT(name) DO NOTHING",
            params![
                volume.name,
                volume.host_path.to_string_lossy(),
                managed,
                volume.tenant,
                volume.created_at_ms,
                volume.size_limit_mib
            ],
        )?;
        Ok(changed == 1)
    }

    /// A volume with the live sandboxes that mount it.
    pub fn volume(&self, name: &str) -> Result<Option<VolumeRow>, StoreError> {
        let row = self
            .conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM volumes WHERE name = ?1"),
                params![name],
                read,
            )
            .optional()?;
        row.map(|mut row| {
            row.volume.mounted_by = self.mounted_by(name)?;
            Ok(row)
        })
        .transpose()
    }

    /// Every volume's row, by name (without `mounted_by`).
    pub fn volume_rows(&self) -> Result<Vec<VolumeRow>, StoreError> {
        let mut statement = self
            .conn
            .prepare(&format!("SELECT {COLUMNS} FROM volumes ORDER BY name"))?;
        let rows = statement
            .query_map([], read)?
            .collect::<rusqlite::Result<Vec<VolumeRow>>>()?;
        Ok(rows)
    }

    /// Every volume, by name, with the live sandboxes that mount it.
    pub fn volumes(&self) -> Result<Vec<Volume>, StoreError> {
        self.volume_rows()?
            .into_iter()
            .map(|mut row| {
                row.volume.mounted_by = self.mounted_by(&row.volume.name)?;
                Ok(row.volume)
            })
            .collect()
    }

    /// The live sandboxes (creating, running, paused) that mount volume `name`, sorted.
    pub fn mounted_by(&self, name: &str) -> Result<Vec<String>, StoreError> {
        mounted_by(&self.conn, name)
    }

    /// Removes a volume unless a live sandbox mounts it (in one transaction, so a create that
    /// recorded its mount first wins): Ok(Err(ids)) names them; Ok(Ok(false)): there was none.
    pub fn remove_volume(&mut self, name: &str) -> Result<Result<bool, Vec<String>>, StoreError> {
        let tx = self.conn.transaction()?;
        let users = mounted_by(&tx, name)?;
        if !users.is_empty() {
            return Ok(Err(users));
        }
        let removed = tx.execute("DELETE FROM volumes WHERE name = ?1", params![name])? == 1;
        tx.commit()?;
        Ok(Ok(removed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::{Sandbox, State, VolumeMount};

    fn volume(name: &str) -> Volume {
        Volume {
            name: name.into(),
            host_path: PathBuf::from(format!("/v/{name}")),
            created_at_ms: 1,
            tenant: None,
            size_limit_mib: None,
            mounted_by: Vec::new(),
        }
    }

    #[test]
    fn volumes_know_their_live_users_and_refuse_removal_while_mounted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = Store::open(&dir.path().join("state.db")).expect("open");
        assert!(store.add_volume(&volume("data"), true).expect("add"));
        assert!(!store.add_volume(&volume("data"), true).expect("again"));
        assert!(store.add_volume(&volume("other"), false).expect("add"));
        let sandbox: Sandbox = serde_json::from_value(serde_json::json!({
            "id": "sb-0000000000000001", "template": "t", "state": "running", "vcpus": 1,
            "memory_mib": 32, "labels": {}, "metadata": {}, "idempotency_key": null,
            "created_at_ms": 1, "expires_at_ms": 2, "idle_ttl_s": null, "last_active_at_ms": 1,
            "pid": null, "pid_start_time": null, "dir": "/x", "ended_at_ms": null,
            "end_reason": null,
        }))
        .expect("sandbox");
        let sandbox = Sandbox {
            volumes: vec![VolumeMount {
                name: "data".into(),
                mount_path: "/data".into(),
                readonly: false,
            }],
            ..sandbox
        };
        store.insert_sandbox(&sandbox).expect("insert");
        assert_eq!(
            store.mounted_by("data").expect("users"),
            std::slice::from_ref(&sandbox.id)
        );
        let row = store.volume("data").expect("get").expect("there");
        assert!(row.managed);
        assert_eq!(row.volume.mounted_by, std::slice::from_ref(&sandbox.id));
        assert_eq!(
            store.remove_volume("data").expect("remove"),
            Err(vec![sandbox.id.clone()])
        );
        store
            .end(&sandbox.id, State::Deleted, "test", 3)
            .expect("end");
        assert_eq!(store.remove_volume("data").expect("remove"), Ok(true));
        assert_eq!(store.remove_volume("data").expect("again"), Ok(false));
        let names: Vec<String> = store
            .volumes()
            .expect("list")
            .into_iter()
            .map(|v| v.name)
            .collect();
        assert_eq!(names, ["other"]);
    }
}
