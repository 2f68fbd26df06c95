//! The networks service: a sandbox that asks for a network gets a host tap with a /30 of the
//! server's pool, NAT to the uplink and its egress policy in nftables, all made by
//! `rollbox::net` (the library `rollbox net` wraps). The tap is attached here, in the host's
//! network namespace, and its descriptor handed to the jailed VMM (`rollbox-vmm --tap-fd`),
//! which lives in an empty namespace of its own: it cannot reach any other tap, and nothing
//! else attaches this one. Leases are named by sandbox id in the net state directory that
//! `rollbox net list`/`gc` read; a restarted daemon releases those of sandboxes that ended.
//! A sandbox whose policy names hostnames also gets a resolver on its gateway
//! (`rollbox::net::resolver`), which lives here while the sandbox does.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use super::api::{ApiError, ExposedPort, NetworkRequest, SandboxNetwork};
use crate::net::resolver::{Resolver, ResolverOptions, Site};
use crate::net::{self, Egress, LeaseRequest, LinkKind, NetError, Pool, StateDir};

/// How `rollbox serve` makes networks.
#[derive(Debug, Clone)]
pub struct NetworkOptions {
    /// Where leases are recorded (`--net-state-dir`; `rollbox net`'s default).
    pub state_dir: PathBuf,
    /// The /30s come from here (`--net-pool`).
    pub pool: Pool,
    /// The DNS server guests are given, and may reach, unless their egress is `none` or
    /// names hostnames (then it is their gateway, the resolver).
    pub dns: Option<Ipv4Addr>,
    /// Where the resolvers of policies with hostnames ask (`--sandbox-dns`, else the host's
    /// nameserver, loopback ones included); none: such policies are a 503.
    pub upstream: Option<SocketAddr>,
    /// The egress of a `network` that names none (`--default-egress`).
    pub default_egress: Egress,
    /// Exposed ports are on 127.0.0.1, and on this address too (`--publish`): only then are
    /// they reachable from other hosts.
    pub publish: Option<Ipv4Addr>,
    /// The host ports exposed guest ports get (`--expose-port-range`), inclusive.
    pub port_range: (u16, u16),
}

/// How many times a create tries other host ports when another daemon sharing the host took
/// the ones it picked meanwhile.
const PORT_ATTEMPTS: usize = 8;

/// A network made for a sandbox: what its JSON shows, and the tap attached for its VMM.
pub struct Made {
    pub network: SandboxNetwork,
    /// /dev/net/tun attached to the tap (TUNSETIFF done), for `rollbox-vmm --tap-fd`.
    pub tap: File,
    /// The kernel's `ip=` argument for a boot.
    pub kernel_ip_arg: String,
}

/// The networks of the sandboxes.
pub struct Networks {
    options: NetworkOptions,
    state: StateDir,
    /// Why this host cannot make networks (no nft, no /dev/net/tun), if it cannot.
    unavailable: Option<String>,
    /// Held while host ports are picked and leased; the next port to try.
    next_port: Mutex<u16>,
    /// The resolvers of sandboxes whose policy at create named hostnames, by sandbox id.
    resolvers: Mutex<HashMap<String, Arc<Resolver>>>,
    /// Where resolvers run (the daemon's runtime; none outside one).
    runtime: Option<tokio::runtime::Handle>,
}

