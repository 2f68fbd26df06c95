//! `rollbox net` against the real kernel: taps, nftables and leases on this host (root, with
//! /dev/net/tun and nft). Each test uses its own pool, state directory and names, so they run
//! in parallel, and a guard removes what a test made even when it fails.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rollbox_tests::netns::{connect, in_netns, ip, nft_table, prerequisites, Listener, Netns};
use serde_json::Value;

fn rollbox() -> PathBuf {
    rollbox_tests::rollbox_binary()
}

/// One test's pool and state directory. Dropping it takes down every sandbox it brought up
/// and runs `gc` over its pool.
struct Net {
    pool: String,
    state: tempfile::TempDir,
    names: Vec<String>,
}

impl Net {
    fn new(pool: &str) -> Net {
        let net = Net {
            pool: pool.to_string(),
            state: tempfile::tempdir().unwrap(),
            names: Vec::new(),
        };
        // Leftovers of an earlier, killed run of the same test.
        net.run(&["gc", "--pool", pool]);
        net
    }

    fn state(&self) -> &Path {
        self.state.path()
    }

    /// `rollbox net ARGS --state-dir DIR`.
    fn run(&self, args: &[&str]) -> Output {
        self.run_env(args, &[])
    }

    fn run_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(rollbox());
        cmd.arg("net")
            .args(args)
            .arg("--state-dir")
            .arg(self.state());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    /// `up NAME --pool POOL EXTRA...`, which must succeed; returns its JSON.
    fn up(&mut self, name: &str, extra: &[&str]) -> Value {
        self.names.push(name.to_string());
        let mut args = vec!["up", name, "--pool", &self.pool];
        args.extend(extra);
        let out = self.run(&args);
        assert!(
            out.status.success(),
            "up {name} {extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `up` that must fail; returns its stderr, after checking it is one `error:` line.
    fn up_fails(&self, name: &str, extra: &[&str], env: &[(&str, &str)]) -> String {
        let mut args = vec!["up", name];
        if !extra.contains(&"--pool") {
            args.extend(["--pool", &self.pool]);
        }
        args.extend(extra);
        let out = self.run_env(&args, env);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "up {name} {extra:?} succeeded");
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            stderr.starts_with("error: ") && stderr.trim_end().lines().count() == 1,
            "not one error line: {stderr:?}"
        );
        stderr
    }

    fn down(&self, name: &str) {
        let out = self.run(&["down", name]);
        assert!(
            out.status.success(),
            "down {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The lease files and name claims in the state directory.
    fn state_files(&self) -> Vec<String> {
        let mut files = Vec::new();
        for dir in ["leases", "names"] {
            if let Ok(entries) = std::fs::read_dir(self.state().join(dir)) {
                for entry in entries {
                    files.push(format!(
                        "{dir}/{}",
                        entry.unwrap().file_name().to_string_lossy()
                    ));
                }
            }
        }
        files
    }

    /// Asserts nothing of this pool is left: no interface, no nftables chain or element, no
    /// lease file.
    fn assert_clean(&self) {
        let pool: rollbox::net::Pool = rollbox::net::Pool::parse(&self.pool).unwrap();
        let taps = our_taps(&pool);
        assert!(taps.is_empty(), "interfaces left: {taps:?}");
        let table = nft_table();
        let prefix = pool_prefix(&self.pool);
        let left: Vec<&str> = table
            .lines()
            .filter(|l| {
                taps_in(l).iter().any(|t| {
                    rollbox::net::pool::slot_of_tap(t)
                        .is_some_and(|s| pool.net().contains(s.guest_ip()))
                }) || l.contains(&prefix)
            })
            .collect();
        assert!(left.is_empty(), "nftables lines left: {left:?}\n{table}");
        assert_eq!(self.state_files(), Vec::<String>::new());
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = self.run(&["down", name]);
        }
        let _ = self.run(&["gc", "--pool", &self.pool]);
    }
}

/// `10.231.` for pool 10.231.0.0/16: a string that only this pool's addresses contain.
fn pool_prefix(pool: &str) -> String {
    let octets: Vec<&str> = pool.split('.').collect();
    format!(" {}.{}.{}.", octets[0], octets[1], octets[2])
}

/// Interface names of the form rbxXXXXXXXX in a line.
fn taps_in(line: &str) -> Vec<String> {
    line.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.len() == 11 && w.starts_with("rbx"))
        .map(str::to_string)
        .collect()
}

