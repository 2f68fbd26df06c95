//! Leases: what [`lease`] makes for a sandbox (tap or veth, /30, rules, lease file), and the
//! teardown that removes exactly that.

use super::pool::{self, Lease, LinkKind, StateDir};
use super::{check_name, nft, tap, Egress, LeaseRequest, NetError, NetInfo};

/// The nftables view of a lease.
pub fn sandbox_rules<'a>(lease: &'a Lease, egress: &'a Egress) -> nft::Sandbox<'a> {
    nft::Sandbox {
        tap: &lease.tap,
        host_ip: lease.host_ip,
        guest_ip: lease.guest_ip,
        egress,
        dns: lease.dns,
        expose: &lease.expose,
        expose_on: &lease.expose_on,
    }
}

/// Leases sandbox `request.name` a tap (or a test veth) and a /30 of its pool, with NAT to the
/// uplink, its egress policy and its exposed ports (one nftables transaction); on failure
/// removes whatever it had made.
pub fn lease(state: &StateDir, request: &LeaseRequest) -> Result<NetInfo, NetError> {
    let LeaseRequest {
        name,
        pool,
        egress,
        dns,
        expose,
        expose_on,
        link,
        resolver,
    } = request;
    check_name(name)?;
    if egress.has_hosts() && !resolver {
        return Err(NetError::HostnamesNeedResolver(egress.to_string()));
    }
    // The host's own networks (not the default route, not our taps) must stay out of the pool.
    let in_use = tap::routes().into_iter().find(|(interface, route)| {
        route.prefix() > 0 && pool::slot_of_tap(interface).is_none() && route.overlaps(&pool.net())
    });
    if let Some((interface, route)) = in_use {
        return Err(NetError::PoolInUse {
            pool: pool.net().to_string(),
            route: route.to_string(),
            interface,
        });
    }
    nft::binary()?;

    state.claim_name(name)?;
    let made = state.claim_slot(pool, |slot| Lease {
        name: name.clone(),
        pool: pool.net().to_string(),
        subnet: slot.subnet.to_string(),
        tap: slot.tap_name(),
        link: link.clone(),
        host_ip: slot.host_ip(),
        guest_ip: slot.guest_ip(),
        prefix_len: pool::SUBNET_PREFIX,
        egress: egress.to_string(),
        // With the resolver, the guest's DNS server is its gateway.
        dns: if *resolver {
            Some(slot.host_ip())
        } else {
            *dns
        },
        expose: expose.clone(),
        expose_on: expose_on.clone(),
        pid: std::process::id(),
        complete: false,
    });
    let (slot, mut lease) = match made {
        Ok(made) => made,
        Err(e) => {
            let _ = state.release_name(name);
            return Err(e.into());
        }
    };
    let mut link_made = false;
    let mut rules_made = false;
    let result = (|| -> Result<(), NetError> {
        match &lease.link {
            LinkKind::Tap => tap::create_tap(&lease.tap)?,
            LinkKind::Veth { netns } => tap::create_veth(
                &lease.tap,
                netns,
                lease.guest_ip,
                lease.host_ip,
                lease.prefix_len,
            )?,
        }
        link_made = true;
        tap::configure(&lease.tap, lease.host_ip, slot.subnet.netmask())?;
        if !lease.expose.is_empty() && lease.expose_on.iter().any(|a| a.is_loopback()) {
            tap::route_localnet(&lease.tap)?;
        }
        tap::enable_forwarding()?;
        nft::admit_through_docker()?;
        nft::apply_up(&nft::render_up(&sandbox_rules(&lease, egress)))?;
        rules_made = true;
        lease.complete = true;
        state.update(&lease, &slot)?;
        Ok(())
    })();
    if let Err(error) = result {
        // Roll back what this call made: the rules, the link, the lease. (A failed nft script
        // changed nothing; an interface that was there already is not ours.)
        if rules_made {
            let _ = nft::apply(&nft::render_down(&sandbox_rules(&lease, egress)));
        }
        if link_made {
            let _ = remove_link(&lease);
        }
        let _ = state.release_lease(&slot.key());
        let _ = state.release_name(name);
        return Err(error);
    }
    Ok(NetInfo::of(&lease))
}

fn remove_link(lease: &Lease) -> Result<(), NetError> {
    match &lease.link {
        LinkKind::Tap => tap::delete_tap(&lease.tap)?,
        LinkKind::Veth { .. } => tap::delete_veth(&lease.tap)?,
    }
    Ok(())
}