impl Networks {
    pub fn new(options: NetworkOptions) -> Networks {
        let unavailable = if !std::path::Path::new("/dev/net/tun").exists() {
            Some("this host has no /dev/net/tun".to_string())
        } else {
            net::nft::binary().err().map(|e| e.to_string())
        };
        Networks {
            state: StateDir::new(&options.state_dir),
            next_port: Mutex::new(options.port_range.0),
            options,
            unavailable,
            resolvers: Mutex::new(HashMap::new()),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// Starts sandbox `id`'s resolver, on its gateway.
    fn start_resolver(&self, id: &str, site: Site, egress: &Egress) -> Result<(), ApiError> {
        let (Some(upstream), Some(runtime)) = (self.options.upstream, &self.runtime) else {
            return Err(ApiError::Unavailable(format!(
                "network of sandbox {id}: its egress names hostnames, and this server has no upstream DNS server for them (--sandbox-dns, or a nameserver in /etc/resolv.conf)"
            )));
        };
        let resolver = Resolver::start(
            site,
            egress.clone(),
            ResolverOptions::new(upstream),
            runtime,
        )
        .map_err(|e| ApiError::Unavailable(format!("network of sandbox {id}: {e}")))?;
        self.resolvers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.to_string(), Arc::new(resolver));
        Ok(())
    }

    fn resolver(&self, id: &str) -> Option<Arc<Resolver>> {
        self.resolvers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// The egress a request gets: its own, else the server's default.
    pub fn egress(&self, request: &NetworkRequest) -> Result<Egress, ApiError> {
        match &request.egress {
            Some(text) => text
                .parse()
                .map_err(|e| ApiError::BadRequest(format!("network.egress: {e}"))),
            None => Ok(self.options.default_egress.clone()),
        }
    }

    /// A create's check before anything is made: this host can make networks, and the
    /// policy parses.
    pub fn check(&self, request: &NetworkRequest) -> Result<(), ApiError> {
        if let Some(why) = &self.unavailable {
            return Err(ApiError::Unavailable(format!(
                "network: {why}; sandboxes without `network` still work"
            )));
        }
        self.egress(request).map(drop)
    }

    /// Makes sandbox `id`'s network (tap, /30, NAT, egress rules, lease) and attaches its tap;
    /// on error nothing of it is left. Blocking (it runs `nft` and ioctls).
    pub fn make(&self, id: &str, request: &NetworkRequest) -> Result<Made, ApiError> {
        let egress = self.egress(request)?;
        // Hostnames need the resolver on the gateway, which asks the upstream.
        let resolver = egress.has_hosts();
        if resolver && (self.options.upstream.is_none() || self.runtime.is_none()) {
            return Err(ApiError::Unavailable(format!(
                "network of sandbox {id}: network.egress names hostnames, and this server has no upstream DNS server for them (--sandbox-dns, or a nameserver in /etc/resolv.conf)"
            )));
        }
        // DNS is a way out too: under `none` the guest gets none.
        let dns = self.options.dns.filter(|_| egress != Egress::None);
        let mut lease = LeaseRequest {
            name: id.to_string(),
            pool: self.options.pool,
            egress: egress.clone(),
            dns,
            expose: Vec::new(),
            expose_on: std::iter::once(Ipv4Addr::LOCALHOST)
                .chain(self.options.publish)
                .collect(),
            link: LinkKind::Tap,
            resolver,
        };
        let info = if request.expose.is_empty() {
            net::lease(&self.state, &lease)
        } else {
            // One create at a time picks host ports; one another daemon took meanwhile
            // fails the lease whole (nothing made), and the next pick skips it.
            let mut next_port = self
                .next_port
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut taken = HashSet::new();
            let mut attempt = 0;
            loop {
                lease.expose = self.pick_ports(id, &request.expose, &mut next_port, &taken)?;
                match net::lease(&self.state, &lease) {
                    Err(NetError::Nft(net::nft::NftError::PortTaken { port, .. }))
                        if attempt + 1 < PORT_ATTEMPTS =>
                    {
                        taken.insert(port);
                        attempt += 1;
                    }
                    other => break other,
                }
            }
        };
        let info = info.map_err(|e| lease_error(id, e))?;
        let dns = if resolver { Some(info.host_ip) } else { dns };
        if resolver {
            let site = Site {
                tap: info.tap.clone(),
                host_ip: info.host_ip,
                guest_ip: info.guest_ip,
            };
            if let Err(e) = self.start_resolver(id, site, &egress) {
                self.release(id);
                return Err(e);
            }
        }
        let host_address = self.options.publish.unwrap_or(Ipv4Addr::LOCALHOST);
        let ports = lease
            .expose
            .iter()
            .map(|&(host_port, port)| ExposedPort {
                port,
                host_address,
                host_port,
            })
            .collect();
        let tap = match net::tap::open_tap(&info.tap) {
            Ok(tap) => tap,
            Err(e) => {
                let message = format!("network of sandbox {id}: attaching tap {}: {e}", info.tap);
                if let Err(e) = net::release(&self.state, id) {
                    log::warn!("sandbox {id}: releasing its network: {e}");
                }
                return Err(ApiError::Internal(message));
            }
        };
        Ok(Made {
            network: SandboxNetwork {
                egress: egress.to_string(),
                address: info.guest_ip,
                gateway: info.host_ip,
                prefix_len: info.prefix_len,
                mac: info.guest_mac,
                tap: info.tap,
                dns,
                ports,
            },
            tap,
            kernel_ip_arg: info.kernel_ip_arg,
        })
    }

    /// Host ports for `guest_ports`, from the range onwards of `next`: none that a lease in
    /// the state directory has, that a process on this host listens on, or that is in
    /// `taken`. Moves `next` past them.
    fn pick_ports(
        &self,
        id: &str,
        guest_ports: &[u16],
        next: &mut u16,
        taken: &HashSet<u16>,
    ) -> Result<Vec<(u16, u16)>, ApiError> {
        let (low, high) = self.options.port_range;
        let leased: HashSet<u16> = net::leases(&self.state)
            .map_err(|e| lease_error(id, e))?
            .iter()
            .flat_map(|lease| lease.expose.iter().map(|(host, _)| *host))
            .collect();
        let size = usize::from(high - low) + 1;
        let mut candidate = (*next).clamp(low, high);
        let mut picked = Vec::with_capacity(guest_ports.len());
        for _ in 0..size {
            let port = candidate;
            candidate = if candidate == high {
                low
            } else {
                candidate + 1
            };
            if leased.contains(&port) || taken.contains(&port) || !free_on_host(port) {
                continue;
            }
            picked.push((port, guest_ports[picked.len()]));
            if picked.len() == guest_ports.len() {
                *next = candidate;
                return Ok(picked);
            }
        }
        Err(ApiError::Unavailable(format!(
            "network of sandbox {id}: no free host port for {} exposed port(s) in --expose-port-range {low}-{high}",
            guest_ports.len()
        )))
    }

    /// Replaces sandbox `id`'s egress policy (one nftables transaction; its resolver, if it
    /// has one, keeps what it answered for names still allowed). Blocking.
    pub fn set_egress(&self, id: &str, egress: &Egress) -> Result<(), ApiError> {
        let apply = |keep: &[net::nft::Resolved]| net::set_egress(&self.state, id, egress, keep);
        let result = match self.resolver(id) {
            Some(resolver) => resolver.set_egress(egress, apply),
            None => apply(&[]),
        };
        result.map(drop).map_err(|e| match e {
            NetError::NoResolver(_) => ApiError::Conflict(format!("network.egress: {e}")),
            e => lease_error(id, e),
        })
    }

    /// Attaches sandbox `id`'s tap again (for a new VMM of the same sandbox). Blocking.
    pub fn attach(&self, id: &str, tap: &str) -> Result<File, ApiError> {
        net::tap::open_tap(tap).map_err(|e| {
            ApiError::Internal(format!("network of sandbox {id}: attaching tap {tap}: {e}"))
        })
    }

    /// Removes sandbox `id`'s network, if it has one (its resolver first). Blocking.
    pub fn release(&self, id: &str) {
        self.resolvers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
        match net::release(&self.state, id) {
            Ok(_) => {}
            Err(e) => log::warn!("sandbox {id}: releasing its network: {e}"),
        }
    }

    /// After a restart: releases the leases of this daemon's sandboxes that are not live
    /// (`ours` tells its sandboxes from another daemon's sharing the state directory), and
    /// returns their names; live ones whose DNS server is their gateway get their resolver
    /// again (what their sets hold stays until it expires).
    pub fn reconcile(&self, live: &HashSet<String>, ours: impl Fn(&str) -> bool) -> Vec<String> {
        let leases = match net::leases(&self.state) {
            Ok(leases) => leases,
            Err(e) => {
                log::warn!("networks: listing leases: {e}");
                return Vec::new();
            }
        };
        let mut released = Vec::new();
        for lease in leases {
            if live.contains(&lease.name) && lease.dns == Some(lease.host_ip) {
                let egress = lease.egress.parse().unwrap_or(Egress::None);
                let site = Site {
                    tap: lease.tap.clone(),
                    host_ip: lease.host_ip,
                    guest_ip: lease.guest_ip,
                };
                if let Err(e) = self.start_resolver(&lease.name, site, &egress) {
                    log::warn!("sandbox {}: its resolver: {e}", lease.name);
                }
            }
            if live.contains(&lease.name) || !ours(&lease.name) {
                continue;
            }
            self.release(&lease.name);
            released.push(lease.name);
        }
        released
    }
}

/// Whether no process on this host listens on TCP `port` (an exposed port would hide it).
fn free_on_host(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
}

/// The host's first IPv4 nameserver in /etc/resolv.conf that a guest can reach (not a
/// loopback address, such as systemd-resolved's 127.0.0.53).
pub fn host_dns() -> Option<Ipv4Addr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    first_nameserver(&text)
}

/// The host's first IPv4 nameserver in /etc/resolv.conf, loopback ones included: where the
/// resolvers ask when `--sandbox-dns` names none.
pub fn host_resolver() -> Option<Ipv4Addr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<Ipv4Addr>().ok())
        .find(|ip| !ip.is_unspecified())
}