/// This pool's interfaces on the host (`ip -br link`).
fn our_taps(pool: &rollbox::net::Pool) -> Vec<String> {
    let out = Command::new("ip").args(["-br", "link"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|name| name.split('@').next().unwrap_or(name).to_string())
        .filter(|name| {
            rollbox::net::pool::slot_of_tap(name).is_some_and(|s| pool.net().contains(s.guest_ip()))
        })
        .collect()
}

fn ip_brief_addr(dev: &str) -> String {
    let out = Command::new("ip")
        .args(["-br", "addr", "show", "dev", dev])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn up_creates_tap_rules_and_lease_and_down_removes_them() {
    if !prerequisites("up_creates_tap_rules_and_lease_and_down_removes_them") {
        return;
    }
    let mut net = Net::new("10.231.0.0/24");
    let info = net.up(
        "basic",
        &[
            "--egress",
            "10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90",
            "--dns",
            "1.1.1.1",
            "--expose",
            "23101:80",
        ],
    );
    assert_eq!(info["name"], "basic");
    assert_eq!(info["tap"], "rbx0ae70000");
    assert_eq!(info["host_ip"], "10.231.0.1");
    assert_eq!(info["guest_ip"], "10.231.0.2");
    assert_eq!(info["prefix_len"], 30);
    assert_eq!(info["guest_mac"], "06:00:0a:e7:00:02");
    assert_eq!(
        info["kernel_ip_arg"],
        "ip=10.231.0.2::10.231.0.1:255.255.255.252::eth0:off:1.1.1.1"
    );
    assert_eq!(
        info["egress"],
        "10.0.0.0/8:443,1.1.1.1,192.168.0.0/16:80-90"
    );

    // The tap: up, with the host address, and opening as the VMM opens it (vnet header).
    let addr = ip_brief_addr("rbx0ae70000");
    assert!(addr.contains("10.231.0.1/30"), "{addr}");
    let details = Command::new("ip")
        .args(["-d", "link", "show", "rbx0ae70000"])
        .output()
        .unwrap();
    let details = String::from_utf8_lossy(&details.stdout);
    assert!(details.contains(",UP"), "{details}");
    assert!(
        details.contains("tap")
            && details.contains("vnet_hdr on")
            && details.contains("persist on"),
        "{details}"
    );
    drop(rollbox::net::tap::open_tap("rbx0ae70000").unwrap());
    assert!(
        rollbox::net::tap::exists("rbx0ae70000"),
        "closing it left it (persistent)"
    );
    // Held open below, as a running VMM holds it, while `down` removes it.
    let vmm_side = rollbox::net::tap::open_tap("rbx0ae70000").unwrap();
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        "1"
    );

    // The rules and the lease.
    let table = nft_table();
    for want in [
        "chain egress_rbx0ae70000",
        "chain host_rbx0ae70000",
        "\"rbx0ae70000\" : jump egress_rbx0ae70000",
        "23101 : 10.231.0.2 . 80",
        "ip daddr 192.168.0.0/16 meta l4proto { tcp, udp } th dport 80-90 accept",
        "masquerade",
    ] {
        assert!(table.contains(want), "no `{want}` in\n{table}");
    }
    let mut files = net.state_files();
    files.sort();
    assert_eq!(files, ["leases/10.231.0.0.json", "names/basic"]);
    let list: Value = serde_json::from_slice(&net.run(&["list"]).stdout).unwrap();
    assert_eq!(list[0]["name"], "basic");
    assert_eq!(list[0]["complete"], true);
    // ROLLBOX_NET_STATE names the state directory when --state-dir is not given.
    let out = Command::new(rollbox())
        .args(["net", "list"])
        .env("ROLLBOX_NET_STATE", net.state())
        .output()
        .unwrap();
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["name"], "basic");

    // A second `up` of the same name is refused and changes nothing.
    let error = net.up_fails("basic", &[], &[]);
    assert!(
        error.contains("sandbox basic already has a network"),
        "{error}"
    );
    // Another sandbox can't take the same host port.
    let error = net.up_fails("other", &["--expose", "23101:22"], &[]);
    assert!(
        error.contains("host port 23101 is already exposed (to 10.231.0.2:80)"),
        "{error}"
    );
    assert_eq!(net.state_files().len(), 2);

    net.down("basic");
    net.assert_clean();
    drop(vmm_side);
    // Idempotent.
    net.down("basic");
    net.assert_clean();
}

