//! `rollbox-bench linux-net`, part `daemon-net`: the throughput rounds of part `throughput`
//! on the network the daemon makes for a sandbox, not on a plain tap.
//!
//! The tap, its /30 and the nftables rules come from `rollbox::net::lease` with the request
//! the daemon builds (`rollbox/src/daemon/networks/mod.rs`): a tap link, egress `all`, guest
//! port 5201 exposed on 127.0.0.1 at a free host port. On that network a guest reaches none of
//! the host's own addresses (but a ping to its gateway), so:
//! - guest -> server: the bench's listener lives in network namespace `rbxbench-out` behind a
//!   veth pair (host side 10.199.SUBNET+1.1/30, server .2); the guest's traffic to it is
//!   forwarded and masqueraded, as a sandbox's `pip install` is. Under `all` the private
//!   ranges (10/8 among them) are dropped unless an entry names them, so the policy is
//!   `all,10.199.SUBNET+1.0/30`: the operator's opt-in for that one /30.
//! - host -> guest: the bench connects to 127.0.0.1:HOSTPORT, which the rules DNAT to the
//!   guest's 5201.
//!
//! The lease is released and the namespace removed on drop, on error too.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use rollbox::net::{self, Egress, LeaseRequest, LinkKind, NetInfo, Pool, StateDir};
use serde::Serialize;

use super::{
    check_qemu, run_rounds, throughput_table, Endpoints, GuestNic, NetBenchConfig, NetReport,
    NetVmmFigures, Rounds, GUEST_PORT,
};
use crate::linux::{host_cmd, LinuxBenchError};

/// The server's network namespace (`/var/run/netns/rbxbench-out`).
const NETNS: &str = "rbxbench-out";
/// The veth pair to it: this end on the host, the peer in the namespace.
const VETH_HOST: &str = "rbxbench-vo";
const VETH_NETNS: &str = "rbxbench-vi";
/// The lease's name (a sandbox id for the daemon).
const LEASE_NAME: &str = "rbxbench-daemon-net";

/// Part `daemon-net`'s figures, as `--json` writes them.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseNetFigures {
    /// The lease's egress policy.
    pub egress: String,
    /// The lease's tap, the guest's and the gateway's addresses.
    pub tap: String,
    pub guest_ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
    /// The server the guest sends to and pings (in a network namespace).
    pub server: Ipv4Addr,
    /// The host port on 127.0.0.1 forwarded to the guest's 5201.
    pub exposed_host_port: u16,
    pub rollbox: NetVmmFigures,
    pub qemu: NetVmmFigures,
}

/// The addresses of part `daemon-net` for `--subnet SUBNET`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    /// The pool the lease's /30 comes from: 10.199.SUBNET.0/30, one slot.
    pool: String,
    /// The veth's /30: 10.199.SUBNET+1.0/30, host .1, server .2.
    host: Ipv4Addr,
    server: Ipv4Addr,
    egress: String,
}

impl Plan {
    fn of(subnet: u8) -> Result<Plan, LinuxBenchError> {
        let next = subnet.checked_add(1).ok_or_else(|| {
            LinuxBenchError::Host(format!(
                "--subnet {subnet}: part daemon-net also needs 10.199.SUBNET+1.0/30 for its server; pass at most 254"
            ))
        })?;
        Ok(Plan {
            pool: format!("10.199.{subnet}.0/30"),
            host: Ipv4Addr::new(10, 199, next, 1),
            server: Ipv4Addr::new(10, 199, next, 2),
            egress: format!("all,10.199.{next}.0/30"),
        })
    }
}

/// Runs `f` on a thread that has joined the network namespace at `netns`; what it makes there
/// (a socket) stays in that namespace whichever thread uses it afterwards.
pub(super) fn in_netns<T: Send>(
    netns: &Path,
    f: impl FnOnce() -> Result<T, LinuxBenchError> + Send,
) -> Result<T, LinuxBenchError> {
    let file = File::open(netns).map_err(|source| LinuxBenchError::Io {
        what: "network namespace",
        path: netns.to_path_buf(),
        source,
    })?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: `file` is an open descriptor of a network namespace owned by this
                // closure for the call; setns changes only this thread's namespace, and this
                // thread ends when `f` returns.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                if rc != 0 {
                    return Err(LinuxBenchError::Io {
                        what: "joining network namespace",
                        path: netns.to_path_buf(),
                        source: std::io::Error::last_os_error(),
                    });
                }
                f()
            })
            .join()
            .map_err(|_| {
                LinuxBenchError::Host(format!(
                    "the thread in network namespace {} panicked",
                    netns.display()
                ))
            })?
    })
}

