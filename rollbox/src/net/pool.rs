//! The address pool and its leases: each sandbox gets one /30 of the pool (host `.1`, guest
//! `.2`), claimed by creating one lease file with O_EXCL in the state directory, so concurrent
//! `rollbox net up`s in different processes never get the same subnet.
//!
//! State directory layout:
//!   leases/<subnet address>.json  the lease: which subnet, and what `up` created for it
//!   names/<sandbox name>          claims the name (O_EXCL); holds the lease's file name

use std::collections::HashSet;
use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::cidr::{CidrError, Ipv4Net};

/// Each sandbox's share of the pool.
pub const SUBNET_PREFIX: u8 = 30;

/// Pool and lease-file failures.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("pool {0}")]
    Cidr(#[from] CidrError),
    #[error("pool {pool} is too small: it must hold at least one /30 (prefix length 30 or less)")]
    TooSmall { pool: String },
    #[error("pool {pool} overlaps {reserved}, which is reserved")]
    Reserved { pool: String, reserved: String },
    #[error("pool {pool} is exhausted: all {slots} /30 subnets are leased (see `rollbox net list`, or free some with `rollbox net down`/`gc`)")]
    Exhausted { pool: String, slots: u64 },
    #[error("sandbox {name} already has a network (see `rollbox net list`; `rollbox net down {name}` removes it)")]
    NameTaken { name: String },
    #[error("state directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lease {path} is not valid JSON: {source}")]
    BadLease {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PoolError + '_ {
    move |source| PoolError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Blocks a pool may not overlap: this host, "this network", link-local, multicast and above.
const RESERVED: [&str; 4] = ["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];

/// A validated pool of /30 subnets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    net: Ipv4Net,
}

impl Pool {
    pub fn parse(text: &str) -> Result<Pool, PoolError> {
        let net: Ipv4Net = text.parse()?;
        if net.prefix() > SUBNET_PREFIX {
            return Err(PoolError::TooSmall {
                pool: net.to_string(),
            });
        }
        for reserved in RESERVED {
            let reserved_net: Ipv4Net = reserved.parse()?;
            if net.overlaps(&reserved_net) {
                return Err(PoolError::Reserved {
                    pool: net.to_string(),
                    reserved: reserved.to_string(),
                });
            }
        }
        Ok(Pool { net })
    }

    pub fn net(&self) -> Ipv4Net {
        self.net
    }

    /// How many /30 subnets the pool holds.
    pub fn slots(&self) -> u64 {
        1u64 << (SUBNET_PREFIX - self.net.prefix())
    }

    pub fn slot(&self, index: u64) -> Option<Slot> {
        self.net
            .subnet(SUBNET_PREFIX, index)
            .map(|subnet| Slot { subnet })
    }
}

/// One sandbox's /30.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub subnet: Ipv4Net,
}

impl Slot {
    pub fn host_ip(&self) -> Ipv4Addr {
        self.subnet.nth(1)
    }

    pub fn guest_ip(&self) -> Ipv4Addr {
        self.subnet.nth(2)
    }

    /// The host-side interface: `rbx` and the subnet address in hex (11 bytes, under Linux's
    /// 15), unique on the host because the subnet must be.
    pub fn tap_name(&self) -> String {
        format!("rbx{:08x}", u32::from(self.subnet.network()))
    }

    /// The lease file's name.
    pub fn key(&self) -> String {
        format!("{}.json", self.subnet.network())
    }
}

/// The subnet of a tap name made by [`Slot::tap_name`].
pub fn slot_of_tap(tap: &str) -> Option<Slot> {
    let hex = tap.strip_prefix("rbx")?;
    if hex.len() != 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let addr = u32::from_str_radix(hex, 16).ok()?;
    Ipv4Net::new(Ipv4Addr::from(addr), SUBNET_PREFIX).map(|subnet| Slot { subnet })
}

/// The /30 that holds `ip`.
pub fn slot_of_ip(ip: Ipv4Addr) -> Slot {
    let base = u32::from(ip) & super::cidr::mask(SUBNET_PREFIX);
    Slot {
        subnet: Ipv4Net::new(Ipv4Addr::from(base), SUBNET_PREFIX)
            .unwrap_or_else(|| unreachable!("the host bits were just cleared")),
    }
}

/// What kind of host-side interface a lease uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum LinkKind {
    /// A persistent tap for the VMM (IFF_TAP | IFF_NO_PI | IFF_VNET_HDR).
    Tap,
    /// A veth pair whose peer sits, configured as the guest, in network namespace `netns`:
    /// the stand-in for a guest in tests (the nftables rules are identical).
    Veth { netns: String },
}