#[test]
fn two_hundred_networked_sandbox_cycles_leave_nothing_behind() {
    if !prerequisites("two_hundred_networked_sandbox_cycles_leave_nothing_behind")
        || !rollbox_tests::kvm_available()
    {
        return;
    }
    let mut net = Net::new("10.232.0.0/24");
    let (mut up_total, mut down_total) = (Duration::ZERO, Duration::ZERO);
    let cycles = 200;
    for i in 0..cycles {
        let name = format!("cycle{}", i % 3);
        let started = Instant::now();
        let info = net.up(
            &name,
            &["--egress", "10.0.0.0/8:443,1.1.1.1", "--expose", "23201:80"],
        );
        up_total += started.elapsed();
        assert_eq!(info["guest_ip"], "10.232.0.2", "the freed /30 is reused");
        // A real sandbox on the tap: rollbox-vmm with the test guest, its virtio-net attached.
        let tap = info["tap"].as_str().expect("tap");
        let mac = info["guest_mac"].as_str().expect("guest_mac");
        let mut vm = rollbox_tests::Vm::boot(&["--net", &format!("{tap},mac={mac}")]);
        let _ = vm.child.kill();
        let _ = vm.child.wait();
        let started = Instant::now();
        net.down(&name);
        down_total += started.elapsed();
        net.names.pop();
    }
    net.assert_clean();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0 / f64::from(cycles);
    eprintln!(
        "rollbox net: {cycles} cycles with a VM on the tap each, mean {:.1} ms per up, {:.1} ms per down (debug build, process start included)",
        ms(up_total),
        ms(down_total)
    );
}

#[test]
fn concurrent_ups_get_distinct_subnets() {
    if !prerequisites("concurrent_ups_get_distinct_subnets") {
        return;
    }
    let mut net = Net::new("10.233.0.0/24");
    let children: Vec<_> = (0..8)
        .map(|i| {
            let name = format!("par{i}");
            net.names.push(name.clone());
            Command::new(rollbox())
                .args(["net", "up", &name, "--pool", &net.pool, "--state-dir"])
                .arg(net.state())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ips: Vec<String> = children
        .into_iter()
        .map(|child| {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let info: Value = serde_json::from_slice(&out.stdout).unwrap();
            info["guest_ip"].as_str().unwrap().to_string()
        })
        .collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), 8, "{ips:?}");
    for i in 0..8 {
        net.down(&format!("par{i}"));
    }
    net.assert_clean();
}

#[test]
fn an_exhausted_pool_is_a_clear_error() {
    if !prerequisites("an_exhausted_pool_is_a_clear_error") {
        return;
    }
    let mut net = Net::new("10.234.0.0/29");
    net.up("first", &[]);
    net.up("second", &[]);
    let error = net.up_fails("third", &[], &[]);
    assert_eq!(
        error.trim_end(),
        "error: pool 10.234.0.0/29 is exhausted: all 2 /30 subnets are leased (see `rollbox net list`, or free some with `rollbox net down`/`gc`)"
    );
    assert_eq!(net.state_files().len(), 4, "the failed up left nothing");
    net.down("first");
    net.down("second");
    net.assert_clean();
}

