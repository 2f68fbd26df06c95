//! Queries of the `api_keys` table: keys by id, with the hex SHA-256 of the key (the key
//! itself is never stored).

use rusqlite::params;

use super::{Store, StoreError};

/// An `api_keys` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRow {
    pub id: String,
    /// None: an admin key.
    pub tenant: Option<String>,
    /// Hex SHA-256 of the key.
    pub hash: String,
    pub created_at_ms: u64,
}

impl Store {
    pub fn add_key(&self, key: &KeyRow) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO api_keys (id, tenant, hash, created_at_ms) VALUES (?1, ?2, ?3, ?4)",
            params![key.id, key.tenant, key.hash, key.created_at_ms],
        )?;
        Ok(())
    }

    /// Every key, oldest first.
    pub fn keys(&self) -> Result<Vec<KeyRow>, StoreError> {
        let mut statement = self.conn.prepare(
            "SELECT id, tenant, hash, created_at_ms FROM api_keys ORDER BY created_at_ms, id",
        )?;
        let rows = statement
            .query_map([], |row| {
                Ok(KeyRow {
                    id: row.get(0)?,
                    tenant: row.get(1)?,
                    hash: row.get(2)?,
                    created_at_ms: row.get(3)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<KeyRow>>>()?;
        Ok(rows)
    }

    /// Removes a key; false if there was none.
    pub fn remove_key(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn
            .execute("DELETE FROM api_keys WHERE id = ?1", params![id])?
            == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_added_listed_and_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&dir.path().join("state.db")).expect("open");
        let key = KeyRow {
            id: "key-1".into(),
            tenant: Some("a".into()),
            hash: "00".repeat(32),
            created_at_ms: 5,
        };
        store.add_key(&key).expect("add");
        assert_eq!(store.keys().expect("list"), [key]);
        assert!(store.remove_key("key-1").expect("remove"));
        assert!(!store.remove_key("key-1").expect("again"));
        assert!(store.keys().expect("list").is_empty());
    }
}
