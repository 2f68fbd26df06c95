//! Per-sandbox host networking: a tap with a /30 from a pool, NAT to the uplink, and an egress
//! policy in nftables. `rollbox net up|down|list|gc` drive it; the daemon will call the same
//! functions. Design and rules: docs/networking.md.

pub mod cidr;
pub mod nft;
pub mod policy;
pub mod pool;
pub mod tap;

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::Serialize;

pub use policy::Egress;
pub use pool::{Lease, LinkKind, Pool, StateDir};

/// Runs `program` with `args`, feeding it `stdin` (if any); collects stdout and stderr.
fn run_piped(
    program: &std::path::Path,
    args: &[&str],
    stdin: Option<&str>,
) -> std::io::Result<std::process::Output> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())?;
    }
    child.wait_with_output()
}

/// The default pool.
pub const DEFAULT_POOL: &str = "10.200.0.0/16";
/// The default state directory.
pub const DEFAULT_STATE_DIR: &str = "/run/rollbox/net";
/// Sandbox names: at most this many bytes.
pub const MAX_NAME: usize = 64;

/// Failures of `rollbox net`, each naming the input or resource at fault.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("sandbox name `{name}`: {reason}")]
    BadName { name: String, reason: String },
    #[error("--dns `{0}` is not an IPv4 address")]
    BadDns(String),
    #[error("--expose `{token}`: {reason}")]
    BadExpose { token: String, reason: String },
    #[error("pool {pool} overlaps the route to {route} on {interface}; pick a pool the host does not use")]
    PoolInUse {
        pool: String,
        route: String,
        interface: String,
    },
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    #[error(transparent)]
    Tap(#[from] tap::TapError),
    #[error(transparent)]
    Nft(#[from] nft::NftError),
}

/// Checks a sandbox name: 1-64 bytes of `A-Za-z0-9_.-`, starting with a letter or digit (it
/// names a file in the state directory).
pub fn check_name(name: &str) -> Result<(), NetError> {
    let bad = |reason: &str| NetError::BadName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() {
        return Err(bad("is empty"));
    }
    if name.len() > MAX_NAME {
        return Err(bad(&format!("is {} bytes, over {MAX_NAME}", name.len())));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(bad("must start with a letter or digit"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(bad(&format!(
            "has `{c}`; only A-Z a-z 0-9 _ . - are allowed"
        )));
    }
    Ok(())
}

/// `HOSTPORT:GUESTPORT` (TCP).
pub fn parse_expose(token: &str) -> Result<(u16, u16), NetError> {
    let bad = |reason: &str| NetError::BadExpose {
        token: token.to_string(),
        reason: reason.to_string(),
    };
    let (host, guest) = token
        .split_once(':')
        .ok_or_else(|| bad("expected HOSTPORT:GUESTPORT"))?;
    let port = |text: &str| {
        text.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad(&format!("port `{text}` is not a number from 1 to 65535")))
    };
    Ok((port(host)?, port(guest)?))
}

/// What `rollbox net up` is asked for.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub name: String,
    pub pool: String,
    pub egress: String,
    pub dns: Option<String>,
    pub expose: Vec<String>,
    pub link: LinkKind,
}

/// What the VMM and the guest need: printed as JSON by `rollbox net up`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetInfo {
    pub name: String,
    pub tap: String,
    pub host_ip: Ipv4Addr,
    pub guest_ip: Ipv4Addr,
    pub prefix_len: u8,
    pub guest_mac: String,
    pub kernel_ip_arg: String,
    pub egress: String,
}