/// Network namespace [`NETNS`] with the server's end of a veth pair, a default route back
/// through the host's end. Removed on drop.
struct ServerNetns {
    path: PathBuf,
    server: Ipv4Addr,
}

impl ServerNetns {
    fn create(plan: &Plan) -> Result<ServerNetns, LinuxBenchError> {
        remove_netns();
        host_cmd("ip", &["netns", "add", NETNS])?;
        // From here on, drop removes it.
        let made = ServerNetns {
            path: Path::new("/var/run/netns").join(NETNS),
            server: plan.server,
        };
        host_cmd(
            "ip",
            &[
                "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NETNS, "netns",
                NETNS,
            ],
        )?;
        host_cmd(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/30", plan.host),
                "dev",
                VETH_HOST,
            ],
        )?;
        host_cmd("ip", &["link", "set", VETH_HOST, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["-n", NETNS];
            all.extend_from_slice(args);
            host_cmd("ip", &all)
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/30", plan.server),
            "dev",
            VETH_NETNS,
        ])?;
        inside(&["link", "set", VETH_NETNS, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        inside(&["route", "add", "default", "via", &plan.host.to_string()])?;
        Ok(made)
    }
}

/// Removes the namespace (and with it the veth pair) and the host's end, if there.
fn remove_netns() {
    let _ = Command::new("ip").args(["netns", "del", NETNS]).output();
    let _ = Command::new("ip").args(["link", "del", VETH_HOST]).output();
}

impl Drop for ServerNetns {
    fn drop(&mut self) {
        remove_netns();
    }
}

/// The lease `rollbox::net::lease` made, as the daemon asks for it. Released on drop.
struct DaemonNetwork {
    state: StateDir,
    info: NetInfo,
    host_port: u16,
    egress: Egress,
}

impl DaemonNetwork {
    /// `link`: a tap for the VMMs; a veth into a namespace stands in for the guest in tests.
    fn lease(
        plan: &Plan,
        state_dir: &Path,
        link: LinkKind,
    ) -> Result<DaemonNetwork, LinuxBenchError> {
        let fail = |what: &str, detail: String| {
            LinuxBenchError::Host(format!(
                "network {LEASE_NAME} (pool {}, state {}): {what}: {detail}",
                plan.pool,
                state_dir.display()
            ))
        };
        let pool = Pool::parse(&plan.pool).map_err(|e| fail("pool", e.to_string()))?;
        let egress: Egress = plan
            .egress
            .parse()
            .map_err(|e: net::policy::PolicyError| fail("egress", e.to_string()))?;
        let host_port = free_local_port().map_err(|e| fail("a free port on 127.0.0.1", e))?;
        let state = StateDir::new(state_dir);
        // A lease this state directory kept from an earlier run that stopped hard.
        let _ = net::release(&state, LEASE_NAME);
        // As `Networks::make` builds it: a tap, no DNS server (the bench resolves nothing),
        // the exposed port on 127.0.0.1 only.
        let request = LeaseRequest {
            name: LEASE_NAME.to_string(),
            pool,
            egress: egress.clone(),
            dns: None,
            expose: vec![(host_port, GUEST_PORT)],
            expose_on: vec![Ipv4Addr::LOCALHOST],
            link,
            resolver: false,
        };
        let info = net::lease(&state, &request).map_err(|e| fail("lease", e.to_string()))?;
        Ok(DaemonNetwork {
            state,
            info,
            host_port,
            egress,
        })
    }