#[test]
fn bad_input_is_refused_and_leaves_nothing() {
    if !prerequisites("bad_input_is_refused_and_leaves_nothing") {
        return;
    }
    let net = Net::new("10.235.0.0/24");
    let long = "n".repeat(65);
    let empty_path = tempfile::tempdir().unwrap();
    let empty_path = empty_path.path().to_str().unwrap().to_string();
    // (name, extra arguments, environment, what the error must say)
    type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (long.as_str(), vec![], vec![], "is 65 bytes, over 64"),
        ("a/b", vec![], vec![], "sandbox name `a/b`: has `/`"),
        ("_x", vec![], vec![], "must start with a letter or digit"),
        (
            "p",
            vec!["--egress", "1.1.1.1,10.0.0.0/33"],
            vec![],
            "egress policy token `10.0.0.0/33`",
        ),
        (
            "p",
            vec!["--egress", "10.0.0.0/8:http"],
            vec![],
            "egress policy token `10.0.0.0/8:http`: port `http` is not a number",
        ),
        (
            "p",
            vec!["--egress", "pypi.org:443,1.1.1.1"],
            vec![],
            "egress policy `pypi.org:443,1.1.1.1` names hostnames: only `rollbox serve` resolves them",
        ),
        (
            "p",
            vec!["--egress", "pypi_org:443"],
            vec![],
            "egress policy token `pypi_org:443`: hostname `pypi_org` has `_`",
        ),
        (
            "p",
            vec!["--pool", "10.235.0.0/31"],
            vec![],
            "pool 10.235.0.0/31 is too small",
        ),
        (
            "p",
            vec!["--pool", "10.235.0/24"],
            vec![],
            "pool `10.235.0/24` is not an IPv4 address",
        ),
        (
            "p",
            vec!["--pool", "10.235.0.1/24"],
            vec![],
            "did you mean 10.235.0.0/24",
        ),
        (
            "p",
            vec!["--dns", "dns.example"],
            vec![],
            "--dns `dns.example` is not an IPv4 address",
        ),
        (
            "p",
            vec!["--expose", "80"],
            vec![],
            "--expose `80`: expected HOSTPORT:GUESTPORT",
        ),
        (
            "p",
            vec![],
            vec![("PATH", empty_path.as_str())],
            "nft not found (not on PATH): install nftables (apt-get install nftables)",
        ),
    ];
    for (name, extra, env, want) in cases {
        let error = net.up_fails(name, &extra, &env);
        assert!(
            error.contains(want),
            "{name} {extra:?}: want `{want}` in {error:?}"
        );
        net.assert_clean();
    }

    // A pool that overlaps one of the host's own networks.
    let mut other = Netns::new(&format!("rbxt{}o", std::process::id() % 100_000));
    other.uplink(
        &format!("rbt{}o", std::process::id() % 100_000),
        "10.235.128.1",
        "10.235.128.2",
    );
    let error = net.up_fails("p", &["--pool", "10.235.0.0/16"], &[]);
    assert!(
        error.contains("pool 10.235.0.0/16 overlaps the route to 10.235.128.0/30 on rbt"),
        "{error}"
    );
    drop(other);
    net.assert_clean();

    // A tap that already exists where the first /30's would go: refused, and rolled back.
    rollbox::net::tap::create_tap("rbx0aeb0000").unwrap();
    struct DeleteTap;
    impl Drop for DeleteTap {
        fn drop(&mut self) {
            let _ = rollbox::net::tap::delete_tap("rbx0aeb0000");
        }
    }
    let guard = DeleteTap;
    let error = net.up_fails("p", &[], &[]);
    assert!(
        error.contains("interface rbx0aeb0000 already exists"),
        "{error}"
    );
    assert_eq!(net.state_files(), Vec::<String>::new());
    assert!(!nft_table().contains("rbx0aeb0000"));
    drop(guard);
    net.assert_clean();
}

