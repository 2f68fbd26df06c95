//! `rollbox serve` end to end, networks (host, test guest): a create with `network` gets a
//! tap, a /30 of the server's pool and its egress policy in nftables, the jailed VMM holds the
//! tap from its own network namespace, a reset keeps it, and everything goes with the
//! sandbox: on delete, when a restore fails, over many create/delete cycles, and after kill -9
//! of the daemon mid-create. The traffic itself
//! (what a Linux guest can reach under each policy) is `tier4_network.rs`'s; exposed ports get
//! free host ports on 127.0.0.1 and the `--publish` address (the DNAT itself is `net.rs`'s).

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox::net::{Pool, StateDir};
use rollbox_tests::daemon::{wait_for, Server};
use rollbox_tests::netns::prerequisites;
use serde_json::{json, Value};

/// A daemon with its own pool (its leases are in the server's scratch directory, which
/// [`Server`] releases when dropped: the test then fails on its own checks).
struct Networked {
    server: Server,
    pool: String,
}

impl Networked {
    fn start(pool: &str) -> Networked {
        Networked::start_with(pool, &[])
    }

    fn start_with(pool: &str, extra: &[&str]) -> Networked {
        // The test guest has no agent: a restore's readdress fails fast.
        let mut args = vec![
            "--net-pool",
            pool,
            "--sandbox-dns",
            "10.9.9.9",
            "--agent-timeout",
            "2",
        ];
        args.extend(extra);
        let server = Server::start(&args);
        Networked {
            server,
            pool: pool.to_string(),
        }
    }

    fn leases(&self) -> Vec<String> {
        rollbox::net::leases(&StateDir::new(self.server.net_state()))
            .expect("leases")
            .into_iter()
            .map(|l| l.name)
            .collect()
    }

    /// Asserts nothing of the pool is left: no lease, no tap, no nftables chain or element.
    fn assert_clean(&self) {
        assert_eq!(self.leases(), Vec::<String>::new(), "leases left");
        let pool = Pool::parse(&self.pool).expect("pool");
        let taps: Vec<String> = std::fs::read_dir("/sys/class/net")
            .expect("/sys/class/net")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| {
                rollbox::net::pool::slot_of_tap(name)
                    .is_some_and(|slot| pool.net().contains(slot.guest_ip()))
            })
            .collect();
        assert_eq!(taps, Vec::<String>::new(), "taps left");
        let listing = rollbox::net::nft::list_table()
            .expect("nft")
            .unwrap_or_default();
        let prefix = self.pool.trim_end_matches("0.0/24");
        let left: Vec<&str> = listing.lines().filter(|l| l.contains(prefix)).collect();
        assert!(left.is_empty(), "nftables still names {prefix}*: {left:?}");
    }
}

/// The processes with tap `tap` attached (/proc/PID/fdinfo says `iff: TAP`).
fn tap_holders(tap: &str) -> Vec<u32> {
    let want = format!("iff:\t{tap}");
    let mut holders = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(infos) = std::fs::read_dir(entry.path().join("fdinfo")) else {
            continue;
        };
        let holds = infos.flatten().any(|info| {
            std::fs::read_to_string(info.path()).is_ok_and(|t| t.lines().any(|l| l == want))
        });
        if holds {
            holders.push(pid);
        }
    }
    holders
}

fn netns(pid: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).expect("netns")
}

