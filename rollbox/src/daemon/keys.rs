//! API keys and who a request runs as. The `--api-key-file` key is an admin key; more keys,
//! of a tenant or an admin, are added with POST /keys and revoked with DELETE /keys/{id},
//! without a restart. Only the SHA-256 of a key is kept (in `api_keys` and in memory), and a
//! key is checked against every hash without an early exit.
//!
//! What a [`Caller`] may do is the core's to decide (`core.rs`): an admin everything, a
//! tenant only its own sandboxes and snapshots, and templates only to list and use.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use sha2::Digest as _;

use super::api::{ApiError, KeyInfo, NewKey, Reply};
use super::store::{Db, KeyRow, StoreError};
use super::util::{internal, now_ms, random_hex};
use crate::images::digest::to_hex;

/// Random bytes in a new key (256 bits).
const KEY_BYTES: usize = 32;
/// What every key made by the daemon starts with (so a leaked one is easy to find).
pub const KEY_PREFIX: &str = "rbx_";

/// Who a request runs as: its key's role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Everything: templates, keys, node metrics, every tenant's sandboxes.
    Admin,
    /// Its own sandboxes and snapshots; templates to list and create sandboxes from.
    Tenant(String),
}

impl Caller {
    /// The tenant, for a tenant key.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Admin => None,
            Caller::Tenant(tenant) => Some(tenant),
        }
    }

    /// Whether it may see what `owner` (a tenant; None: an admin) owns.
    pub fn sees(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Admin => true,
            Caller::Tenant(tenant) => owner == Some(tenant.as_str()),
        }
    }
}

/// A key the daemon accepts.
struct Entry {
    /// None: the `--api-key-file` key (not listed, not revocable).
    id: Option<String>,
    tenant: Option<String>,
    /// Hex SHA-256 of the key.
    hash: String,
    created_at_ms: u64,
}

/// The keys: the table's rows and the startup key, in memory for the per-request check.
pub struct Keys {
    db: Arc<Db>,
    entries: RwLock<Vec<Entry>>,
}

