//! The nftables rules: rendered as one script and applied with `nft -f -`, so each change is
//! one atomic transaction. Everything lives in `table inet rollbox`; no other table is touched.
//!
//! Shared part (rewritten, identical, by every `up`): base chains on the forward, input,
//! prerouting, output and postrouting hooks; a set of the sandboxes' interfaces; two verdict
//! maps keyed by interface name that jump to a sandbox's chains; a set of guest addresses to
//! masquerade; a map of exposed host ports. Per sandbox: chains `egress_<tap>` (what it may
//! reach through the host) and `host_<tap>` (what it may reach on the host itself), and one
//! element in each map and set; and, for each hostname entry of its policy, a set
//! `dns<i>_<tap>` of the addresses the daemon's resolver answered for it (with timeouts).

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use super::policy::{Allow, Dest, Egress, DENIED_UNDER_ALL};

pub const TABLE: &str = "inet rollbox";

/// nftables failures.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nft not found ({0}): install nftables (apt-get install nftables)")]
    Missing(String),
    #[error("cannot run {path}: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nft rejected the rules: {0}")]
    Rejected(String),
    #[error("host port {port} is already exposed (to {target}); pick another --expose port")]
    PortTaken { port: u16, target: String },
}

/// The `nft` binary: `$ROLLBOX_NFT`, else the first `nft` on PATH.
pub fn binary() -> Result<PathBuf, NftError> {
    if let Some(path) = std::env::var_os("ROLLBOX_NFT").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(NftError::Missing(format!("ROLLBOX_NFT={}", path.display())))
        };
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join("nft"))
        .find(|path| path.is_file())
        .ok_or_else(|| NftError::Missing("not on PATH".to_string()))
}

