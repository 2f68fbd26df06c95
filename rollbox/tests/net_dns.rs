//! Hostnames in egress allow-lists against the real kernel: a sandbox network leased through
//! `rollbox::net` (a veth into a network namespace standing in for the guest, as in net.rs),
//! its resolver (`rollbox::net::resolver`) on the gateway, and an upstream DNS server of the
//! test's own on the host's loopback that counts what it is asked. The guest's queries are
//! crafted here and sent from its namespace; an "internet" namespace behind another veth has
//! TCP listeners. Root, /dev/net/tun, nft and ip needed (else skipped; a failure under
//! ROLLBOX_REQUIRE_ALL=1).

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollbox::net::dns;
use rollbox::net::resolver::{Resolver, ResolverOptions, Site};
use rollbox::net::{Egress, LeaseRequest, LinkKind, Pool, StateDir};
use rollbox_tests::netns::{connect, in_netns, nft_table, prerequisites, Listener, Netns};

/// Each test its own pool (gc takes what its state directory does not know for orphans).
const POOL: &str = "10.226.0.0/24";
const POOL_GC: &str = "10.227.0.0/24";
/// The "internet" host, outside every range a hostname's answer may not add by itself.
const INTERNET: &str = "198.18.24.2";

/// The test's upstream: answers A questions from a table (name → addresses, TTL), NXDOMAIN
/// for other names, and records every question it gets. Over UDP it answers
/// `big.test.example` truncated (TC, no records), over TCP (the same port) in full.
struct Upstream {
    addr: SocketAddr,
    asked: Arc<Mutex<Vec<(String, u16)>>>,
    stop: Arc<AtomicBool>,
}