/// The rules of the sandbox's egress chain.
fn egress_chain(tap: &str) -> String {
    let out = Command::new("nft")
        .args(["list", "chain", "inet", "rollbox", &format!("egress_{tap}")])
        .output()
        .expect("nft");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn each_egress_policy_makes_its_tap_address_and_rules_and_delete_removes_them() {
    if !prerequisites("each_egress_policy_makes_its_tap_address_and_rules_and_delete_removes_them")
    {
        return;
    }
    let net = Networked::start("10.241.0.0/24");
    let server = &net.server;
    server.add_guest_template("guest");
    let cases = [
        (json!({}), "none"),
        (json!({"egress": "all"}), "all"),
        (
            json!({"egress": {"allow": ["10.9.0.0/16:443", "192.0.2.7"]}}),
            "10.9.0.0/16:443,192.0.2.7",
        ),
    ];
    let mut made = Vec::new();
    for (network, egress) in cases {
        let sandbox = server.create(json!({"template": "guest", "ttl_s": 120, "network": network}));
        let nic = &sandbox["network"];
        assert_eq!(nic["egress"], egress, "{sandbox}");
        let tap = nic["tap"].as_str().expect("tap").to_string();
        let address: std::net::Ipv4Addr =
            nic["address"].as_str().expect("address").parse().unwrap();
        assert!(
            Pool::parse(&net.pool).unwrap().net().contains(address),
            "{sandbox}"
        );
        assert_eq!(nic["prefix_len"], 30);
        // DNS is a way out: a sandbox with egress none is given none.
        assert_eq!(nic.get("dns").is_some(), egress != "none", "{sandbox}");
        // The VMM's boot configuration names the tap and MAC; the kernel gets `ip=`.
        let config = rollbox_tests::daemon::boot_config(&sandbox);
        assert_eq!(
            config["network-interfaces"][0]["host_dev_name"],
            tap.as_str()
        );
        assert_eq!(config["network-interfaces"][0]["guest_mac"], nic["mac"]);
        let cmdline = config["boot-source"]["boot_args"]
            .as_str()
            .unwrap_or_default();
        assert!(cmdline.contains(&format!("ip={address}::")), "{cmdline}");
        // One process holds the tap: the VMM, in a network namespace that is not the host's.
        let holders = tap_holders(&tap);
        assert_eq!(holders.len(), 1, "{tap} held by {holders:?}");
        assert_ne!(
            netns(&holders[0].to_string()),
            netns("self"),
            "the VMM is in the host's netns"
        );
        let chain = egress_chain(&tap);
        match egress {
            "none" => assert!(!chain.contains("accept"), "{chain}"),
            "all" => {
                assert!(chain.contains("10.0.0.0/8"), "{chain}");
                assert!(chain.contains("accept"), "{chain}");
            }
            _ => {
                assert!(chain.contains("ip daddr 10.9.0.0/16"), "{chain}");
                assert!(chain.contains("ip daddr 192.0.2.7 accept"), "{chain}");
            }
        }
        made.push((sandbox["id"].as_str().unwrap().to_string(), tap));
    }
    let mut leases = net.leases();
    leases.sort();
    let mut ids: Vec<String> = made.iter().map(|(id, _)| id.clone()).collect();
    ids.sort();
    assert_eq!(leases, ids);
    // PATCH replaces the egress chain of a live sandbox; the rest of its rules stay.
    let (id, tap) = &made[0];
    let (status, patched) = server.call(
        "PATCH",
        &format!("/sandboxes/{id}/network"),
        Some(json!({"egress": {"allow": ["198.51.100.0/24:80"]}})),
    );
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["network"]["egress"], "198.51.100.0/24:80");
    assert_eq!(server.get(id)["network"], patched["network"]);
    let chain = egress_chain(tap);
    assert!(chain.contains("ip daddr 198.51.100.0/24"), "{chain}");
    for (body, status_wanted, field) in [
        (json!({}), 400, "egress: required"),
        (json!({"egress": "10.0.0.0/99"}), 400, "network.egress"),
        (json!({"egress": "none", "dns": "1.1.1.1"}), 400, "dns"),
    ] {
        let (status, answer) = server.call(
            "PATCH",
            &format!("/sandboxes/{id}/network"),
            Some(body.clone()),
        );
        assert_eq!(status, status_wanted, "{body}: {answer}");
        assert!(answer.to_string().contains(field), "{body}: {answer}");
    }
    let (status, patched) = server.call(
        "PATCH",
        &format!("/sandboxes/{id}/network"),
        Some(json!({"egress": "none"})),
    );
    assert_eq!(status, 200, "{patched}");
    assert!(
        !egress_chain(tap).contains("accept"),
        "{}",
        egress_chain(tap)
    );
    // A reset keeps the sandbox's tap and address, with a new VMM holding the tap.
    let before = tap_holders(tap);
    let (status, reset) = server.call("POST", &format!("/sandboxes/{id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{reset}\n{}", server.log_tail());
    assert_eq!(reset["network"], server.get(id)["network"]);
    assert_eq!(reset["network"]["tap"], tap.as_str());
    let after = tap_holders(tap);
    assert_eq!(after.len(), 1, "{tap} held by {after:?}");
    assert_ne!(after, before, "the old VMM still holds {tap}");
    // A snapshot records the egress; its restores get a network of their own and the agent
    // readdresses the guest. The test guest has none: the restore fails naming it, and its
    // network goes with it.
    let (status, snapshot) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snapshot}");
    assert_eq!(snapshot["network"], "none", "{snapshot}");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": snapshot["id"], "ttl_s": 60})),
    );
    assert_eq!(status, 503, "{body}");
    assert!(body.to_string().contains("agent"), "{body}");
    let live: Vec<String> = server
        .list("running")
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    let mut leases = net.leases();
    leases.sort();
    let mut live_sorted = live.clone();
    live_sorted.sort();
    assert_eq!(leases, live_sorted, "a failed restore left its lease");
    for (id, tap) in &made {
        let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
        assert!(
            !Path::new("/sys/class/net").join(tap).exists(),
            "{tap} left"
        );
    }
    net.assert_clean();
    // A sandbox without a network has no egress to change.
    let plain = server.create(json!({"template": "guest", "ttl_s": 60}));
    let plain_id = plain["id"].as_str().unwrap();
    assert!(plain.get("network").is_none(), "{plain}");
    let (status, body) = server.call(
        "PATCH",
        &format!("/sandboxes/{plain_id}/network"),
        Some(json!({"egress": "all"})),
    );
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("has no network"), "{body}");
}