/// Removes exactly what a lease says was made: rules, link, lease file, name.
pub fn teardown(state: &StateDir, key: &str, lease: &Lease) -> Result<(), NetError> {
    // A policy that no longer parses only matters for the rules it renders, which `down`
    // deletes by chain; `none` renders the same chains.
    let egress = lease.egress.parse().unwrap_or(Egress::None);
    let rules = sandbox_rules(lease, &egress);
    // Deleting a link waits for the kernel (RCU), and so does nft's commit: both at once.
    std::thread::scope(|scope| {
        let link = scope.spawn(|| remove_link(lease));
        if nft::apply(&nft::render_down(&rules)).is_err() {
            remove_rules_one_by_one(lease)?;
        }
        link.join().unwrap_or_else(|_| {
            Err(NetError::Tap(tap::TapError::Command {
                command: format!("removing {}", lease.tap),
                detail: "the thread panicked".to_string(),
            }))
        })
    })?;
    state.release_lease(key)?;
    state.release_name(&lease.name)?;
    Ok(())
}

/// The slow path when the one-transaction removal failed (for instance, a host port of ours
/// was since given to another sandbox): each statement on its own, skipping what is gone,
/// and exposed ports only where they still point at this guest.
fn remove_rules_one_by_one(lease: &Lease) -> Result<(), NetError> {
    let Some(listing) = nft::list_table()? else {
        return Ok(());
    };
    let tap = &lease.tap;
    let table = nft::TABLE;
    let mut statements = vec![
        format!("delete element {table} egress {{ \"{tap}\" }}"),
        format!("delete element {table} to_host {{ \"{tap}\" }}"),
        format!("delete element {table} guests {{ {} }}", lease.guest_ip),
    ];
    statements.extend(nft::delete_ports_of(&listing, lease.guest_ip));
    statements.push(format!("delete chain {table} egress_{tap}"));
    statements.push(format!("delete chain {table} host_{tap}"));
    statements.extend(nft::delete_dns_sets_of(&listing, tap));
    for statement in statements {
        let _ = nft::apply(&statement);
    }
    Ok(())
}

/// Replaces sandbox `name`'s egress policy: its egress chain is flushed and refilled in one
/// nftables transaction (no packet meets a half-made policy), then its lease records it.
/// Every packet the guest sends meets the chain, so connections already open meet the new
/// policy too. The hostname sets are emptied in the same transaction and refilled with `keep`
/// (what the resolver answered for names the new policy still allows).
pub fn set_egress(
    state: &StateDir,
    name: &str,
    egress: &Egress,
    keep: &[nft::Resolved],
) -> Result<NetInfo, NetError> {
    check_name(name)?;
    let mut lease = match state.lease_of(name)? {
        Some((_, Some(lease))) if lease.complete => lease,
        _ => return Err(NetError::NoLease(name.to_string())),
    };
    let slot = pool::slot_of_tap(&lease.tap).ok_or_else(|| NetError::NoLease(name.to_string()))?;
    if egress.has_hosts() && lease.dns != Some(lease.host_ip) {
        return Err(NetError::NoResolver(name.to_string()));
    }
    let old = lease.egress.parse().unwrap_or(Egress::None);
    nft::apply(&nft::render_egress(
        &sandbox_rules(&lease, egress),
        &old,
        keep,
    ))?;
    super::tool::forget_connections(lease.guest_ip);
    lease.egress = egress.to_string();
    state.update(&lease, &slot)?;
    Ok(NetInfo::of(&lease))
}

/// Tears down sandbox `name`'s networking. Returns false when it had none (not an error).
pub fn release(state: &StateDir, name: &str) -> Result<bool, NetError> {
    check_name(name)?;
    let Some((key, lease)) = state.lease_of(name)? else {
        return Ok(false);
    };
    match lease {
        Some(lease) => teardown(state, &key, &lease)?,
        None => {
            // Claimed but never leased, or the lease file is gone: only the claim is left.
            if !key.is_empty() {
                state.release_lease(&key)?;
            }
            state.release_name(name)?;
        }
    }
    Ok(true)
}

/// The leases in the state directory.
pub fn leases(state: &StateDir) -> Result<Vec<Lease>, NetError> {
    Ok(state
        .all_leases()?
        .into_iter()
        .filter_map(|(_, lease)| lease.ok().flatten())
        .collect())
}