impl Upstream {
    fn start(table: &[(&str, &[&str], u32)]) -> Upstream {
        let socket = UdpSocket::bind(("127.0.0.1", 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let table: Vec<(String, Vec<Ipv4Addr>, u32)> = table
            .iter()
            .map(|(name, addrs, ttl)| {
                let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
                (name.to_string(), addrs, *ttl)
            })
            .collect();
        let asked = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tcp = TcpListener::bind(addr).unwrap();
        let (tcp_log, tcp_table) = (Arc::clone(&asked), table.clone());
        std::thread::spawn(move || {
            for stream in tcp.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut len = [0u8; 2];
                if stream.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
                if stream.read_exact(&mut msg).is_err() {
                    continue;
                }
                let Ok(query) = dns::parse_query(&msg) else {
                    continue;
                };
                tcp_log
                    .lock()
                    .unwrap()
                    .push((query.question.name.clone(), query.question.qtype));
                let answers: Vec<(Ipv4Addr, u32)> = tcp_table
                    .iter()
                    .filter(|(name, _, _)| *name == query.question.name)
                    .flat_map(|(_, addrs, ttl)| addrs.iter().map(|a| (*a, *ttl)))
                    .collect();
                let reply = dns::build_reply(&query, dns::NOERROR, &answers, 65535);
                let _ = stream.write_all(&(reply.len() as u16).to_be_bytes());
                let _ = stream.write_all(&reply);
            }
        });
        let (log, flag) = (Arc::clone(&asked), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !flag.load(Ordering::Relaxed) {
                let Ok((len, peer)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let Ok(query) = dns::parse_query(&buf[..len]) else {
                    continue;
                };
                let q = &query.question;
                log.lock().unwrap().push((q.name.clone(), q.qtype));
                // Every name under wild.test.example is the a.wild.test.example entry.
                let key = if q.name.ends_with(".wild.test.example") {
                    "a.wild.test.example"
                } else {
                    q.name.as_str()
                };
                let reply = match table.iter().find(|(name, _, _)| name == key) {
                    Some((_, addrs, ttl)) if q.qtype == dns::TYPE_A => {
                        let answers: Vec<(Ipv4Addr, u32)> =
                            addrs.iter().map(|a| (*a, *ttl)).collect();
                        dns::build_reply(&query, dns::NOERROR, &answers, dns::MAX_UDP)
                    }
                    Some(_) => dns::build_reply(&query, dns::NOERROR, &[], dns::MAX_UDP),
                    None => dns::build_reply(&query, dns::NXDOMAIN, &[], dns::MAX_UDP),
                };
                let mut reply = reply;
                if q.name == "big.test.example" {
                    reply = dns::build_reply(&query, dns::NOERROR, &[], dns::MAX_UDP);
                    reply[2] |= 0x02;
                }
                let _ = socket.send_to(&reply, peer);
            }
        });
        Upstream { addr, asked, stop }
    }

    fn asked_for(&self, name: &str) -> Vec<u16> {
        let asked = self.asked.lock().unwrap();
        asked
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, t)| *t)
            .collect()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A reply as the guest sees it: rcode, answer count, A records with TTLs.
#[derive(Debug)]
struct Reply {
    rcode: u8,
    count: u16,
    addresses: Vec<(Ipv4Addr, u32)>,
}

fn read_reply(msg: &[u8], id: u16, name: &str) -> Reply {
    assert_eq!(u16::from_be_bytes([msg[0], msg[1]]), id);
    let rcode = msg[3] & 0xF;
    let count = u16::from_be_bytes([msg[6], msg[7]]);
    let addresses = dns::parse_answer(msg, id, name)
        .map(|a| a.addresses)
        .unwrap_or_default();
    Reply {
        rcode,
        count,
        addresses,
    }
}

/// Asks `server:53` over UDP from a namespace (the guest's, or None for the host); None when
/// no reply came within 1.5 s.
fn ask(netns: Option<&str>, server: Ipv4Addr, name: &str, qtype: u16) -> Option<Reply> {
    let name = name.to_string();
    let netns = netns.map(str::to_string);
    in_netns(netns.as_deref(), move || {
        let socket = UdpSocket::bind(("0.0.0.0", 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        let id = 0x5a5a;
        // The guest's letter case: the reply must keep it.
        let asked = name.to_uppercase();
        socket
            .send_to(&dns::build_query(id, &asked, qtype), (server, 53))
            .unwrap();
        let mut buf = [0u8; 1500];
        let (len, _) = socket.recv_from(&mut buf).ok()?;
        let msg = &buf[..len];
        let wire_name = &msg[13..13 + asked.split('.').next().unwrap().len()];
        assert_eq!(
            wire_name,
            asked.split('.').next().unwrap().as_bytes(),
            "case kept"
        );
        Some(read_reply(msg, id, &name))
    })
}

/// The same over TCP (length-prefixed).
fn ask_tcp(netns: &str, server: Ipv4Addr, name: &str) -> Reply {
    let name = name.to_string();
    in_netns(Some(netns), move || {
        let mut stream =
            TcpStream::connect_timeout(&(server, 53).into(), Duration::from_secs(2)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let query = dns::build_query(7, &name, dns::TYPE_A);
        stream
            .write_all(&(query.len() as u16).to_be_bytes())
            .unwrap();
        stream.write_all(&query).unwrap();
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).unwrap();
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut msg).unwrap();
        read_reply(&msg, 7, &name)
    })
}

/// The addresses in set `set` of the listing.
fn set_elements(set: &str) -> Vec<Ipv4Addr> {
    let listing = nft_table();
    let Some(start) = listing.find(&format!("set {set} {{")) else {
        return Vec::new();
    };
    let block = &listing[start..];
    let block = &block[..block.find("\n\t}").unwrap_or(block.len())];
    block
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|word| word.parse::<Ipv4Addr>().ok())
        .collect()
}

/// Leases and releases for one test through the library; what is left is removed on drop.
struct Leases {
    state: StateDir,
    _dir: tempfile::TempDir,
    pool: Pool,
    names: Vec<String>,
}

impl Leases {
    fn new(pool: &str) -> Leases {
        let dir = tempfile::tempdir().unwrap();
        let leases = Leases {
            state: StateDir::new(dir.path()),
            _dir: dir,
            pool: Pool::parse(pool).unwrap(),
            names: Vec::new(),
        };
        // Leftovers of an earlier, killed run.
        let _ = rollbox::net::gc(&leases.state, &leases.pool);
        leases
    }