/// Compares without an early exit, so timing does not reveal how much of a secret matched
/// (keys' hashes here; envd and traffic tokens and upload signatures in the E2B frontend).
pub fn same_secret(given: &[u8], secret: &[u8]) -> bool {
    given.len() == secret.len()
        && given
            .iter()
            .zip(secret)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Hex SHA-256 of a key as given (surrounding whitespace is not part of it).
fn hash_of(key: &str) -> String {
    to_hex(&sha2::Sha256::digest(key.trim().as_bytes()))
}

/// A new key: [`KEY_PREFIX`] and 64 hex digits from the kernel's random source.
fn new_secret() -> Result<String, ApiError> {
    let mut bytes = [0u8; KEY_BYTES];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(n).ok() != Some(bytes.len()) {
        return Err(internal(format!(
            "cannot make a key: getrandom: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(format!("{KEY_PREFIX}{}", to_hex(&bytes)))
}

fn info(entry: &Entry, id: &str, key: Option<String>) -> KeyInfo {
    KeyInfo {
        id: id.to_string(),
        role: if entry.tenant.is_some() {
            "tenant"
        } else {
            "admin"
        }
        .to_string(),
        tenant: entry.tenant.clone(),
        created_at_ms: entry.created_at_ms,
        key,
    }
}

impl Keys {
    /// The keys of the table, and `admin_key` (the `--api-key-file` key).
    pub fn new(db: Arc<Db>, admin_key: &str) -> Result<Keys, StoreError> {
        let mut entries = vec![Entry {
            id: None,
            tenant: None,
            hash: hash_of(admin_key),
            created_at_ms: 0,
        }];
        for row in db.lock().keys()? {
            entries.push(Entry {
                id: Some(row.id),
                tenant: row.tenant,
                hash: row.hash,
                created_at_ms: row.created_at_ms,
            });
        }
        Ok(Keys {
            db,
            entries: RwLock::new(entries),
        })
    }

    fn read(&self) -> RwLockReadGuard<'_, Vec<Entry>> {
        self.entries.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Vec<Entry>> {
        self.entries.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Who `given` is the key of, if anyone's. Every hash is compared, in constant time.
    pub fn authenticate(&self, given: &str) -> Option<Caller> {
        let hash = hash_of(given);
        let mut found = None;
        for entry in self.read().iter() {
            if same_secret(hash.as_bytes(), entry.hash.as_bytes()) && found.is_none() {
                found = Some(match &entry.tenant {
                    Some(tenant) => Caller::Tenant(tenant.clone()),
                    None => Caller::Admin,
                });
            }
        }
        found
    }

    /// POST /keys: a new key, whose plaintext is in this answer only.
    pub fn add(&self, new: NewKey) -> Result<Reply, ApiError> {
        let secret = new_secret()?;
        let row = KeyRow {
            id: format!("key-{}", random_hex()),
            tenant: new.tenant,
            hash: hash_of(&secret),
            created_at_ms: now_ms(),
        };
        self.db.lock().add_key(&row).map_err(internal)?;
        let entry = Entry {
            id: Some(row.id.clone()),
            tenant: row.tenant,
            hash: row.hash,
            created_at_ms: row.created_at_ms,
        };
        let shown = info(&entry, &row.id, Some(secret));
        self.write().push(entry);
        Ok(Reply::Key(shown))
    }

    /// GET /keys: the added keys (never a hash or a key).
    pub fn list(&self) -> Reply {
        Reply::Keys(
            self.read()
                .iter()
                .filter_map(|e| e.id.as_deref().map(|id| info(e, id, None)))
                .collect(),
        )
    }

    /// DELETE /keys/{id}: the key stops working at once.
    pub fn revoke(&self, id: &str) -> Result<Reply, ApiError> {
        let removed = self.db.lock().remove_key(id).map_err(internal)?;
        let mut entries = self.write();
        let before = entries.len();
        entries.retain(|e| e.id.as_deref() != Some(id));
        if !removed && entries.len() == before {
            return Err(ApiError::NotFound(format!("no key {id}")));
        }
        Ok(Reply::NoContent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::store::Store;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"secret", b"secret"));
        assert!(!same_secret(b"secre", b"secret"));
        assert!(!same_secret(b"secreT", b"secret"));
        assert!(!same_secret(b"", b"secret"));
    }

    #[test]
    fn keys_authenticate_by_role_and_revoke_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Arc::new(Db::new(
            Store::open(&dir.path().join("state.db")).expect("open"),
        ));
        let keys = Keys::new(Arc::clone(&db), "boot-key\n").expect("keys");
        assert_eq!(keys.authenticate("boot-key"), Some(Caller::Admin));
        assert_eq!(keys.authenticate("boot-kex"), None);
        let Reply::Key(made) = keys
            .add(NewKey {
                tenant: Some("a".into()),
            })
            .expect("add")
        else {
            panic!("not a key")
        };
        let secret = made.key.clone().expect("plaintext once");
        assert!(secret.starts_with(KEY_PREFIX) && secret.len() == KEY_PREFIX.len() + 64);
        assert_eq!(keys.authenticate(&secret), Some(Caller::Tenant("a".into())));
        let Reply::Keys(listed) = keys.list() else {
            panic!("not keys")
        };
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].key.as_deref(), listed[0].role.as_str()),
            (None, "tenant")
        );
        // Kept across a restart, as a hash only.
        let again = Keys::new(Arc::clone(&db), "boot-key").expect("reload");
        assert_eq!(
            again.authenticate(&secret),
            Some(Caller::Tenant("a".into()))
        );
        assert!(db
            .lock()
            .keys()
            .expect("rows")
            .iter()
            .all(|r| r.hash != secret));
        keys.revoke(&made.id).expect("revoke");
        assert_eq!(keys.authenticate(&secret), None);
        assert!(matches!(keys.revoke(&made.id), Err(ApiError::NotFound(_))));
        assert!(Caller::Admin.sees(Some("a")) && Caller::Tenant("a".into()).sees(Some("a")));
        assert!(
            !Caller::Tenant("a".into()).sees(Some("b")) && !Caller::Tenant("a".into()).sees(None)
        );
    }
}