/// Runs `nft` with `args`, feeding `stdin`; returns stdout.
fn nft(args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
    let path = binary()?;
    let spawn = |source| NftError::Spawn {
        path: path.clone(),
        source,
    };
    let out = super::tool::run_piped(&path, args, stdin).map_err(spawn)?;
    if !out.status.success() {
        return Err(NftError::Rejected(one_line(&String::from_utf8_lossy(
            &out.stderr,
        ))));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// nft's multi-line error (position, message, the statement, carets) as one line.
fn one_line(stderr: &str) -> String {
    let mut lines = stderr.lines().map(str::trim).filter(|l| !l.is_empty());
    let Some(first) = lines.next() else {
        return "no message".to_string();
    };
    let message = first
        .split_once("Error: ")
        .map_or(first, |(_, message)| message);
    match lines.next().filter(|l| !l.starts_with('^')) {
        Some(statement) => format!("{message} (in `{statement}`)"),
        None => message.to_string(),
    }
}

/// The comment on the rules [`admit_through_docker`] adds, which finds them again.
const DOCKER_RULE_COMMENT: &str = "rollbox: sandbox traffic (policy in table inet rollbox)";

/// Where Docker's `ip filter` table has a `DOCKER-USER` chain, makes sure it accepts traffic
/// from and to `rbx*` interfaces. netfilter runs every table's base chains, and dockerd sets
/// its FORWARD policy to drop when it turned forwarding on itself: without these two rules a
/// sandbox reaches nothing through the host. Accepting there only lifts Docker's drop; table
/// inet rollbox still enforces each sandbox's egress. Added once, host-wide, like forwarding
/// itself, and never removed.
pub fn admit_through_docker() -> Result<(), NftError> {
    let chain = match nft(&["list", "chain", "ip", "filter", "DOCKER-USER"], None) {
        Ok(text) => text,
        // No Docker (or no DOCKER-USER chain): nothing to lift.
        Err(NftError::Rejected(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    if chain.contains(DOCKER_RULE_COMMENT) {
        return Ok(());
    }
    let script = format!(
        "insert rule ip filter DOCKER-USER iifname \"rbx*\" counter accept comment \"{DOCKER_RULE_COMMENT}\"\n\
         insert rule ip filter DOCKER-USER oifname \"rbx*\" counter accept comment \"{DOCKER_RULE_COMMENT}\"\n"
    );
    apply(&script)
}

/// Applies a script atomically.
pub fn apply(script: &str) -> Result<(), NftError> {
    nft(&["-f", "-"], Some(script)).map(|_| ())
}

/// `nft list table inet rollbox`; `None` when the table does not exist.
pub fn list_table() -> Result<Option<String>, NftError> {
    match nft(&["list", "table", "inet", "rollbox"], None) {
        Ok(text) => Ok(Some(text)),
        Err(NftError::Rejected(message)) if message.contains("No such file") => Ok(None),
        Err(e) => Err(e),
    }
}

/// One sandbox's rules.
#[derive(Debug, Clone)]
pub struct Sandbox<'a> {
    pub tap: &'a str,
    pub host_ip: Ipv4Addr,
    pub guest_ip: Ipv4Addr,
    pub egress: &'a Egress,
    pub dns: Option<Ipv4Addr>,
    /// Host TCP port → guest TCP port.
    pub expose: &'a [(u16, u16)],
    /// The host addresses `expose` is on; empty: every local address but loopback (map
    /// `expose_tcp`). Else exactly these (map `ports_tcp`), 127.0.0.1 included if named.
    pub expose_on: &'a [Ipv4Addr],
}

/// The table, maps and set (no chains): `add` leaves existing ones as they are.
fn declarations(s: &mut String) {
    let _ = writeln!(s, "add table {TABLE}");
    let _ = writeln!(s, "add map {TABLE} egress {{ type ifname : verdict; }}");
    let _ = writeln!(s, "add map {TABLE} to_host {{ type ifname : verdict; }}");
    let _ = writeln!(s, "add set {TABLE} sandboxes {{ type ifname; }}");
    let _ = writeln!(s, "add set {TABLE} guests {{ type ipv4_addr; }}");
    let _ = writeln!(
        s,
        "add map {TABLE} expose_tcp {{ type inet_service : ipv4_addr . inet_service; }}"
    );
    let _ = writeln!(
        s,
        "add map {TABLE} ports_tcp {{ type ipv4_addr . inet_service : ipv4_addr . inet_service; }}"
    );
}

/// The base chains, flushed and rewritten in the same transaction (so never missing, never
/// doubled). Only interfaces in the set `sandboxes` are touched, whatever other interfaces are
/// called.
fn base_chains(s: &mut String) {
    let chain = |s: &mut String, name: &str, spec: &str, rules: &[&str]| {
        let _ = writeln!(s, "add chain {TABLE} {name} {{ {spec}; policy accept; }}");
        let _ = writeln!(s, "flush chain {TABLE} {name}");
        for rule in rules {
            let _ = writeln!(s, "add rule {TABLE} {name} {rule}");
        }
    };
    chain(
        s,
        "forward",
        "type filter hook forward priority filter",
        &[
            r#"iifname @sandboxes oifname @sandboxes drop comment "sandboxes never reach each other""#,
            "oifname @sandboxes ct state established,related accept",
            r#"oifname @sandboxes ct status dnat accept comment "exposed ports""#,
            r#"oifname @sandboxes drop comment "nothing else opens connections into a sandbox""#,
            // A connection the policy let open keeps flowing (a hostname's addresses may expire
            // from its set meanwhile); a policy change forgets the guest's connections
            // (`conntrack -D`), so their next packets meet the new policy.
            "iifname @sandboxes ct state established,related accept",
            "iifname vmap @egress",
            "iifname @sandboxes drop",
        ],
    );
    chain(
        s,
        "input",
        "type filter hook input priority filter",
        &[
            "iifname @sandboxes ct state established,related accept",
            r#"iifname @sandboxes ip daddr 127.0.0.0/8 drop comment "a guest never reaches the host's loopback (route_localnet is on for exposed ports)""#,
            "iifname vmap @to_host",
            "iifname @sandboxes drop",
        ],
    );
    chain(
        s,
        "prerouting",
        "type nat hook prerouting priority dstnat",
        &[
            r#"iifname != @sandboxes fib daddr type local dnat ip to tcp dport map @expose_tcp comment "exposed ports""#,
            r#"iifname != @sandboxes dnat ip to ip daddr . tcp dport map @ports_tcp comment "exposed ports on an address""#,
        ],
    );
    chain(
        s,
        "output",
        "type nat hook output priority -100",
        &[
            "ip daddr != 127.0.0.0/8 fib daddr type local dnat ip to tcp dport map @expose_tcp comment \"exposed ports, from the host itself\"",
            "dnat ip to ip daddr . tcp dport map @ports_tcp comment \"exposed ports on an address, from the host itself\"",
        ],
    );
    chain(
        s,
        "postrouting",
        "type nat hook postrouting priority srcnat",
        &[
            "ip saddr @guests oifname != @sandboxes masquerade",
            r#"ip saddr 127.0.0.0/8 oifname @sandboxes masquerade comment "exposed ports on 127.0.0.1""#,
        ],
    );
}

/// One address the resolver answered for a hostname entry: an element of set
/// `dns<set>_<tap>` that expires after `timeout_s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    /// The index of the entry among the policy's hostname entries.
    pub set: usize,
    pub addr: Ipv4Addr,
    pub timeout_s: u64,
}

/// The name of the set of the `index`-th hostname entry's addresses.
pub fn dns_set(tap: &str, index: usize) -> String {
    format!("dns{index}_{tap}")
}

fn declare_dns_set(s: &mut String, tap: &str, index: usize) {
    let _ = writeln!(
        s,
        "add set {TABLE} {} {{ type ipv4_addr; flags timeout; }}",
        dns_set(tap, index)
    );
}

/// The script that adds (or refreshes: add, delete, add, so the new timeout holds) resolved
/// addresses to their sets.
pub fn render_resolved(tap: &str, resolved: &[Resolved]) -> String {
    let mut s = String::new();
    for r in resolved {
        let set = dns_set(tap, r.set);
        let (addr, timeout) = (r.addr, r.timeout_s.max(1));
        let _ = writeln!(
            s,
            "add element {TABLE} {set} {{ {addr} timeout {timeout}s }}"
        );
        let _ = writeln!(s, "delete element {TABLE} {set} {{ {addr} }}");
        let _ = writeln!(
            s,
            "add element {TABLE} {set} {{ {addr} timeout {timeout}s }}"
        );
    }
    s
}

/// The per-sandbox rules in policy order (without `add rule TABLE CHAIN`).
fn egress_rules(sandbox: &Sandbox<'_>) -> Vec<String> {
    let guest = sandbox.guest_ip;
    let mut rules = vec![
        "meta nfproto ipv6 drop comment \"guests are IPv4 only\"".to_string(),
        format!("ip saddr != {guest} drop comment \"only the guest's own address\""),
    ];
    if let Some(dns) = sandbox.dns {
        rules.push(format!(
            "ip daddr {dns} meta l4proto {{ tcp, udp }} th dport 53 accept comment \"DNS\""
        ));
    }
    let mut host = 0;
    let mut allow = |entry: &Allow| {
        let rule = allow_rule(sandbox.tap, entry, host);
        if matches!(entry.dest, Dest::Host(_)) {
            host += 1;
        }
        rule
    };
    match sandbox.egress {
        Egress::None => {}
        Egress::All(opt_ins) => {
            rules.extend(opt_ins.iter().map(&mut allow));
            rules.push(format!(
                "ip daddr {{ {} }} drop comment \"private, shared and link-local (cloud metadata) ranges: name one after all to allow it\"",
                DENIED_UNDER_ALL.join(", ")
            ));
            rules.push("accept".to_string());
        }
        Egress::Allow(entries) => rules.extend(entries.iter().map(allow)),
    }
    rules.push("drop".to_string());
    rules
}

/// The rule that accepts one allow-list entry; a hostname entry (the `host`-th) accepts the
/// addresses in its set.
fn allow_rule(tap: &str, entry: &Allow, host: usize) -> String {
    let daddr = match &entry.dest {
        Dest::Net(net) if net.prefix() == 32 => net.network().to_string(),
        Dest::Net(net) => net.to_string(),
        Dest::Host(_) => format!("@{}", dns_set(tap, host)),
    };
    match entry.ports {
        None => format!("ip daddr {daddr} accept"),
        Some((lo, hi)) if lo == hi => {
            format!("ip daddr {daddr} meta l4proto {{ tcp, udp }} th dport {lo} accept")
        }
        Some((lo, hi)) => {
            format!("ip daddr {daddr} meta l4proto {{ tcp, udp }} th dport {lo}-{hi} accept")
        }
    }
}

fn host_rules(sandbox: &Sandbox<'_>) -> Vec<String> {
    let (guest, host) = (sandbox.guest_ip, sandbox.host_ip);
    let mut rules = vec![
        format!("ip saddr != {guest} drop comment \"only the guest's own address\""),
        format!("ip daddr {host} icmp type echo-request accept comment \"ping the gateway\""),
    ];
    if sandbox.dns == Some(host) {
        rules.push(format!(
            "ip daddr {host} meta l4proto {{ tcp, udp }} th dport 53 accept comment \"DNS on the gateway\""
        ));
    }
    rules.push("drop".to_string());
    rules
}

fn elements(s: &mut String, verb: &str, sandbox: &Sandbox<'_>) {
    let tap = sandbox.tap;
    let guest = sandbox.guest_ip;
    let _ = writeln!(
        s,
        "{verb} element {TABLE} egress {{ \"{tap}\" : jump egress_{tap} }}"
    );
    let _ = writeln!(
        s,
        "{verb} element {TABLE} to_host {{ \"{tap}\" : jump host_{tap} }}"
    );
    let _ = writeln!(s, "{verb} element {TABLE} sandboxes {{ \"{tap}\" }}");
    let _ = writeln!(s, "{verb} element {TABLE} guests {{ {guest} }}");
    for line in expose_elements(verb, sandbox) {
        let _ = writeln!(s, "{line}");
    }
}

/// The map elements of a sandbox's exposed ports, with `verb` (`add`, `create`, `delete`).
fn expose_elements(verb: &str, sandbox: &Sandbox<'_>) -> Vec<String> {
    let guest = sandbox.guest_ip;
    let mut lines = Vec::new();
    for (host_port, guest_port) in sandbox.expose {
        let value = if verb == "delete" {
            String::new()
        } else {
            format!(" : {guest} . {guest_port}")
        };
        if sandbox.expose_on.is_empty() {
            lines.push(format!(
                "{verb} element {TABLE} expose_tcp {{ {host_port}{value} }}"
            ));
        }
        for addr in sandbox.expose_on {
            lines.push(format!(
                "{verb} element {TABLE} ports_tcp {{ {addr} . {host_port}{value} }}"
            ));
        }
    }
    lines
}

/// The script that replaces a sandbox's egress policy `old` with `sandbox.egress`: its egress
/// chain flushed and refilled, the hostname sets emptied (those the new policy has not,
/// deleted) and refilled with `keep`, one transaction (its other rules and elements stay).
pub fn render_egress(sandbox: &Sandbox<'_>, old: &Egress, keep: &[Resolved]) -> String {
    let tap = sandbox.tap;
    let chain = format!("egress_{tap}");
    let mut s = format!("flush chain {TABLE} {chain}\n");
    let new_sets = sandbox.egress.hosts().len();
    // After the flush no rule refers to the old sets.
    for index in new_sets..old.hosts().len() {
        declare_dns_set(&mut s, tap, index);
        let _ = writeln!(s, "delete set {TABLE} {}", dns_set(tap, index));
    }
    for index in 0..new_sets {
        declare_dns_set(&mut s, tap, index);
        let _ = writeln!(s, "flush set {TABLE} {}", dns_set(tap, index));
    }
    for rule in egress_rules(sandbox) {
        let _ = writeln!(s, "add rule {TABLE} {chain} {rule}");
    }
    let keep: Vec<Resolved> = keep.iter().copied().filter(|r| r.set < new_sets).collect();
    s.push_str(&render_resolved(tap, &keep));
    s
}

/// The script that sets a sandbox up.
pub fn render_up(sandbox: &Sandbox<'_>) -> String {
    let tap = sandbox.tap;
    let mut s = format!("# rollbox net: sandbox interface {tap}\n");
    declarations(&mut s);
    base_chains(&mut s);
    for index in 0..sandbox.egress.hosts().len() {
        declare_dns_set(&mut s, tap, index);
        let _ = writeln!(s, "flush set {TABLE} {}", dns_set(tap, index));
    }
    for (chain, rules) in [
        (format!("egress_{tap}"), egress_rules(sandbox)),
        (format!("host_{tap}"), host_rules(sandbox)),
    ] {
        let _ = writeln!(s, "add chain {TABLE} {chain}");
        let _ = writeln!(s, "flush chain {TABLE} {chain}");
        for rule in rules {
            let _ = writeln!(s, "add rule {TABLE} {chain} {rule}");
        }
    }
    // `create` fails if another sandbox has the host port, failing the whole transaction.
    elements(
        &mut s,
        "add",
        &Sandbox {
            expose: &[],
            ..sandbox.clone()
        },
    );
    for line in expose_elements("create", sandbox) {
        let _ = writeln!(s, "{line}");
    }
    s
}

/// The script that removes a sandbox's rules. It first adds what it deletes (adding what
/// exists changes nothing), so it succeeds whether or not `up` got that far: idempotent in
/// one transaction.
pub fn render_down(sandbox: &Sandbox<'_>) -> String {
    let tap = sandbox.tap;
    let mut s = format!("# rollbox net: remove sandbox interface {tap}\n");
    declarations(&mut s);
    let _ = writeln!(s, "add chain {TABLE} egress_{tap}");
    let _ = writeln!(s, "add chain {TABLE} host_{tap}");
    elements(&mut s, "add", sandbox);
    elements(&mut s, "delete", sandbox);
    for chain in [format!("egress_{tap}"), format!("host_{tap}")] {
        let _ = writeln!(s, "flush chain {TABLE} {chain}");
        let _ = writeln!(s, "delete chain {TABLE} {chain}");
    }
    // The hostname sets, once no rule refers to them.
    for index in 0..sandbox.egress.hosts().len() {
        declare_dns_set(&mut s, tap, index);
        let _ = writeln!(s, "delete set {TABLE} {}", dns_set(tap, index));
    }
    s
}

/// The hostname sets (`dns<i>_<tap>`) in a listing, with their interface names.
pub fn dns_sets(listing: &str) -> Vec<(String, String)> {
    listing
        .lines()
        .filter_map(|line| line.trim().strip_prefix("set "))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter_map(|set| {
            let (head, tap) = set.split_once('_')?;
            let index = head.strip_prefix("dns")?;
            (!index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
                .then(|| (tap.to_string(), set.to_string()))
        })
        .collect()
}

/// The statements that delete the hostname sets of `tap` in a listing (after its chains).
pub fn delete_dns_sets_of(listing: &str, tap: &str) -> Vec<String> {
    dns_sets(listing)
        .into_iter()
        .filter(|(of, _)| of == tap)
        .map(|(_, set)| format!("delete set {TABLE} {set}"))
        .collect()
}

/// The elements of the set or map that `header` (`map expose_tcp {`) opens in a listing.
fn listed_elements<'a>(listing: &'a str, header: &str) -> Vec<&'a str> {
    let Some(start) = listing.find(header) else {
        return Vec::new();
    };
    let block = &listing[start..];
    // The first `}` closes the elements (or, without elements, the set itself).
    let block = &block[..block.find('}').unwrap_or(block.len())];
    let Some((_, elements)) = block.split_once("elements = {") else {
        return Vec::new();
    };
    elements.split(',').map(str::trim).collect()
}

/// The exposed-port elements of a listing of the table: (host port, guest address, guest port).
pub fn exposed(listing: &str) -> Vec<(u16, Ipv4Addr, u16)> {
    listed_elements(listing, "map expose_tcp {")
        .into_iter()
        .filter_map(|element| {
            let (port, target) = element.split_once(':')?;
            let (addr, guest_port) = target.rsplit_once(" . ")?;
            Some((
                port.trim().parse().ok()?,
                addr.trim().parse().ok()?,
                guest_port.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// The elements of map `ports_tcp` in a listing: (host address, host port, guest address,
/// guest port).
pub fn ports(listing: &str) -> Vec<(Ipv4Addr, u16, Ipv4Addr, u16)> {
    listed_elements(listing, "map ports_tcp {")
        .into_iter()
        .filter_map(|element| {
            let (key, target) = element.split_once(':')?;
            let (addr, port) = key.split_once(" . ")?;
            let (guest, guest_port) = target.split_once(" . ")?;
            Some((
                addr.trim().parse().ok()?,
                port.trim().parse().ok()?,
                guest.trim().parse().ok()?,
                guest_port.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// The statements that delete every exposed port (both maps) that points at `guest`: for
/// rules whose lease is gone or out of date.
pub fn delete_ports_of(listing: &str, guest: Ipv4Addr) -> Vec<String> {
    let mut statements: Vec<String> = exposed(listing)
        .into_iter()
        .filter(|(_, addr, _)| *addr == guest)
        .map(|(port, _, _)| format!("delete element {TABLE} expose_tcp {{ {port} }}"))
        .collect();
    statements.extend(
        ports(listing)
            .into_iter()
            .filter(|(_, _, addr, _)| *addr == guest)
            .map(|(on, port, _, _)| {
                format!("delete element {TABLE} ports_tcp {{ {on} . {port} }}")
            }),
    );
    statements
}

/// The guest addresses in the masquerade set.
pub fn guests(listing: &str) -> Vec<Ipv4Addr> {
    listed_elements(listing, "set guests {")
        .into_iter()
        .filter_map(|element| element.parse().ok())
        .collect()
}

/// The interface names in the `sandboxes` set and the two verdict maps.
pub fn mapped_interfaces(listing: &str) -> Vec<String> {
    ["set sandboxes {", "map egress {", "map to_host {"]
        .into_iter()
        .flat_map(|header| listed_elements(listing, header))
        .map(|element| element.split_once(':').map_or(element, |(name, _)| name))
        .map(|name| name.trim().trim_matches('"').to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

/// The per-sandbox chains in a listing: interface names with an `egress_`/`host_` chain (or a
/// hostname set).
pub fn sandbox_chains(listing: &str) -> Vec<String> {
    let mut taps: Vec<String> = listing
        .lines()
        .filter_map(|line| line.trim().strip_prefix("chain "))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter_map(|chain| {
            chain
                .strip_prefix("egress_")
                .or_else(|| chain.strip_prefix("host_"))
        })
        .map(str::to_string)
        .chain(dns_sets(listing).into_iter().map(|(tap, _)| tap))
        .collect();
    taps.sort();
    taps.dedup();
    taps
}

/// Applies an `up` script. When it failed because another sandbox has one of the host ports
/// (its `create element` found the key), says which port and where it goes.
pub fn apply_up(script: &str) -> Result<(), NftError> {
    let Err(error) = apply(script) else {
        return Ok(());
    };
    let NftError::Rejected(message) = &error else {
        return Err(error);
    };
    if !message.contains("File exists") {
        return Err(error);
    }
    // `expose_tcp { PORT : ...` or `ports_tcp { ADDR . PORT : ...`.
    let legacy = message
        .split_once("expose_tcp { ")
        .and_then(|(_, rest)| rest.split_whitespace().next());
    let on_address = message
        .split_once("ports_tcp { ")
        .and_then(|(_, rest)| rest.split_whitespace().nth(2));
    let Some(port) = legacy.or(on_address).and_then(|p| p.parse::<u16>().ok()) else {
        return Err(error);
    };
    let listing = list_table().ok().flatten().unwrap_or_default();
    let mut targets = exposed(&listing)
        .into_iter()
        .filter(|(p, _, _)| *p == port)
        .map(|(_, a, p)| (a, p))
        .chain(
            ports(&listing)
                .into_iter()
                .filter(|(_, p, _, _)| *p == port)
                .map(|(_, _, a, p)| (a, p)),
        );
    let target = targets.next().map_or_else(
        || "another sandbox".to_string(),
        |(a, p)| format!("{a}:{p}"),
    );
    Err(NftError::PortTaken { port, target })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox<'a>(egress: &'a Egress, expose: &'a [(u16, u16)]) -> Sandbox<'a> {
        Sandbox {
            tap: "rbx0ac80004",
            host_ip: Ipv4Addr::new(10, 200, 0, 5),
            guest_ip: Ipv4Addr::new(10, 200, 0, 6),
            egress,
            dns: Some(Ipv4Addr::new(1, 1, 1, 1)),
            expose,
            expose_on: &[],
        }
    }

    #[test]
    fn a_policy_change_is_one_flush_and_refill_of_the_egress_chain() {
        let egress: Egress = "all".parse().unwrap();
        let script = render_egress(&sandbox(&egress, &[]), &Egress::None, &[]);
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines[0], "flush chain inet rollbox egress_rbx0ac80004");
        assert!(lines[1..]
            .iter()
            .all(|l| l.starts_with("add rule inet rollbox egress_rbx0ac80004 ")));
        assert_eq!(
            lines.last(),
            Some(&"add rule inet rollbox egress_rbx0ac80004 drop")
        );
        assert!(script.contains(" accept\n"), "{script}");
    }

    #[test]
    fn renders_an_allow_list() {
        let egress: Egress = "10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90"
            .parse()
            .unwrap();
        let script = render_up(&sandbox(&egress, &[(8080, 80)]));
        let chain: Vec<&str> = script
            .lines()
            .filter_map(|l| l.strip_prefix("add rule inet rollbox egress_rbx0ac80004 "))
            .collect();
        assert_eq!(
            chain,
            [
                "meta nfproto ipv6 drop comment \"guests are IPv4 only\"",
                "ip saddr != 10.200.0.6 drop comment \"only the guest's own address\"",
                "ip daddr 1.1.1.1 meta l4proto { tcp, udp } th dport 53 accept comment \"DNS\"",
                "ip daddr 10.0.0.0/8 meta l4proto { tcp, udp } th dport 443 accept",
                "ip daddr 1.1.1.1 accept",
                "ip daddr 192.168.0.0/16 meta l4proto { tcp, udp } th dport 80-90 accept",
                "drop",
            ]
        );
        assert!(script.contains(
            "add element inet rollbox egress { \"rbx0ac80004\" : jump egress_rbx0ac80004 }"
        ));
        assert!(script.contains("add element inet rollbox guests { 10.200.0.6 }"));
        assert!(script.contains("add element inet rollbox sandboxes { \"rbx0ac80004\" }"));
        assert!(
            !script.contains("rbx*"),
            "no wildcard: other rbx interfaces are not ours"
        );
        assert!(
            script.contains("create element inet rollbox expose_tcp { 8080 : 10.200.0.6 . 80 }")
        );
        // Base chains are flushed before they are filled, in the same script.
        let flush = script.find("flush chain inet rollbox forward").unwrap();
        let fill = script.find("add rule inet rollbox forward").unwrap();
        assert!(flush < fill);
        assert!(!script.contains("table ip "), "only our own table");
    }

    #[test]
    fn none_and_all() {
        let none = render_up(&sandbox(&Egress::None, &[]));
        let rules = |script: &str| -> Vec<String> {
            script
                .lines()
                .filter_map(|l| l.strip_prefix("add rule inet rollbox egress_rbx0ac80004 "))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(rules(&none).last().map(String::as_str), Some("drop"));
        assert!(!rules(&none).iter().any(|r| r == "accept"));
        let all = render_up(&sandbox(&Egress::All(Vec::new()), &[]));
        let all = rules(&all);
        assert_eq!(&all[all.len() - 3..][1..], ["accept", "drop"]);
        let denied = &all[all.len() - 3];
        for range in [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "169.254.0.0/16",
        ] {
            assert!(
                denied.starts_with("ip daddr {") && denied.contains(range),
                "{range} is not dropped under all: {denied}"
            );
        }
        assert!(denied.contains("} drop comment"), "{denied}");
        // An opt-in beside `all` is accepted before the private ranges are dropped.
        let opted: Egress = "all,169.254.169.254,10.1.0.0/16:5432".parse().unwrap();
        let opted = rules(&render_up(&sandbox(&opted, &[])));
        let at = |rule: &str| opted.iter().position(|r| r == rule).unwrap();
        let dropped = opted.iter().position(|r| r.contains("} drop")).unwrap();
        assert!(at("ip daddr 169.254.169.254 accept") < dropped);
        assert!(
            at("ip daddr 10.1.0.0/16 meta l4proto { tcp, udp } th dport 5432 accept") < dropped
        );
    }

    #[test]
    fn host_chain_allows_ping_and_dns_on_the_gateway_only() {
        let mut s = sandbox(&Egress::None, &[]);
        s.dns = Some(s.host_ip);
        let script = render_up(&s);
        let host: Vec<&str> = script
            .lines()
            .filter_map(|l| l.strip_prefix("add rule inet rollbox host_rbx0ac80004 "))
            .collect();
        assert_eq!(host.len(), 4, "{host:?}");
        assert!(host[1].starts_with("ip daddr 10.200.0.5 icmp type echo-request accept"));
        assert!(
            host[2].starts_with("ip daddr 10.200.0.5 meta l4proto { tcp, udp } th dport 53 accept")
        );
        assert_eq!(host[3], "drop");
    }

    #[test]
    fn down_adds_then_deletes_everything_up_made() {
        let script = render_down(&sandbox(&Egress::All(Vec::new()), &[(8080, 80)]));
        let add = script
            .find("add element inet rollbox expose_tcp { 8080 : 10.200.0.6 . 80 }")
            .unwrap();
        let delete = script
            .find("delete element inet rollbox expose_tcp { 8080 }")
            .unwrap();
        assert!(add < delete);
        for chain in ["egress_rbx0ac80004", "host_rbx0ac80004"] {
            assert!(script.contains(&format!("delete chain inet rollbox {chain}")));
        }
        assert!(
            !script.contains("flush chain inet rollbox forward"),
            "leaves shared chains"
        );
    }

    #[test]
    fn ports_on_addresses_go_to_the_address_map_only() {
        let on = [Ipv4Addr::LOCALHOST, Ipv4Addr::new(192, 0, 2, 7)];
        let egress = Egress::None;
        let rules = Sandbox {
            expose_on: &on,
            ..sandbox(&egress, &[(20001, 8080)])
        };
        let up = render_up(&rules);
        assert!(up.contains(
            "create element inet rollbox ports_tcp { 127.0.0.1 . 20001 : 10.200.0.6 . 8080 }"
        ));
        assert!(up.contains(
            "create element inet rollbox ports_tcp { 192.0.2.7 . 20001 : 10.200.0.6 . 8080 }"
        ));
        assert!(!up.contains("element inet rollbox expose_tcp"), "{up}");
        let down = render_down(&rules);
        assert!(down.contains("delete element inet rollbox ports_tcp { 127.0.0.1 . 20001 }"));
        let listing = "table inet rollbox {\n\tmap ports_tcp {\n\t\ttype ipv4_addr . inet_service : ipv4_addr . inet_service\n\t\telements = { 127.0.0.1 . 20001 : 10.200.0.6 . 8080,\n\t\t\t     192.0.2.7 . 20001 : 10.200.0.6 . 8080, 127.0.0.1 . 20002 : 10.200.0.10 . 22 }\n\t}\n}\n";
        assert_eq!(
            ports(listing),
            [
                (
                    Ipv4Addr::LOCALHOST,
                    20001,
                    Ipv4Addr::new(10, 200, 0, 6),
                    8080
                ),
                (
                    Ipv4Addr::new(192, 0, 2, 7),
                    20001,
                    Ipv4Addr::new(10, 200, 0, 6),
                    8080
                ),
                (
                    Ipv4Addr::LOCALHOST,
                    20002,
                    Ipv4Addr::new(10, 200, 0, 10),
                    22
                ),
            ]
        );
        assert_eq!(
            delete_ports_of(listing, Ipv4Addr::new(10, 200, 0, 10)),
            ["delete element inet rollbox ports_tcp { 127.0.0.1 . 20002 }"]
        );
    }

    #[test]
    fn parses_listings() {
        let listing = "table inet rollbox {\n\tmap expose_tcp {\n\t\ttype inet_service : ipv4_addr . inet_service\n\t\telements = { 8080 : 10.200.0.6 . 80, 9000 : 10.200.0.10 . 22 }\n\t}\n\tchain egress_rbx0ac80004 {\n\t}\n\tchain host_rbx0ac80004 {\n\t}\n\tchain forward {\n\t}\n}\n";
        assert_eq!(
            exposed(listing),
            [
                (8080, Ipv4Addr::new(10, 200, 0, 6), 80),
                (9000, Ipv4Addr::new(10, 200, 0, 10), 22)
            ]
        );
        assert_eq!(sandbox_chains(listing), ["rbx0ac80004"]);
        let listing = "table inet rollbox {\n\tset sandboxes {\n\t\ttype ifname\n\t\telements = { \"rbx0ac8000c\" }\n\t}\n\tmap egress {\n\t\ttype ifname : verdict\n\t\telements = { \"rbx0ac80004\" : jump egress_rbx0ac80004,\n\t\t\t     \"rbx0ac80008\" : jump egress_rbx0ac80008 }\n\t}\n\tset guests {\n\t\ttype ipv4_addr\n\t\telements = { 10.200.0.6, 10.200.0.10 }\n\t}\n}\n";
        assert_eq!(
            mapped_interfaces(listing),
            ["rbx0ac8000c", "rbx0ac80004", "rbx0ac80008"]
        );
        assert_eq!(
            guests(listing),
            [Ipv4Addr::new(10, 200, 0, 6), Ipv4Addr::new(10, 200, 0, 10)]
        );
        assert_eq!(
            guests("table inet rollbox {\n\tset guests {\n\t\ttype ipv4_addr\n\t}\n}"),
            Vec::<Ipv4Addr>::new()
        );
        assert_eq!(exposed("table inet rollbox {\n}"), []);
    }

    #[test]
    fn errors_become_one_line() {
        let stderr = "/dev/stdin:17:1-50: Error: Could not process rule: File exists\ncreate element inet rollbox expose_tcp { 8080 : 10.200.0.6 . 80 }\n^^^^^^^^\n";
        assert_eq!(
            one_line(stderr),
            "Could not process rule: File exists (in `create element inet rollbox expose_tcp { 8080 : 10.200.0.6 . 80 }`)"
        );
    }

    #[test]
    fn hostname_entries_accept_their_sets() {
        let egress: Egress = "pypi.org:443,10.0.0.0/8,*.example.com,files.example.org:80-90"
            .parse()
            .unwrap();
        let script = render_up(&sandbox(&egress, &[]));
        for index in 0..3 {
            let set = format!("dns{index}_rbx0ac80004");
            let declared = script
                .find(&format!(
                    "add set inet rollbox {set} {{ type ipv4_addr; flags timeout; }}"
                ))
                .unwrap();
            let used = script.find(&format!("@{set}")).unwrap();
            assert!(declared < used, "{script}");
        }
        let chain: Vec<&str> = script
            .lines()
            .filter_map(|l| l.strip_prefix("add rule inet rollbox egress_rbx0ac80004 "))
            .collect();
        assert_eq!(
            &chain[3..],
            [
                "ip daddr @dns0_rbx0ac80004 meta l4proto { tcp, udp } th dport 443 accept",
                "ip daddr 10.0.0.0/8 accept",
                "ip daddr @dns1_rbx0ac80004 accept",
                "ip daddr @dns2_rbx0ac80004 meta l4proto { tcp, udp } th dport 80-90 accept",
                "drop",
            ]
        );
        // Down deletes the sets after the chains that use them.
        let down = render_down(&sandbox(&egress, &[]));
        let chain_gone = down
            .find("delete chain inet rollbox egress_rbx0ac80004")
            .unwrap();
        let set_gone = down
            .find("delete set inet rollbox dns2_rbx0ac80004")
            .unwrap();
        assert!(chain_gone < set_gone);
        // A change to one hostname entry: the chain refilled, set 0 emptied and refilled
        // with what is kept, sets 1 and 2 deleted after the flush.
        let new: Egress = "pypi.org:443".parse().unwrap();
        let keep = [
            Resolved {
                set: 0,
                addr: Ipv4Addr::new(151, 101, 0, 223),
                timeout_s: 50,
            },
            Resolved {
                set: 2,
                addr: Ipv4Addr::new(1, 2, 3, 4),
                timeout_s: 50,
            },
        ];
        let change = render_egress(&sandbox(&new, &[]), &egress, &keep);
        let lines: Vec<&str> = change.lines().collect();
        assert_eq!(lines[0], "flush chain inet rollbox egress_rbx0ac80004");
        assert!(change.contains("delete set inet rollbox dns1_rbx0ac80004"));
        assert!(change.contains("delete set inet rollbox dns2_rbx0ac80004"));
        assert!(change.contains("flush set inet rollbox dns0_rbx0ac80004"));
        assert!(change
            .contains("add element inet rollbox dns0_rbx0ac80004 { 151.101.0.223 timeout 50s }"));
        assert!(!change.contains("1.2.3.4"), "set 2 is gone: {change}");
        let listing = "table inet rollbox {\n\tset dns0_rbx0ac80004 {\n\t\ttype ipv4_addr\n\t\tflags timeout\n\t}\n\tset dns12_rbx0ac80008 {\n\t}\n\tset dnsx_rbx0ac8000c {\n\t}\n\tset guests {\n\t}\n}\n";
        assert_eq!(sandbox_chains(listing), ["rbx0ac80004", "rbx0ac80008"]);
        assert_eq!(
            delete_dns_sets_of(listing, "rbx0ac80008"),
            ["delete set inet rollbox dns12_rbx0ac80008"]
        );
    }
}