    fn nic(&self) -> GuestNic {
        GuestNic {
            tap: self.info.tap.clone(),
            mac: self.info.guest_mac.clone(),
            kernel_arg: self.info.kernel_ip_arg.clone(),
        }
    }
}

impl Drop for DaemonNetwork {
    fn drop(&mut self) {
        if let Err(e) = net::release(&self.state, LEASE_NAME) {
            eprintln!("linux-net daemon-net: releasing network {LEASE_NAME}: {e}");
        }
    }
}

/// A TCP port on 127.0.0.1 nothing listens on now.
fn free_local_port() -> Result<u16, String> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// IP forwarding: `rollbox::net::lease` turns it on; checked, since the part measures it.
fn check_forwarding() -> Result<(), LinuxBenchError> {
    let path = Path::new("/proc/sys/net/ipv4/ip_forward");
    let value = std::fs::read_to_string(path).map_err(|source| LinuxBenchError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source,
    })?;
    if value.trim() != "1" {
        return Err(LinuxBenchError::Host(format!(
            "{} is {:?} after the lease: the guest's traffic is not forwarded",
            path.display(),
            value.trim()
        )));
    }
    Ok(())
}

/// The lease, the server's namespace and the transfers' ends, made and checked: what the
/// rounds need besides the guest. `state_dir` holds the lease.
struct Setup {
    // Dropped in this order: the lease, then the namespace.
    network: DaemonNetwork,
    server: ServerNetns,
}

impl Setup {
    fn make(subnet: u8, state_dir: &Path, link: LinkKind) -> Result<Setup, LinuxBenchError> {
        let plan = Plan::of(subnet)?;
        let network = DaemonNetwork::lease(&plan, state_dir, link)?;
        let server = ServerNetns::create(&plan)?;
        check_forwarding()?;
        Ok(Setup { network, server })
    }

    fn endpoints(&self) -> Endpoints {
        Endpoints {
            server: self.server.server,
            server_netns: Some(self.server.path.clone()),
            guest: SocketAddr::from((Ipv4Addr::LOCALHOST, self.network.host_port)),
        }
    }
}

/// Part `daemon-net`.
pub(super) fn run_daemon_net(
    config: &NetBenchConfig,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
) -> Result<LeaseNetFigures, LinuxBenchError> {
    check_qemu(config)?;
    let setup = Setup::make(config.subnet, &work.join("daemon-net-state"), LinkKind::Tap)?;
    let network = &setup.network;
    eprintln!(
        "linux-net daemon-net: tap {} guest {} gateway {}, egress {}, 127.0.0.1:{} -> {}:{GUEST_PORT}, server {} in netns {NETNS}",
        network.info.tap,
        network.info.guest_ip,
        network.info.host_ip,
        network.egress,
        network.host_port,
        network.info.guest_ip,
        setup.server.server
    );
    let (rollbox, qemu) = run_rounds(&Rounds {
        config,
        kernel,
        initramfs,
        work,
        nic: &network.nic(),
        ends: &setup.endpoints(),
        part: "daemon-net",
    })?;
    Ok(LeaseNetFigures {
        egress: network.egress.to_string(),
        tap: network.info.tap.clone(),
        guest_ip: network.info.guest_ip,
        gateway: network.info.host_ip,
        server: setup.server.server,
        exposed_host_port: network.host_port,
        rollbox,
        qemu,
    })
}