fn first_nameserver(resolv_conf: &str) -> Option<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|line| line.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<Ipv4Addr>().ok())
        .find(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

/// A lease's failure as the API answers it: an exhausted or clashing pool and a missing tool
/// are the host's state (503), bad input was checked before.
fn lease_error(id: &str, error: NetError) -> ApiError {
    let message = format!("network of sandbox {id}: {error}");
    match error {
        NetError::Pool(_) | NetError::PoolInUse { .. } | NetError::Nft(_) => {
            ApiError::Unavailable(message)
        }
        _ => ApiError::Internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn networks(default_egress: &str) -> Networks {
        Networks::new(NetworkOptions {
            state_dir: PathBuf::from("/nonexistent/rollbox-net-test"),
            pool: Pool::parse("10.250.0.0/24").expect("pool"),
            dns: Some(Ipv4Addr::new(1, 1, 1, 1)),
            upstream: None,
            default_egress: default_egress.parse().expect("egress"),
            publish: None,
            port_range: (20000, 20002),
        })
    }

    #[test]
    fn a_create_takes_what_its_network_leaves_out_from_the_template() {
        let template = NetworkRequest {
            egress: Some("all".into()),
            expose: vec![8080],
        };
        let asked = NetworkRequest::default();
        assert_eq!(asked.over(&template), template);
        let asked = NetworkRequest {
            egress: Some("none".into()),
            expose: vec![22],
        };
        assert_eq!(asked.over(&template), asked);
    }

    #[test]
    fn the_first_reachable_nameserver_is_the_guests() {
        let conf = "# comment\nnameserver 127.0.0.53\nnameserver fe80::1\nnameserver 10.0.0.2\nnameserver 8.8.8.8\n";
        assert_eq!(first_nameserver(conf), Some(Ipv4Addr::new(10, 0, 0, 2)));
        assert_eq!(first_nameserver("nameserver 127.0.0.1\n"), None);
    }

    #[test]
    fn a_request_without_egress_takes_the_default_and_a_bad_one_names_the_field() {
        let nets = networks("none");
        assert_eq!(
            nets.egress(&NetworkRequest::default()).ok(),
            Some(Egress::None)
        );
        let all = NetworkRequest {
            egress: Some("all".into()),
            ..NetworkRequest::default()
        };
        assert_eq!(
            nets.egress(&all).map(|e| e.to_string()).ok(),
            Some("all".to_string())
        );
        let bad = NetworkRequest {
            egress: Some("10.0.0.0/99".into()),
            ..NetworkRequest::default()
        };
        let err = nets.egress(&bad).expect_err("bad");
        assert!(err.to_string().starts_with("network.egress: "), "{err}");
    }
}