#[test]
fn gc_removes_what_lost_state_left_behind() {
    if !prerequisites("gc_removes_what_lost_state_left_behind") {
        return;
    }
    let mut net = Net::new("10.236.0.0/24");
    net.up("kept", &[]);
    net.up("lost", &["--expose", "23601:80"]);
    // `crashed`'s `up` died half-way: its lease is unfinished and its process gone.
    net.up("crashed", &[]);
    let lease_path = net.state().join("leases/10.236.0.8.json");
    let mut lease: Value = serde_json::from_slice(&std::fs::read(&lease_path).unwrap()).unwrap();
    let mut dead = Command::new("true").spawn().unwrap();
    dead.wait().unwrap();
    lease["complete"] = Value::Bool(false);
    lease["pid"] = dead.id().into();
    std::fs::write(&lease_path, serde_json::to_vec(&lease).unwrap()).unwrap();
    // The state of `lost` disappears (as if its daemon's record were wiped).
    std::fs::remove_file(net.state().join("leases/10.236.0.4.json")).unwrap();
    std::fs::remove_file(net.state().join("names/lost")).unwrap();
    // Its leftovers block its /30: a new `up` is refused, and its rollback leaves the
    // leftovers' rules alone (they are not its own).
    let error = net.up_fails("again", &[], &[]);
    assert!(
        error.contains("interface rbx0aec0004 already exists"),
        "{error}"
    );
    assert!(nft_table().contains("chain egress_rbx0aec0004"));
    let out = net.run(&["gc", "--pool", "10.236.0.0/24"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("interface rbx0aec0004"), "{report}");
    assert!(report.contains("nftables rules of rbx0aec0004"), "{report}");
    assert!(!rollbox::net::tap::exists("rbx0aec0004"));
    assert!(
        report.contains("unfinished lease 10.236.0.8.json of crashed"),
        "{report}"
    );
    assert!(!rollbox::net::tap::exists("rbx0aec0008"));
    assert!(!net.state().join("names/crashed").exists());
    let table = nft_table();
    assert!(
        !table.contains("rbx0aec0004")
            && !table.contains("rbx0aec0008")
            && !table.contains("23601"),
        "{table}"
    );
    // The live sandbox is untouched.
    assert!(rollbox::net::tap::exists("rbx0aec0000"));
    assert!(table.contains("chain egress_rbx0aec0000"));
    net.down("kept");
    net.assert_clean();
}

// ---- Egress enforcement, with veth pairs standing in for guests and for internet hosts ----
//
// There is no guest here, and the far side of a tap is a VMM's file descriptor, not a network
// stack that could open TCP connections. So `up --veth-netns NS` makes a veth pair instead:
// the host side gets the sandbox's interface name (rbx...) and address, exactly as the tap
// would, and the peer sits in network namespace NS, configured as the guest configures its
// eth0 from the kernel's ip= argument (guest address/30, default route via the host side).
// Every nftables rule keys on the interface name (iifname/oifname) and the addresses, so the
// host sees the same packets on the same rules as from a tap; only the link type differs.
// Two more namespaces, each behind its own veth pair, are "internet" hosts.

/// A route in the root namespace, deleted when dropped.
struct Route(String);

impl Route {
    fn via(dest: &str, gateway: &str) -> Route {
        let _ = Command::new("ip").args(["route", "del", dest]).output();
        ip(&["route", "add", dest, "via", gateway]);
        Route(dest.to_string())
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["route", "del", &self.0]).output();
    }
}

/// A UDP server in a namespace that answers each datagram with "<label> <peer address>".
fn udp_echo(netns: &str, port: u16, label: &str) -> Listener {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let label = label.to_string();
    let socket = in_netns(Some(netns), move || {
        std::net::UdpSocket::bind(("0.0.0.0", port)).unwrap()
    });
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while !flag.load(Ordering::Relaxed) {
            if let Ok((_, peer)) = socket.recv_from(&mut buf) {
                let _ = socket.send_to(format!("{label} {}", peer.ip()).as_bytes(), peer);
            }
        }
    });
    Listener::from_flag(stop)
}

/// One UDP datagram from a namespace; the answer, if one came within 700 ms.
fn udp_ask(netns: Option<&str>, addr: &str, port: u16) -> Option<String> {
    udp_ask_from(netns, 0, addr, port)
}