/// One more address of this host (on `lo`), for `--publish`; removed when dropped.
struct LocalAddress {
    cidr: String,
}

impl LocalAddress {
    fn add(addr: &str) -> LocalAddress {
        let cidr = format!("{addr}/32");
        let out = Command::new("ip")
            .args(["addr", "add", &cidr, "dev", "lo"])
            .output()
            .expect("ip");
        assert!(out.status.success(), "ip addr add {cidr} dev lo: {out:?}");
        LocalAddress { cidr }
    }
}

impl Drop for LocalAddress {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["addr", "del", &self.cidr, "dev", "lo"])
            .status();
    }
}

#[test]
fn exposed_ports_get_free_host_ports_on_loopback_and_the_publish_address() {
    if !prerequisites("exposed_ports_get_free_host_ports_on_loopback_and_the_publish_address") {
        return;
    }
    let publish = "192.0.2.201";
    let _address = LocalAddress::add(publish);
    // Four host ports, one of which a host process listens on: exposures never hide it.
    let busy = std::net::TcpListener::bind(("0.0.0.0", 23802)).expect("bind 23802");
    let pool = "10.248.0.0/24";
    let server = Server::start(&[
        "--net-pool",
        pool,
        "--agent-timeout",
        "2",
        "--publish",
        publish,
        "--expose-port-range",
        "23800-23803",
    ]);
    let net = Networked {
        server,
        pool: pool.to_string(),
    };
    let server = &net.server;
    server.add_guest_template("guest");
    let create = |expose: Value| {
        server.call(
            "POST",
            "/sandboxes",
            Some(json!({"template": "guest", "ttl_s": 120, "network": {"expose": expose}})),
        )
    };
    let ports = |sandbox: &Value| -> Vec<(u64, String, u64)> {
        sandbox["network"]["ports"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .map(|p| {
                (
                    p["port"].as_u64().unwrap(),
                    p["host_address"].as_str().unwrap().to_string(),
                    p["host_port"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let (status, a) = create(json!([8080, 22]));
    assert_eq!(status, 201, "{a}\n{}", server.log_tail());
    assert_eq!(
        ports(&a),
        [
            (8080, publish.to_string(), 23800),
            (22, publish.to_string(), 23801)
        ],
        "{a}"
    );
    let (status, b) = create(json!([8080]));
    assert_eq!(status, 201, "{b}");
    assert_eq!(ports(&b), [(8080, publish.to_string(), 23803)], "{b}");
    // The range is used up (23802 is the host's): a clear 503, and nothing made.
    let (status, c) = create(json!([80]));
    assert_eq!(status, 503, "{c}");
    assert!(
        c.to_string().contains("--expose-port-range 23800-23803"),
        "{c}"
    );
    assert_eq!(net.leases().len(), 2, "the refused create left a lease");
    drop(busy);
    // Each port is on 127.0.0.1 and on the publish address, towards the sandbox's guest.
    let listing = rollbox::net::nft::list_table().unwrap().unwrap_or_default();
    let on_addresses = rollbox::net::nft::ports(&listing);
    let a_addr: std::net::Ipv4Addr = a["network"]["address"].as_str().unwrap().parse().unwrap();
    for on in ["127.0.0.1", publish] {
        assert!(
            on_addresses.contains(&(on.parse().unwrap(), 23800, a_addr, 8080)),
            "{on}:23800 -> {a_addr}:8080 missing from {on_addresses:?}"
        );
    }
    // Host connections to 127.0.0.1 are DNAT-ed to the guest through its tap.
    let tap = a["network"]["tap"].as_str().unwrap();
    let localnet =
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{tap}/route_localnet")).unwrap();
    assert_eq!(localnet.trim(), "1");
    // A live sandbox's ports cannot change; a reset keeps them; a snapshot records them.
    let a_id = a["id"].as_str().unwrap();
    let (status, body) = server.call(
        "PATCH",
        &format!("/sandboxes/{a_id}/network"),
        Some(json!({"egress": "all", "expose": [9090]})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("expose"), "{body}");
    let (status, reset) = server.call("POST", &format!("/sandboxes/{a_id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{reset}\n{}", server.log_tail());
    assert_eq!(ports(&reset), ports(&a));
    let (status, snapshot) = server.call("POST", &format!("/sandboxes/{a_id}/snapshots"), None);
    assert_eq!(status, 201, "{snapshot}");
    assert_eq!(snapshot["expose"], json!([8080, 22]), "{snapshot}");
    // Deleting frees the host ports: the next create gets the lowest again.
    for sandbox in [&a, &b] {
        let id = sandbox["id"].as_str().unwrap();
        let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    net.assert_clean();
    let (status, d) = create(json!([8080]));
    assert_eq!(status, 201, "{d}");
    let d_port = ports(&d)[0].2;
    assert!((23800..=23803).contains(&d_port), "{d}");
    let (status, body) = server.call(
        "DELETE",
        &format!("/sandboxes/{}", d["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(status, 204, "{body}");
    net.assert_clean();
}

#[test]
fn bad_networks_are_refused_by_field_and_make_nothing() {
    if !prerequisites("bad_networks_are_refused_by_field_and_make_nothing") {
        return;
    }
    let net = Networked::start("10.242.0.0/24");
    let server = &net.server;
    let snapshot = server.guest_snapshot();
    for (body, want) in [
        (
            json!({"template": "guest", "ttl_s": 60, "network": {"egress": "some"}}),
            "network.egress",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "network": {"egress": {"allow": ["10.0.0.0/40"]}}}),
            "network.egress: egress policy token `10.0.0.0/40`",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "network": {"egress": {"allow": ["exa_mple.com"]}}}),
            "network.egress: egress policy token `exa_mple.com`: hostname `exa_mple.com` has `_`",
        ),
        (
            json!({"template": "guest", "ttl_s": 60, "network": {"egress": {"allow": ["localhost:80"]}}}),
            "network.egress: egress policy token `localhost:80`: hostname `localhost` needs at least two labels",
        ),
        (
            json!({"snapshot": snapshot, "ttl_s": 60, "network": {}}),
            "was taken of a sandbox without a network, and a restore cannot add",
        ),
    ] {
        let (status, answer) = server.call("POST", "/sandboxes", Some(body.clone()));
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.to_string().contains(want), "{body}: {answer}");
    }
    net.assert_clean();
}

#[test]
fn create_delete_cycles_and_a_kill_9_mid_create_leave_no_tap_rule_or_lease() {
    if !prerequisites("create_delete_cycles_and_a_kill_9_mid_create_leave_no_tap_rule_or_lease") {
        return;
    }
    let mut net = Networked::start("10.243.0.0/24");
    net.server.add_guest_template("guest");
    let cycles = 200;
    let started = Instant::now();
    for i in 0..cycles {
        let egress = if i % 2 == 0 { "none" } else { "all" };
        let sandbox = net
            .server
            .create(json!({"template": "guest", "ttl_s": 60, "network": {"egress": egress}}));
        let id = sandbox["id"].as_str().unwrap();
        let (status, body) = net.server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    println!(
        "{cycles} create/delete cycles with a network: {:.1} ms each",
        started.elapsed().as_secs_f64() * 1000.0 / f64::from(cycles)
    );
    net.assert_clean();

    // Creates in flight when the daemon is killed: their networks go at its next start.
    let sock = net.server.sock();
    let creators: Vec<_> = (0..6)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let body = json!({"template": "guest", "ttl_s": 60, "network": {"egress": "all"}})
                    .to_string();
                let _ = rollbox::daemon::client::Endpoint::Unix(sock).request(
                    "POST",
                    "/sandboxes",
                    &[(
                        "Authorization",
                        &format!("Bearer {}", rollbox_tests::daemon::KEY),
                    )],
                    Some(body.as_bytes()),
                    Duration::from_secs(30),
                );
            })
        })
        .collect();
    wait_for("a lease made mid-create", Duration::from_secs(30), || {
        !net.leases().is_empty()
    });
    net.server.kill9();
    for creator in creators {
        let _ = creator.join();
    }
    net.server.spawn();
    // Every sandbox still alive is ended; none may keep a network.
    let live: Vec<Value> = ["creating", "running"]
        .iter()
        .flat_map(|state| net.server.list(state))
        .collect();
    for sandbox in live {
        let id = sandbox["id"].as_str().unwrap();
        let (status, body) = net.server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    net.assert_clean();
}

/// Whether a socket of this host listens on `addr:port`, UDP and TCP (/proc/net/udp and
/// /proc/net/tcp: `local_address` is the address's bytes in memory order, hex, then the port).
fn listening(addr: Ipv4Addr, port: u16) -> (bool, bool) {
    let local = format!("{:08X}:{port:04X}", u32::from_ne_bytes(addr.octets()));
    let has = |table: &str, state: Option<&str>| {
        std::fs::read_to_string(table).unwrap().lines().any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(1) == Some(&local.as_str())
                && state.is_none_or(|s| fields.get(3) == Some(&s))
        })
    };
    (has("/proc/net/udp", None), has("/proc/net/tcp", Some("0A")))
}

/// The addresses in the sandbox's hostname set `index`, from the live ruleset.
fn dns_set(tap: &str, index: usize) -> Option<Vec<Ipv4Addr>> {
    let out = Command::new("nft")
        .args([
            "list",
            "set",
            "inet",
            "rollbox",
            &format!("dns{index}_{tap}"),
        ])
        .output()
        .expect("nft");
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let elements = text.split_once("elements = {").map_or("", |(_, e)| e);
    Some(
        elements
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter_map(|word| word.parse().ok())
            .collect(),
    )
}

#[test]
fn hostnames_get_a_resolver_on_the_gateway() {
    if !prerequisites("hostnames_get_a_resolver_on_the_gateway") {
        return;
    }
    // The resolver's traffic (queries, answers, the sets filling) is net_dns.rs's: the test
    // guest has no network stack, and the host cannot send from the guest's address to its
    // own gateway. Here: the daemon's plumbing.
    let mut net = Networked::start_with("10.228.0.0/24", &["--resolver-upstream", "127.0.0.1:53"]);
    net.server.add_guest_template("guest");
    let sandbox = net.server.create(json!({
        "template": "guest", "ttl_s": 120,
        "network": {"egress": {"allow": ["PyPI.test.example:443", "10.9.9.9:53"]}},
    }));
    let id = sandbox["id"].as_str().unwrap().to_string();
    let network = &sandbox["network"];
    assert_eq!(network["dns"], network["gateway"], "{sandbox}");
    assert_eq!(network["egress"], "pypi.test.example:443,10.9.9.9:53");
    let tap = network["tap"].as_str().unwrap().to_string();
    let gateway: Ipv4Addr = network["gateway"].as_str().unwrap().parse().unwrap();
    assert!(
        egress_chain(&tap).contains(&format!(
            "ip daddr @dns0_{tap} meta l4proto {{ tcp, udp }} th dport 443 accept"
        )),
        "{}",
        egress_chain(&tap)
    );
    assert_eq!(dns_set(&tap, 0), Some(Vec::new()));
    assert_eq!(
        listening(gateway, 53),
        (true, true),
        "the resolver on {gateway}:53"
    );

    // PATCH without hostnames: the set goes in the same transaction; with them again, the
    // resolver is still there.
    let patch = |net: &Networked, id: &str, egress: Value| {
        net.server.call(
            "PATCH",
            &format!("/sandboxes/{id}/network"),
            Some(json!({ "egress": egress })),
        )
    };
    let (status, body) = patch(&net, &id, json!("1.1.1.1"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(dns_set(&tap, 0), None);
    let (status, body) = patch(&net, &id, json!({"allow": ["pypi.test.example:443"]}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(dns_set(&tap, 0), Some(Vec::new()));
    // A restarted daemon starts the resolver again.
    net.server.kill9();
    assert_eq!(listening(gateway, 53), (false, false));
    net.server.spawn();
    wait_for(
        "the resolver after a restart",
        Duration::from_secs(10),
        || listening(gateway, 53) == (true, true),
    );

    // A sandbox created without hostnames has no resolver: adding them is a 409.
    let plain = net
        .server
        .create(json!({"template": "guest", "ttl_s": 60, "network": {"egress": "all"}}));
    let plain_id = plain["id"].as_str().unwrap();
    let plain_gateway: Ipv4Addr = plain["network"]["gateway"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(listening(plain_gateway, 53), (false, false));
    let (status, body) = patch(&net, plain_id, json!({"allow": ["pypi.test.example:443"]}));
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("has no resolver"), "{body}");
    for id in [id.as_str(), plain_id] {
        let (status, body) = net.server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    net.assert_clean();
    assert_eq!(listening(gateway, 53), (false, false));
    let listing = rollbox::net::nft::list_table().unwrap().unwrap_or_default();
    assert!(!listing.contains(&tap), "{listing}");
}