/// A lease file: the subnet, and everything `up` creates for it, so `down` removes exactly that.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub name: String,
    pub pool: String,
    pub subnet: String,
    pub tap: String,
    pub link: LinkKind,
    pub host_ip: Ipv4Addr,
    pub guest_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub egress: String,
    pub dns: Option<Ipv4Addr>,
    /// Host TCP port → guest TCP port.
    pub expose: Vec<(u16, u16)>,
    /// The host addresses `expose` is on; empty (older leases too): every local address but
    /// loopback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expose_on: Vec<Ipv4Addr>,
    /// The process that ran `up`.
    pub pid: u32,
    /// False until `up` finished; a lease left incomplete by a dead process is `gc`'s.
    pub complete: bool,
}

/// A lease file's name and what reading it gave.
pub type LeaseEntry = (String, Result<Option<Lease>, PoolError>);

/// The state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> StateDir {
        StateDir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn leases(&self) -> PathBuf {
        self.root.join("leases")
    }

    fn names(&self) -> PathBuf {
        self.root.join("names")
    }

    fn lease_path(&self, key: &str) -> PathBuf {
        self.leases().join(key)
    }

    fn name_path(&self, name: &str) -> PathBuf {
        self.names().join(name)
    }

    fn create_dirs(&self) -> Result<(), PoolError> {
        for dir in [self.leases(), self.names()] {
            fs::create_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }

    /// Claims `name` (O_EXCL). The caller releases it with [`StateDir::release_name`].
    pub fn claim_name(&self, name: &str) -> Result<(), PoolError> {
        self.create_dirs()?;
        let path = self.name_path(name);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(PoolError::NameTaken {
                name: name.to_string(),
            }),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// Claims the lowest free /30 of `pool` by creating its lease file (O_EXCL), written from
    /// `lease(slot)`; records the lease in the name's file.
    pub fn claim_slot(
        &self,
        pool: &Pool,
        lease: impl Fn(Slot) -> Lease,
    ) -> Result<(Slot, Lease), PoolError> {
        self.create_dirs()?;
        let taken = self.lease_keys()?;
        for index in 0..pool.slots() {
            let Some(slot) = pool.slot(index) else { break };
            if taken.contains(&slot.key()) {
                continue;
            }
            let path = self.lease_path(&slot.key());
            let mut file = match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => file,
                // Another process got there first: try the next.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io(&path)(e)),
            };
            let record = lease(slot);
            let written = serde_json::to_vec_pretty(&record)
                .map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
                .and_then(|bytes| file.write_all(&bytes));
            let named = written.and_then(|()| fs::write(self.name_path(&record.name), slot.key()));
            if let Err(e) = named {
                let _ = fs::remove_file(&path);
                return Err(io(&path)(e));
            }
            return Ok((slot, record));
        }
        Err(PoolError::Exhausted {
            pool: pool.net().to_string(),
            slots: pool.slots(),
        })
    }

    /// Claims a subnet for `gc` (an empty lease file, O_EXCL): false when a lease holds it.
    pub fn claim_orphan(&self, slot: &Slot) -> Result<bool, PoolError> {
        self.create_dirs()?;
        let path = self.lease_path(&slot.key());
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// Replaces a lease file's content atomically (write, then rename over it).
    pub fn update(&self, lease: &Lease, slot: &Slot) -> Result<(), PoolError> {
        let path = self.lease_path(&slot.key());
        let tmp = self.leases().join(format!(".{}.tmp", slot.key()));
        let bytes = serde_json::to_vec_pretty(lease)
            .map_err(|e| io(&path)(std::io::Error::new(ErrorKind::InvalidData, e)))?;
        fs::write(&tmp, bytes).map_err(io(&tmp))?;
        fs::rename(&tmp, &path).map_err(io(&path))
    }

    /// The lease file names present.
    fn lease_keys(&self) -> Result<HashSet<String>, PoolError> {
        Ok(dir_names(&self.leases())?
            .into_iter()
            .filter(|name| name.ends_with(".json") && !name.starts_with('.'))
            .collect())
    }

    /// The lease of sandbox `name`: `Ok(None)` when it has none; `Some((key, None))` when the
    /// name is claimed but its lease file is missing or not yet written.
    pub fn lease_of(&self, name: &str) -> Result<Option<(String, Option<Lease>)>, PoolError> {
        let path = self.name_path(name);
        let key = match fs::read_to_string(&path) {
            Ok(key) => key,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        if key.is_empty() {
            return Ok(Some((key, None)));
        }
        Ok(Some((key.clone(), self.read_lease(&key)?)))
    }

    /// A lease file; `Ok(None)` when it is missing or still empty (being written).
    pub fn read_lease(&self, key: &str) -> Result<Option<Lease>, PoolError> {
        let path = self.lease_path(key);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        if bytes.is_empty() {
            return Ok(None);
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| PoolError::BadLease { path, source })
    }

    /// Every readable lease, sorted by subnet; unreadable ones are returned as errors beside.
    pub fn all_leases(&self) -> Result<Vec<LeaseEntry>, PoolError> {
        let mut keys: Vec<String> = self.lease_keys()?.into_iter().collect();
        keys.sort_by_key(|key| {
            key.trim_end_matches(".json")
                .parse::<Ipv4Addr>()
                .map(u32::from)
                .unwrap_or(u32::MAX)
        });
        Ok(keys
            .into_iter()
            .map(|key| {
                let lease = self.read_lease(&key);
                (key, lease)
            })
            .collect())
    }

    /// The claimed names and what each file holds (a lease key, or empty).
    pub fn all_names(&self) -> Result<Vec<(String, String)>, PoolError> {
        Ok(dir_names(&self.names())?
            .into_iter()
            .map(|name| {
                let key = fs::read_to_string(self.name_path(&name)).unwrap_or_default();
                (name, key)
            })
            .collect())
    }

    /// How long ago a name was claimed.
    pub fn name_age(&self, name: &str) -> Option<std::time::Duration> {
        age(&self.name_path(name))
    }

    /// How long ago a lease file was last written.
    pub fn lease_age(&self, key: &str) -> Option<std::time::Duration> {
        age(&self.lease_path(key))
    }

    /// Removes a lease file (missing is fine).
    pub fn release_lease(&self, key: &str) -> Result<(), PoolError> {
        remove(&self.lease_path(key))
    }

    /// Removes a name claim (missing is fine).
    pub fn release_name(&self, name: &str) -> Result<(), PoolError> {
        remove(&self.name_path(name))
    }
}

/// The (UTF-8) names in a directory; none when it does not exist.
fn dir_names(dir: &Path) -> Result<Vec<String>, PoolError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    Ok(entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| entry.file_name().into_string().ok())
        .collect())
}