/// [`udp_ask`] from source port `from` (0: any), so that asks share one conntrack flow.
fn udp_ask_from(netns: Option<&str>, from: u16, addr: &str, port: u16) -> Option<String> {
    let target = SocketAddr::new(addr.parse::<Ipv4Addr>().unwrap().into(), port);
    in_netns(netns, move || {
        let socket = std::net::UdpSocket::bind(("0.0.0.0", from)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(700)))
            .unwrap();
        socket.send_to(b"?", target).unwrap();
        let mut buf = [0u8; 64];
        let (n, _) = socket.recv_from(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
}

/// Sends one ICMP echo request from a namespace (a raw socket: no ping binary needed) and
/// says whether `addr` answered within 700 ms.
fn ping(netns: Option<&str>, addr: &str) -> bool {
    let target: Ipv4Addr = addr.parse().unwrap();
    in_netns(netns, move || {
        // SAFETY: plain socket(2); the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_ICMP,
            )
        };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: SO_RCVTIMEO reads a timeval of the given size from a live local.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let id = (std::process::id() as u16).to_be_bytes();
        let mut packet = [8u8, 0, 0, 0, id[0], id[1], 0, 1, b'r', b'b', b'x', b'!'];
        let sum = packet
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum::<u32>();
        let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
        let dest = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(target.octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: the buffer and address are live locals of the sizes passed.
        let sent = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&dest as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(
            sent,
            packet.len() as isize,
            "{}",
            std::io::Error::last_os_error()
        );
        let deadline = Instant::now() + Duration::from_millis(700);
        let mut buf = [0u8; 1500];
        while Instant::now() < deadline {
            // SAFETY: `buf` is a live local of the size passed.
            let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            let Ok(n) = usize::try_from(n) else { continue };
            let ihl = usize::from(buf[0] & 0x0f) * 4;
            let from = Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]);
            if n >= ihl + 8 && buf[ihl] == 0 && buf[ihl + 4..ihl + 6] == id && from == target {
                return true;
            }
        }
        false
    })
}

