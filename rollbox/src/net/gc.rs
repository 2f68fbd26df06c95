//! Garbage collection: what sandboxes whose state is gone left behind (unfinished leases,
//! names without a lease, and interfaces and rules of the pool that no lease accounts for).

use super::lease::{leases, teardown};
use super::pool::{self, Pool, StateDir};
use super::{nft, tap, Egress, NetError};

/// Whether process `pid` is alive.
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// How long a claim may stay without its lease written before `gc` takes it for abandoned.
const CLAIM_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Removes what sandboxes whose state is gone left behind, and returns what it removed:
/// leases that `up` never finished (its process is dead); names without a lease; and, within
/// `pool`, `rbx` interfaces and nftables chains and elements that no lease in this state
/// directory accounts for.
pub fn gc(state: &StateDir, pool: &Pool) -> Result<Vec<String>, NetError> {
    let mut removed = Vec::new();
    for (key, lease) in state.all_leases()? {
        match lease {
            Ok(Some(lease)) if lease.complete || alive(lease.pid) => {}
            Ok(Some(lease)) => {
                teardown(state, &key, &lease)?;
                removed.push(format!("unfinished lease {key} of {}", lease.name));
            }
            Ok(None) | Err(_) => {
                // Empty (being written) or corrupt: only past the grace period.
                let old = state.lease_age(&key).is_none_or(|age| age > CLAIM_GRACE);
                if old {
                    state.release_lease(&key)?;
                    removed.push(format!("unreadable lease {key}"));
                }
            }
        }
    }
    let leases = leases(state)?;
    for (name, key) in state.all_names()? {
        let has_lease = leases.iter().any(|l| l.name == name);
        let old = state.name_age(&name).is_none_or(|age| age > CLAIM_GRACE);
        if !has_lease && (old || !key.is_empty()) {
            state.release_name(&name)?;
            removed.push(format!("name {name}"));
        }
    }
    // Interfaces and chains of this pool that no lease accounts for. Each is first claimed
    // like a lease (O_EXCL), so an `up` running meanwhile either owns it (and gc skips it) or
    // waits for another subnet.
    let listing = nft::list_table()?.unwrap_or_default();
    let mut orphans: Vec<String> = nft::sandbox_chains(&listing);
    orphans.extend(nft::mapped_interfaces(&listing));
    let addresses = nft::exposed(&listing).into_iter().map(|(_, addr, _)| addr);
    let addresses = addresses.chain(nft::ports(&listing).into_iter().map(|(_, _, addr, _)| addr));
    let addresses = addresses.chain(nft::guests(&listing));
    orphans.extend(addresses.map(|addr| pool::slot_of_ip(addr).tap_name()));
    orphans.extend(tap::interfaces());
    orphans.sort();
    orphans.dedup();
    for name in orphans {
        let Some(slot) = pool::slot_of_tap(&name) else {
            continue;
        };
        if !pool.net().contains(slot.guest_ip()) || !state.claim_orphan(&slot)? {
            continue;
        }
        let cleaned = remove_orphan(&name, &slot, &listing, &mut removed);
        state.release_lease(&slot.key())?;
        cleaned?;
    }
    Ok(removed)
}

/// Removes an interface and its rules that no lease accounts for.
fn remove_orphan(
    tap: &str,
    slot: &pool::Slot,
    listing: &str,
    removed: &mut Vec<String>,
) -> Result<(), NetError> {
    if !listing.is_empty() {
        // Whatever of it is there (chains, map and set elements): the script is idempotent;
        // its exposed ports first, each on its own (only those that are there).
        for statement in nft::delete_ports_of(listing, slot.guest_ip()) {
            let _ = nft::apply(&statement);
        }
        let rules = nft::Sandbox {
            tap,
            host_ip: slot.host_ip(),
            guest_ip: slot.guest_ip(),
            egress: &Egress::None,
            dns: None,
            expose: &[],
            expose_on: &[],
        };
        nft::apply(&nft::render_down(&rules))?;
        for statement in nft::delete_dns_sets_of(listing, tap) {
            let _ = nft::apply(&statement);
        }
        removed.push(format!("nftables rules of {tap}"));
    }
    if tap::exists(tap) {
        // A tap, or else a test's veth.
        if tap::delete_tap(tap).is_err() {
            tap::delete_veth(tap)?;
        }
        removed.push(format!("interface {tap}"));
    }
    Ok(())
}