fn age(path: &Path) -> Option<std::time::Duration> {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
}

fn remove(path: &Path) -> Result<(), PoolError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, slot: Slot) -> Lease {
        Lease {
            name: name.to_string(),
            pool: "test".to_string(),
            subnet: slot.subnet.to_string(),
            tap: slot.tap_name(),
            link: LinkKind::Tap,
            host_ip: slot.host_ip(),
            guest_ip: slot.guest_ip(),
            prefix_len: SUBNET_PREFIX,
            egress: "none".to_string(),
            dns: None,
            expose: Vec::new(),
            expose_on: Vec::new(),
            pid: std::process::id(),
            complete: false,
        }
    }

    #[test]
    fn pools_are_validated() {
        assert_eq!(Pool::parse("10.200.0.0/16").unwrap().slots(), 16384);
        assert_eq!(Pool::parse("10.0.0.0/30").unwrap().slots(), 1);
        assert!(matches!(
            Pool::parse("10.0.0.0/31"),
            Err(PoolError::TooSmall { .. })
        ));
        assert!(matches!(
            Pool::parse("127.0.0.0/24"),
            Err(PoolError::Reserved { .. })
        ));
        assert!(matches!(
            Pool::parse("0.0.0.0/0"),
            Err(PoolError::Reserved { .. })
        ));
        assert!(matches!(
            Pool::parse("10.0.0.1/24"),
            Err(PoolError::Cidr(_))
        ));
        assert_eq!(
            Pool::parse("10.0.0.0/31").unwrap_err().to_string(),
            "pool 10.0.0.0/31 is too small: it must hold at least one /30 (prefix length 30 or less)"
        );
    }

    #[test]
    fn slots_give_host_guest_and_tap() {
        let pool = Pool::parse("10.200.0.0/16").unwrap();
        let slot = pool.slot(1).unwrap();
        assert_eq!(slot.host_ip(), Ipv4Addr::new(10, 200, 0, 5));
        assert_eq!(slot.guest_ip(), Ipv4Addr::new(10, 200, 0, 6));
        assert_eq!(slot.tap_name(), "rbx0ac80004");
        assert!(slot.tap_name().len() <= 15);
        assert_eq!(slot_of_tap("rbx0ac80004"), Some(slot));
        assert_eq!(slot_of_tap("rbx0ac80005"), None);
        assert_eq!(slot_of_tap("rbx0ac8000"), None);
        assert_eq!(slot_of_tap("eth0"), None);
        assert_eq!(slot_of_ip(Ipv4Addr::new(10, 200, 0, 6)), slot);
        assert_eq!(slot.key(), "10.200.0.4.json");
    }

    #[test]
    fn allocation_takes_the_lowest_free_subnet_until_exhausted() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let pool = Pool::parse("10.9.0.0/29").unwrap();
        let mut keys = Vec::new();
        for name in ["a", "b"] {
            state.claim_name(name).unwrap();
            let (slot, record) = state.claim_slot(&pool, |s| lease(name, s)).unwrap();
            assert_eq!(record.tap, slot.tap_name());
            keys.push(slot.key());
        }
        assert_eq!(keys, ["10.9.0.0.json", "10.9.0.4.json"]);
        state.claim_name("c").unwrap();
        let error = state.claim_slot(&pool, |s| lease("c", s)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "pool 10.9.0.0/29 is exhausted: all 2 /30 subnets are leased (see `rollbox net list`, or free some with `rollbox net down`/`gc`)"
        );
        assert!(matches!(
            state.claim_name("a"),
            Err(PoolError::NameTaken { .. })
        ));
        // Freeing the first makes it the next one handed out.
        let (key, record) = state.lease_of("a").unwrap().unwrap();
        assert_eq!(record.unwrap().name, "a");
        state.release_lease(&key).unwrap();
        state.release_name("a").unwrap();
        let (slot, _) = state.claim_slot(&pool, |s| lease("c", s)).unwrap();
        assert_eq!(slot.key(), "10.9.0.0.json");
        assert_eq!(state.all_leases().unwrap().len(), 2);
        assert_eq!(state.lease_of("a").unwrap(), None);
    }

    #[test]
    fn concurrent_claims_never_share_a_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::parse("10.9.0.0/24").unwrap();
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let state = StateDir::new(dir.path());
                std::thread::spawn(move || {
                    let name = format!("s{i}");
                    state.claim_name(&name).unwrap();
                    state.claim_slot(&pool, |s| lease(&name, s)).unwrap().0
                })
            })
            .collect();
        let slots: HashSet<String> = threads
            .into_iter()
            .map(|t| t.join().unwrap().key())
            .collect();
        assert_eq!(slots.len(), 16);
    }
}
