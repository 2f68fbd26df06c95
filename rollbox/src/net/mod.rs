//! Per-sandbox host networking: a tap with a /30 from a pool, NAT to the uplink, and an egress
//! policy in nftables. Design and rules: docs/networking.md.
//!
//! The library boundary (what `rollbox net` calls, and what the daemon will call):
//! - [`lease`]: a sandbox's tap (or a test veth) and /30 from a pool, NAT, its egress policy
//!   and its exposed ports, all from one typed [`LeaseRequest`], applied at once; the answer,
//!   [`NetInfo`], is what the VMM and the guest need.
//! - [`release`]: removes exactly what a lease made; [`leases`] lists them.
//! - [`gc`]: removes what sandboxes whose state is gone left behind in a pool.
//!
//! [`LeaseRequest::parse`] reads the CLI's text ([`UpOptions`]); the modules below are the
//! parts: `cidr`, `policy` (egress), `pool` (leases on disk), `tap`, `nft`; and `resolver`
//! (with `dns`), the daemon's DNS server for policies that name hostnames.

pub mod cidr;
pub mod dns;
mod gc;
mod lease;
pub mod nft;
pub mod policy;
pub mod pool;
pub mod resolver;
pub mod tap;
mod tool;

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::Serialize;

pub use gc::gc;
pub use lease::{lease, leases, release, set_egress};
pub use policy::Egress;
pub use pool::{Lease, LinkKind, Pool, StateDir};

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
    #[error("sandbox `{0}` has no network lease (or its `up` has not finished)")]
    NoLease(String),
    #[error("--dns `{0}` is not an IPv4 address")]
    BadDns(String),
    #[error("egress policy `{0}` names hostnames: only `rollbox serve` resolves them (its resolver is the guest's DNS server); `rollbox net up` takes CIDRs")]
    HostnamesNeedResolver(String),
    #[error("sandbox `{0}` has no resolver (its DNS server is not its gateway: its policy at create named no hostname), so its policy cannot name hostnames; create it with one")]
    NoResolver(String),
    #[error("--expose `{token}`: {reason}")]
    BadExpose { token: String, reason: String },
    #[error("--expose-on `{0}` is not one IPv4 address of this host (such as 127.0.0.1)")]
    BadExposeOn(String),
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

/// What `rollbox net up` is asked for, as its flags give it (text).
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub name: String,
    pub pool: String,
    pub egress: String,
    pub dns: Option<String>,
    pub expose: Vec<String>,
    /// The host addresses the ports are exposed on; none: every local address but loopback.
    pub expose_on: Vec<String>,
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

/// A lease, typed: what [`lease`] makes.
#[derive(Debug, Clone)]
pub struct LeaseRequest {
    /// The sandbox's name (it names the lease in the state directory).
    pub name: String,
    /// The pool its /30 comes from.
    pub pool: Pool,
    pub egress: Egress,
    /// A DNS server the guest may reach (port 53), also in the kernel's `ip=` argument.
    pub dns: Option<Ipv4Addr>,
    /// (host port, guest port) pairs forwarded to the guest (TCP).
    pub expose: Vec<(u16, u16)>,
    /// The host addresses they are on (127.0.0.1 for the host itself); empty: every local
    /// address but loopback.
    pub expose_on: Vec<Ipv4Addr>,
    pub link: LinkKind,
    /// The guest's DNS server is its gateway, where the daemon's resolver answers for the
    /// policy's hostnames (`dns` is then ignored); a policy with hostnames needs it.
    pub resolver: bool,
}

impl LeaseRequest {
    /// The request of `rollbox net up`'s flags. Everything is checked before anything is made:
    /// the name first, then the pool, the policy, the DNS server and the ports.
    pub fn parse(options: &UpOptions) -> Result<LeaseRequest, NetError> {
        check_name(&options.name)?;
        let pool = Pool::parse(&options.pool)?;
        let egress: Egress = options.egress.parse()?;
        if egress.has_hosts() {
            return Err(NetError::HostnamesNeedResolver(egress.to_string()));
        }
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
        let mut expose_on = Vec::new();
        for text in &options.expose_on {
            let addr = text
                .parse::<Ipv4Addr>()
                .ok()
                .filter(|a| !a.is_unspecified() && !a.is_multicast() && !a.is_broadcast())
                .ok_or_else(|| NetError::BadExposeOn(text.clone()))?;
            if !expose_on.contains(&addr) {
                expose_on.push(addr);
            }
        }
        Ok(LeaseRequest {
            name: options.name.clone(),
            pool,
            egress,
            dns,
            expose,
            expose_on,
            link: options.link.clone(),
            resolver: false,
        })
    }
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