    fn lease(&mut self, name: &str, netns: &str, egress: &str) -> rollbox::net::NetInfo {
        self.names.push(name.to_string());
        rollbox::net::lease(
            &self.state,
            &LeaseRequest {
                name: name.to_string(),
                pool: self.pool,
                egress: egress.parse().unwrap(),
                dns: None,
                expose: Vec::new(),
                expose_on: Vec::new(),
                link: LinkKind::Veth {
                    netns: netns.to_string(),
                },
                resolver: true,
            },
        )
        .unwrap()
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = rollbox::net::release(&self.state, name);
        }
        let _ = rollbox::net::gc(&self.state, &self.pool);
    }
}

#[test]
fn hostnames_allow_only_what_the_resolver_answered_for_them() {
    if !prerequisites("hostnames_allow_only_what_the_resolver_answered_for_them") {
        return;
    }
    let tag = std::process::id() % 100_000;
    let mut internet = Netns::new(&format!("rbxt{tag}dnsi"));
    internet.uplink(&format!("rbxi{tag}n"), "198.18.24.1", INTERNET);
    let _open = Listener::start(Some(&internet.name), 8000, "I");
    let _closed = Listener::start(Some(&internet.name), 8001, "I");
    let upstream = Upstream::start(&[
        ("allowed.test.example", &[INTERNET], 1),
        (
            "rebind.test.example",
            &["10.226.9.9", "127.0.0.1", "198.18.24.9"],
            300,
        ),
        ("named.test.example", &["10.226.200.1"], 300),
        ("a.wild.test.example", &[INTERNET], 300),
        ("other.test.example", &[INTERNET], 300),
        ("big.test.example", &[INTERNET], 300),
    ]);
    let guest = Netns::new(&format!("rbxt{tag}dnsg"));
    let mut leases = Leases::new(POOL);
    let policy = "allowed.test.example:8000,rebind.test.example:8000,*.wild.test.example:8000,named.test.example,10.226.200.0/30:1,big.test.example:8000";
    let info = leases.lease("dnsguest", &guest.name, policy);
    let gateway = info.host_ip;
    assert!(
        info.kernel_ip_arg.ends_with(&format!(":{gateway}")),
        "the guest's DNS server is its gateway: {}",
        info.kernel_ip_arg
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let options = ResolverOptions {
        ttl_floor: Duration::from_secs(1),
        grace: Duration::from_secs(1),
        ..ResolverOptions::new(upstream.addr)
    };
    let site = Site {
        tap: info.tap.clone(),
        host_ip: info.host_ip,
        guest_ip: info.guest_ip,
    };
    let egress: Egress = policy.parse().unwrap();
    let resolver = Resolver::start(site, egress, options, runtime.handle()).unwrap();
    let g = guest.name.as_str();
    let set = |i: usize| format!("dns{i}_{}", info.tap);

    // Nothing is reachable before the name is resolved.
    assert!(connect(Some(g), INTERNET, 8000).is_err());
    // An allowed name: the upstream's answer, and then its address on the entry's port only.
    let reply = ask(Some(g), gateway, "allowed.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.rcode, dns::NOERROR);
    assert_eq!(reply.addresses, [(INTERNET.parse().unwrap(), 1)]);
    assert_eq!(
        set_elements(&set(0)),
        [INTERNET.parse::<Ipv4Addr>().unwrap()]
    );
    assert_eq!(
        connect(Some(g), INTERNET, 8000).map(|g| g.starts_with("I ")),
        Ok(true)
    );
    assert!(connect(Some(g), INTERNET, 8001).is_err(), "another port");
    // It expires: TTL 1 s, floor 1 s, grace 1 s.
    std::thread::sleep(Duration::from_millis(2600));
    assert_eq!(set_elements(&set(0)), Vec::<Ipv4Addr>::new());
    assert!(connect(Some(g), INTERNET, 8000).is_err(), "expired");
    // Over TCP too.
    let reply = ask_tcp(g, gateway, "allowed.test.example");
    assert_eq!(reply.addresses, [(INTERNET.parse().unwrap(), 1)]);
    assert_eq!(
        connect(Some(g), INTERNET, 8000).map(|g| g.starts_with("I ")),
        Ok(true)
    );

    // A name not on the list: NXDOMAIN, and the upstream never hears of it.
    let reply = ask(Some(g), gateway, "other.test.example", dns::TYPE_A).unwrap();
    assert_eq!((reply.rcode, reply.count), (dns::NXDOMAIN, 0));
    assert_eq!(upstream.asked_for("other.test.example"), Vec::<u16>::new());
    // AAAA of an allowed name: empty, not forwarded.
    let reply = ask(Some(g), gateway, "allowed.test.example", 28).unwrap();
    assert_eq!((reply.rcode, reply.count), (dns::NOERROR, 0));
    assert!(!upstream.asked_for("allowed.test.example").contains(&28));
    // Rebinding: the private and loopback addresses of an allowed name are dropped from the
    // answer and the set; a range a CIDR entry names is kept.
    let reply = ask(Some(g), gateway, "rebind.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.addresses, [("198.18.24.9".parse().unwrap(), 300)]);
    assert_eq!(
        set_elements(&set(1)),
        ["198.18.24.9".parse::<Ipv4Addr>().unwrap()]
    );
    let reply = ask(Some(g), gateway, "named.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.addresses, [("10.226.200.1".parse().unwrap(), 300)]);
    assert_eq!(
        set_elements(&set(3)),
        ["10.226.200.1".parse::<Ipv4Addr>().unwrap()]
    );
    // A wildcard: names under the domain, not the domain itself.
    let reply = ask(Some(g), gateway, "a.wild.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.addresses.len(), 1);
    assert_eq!(
        set_elements(&set(2)),
        [INTERNET.parse::<Ipv4Addr>().unwrap()]
    );
    let reply = ask(Some(g), gateway, "wild.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.rcode, dns::NXDOMAIN);
    // Figures: a name answered for the first time (upstream, then the set written), one
    // looked up again (the set holds it: no nft transaction), and one not on the list.
    let median = |names: Vec<String>| {
        let mut times: Vec<Duration> = names
            .into_iter()
            .map(|name| {
                let started = std::time::Instant::now();
                let reply = ask(Some(g), gateway, &name, dns::TYPE_A).unwrap();
                let elapsed = started.elapsed();
                assert_ne!(reply.rcode, dns::SERVFAIL, "{name}");
                elapsed
            })
            .collect();
        times.sort();
        times[times.len() / 2].as_secs_f64() * 1000.0
    };
    let first = median((0..15).map(|i| format!("n{i}.wild.test.example")).collect());
    let again = median(vec!["n0.wild.test.example".to_string(); 15]);
    let refused = median(vec!["other.test.example".to_string(); 15]);
    println!(
        "resolver, median of 15 queries from the guest's namespace (a thread and setns each): first answer {first:.1} ms, again {again:.2} ms, not listed {refused:.2} ms"
    );
    assert_eq!(
        set_elements(&set(2)),
        [INTERNET.parse::<Ipv4Addr>().unwrap()]
    );
    // An upstream answer truncated over UDP is fetched again over TCP.
    let reply = ask(Some(g), gateway, "big.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.addresses, [(INTERNET.parse().unwrap(), 300)]);
    assert_eq!(
        upstream.asked_for("big.test.example"),
        [dns::TYPE_A, dns::TYPE_A]
    );
    assert_eq!(
        set_elements(&set(4)),
        [INTERNET.parse::<Ipv4Addr>().unwrap()]
    );
    // Queries that do not come from the guest's address get nothing (the host's own).
    assert!(ask(None, gateway, "allowed.test.example", dns::TYPE_A).is_none());

    // A policy change without the name: its access goes at once, in the same transaction;
    // what was answered for names still allowed is kept.
    let _ = ask(Some(g), gateway, "allowed.test.example", dns::TYPE_A).unwrap();
    assert_eq!(
        connect(Some(g), INTERNET, 8000).map(|g| g.starts_with("I ")),
        Ok(true)
    );
    let new: Egress = "rebind.test.example:8000".parse().unwrap();
    let state = &leases.state;
    resolver
        .set_egress(&new, |keep| {
            rollbox::net::set_egress(state, "dnsguest", &new, keep)
        })
        .unwrap();
    assert!(
        connect(Some(g), INTERNET, 8000).is_err(),
        "no longer allowed"
    );
    assert_eq!(
        set_elements(&set(0)),
        ["198.18.24.9".parse::<Ipv4Addr>().unwrap()]
    );
    let listing = nft_table();
    for gone in [set(1), set(2), set(3), set(4)] {
        assert!(
            !listing.contains(&format!("set {gone} ")),
            "{gone}: {listing}"
        );
    }
    let reply = ask(Some(g), gateway, "allowed.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.rcode, dns::NXDOMAIN);
    // Under `all` every A question is forwarded (such a guest may ask any resolver anyway),
    // and no hostname set is left.
    let all = Egress::All(Vec::new());
    resolver
        .set_egress(&all, |keep| {
            rollbox::net::set_egress(state, "dnsguest", &all, keep)
        })
        .unwrap();
    let reply = ask(Some(g), gateway, "other.test.example", dns::TYPE_A).unwrap();
    assert_eq!(reply.addresses, [(INTERNET.parse().unwrap(), 300)]);
    assert_eq!(upstream.asked_for("other.test.example"), [dns::TYPE_A]);
    assert!(!nft_table().contains(&format!("set {} ", set(0))));

    // Release: no set, chain or resolver left.
    drop(resolver);
    assert!(rollbox::net::release(&leases.state, "dnsguest").unwrap());
    let listing = nft_table();
    assert!(!listing.contains(&info.tap), "{listing}");
    assert!(!rollbox::net::tap::exists(&info.tap));
}

#[test]
fn hostnames_need_the_resolver_and_gc_removes_their_sets() {
    if !prerequisites("hostnames_need_the_resolver_and_gc_removes_their_sets") {
        return;
    }
    let tag = std::process::id() % 100_000;
    let guest = Netns::new(&format!("rbxt{tag}dnsh"));
    let mut leases = Leases::new(POOL_GC);
    // Without the resolver, a policy with hostnames is refused, with nothing made.
    let request = LeaseRequest {
        name: "plain".to_string(),
        pool: leases.pool,
        egress: "pypi.org:443".parse().unwrap(),
        dns: None,
        expose: Vec::new(),
        expose_on: Vec::new(),
        link: LinkKind::Veth {
            netns: guest.name.clone(),
        },
        resolver: false,
    };
    let error = rollbox::net::lease(&leases.state, &request).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("names hostnames: only `rollbox serve` resolves them"),
        "{error}"
    );
    assert_eq!(rollbox::net::leases(&leases.state).unwrap().len(), 0);
    // A sandbox without the resolver cannot be given hostnames later.
    let plain = LeaseRequest {
        egress: "1.1.1.1".parse().unwrap(),
        ..request
    };
    rollbox::net::lease(&leases.state, &plain).unwrap();
    leases.names.push("plain".to_string());
    let error = rollbox::net::set_egress(
        &leases.state,
        "plain",
        &"pypi.org:443".parse().unwrap(),
        &[],
    )
    .unwrap_err();
    assert!(error.to_string().contains("has no resolver"), "{error}");
    assert!(rollbox::net::release(&leases.state, "plain").unwrap());
    // A lease whose state is lost: gc removes its chains and its hostname sets.
    let info = leases.lease("lost", &guest.name, "a.example.org,b.example.org:80");
    let listing = nft_table();
    assert!(
        listing.contains(&format!("set dns1_{} ", info.tap)),
        "{listing}"
    );
    for dir in ["leases", "names"] {
        let dir = leases.state.root().join(dir);
        for entry in std::fs::read_dir(&dir).unwrap() {
            std::fs::remove_file(entry.unwrap().path()).unwrap();
        }
    }
    let removed = rollbox::net::gc(&leases.state, &leases.pool).unwrap();
    assert!(removed.iter().any(|r| r.contains(&info.tap)), "{removed:?}");
    let listing = nft_table();
    assert!(!listing.contains(&info.tap), "{listing}");
}