#[test]
fn egress_policy_is_enforced() {
    if !prerequisites("egress_policy_is_enforced") {
        return;
    }
    let tag = std::process::id() % 100_000;
    let ns = |role: &str| format!("rbxt{tag}{role}");
    // Internet hosts: A (allowed on port 8000 only) and D (denied), each behind its own veth.
    // Their host-side names start with `rbx` too, like other people's taps may: only the
    // interfaces `up` made are sandboxes, so these must work as any other link.
    let mut host_a = Netns::new(&ns("a"));
    host_a.uplink(&format!("rbxi{tag}a"), "10.249.1.1", "10.249.1.2");
    let mut host_d = Netns::new(&ns("d"));
    host_d.uplink(&format!("rbxi{tag}d"), "10.249.1.5", "10.249.1.6");
    let _a8000 = Listener::start(Some(&host_a.name), 8000, "A");
    let _a8001 = Listener::start(Some(&host_a.name), 8001, "A");
    let _d8000 = Listener::start(Some(&host_d.name), 8000, "D");
    let _a53 = Listener::start(Some(&host_a.name), 53, "A");
    let _a8000u = udp_echo(&host_a.name, 8000, "A");
    let _a8001u = udp_echo(&host_a.name, 8001, "A");
    // A service on the host itself, on every address.
    let _host = Listener::start(None, 23702, "host");
    // D also answers on a link-local address, as a cloud's metadata service does.
    ip(&[
        "-n",
        &host_d.name,
        "addr",
        "add",
        "169.254.77.1/32",
        "dev",
        "lo",
    ]);
    let _link_local = Route::via("169.254.77.1/32", "10.249.1.6");

    // Four guests: an allow-list with a port exposed, `none`, `all`, and `all` with opt-ins.
    let (g1, g2, g3, g4) = (
        Netns::new(&ns("g1")),
        Netns::new(&ns("g2")),
        Netns::new(&ns("g3")),
        Netns::new(&ns("g4")),
    );
    let mut net = Net::new("10.237.0.0/24");
    let veth = |g: &Netns| vec!["--veth-netns".to_string(), g.name.clone()];
    let args = |mut v: Vec<String>, more: &[&str]| {
        v.extend(more.iter().map(|s| s.to_string()));
        v
    };
    let a1 = args(
        veth(&g1),
        &["--egress", "10.249.1.2/32:8000", "--expose", "23701:9000"],
    );
    let i1 = net.up("guest1", &a1.iter().map(String::as_str).collect::<Vec<_>>());
    let a2 = args(veth(&g2), &["--egress", "none", "--dns", "10.249.1.2"]);
    let i2 = net.up("guest2", &a2.iter().map(String::as_str).collect::<Vec<_>>());
    let a3 = args(veth(&g3), &["--egress", "all"]);
    net.up("guest3", &a3.iter().map(String::as_str).collect::<Vec<_>>());
    let a4 = args(veth(&g4), &["--egress", "all,10.249.1.4/30,169.254.77.1"]);
    net.up("guest4", &a4.iter().map(String::as_str).collect::<Vec<_>>());
    // Ports exposed on addresses (as `rollbox serve` exposes them): guest5's on 127.0.0.1
    // only (the host itself), guest6's on 127.0.0.1 and the host's address towards A.
    let (g5, g6) = (Netns::new(&ns("g5")), Netns::new(&ns("g6")));
    let a5 = args(
        veth(&g5),
        &["--expose", "23703:9000", "--expose-on", "127.0.0.1"],
    );
    let i5 = net.up("guest5", &a5.iter().map(String::as_str).collect::<Vec<_>>());
    let a6 = args(
        veth(&g6),
        &[
            "--expose",
            "23704:9000",
            "--expose-on",
            "127.0.0.1",
            "--expose-on",
            "10.249.1.1",
        ],
    );
    net.up("guest6", &a6.iter().map(String::as_str).collect::<Vec<_>>());
    let _g5_9000 = Listener::start(Some(&g5.name), 9000, "guest5");
    let _g6_9000 = Listener::start(Some(&g6.name), 9000, "guest6");
    let ip_of = |info: &Value, key: &str| info[key].as_str().unwrap().to_string();
    let (g1_ip, g1_gw) = (ip_of(&i1, "guest_ip"), ip_of(&i1, "host_ip"));
    let (g2_ip, g2_gw) = (ip_of(&i2, "guest_ip"), ip_of(&i2, "host_ip"));
    let _g1_9000 = Listener::start(Some(&g1.name), 9000, "guest1");
    let _g2_9000 = Listener::start(Some(&g2.name), 9000, "guest2");
    let (g1n, g2n, g3n, g4n) = (
        Some(g1.name.as_str()),
        Some(g2.name.as_str()),
        Some(g3.name.as_str()),
        Some(g4.name.as_str()),
    );

    // Allowed: A:8000, masqueraded (A sees the host's address on its link, not the guest's).
    assert_eq!(connect(g1n, "10.249.1.2", 8000).unwrap(), "A 10.249.1.1");
    // Denied: another port on A, and D entirely.
    connect(g1n, "10.249.1.2", 8001).expect_err("port 8001 is not on the allow-list");
    connect(g1n, "10.249.1.6", 8000).expect_err("D is not on the allow-list");
    // The same for UDP.
    assert_eq!(
        udp_ask(g1n, "10.249.1.2", 8000).as_deref(),
        Some("A 10.249.1.1")
    );
    assert_eq!(
        udp_ask(g1n, "10.249.1.2", 8001),
        None,
        "UDP 8001 is not allowed"
    );
    assert_eq!(
        udp_ask(g4n, "10.249.1.2", 8001),
        None,
        "`all` does not forward to 10.0.0.0/8 unless named"
    );
    // The host itself: not through its gateway address, not through its other addresses.
    connect(g1n, &g1_gw, 23702).expect_err("host services are closed to guests");
    connect(g1n, "10.249.1.1", 23702).expect_err("the host's other addresses too");
    let from_a = connect(Some(&host_a.name), "10.249.1.1", 23702);
    assert_eq!(
        from_a.unwrap(),
        "host 10.249.1.2",
        "the host service itself is up"
    );
    // Other sandboxes: neither their guest nor their gateway.
    connect(g1n, &g2_ip, 9000).expect_err("sandboxes can't reach each other");
    connect(g1n, &g2_gw, 23702).expect_err("nor another sandbox's gateway");
    // ICMP echo to its own gateway only.
    assert!(ping(g1n, &g1_gw), "a guest pings its gateway");
    assert!(!ping(g1n, "10.249.1.1"), "but no other host address");
    assert!(
        ping(Some(&host_a.name), "10.249.1.1"),
        "which does answer A"
    );
    assert!(!ping(g1n, &g2_gw), "nor another sandbox's gateway");
    // `none` with --dns: port 53 on the DNS server, and nothing else.
    assert_eq!(connect(g2n, "10.249.1.2", 53).unwrap(), "A 10.249.1.1");
    // `none`: nothing forwarded.
    connect(g2n, "10.249.1.2", 8000).expect_err("egress none");
    // `all`: neither A nor D (both in 10.0.0.0/8), nor D's link-local address; with opt-ins
    // beside `all`, exactly what they name.
    connect(g3n, "10.249.1.6", 8000).expect_err("`all` drops 10.0.0.0/8");
    connect(g3n, "10.249.1.2", 8001).expect_err("`all` drops 10.0.0.0/8");
    connect(g3n, "169.254.77.1", 8000).expect_err("`all` drops 169.254.0.0/16");
    assert_eq!(connect(g4n, "10.249.1.6", 8000).unwrap(), "D 10.249.1.5");
    assert_eq!(connect(g4n, "169.254.77.1", 8000).unwrap(), "D 10.249.1.5");
    connect(g4n, "10.249.1.2", 8001).expect_err("A is not opted in");
    // The live ruleset names the metadata range and every private range.
    let table = nft_table();
    for range in [
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
    ] {
        assert!(table.contains(range), "{range} missing from\n{table}");
    }
    // The host reaches guests directly, `none` included.
    assert_eq!(
        connect(None, &g1_ip, 9000).unwrap(),
        format!("guest1 {g1_gw}")
    );
    assert_eq!(
        connect(None, &g2_ip, 9000).unwrap(),
        format!("guest2 {g2_gw}")
    );
    // The exposed port: from an outside host through the host's address on its link, and from
    // the host itself through a non-loopback local address.
    assert_eq!(
        connect(Some(&host_a.name), "10.249.1.1", 23701).unwrap(),
        "guest1 10.249.1.2"
    );
    assert!(connect(None, &g1_gw, 23701).unwrap().starts_with("guest1 "));
    // On 127.0.0.1: the host reaches it there (the guest sees the tap's address), and an
    // outside host cannot, on any address, unless the port is on that address too.
    let g5_gw = ip_of(&i5, "host_ip");
    assert_eq!(
        connect(None, "127.0.0.1", 23703).unwrap(),
        format!("guest5 {g5_gw}")
    );
    connect(Some(&host_a.name), "10.249.1.1", 23703).expect_err("guest5's port is the host's only");
    assert!(connect(None, "127.0.0.1", 23704)
        .unwrap()
        .starts_with("guest6 "));
    assert_eq!(
        connect(Some(&host_a.name), "10.249.1.1", 23704).unwrap(),
        "guest6 10.249.1.2"
    );
    // Neither is on the host's other addresses.
    connect(None, &g1_gw, 23703).expect_err("only where exposed");
    // A policy change holds for flows already open: the same UDP flow, allowed, then cut.
    assert_eq!(
        udp_ask_from(g1n, 40001, "10.249.1.2", 8000).as_deref(),
        Some("A 10.249.1.1")
    );
    let state = rollbox::net::pool::StateDir::new(net.state());
    rollbox::net::set_egress(&state, "guest1", &"none".parse().unwrap(), &[]).unwrap();
    assert_eq!(
        udp_ask_from(g1n, 40001, "10.249.1.2", 8000),
        None,
        "the open flow is cut by the new policy"
    );
    rollbox::net::set_egress(
        &state,
        "guest1",
        &"10.249.1.2/32:8000".parse().unwrap(),
        &[],
    )
    .unwrap();
    assert_eq!(
        udp_ask_from(g1n, 40001, "10.249.1.2", 8000).as_deref(),
        Some("A 10.249.1.1"),
        "and allowed again"
    );
    // `down` takes the exposure away with the rest.
    for name in ["guest1", "guest2", "guest3", "guest4", "guest5", "guest6"] {
        net.down(name);
    }
    connect(Some(&host_a.name), "10.249.1.1", 23701).expect_err("exposure removed");
    connect(None, "127.0.0.1", 23703).expect_err("exposure removed");
    connect(Some(&host_a.name), "10.249.1.1", 23704).expect_err("exposure removed");
    net.assert_clean();
}