/// Firecracker's convention: `06:00:` and the guest address's four bytes.
pub fn guest_mac(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("06:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// The kernel's `ip=` argument: `ip=<guest>::<gw>:<netmask>::eth0:off[:<dns0>]`.
pub fn kernel_ip_arg(
    guest: Ipv4Addr,
    gateway: Ipv4Addr,
    prefix: u8,
    dns: Option<Ipv4Addr>,
) -> String {
    let netmask = Ipv4Addr::from(cidr::mask(prefix));
    let mut arg = format!("ip={guest}::{gateway}:{netmask}::eth0:off");
    if let Some(dns) = dns {
        arg.push_str(&format!(":{dns}"));
    }
    arg
}

impl NetInfo {
    pub fn of(lease: &Lease) -> NetInfo {
        NetInfo {
            name: lease.name.clone(),
            tap: lease.tap.clone(),
            host_ip: lease.host_ip,
            guest_ip: lease.guest_ip,
            prefix_len: lease.prefix_len,
            guest_mac: guest_mac(lease.guest_ip),
            kernel_ip_arg: kernel_ip_arg(
                lease.guest_ip,
                lease.host_ip,
                lease.prefix_len,
                lease.dns,
            ),
            egress: lease.egress.clone(),
        }
    }
}

/// The nftables view of a lease.
fn sandbox_rules<'a>(lease: &'a Lease, egress: &'a Egress) -> nft::Sandbox<'a> {
    nft::Sandbox {
        tap: &lease.tap,
        host_ip: lease.host_ip,
        guest_ip: lease.guest_ip,
        egress,
        dns: lease.dns,
        expose: &lease.expose,
    }
}

/// Sets up sandbox networking; on failure removes whatever it had made.
pub fn up(state: &StateDir, options: &UpOptions) -> Result<NetInfo, NetError> {
    // Everything is checked before anything is made.
    check_name(&options.name)?;
    let pool = Pool::parse(&options.pool)?;
    let egress: Egress = options.egress.parse()?;
    let dns = match &options.dns {
        Some(text) => Some(
            text.parse::<Ipv4Addr>()
                .map_err(|_| NetError::BadDns(text.clone()))?,
        ),
        None => None,
    };
    let mut expose = Vec::new();
    for token in &options.expose {
        let pair = parse_expose(token)?;
        if expose.iter().any(|(host, _)| *host == pair.0) {
            return Err(NetError::BadExpose {
                token: token.clone(),
                reason: format!("host port {} is given twice", pair.0),
            });
        }
        expose.push(pair);
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

    state.claim_name(&options.name)?;
    let made = state.claim_slot(&pool, |slot| Lease {
        name: options.name.clone(),
        pool: pool.net().to_string(),
        subnet: slot.subnet.to_string(),
        tap: slot.tap_name(),
        link: options.link.clone(),
        host_ip: slot.host_ip(),
        guest_ip: slot.guest_ip(),
        prefix_len: pool::SUBNET_PREFIX,
        egress: egress.to_string(),
        dns,
        expose: expose.clone(),
        pid: std::process::id(),
        complete: false,
    });
    let (slot, mut lease) = match made {
        Ok(made) => made,
        Err(e) => {
            let _ = state.release_name(&options.name);
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
        tap::enable_forwarding()?;
        nft::admit_through_docker()?;
        nft::apply_up(&nft::render_up(&sandbox_rules(&lease, &egress)))?;
        rules_made = true;
        lease.complete = true;
        state.update(&lease, &slot)?;
        Ok(())
    })();
    if let Err(error) = result {
        // Roll back what this call made: the rules, the link, the lease. (A failed nft script
        // changed nothing; an interface that was there already is not ours.)
        if rules_made {
            let _ = nft::apply(&nft::render_down(&sandbox_rules(&lease, &egress)));
        }
        if link_made {
            let _ = remove_link(&lease);
        }
        let _ = state.release_lease(&slot.key());
        let _ = state.release_name(&options.name);
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
fn teardown(state: &StateDir, key: &str, lease: &Lease) -> Result<(), NetError> {
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
    for (port, addr, _) in nft::exposed(&listing) {
        if addr == lease.guest_ip {
            statements.push(format!("delete element {table} expose_tcp {{ {port} }}"));
        }
    }
    statements.push(format!("delete chain {table} egress_{tap}"));
    statements.push(format!("delete chain {table} host_{tap}"));
    for statement in statements {
        let _ = nft::apply(&statement);
    }
    Ok(())
}

/// Tears down sandbox `name`'s networking. Returns false when it had none (not an error).
pub fn down(state: &StateDir, name: &str) -> Result<bool, NetError> {
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
pub fn list(state: &StateDir) -> Result<Vec<Lease>, NetError> {
    Ok(state
        .all_leases()?
        .into_iter()
        .filter_map(|(_, lease)| lease.ok().flatten())
        .collect())
}

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
pub fn gc(state: &StateDir, pool: &str) -> Result<Vec<String>, NetError> {
    let pool = Pool::parse(pool)?;
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
    let leases = list(state)?;
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
        // Whatever of it is there (chains, map and set elements): the script is idempotent.
        let expose: Vec<(u16, u16)> = nft::exposed(listing)
            .into_iter()
            .filter(|(_, addr, _)| *addr == slot.guest_ip())
            .map(|(host, _, guest)| (host, guest))
            .collect();
        let rules = nft::Sandbox {
            tap,
            host_ip: slot.host_ip(),
            guest_ip: slot.guest_ip(),
            egress: &Egress::None,
            dns: None,
            expose: &expose,
        };
        nft::apply(&nft::render_down(&rules))?;
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

/// The state directory: `$ROLLBOX_NET_STATE`, else /run/rollbox/net.
pub fn default_state_dir() -> PathBuf {
    std::env::var_os("ROLLBOX_NET_STATE")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name("sbx-1_a.b").is_ok());
        assert!(check_name(&"a".repeat(64)).is_ok());
        let error = |n: &str| check_name(n).unwrap_err().to_string();
        assert_eq!(
            error(&"a".repeat(65)),
            format!("sandbox name `{}`: is 65 bytes, over 64", "a".repeat(65))
        );
        assert_eq!(
            error("a/b"),
            "sandbox name `a/b`: has `/`; only A-Z a-z 0-9 _ . - are allowed"
        );
        assert_eq!(
            error(".."),
            "sandbox name `..`: must start with a letter or digit"
        );
        assert_eq!(error(""), "sandbox name ``: is empty");
    }

    #[test]
    fn expose_pairs() {
        assert_eq!(parse_expose("8080:80").unwrap(), (8080, 80));
        assert_eq!(
            parse_expose("8080").unwrap_err().to_string(),
            "--expose `8080`: expected HOSTPORT:GUESTPORT"
        );
        assert_eq!(
            parse_expose("8080:0").unwrap_err().to_string(),
            "--expose `8080:0`: port `0` is not a number from 1 to 65535"
        );
    }

    #[test]
    fn mac_and_kernel_argument() {
        let guest = Ipv4Addr::new(10, 200, 0, 6);
        let gateway = Ipv4Addr::new(10, 200, 0, 5);
        assert_eq!(guest_mac(guest), "06:00:0a:c8:00:06");
        assert_eq!(
            kernel_ip_arg(guest, gateway, 30, None),
            "ip=10.200.0.6::10.200.0.5:255.255.255.252::eth0:off"
        );
        assert_eq!(
            kernel_ip_arg(guest, gateway, 30, Some(Ipv4Addr::new(1, 1, 1, 1))),
            "ip=10.200.0.6::10.200.0.5:255.255.255.252::eth0:off:1.1.1.1"
        );
    }
}
