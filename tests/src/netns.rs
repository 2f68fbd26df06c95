//! Network namespaces for host tests of sandbox networks: a namespace behind a veth pair
//! stands in for a guest (`rollbox net up --veth-netns`) or for an internet host, with TCP
//! listeners and connections made from inside it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Whether this host can make sandbox networks: root, /dev/net/tun (opened), nft and ip.
/// Records the skip of `test` (a failure under ROLLBOX_REQUIRE_ALL=1) when not.
pub fn prerequisites(test: &str) -> bool {
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let missing = if !root {
        Some("needs root (creates taps and nftables rules)".to_string())
    } else if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
    {
        Some(format!("needs /dev/net/tun ({e})"))
    } else if !works("nft", &["--version"]) {
        Some("needs nft (apt-get install nftables)".to_string())
    } else if !works("ip", &["-V"]) {
        Some("needs ip (apt-get install iproute2)".to_string())
    } else {
        None
    };
    match missing {
        Some(reason) => {
            crate::skip(test, &reason);
            false
        }
        None => true,
    }
}

/// Runs `ip ARGS`; panics with its stderr if it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `nft list table inet rollbox`: the host's rollbox rules, as text (empty without the table).
pub fn nft_table() -> String {
    let out = Command::new("nft")
        .args(["list", "table", "inet", "rollbox"])
        .output()
        .expect("run nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A network namespace and the host-side veths made for it; removed on drop.
pub struct Netns {
    pub name: String,
    links: Vec<String>,
}

impl Netns {
    pub fn new(name: &str) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        ip(&["netns", "add", name]);
        ip(&["-n", name, "link", "set", "lo", "up"]);
        Netns {
            name: name.to_string(),
            links: Vec::new(),
        }
    }

    /// A veth pair `host_side` (root namespace, `host_addr`/30) to `eth0` in this namespace
    /// (`addr`/30, default route via `host_addr`).
    pub fn uplink(&mut self, host_side: &str, host_addr: &str, addr: &str) {
        let _ = Command::new("ip").args(["link", "del", host_side]).output();
        ip(&[
            "link", "add", host_side, "type", "veth", "peer", "name", "eth0", "netns", &self.name,
        ]);
        self.links.push(host_side.to_string());
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", host_side]);
        ip(&["link", "set", host_side, "up"]);
        let cidr = format!("{addr}/30");
        ip(&["-n", &self.name, "addr", "add", &cidr, "dev", "eth0"]);
        ip(&["-n", &self.name, "link", "set", "eth0", "up"]);
        ip(&[
            "-n", &self.name, "route", "add", "default", "via", host_addr,
        ]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for link in &self.links {
            let _ = Command::new("ip").args(["link", "del", link]).output();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Runs `f` on a new thread that has entered network namespace `netns` (None: stay in the
/// root namespace). Sockets belong to the namespace of the thread that makes them.
pub fn in_netns<T: Send + 'static>(
    netns: Option<&str>,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let netns = netns.map(|n| format!("/run/netns/{n}"));
    std::thread::spawn(move || {
        if let Some(path) = netns {
            let file = std::fs::File::open(&path).expect("open the namespace");
            // SAFETY: setns on a descriptor we hold; it changes only this thread's namespace.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        }
        f()
    })
    .join()
    .expect("the namespace thread panicked")
}

/// A TCP server in a namespace that answers each connection with "<label> <peer address>";
/// stops when dropped.
pub struct Listener {
    stop: Arc<AtomicBool>,
}

impl Listener {
    pub fn start(netns: Option<&str>, port: u16, label: &str) -> Listener {
        let stop = Arc::new(AtomicBool::new(false));
        let label = label.to_string();
        let flag = Arc::clone(&stop);
        let listener = in_netns(netns, move || {
            let listener = TcpListener::bind(("0.0.0.0", port)).expect("bind");
            listener.set_nonblocking(true).expect("nonblocking");
            listener
        });
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut stream, peer)) => {
                        let _ = stream.set_nonblocking(false);
                        let _ = write!(stream, "{label} {}", peer.ip());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Listener { stop }
    }

    /// Stops when `stop` is set (for a caller's own server thread).
    pub fn from_flag(stop: Arc<AtomicBool>) -> Listener {
        Listener { stop }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Connects from a namespace (None: the root one); the server's greeting, or why not.
pub fn connect(netns: Option<&str>, addr: &str, port: u16) -> Result<String, String> {
    let ip: Ipv4Addr = addr
        .parse()
        .map_err(|_| format!("{addr}: not an IPv4 address"))?;
    let target = SocketAddr::new(ip.into(), port);
    in_netns(netns, move || {
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_millis(700))
            .map_err(|e| format!("{target}: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(|e| e.to_string())?;
        let mut greeting = String::new();
        stream
            .read_to_string(&mut greeting)
            .map_err(|e| format!("{target}: {e}"))?;
        Ok(greeting)
    })
}