/// Part `daemon-net`'s table.
pub(super) fn markdown(out: &mut String, report: &NetReport, d: &LeaseNetFigures) {
    let heading = format!(
        "virtio-net on the daemon's network (`rollbox::net` lease, egress `{}`): rollbox-vmm beside QEMU microvm ({} MiB each way, {} pings, {} MiB guest, {} vCPUs; median (min–max) of {} rounds)",
        d.egress, report.mib, report.pings, report.memory_mib, report.vcpus, report.rounds
    );
    let names = [
        format!(
            "TCP guest → server {} in a netns (forwarded, masqueraded), MiB/s (higher is better)",
            d.server
        ),
        format!(
            "TCP host → guest via 127.0.0.1:{} (DNAT), MiB/s (higher is better)",
            d.exposed_host_port
        ),
        "ping guest → server (forwarded), avg ms".to_string(),
        "ping guest → server (forwarded), min ms".to_string(),
    ];
    throughput_table(out, &heading, names, &d.rollbox, &d.qemu);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_puts_the_server_in_the_next_30_and_opts_it_in() {
        let plan = Plan::of(250).expect("plan of subnet 250");
        assert_eq!(plan.pool, "10.199.250.0/30");
        assert_eq!(plan.host, Ipv4Addr::new(10, 199, 251, 1));
        assert_eq!(plan.server, Ipv4Addr::new(10, 199, 251, 2));
        let egress: Egress = plan.egress.parse().expect("the egress policy parses");
        assert!(matches!(&egress, Egress::All(entries) if entries.len() == 1));
        assert!(Pool::parse(&plan.pool).expect("the pool parses").slots() == 1);
        let error = Plan::of(255)
            .expect_err("subnet 255 has no next /30")
            .to_string();
        assert!(error.contains("--subnet 255"), "{error}");
    }

    /// A network namespace standing in for the guest; removed on drop.
    struct GuestNetns(&'static str);

    impl Drop for GuestNetns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", self.0]).output();
        }
    }

    /// Sends `text` over `conn` and returns what `listener` accepted, and from where.
    fn send(
        listener: &TcpListener,
        conn: impl FnOnce() -> std::io::Result<std::net::TcpStream>,
    ) -> (String, SocketAddr) {
        use std::io::{Read, Write};
        let mut out = conn().expect("connect");
        out.write_all(b"hello").expect("send");
        drop(out);
        let (mut conn, peer) = listener.accept().expect("accept");
        let mut got = String::new();
        conn.read_to_string(&mut got).expect("receive");
        (got, peer)
    }

    /// The host side as root, with a veth into a namespace as the guest (what
    /// `rollbox::net`'s own tests do; the rules are the tap's): lease, server namespace, the
    /// guest's connection to the server forwarded and masqueraded, the host's to
    /// 127.0.0.1:HOSTPORT reaching the guest's 5201; then everything gone. It changes the
    /// host's network (table inet rollbox, namespaces, links), so it runs only when asked:
    /// `sudo cargo test -p rollbox-bench daemon_net_setup -- --ignored`.
    #[test]
    #[ignore]
    fn daemon_net_setup_and_teardown() {
        use std::net::TcpStream;

        let dir = std::env::temp_dir().join(format!("rbxbench-daemon-net-{}", std::process::id()));
        let guest_ns = GuestNetns("rbxbench-guest");
        let _ = Command::new("ip")
            .args(["netns", "del", guest_ns.0])
            .output();
        host_cmd("ip", &["netns", "add", guest_ns.0]).expect("ip netns add");
        let guest_path = Path::new("/var/run/netns").join(guest_ns.0);
        let link = LinkKind::Veth {
            netns: guest_ns.0.to_string(),
        };
        let setup = Setup::make(240, &dir, link).expect("lease and namespace");
        let tap = setup.network.info.tap.clone();
        let guest_ip = setup.network.info.guest_ip;
        assert_eq!(guest_ip, Ipv4Addr::new(10, 199, 240, 2));
        assert!(setup
            .network
            .info
            .kernel_ip_arg
            .starts_with("ip=10.199.240.2::10.199.240.1:255.255.255.252::eth0:off"));
        let ends = setup.endpoints();

        // Guest -> server: forwarded, and masqueraded to the host's end of the veth.
        let listener = super::super::listen(&ends).expect("a listener in the namespace");
        let port = listener
            .local_addr()
            .expect("the listener's address")
            .port();
        let (got, peer) = send(&listener, || {
            in_netns(&guest_path, || {
                TcpStream::connect((ends.server, port))
                    .map_err(|e| LinuxBenchError::Host(e.to_string()))
            })
            .map_err(std::io::Error::other)
        });
        assert_eq!(got, "hello");
        assert_eq!(
            peer.ip(),
            std::net::IpAddr::V4(Ipv4Addr::new(10, 199, 241, 1))
        );

        // Host -> guest: 127.0.0.1:HOSTPORT, DNAT'd to the guest's 5201.
        let in_guest = in_netns(&guest_path, || {
            TcpListener::bind((guest_ip, GUEST_PORT))
                .map_err(|e| LinuxBenchError::Host(e.to_string()))
        })
        .expect("a listener in the guest");
        let (got, _) = send(&in_guest, || TcpStream::connect(ends.guest));
        assert_eq!(got, "hello");

        let rules = net::nft::list_table()
            .expect("nft list table")
            .unwrap_or_default();
        assert!(rules.contains(&tap), "{rules}");
        drop(setup);
        let rules = net::nft::list_table()
            .expect("nft list table")
            .unwrap_or_default();
        assert!(!rules.contains(&tap), "{rules}");
        assert!(!Path::new("/var/run/netns").join(NETNS).exists());
        let links = host_cmd("ip", &["link"]).expect("ip link");
        assert!(
            !links.contains(VETH_HOST) && !links.contains(&tap),
            "{links}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
