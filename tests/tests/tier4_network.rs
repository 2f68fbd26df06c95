//! Tier 4: virtio-net with Linux guests. A host tap per guest, the guest's address from the
//! kernel's `ip=` argument (set by the agent), traffic both ways through the real Linux
//! virtio-net driver, and the interface across snapshot, restore and fork.
//!
//! Runs in the nested lab like tier4_linux (scripts/test.sh loads `tun` in L1); elsewhere every
//! test skips with its reason. Throughput figures go to stderr and are never asserted.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox_tests::linux::*;

/// A tap on the host with a /30: the host is `.1`, the guest `.2`. Removed on drop.
struct HostTap {
    name: String,
    host: Ipv4Addr,
    guest: Ipv4Addr,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl HostTap {
    /// Tap `name` with the /30 whose third octet is `subnet` (10.199.<subnet>.0/30).
    fn new(name: &str, subnet: u8) -> HostTap {
        let _ = Command::new("ip").args(["link", "del", name]).output();
        ip(&["tuntap", "add", name, "mode", "tap", "vnet_hdr"]);
        let tap = HostTap {
            name: name.into(),
            host: Ipv4Addr::new(10, 199, subnet, 1),
            guest: Ipv4Addr::new(10, 199, subnet, 2),
        };
        ip(&["addr", "add", &format!("{}/30", tap.host), "dev", name]);
        ip(&["link", "set", name, "up"]);
        tap
    }

    /// The guest's `ip=` kernel argument.
    fn kernel_arg(&self) -> String {
        format!(
            "ip={}::{}:255.255.255.252::eth0:off:{}",
            self.guest, self.host, self.host
        )
    }

    /// The guest MAC: 06:00 and the guest's IPv4 address.
    fn mac(&self) -> String {
        let o = self.guest.octets();
        format!("06:00:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
    }

    fn net_flag(&self) -> String {
        format!("{},mac={}", self.name, self.mac())
    }
}

impl Drop for HostTap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

/// Fetches `path` from the guest's HTTP server, retrying while it starts.
fn http_get(addr: SocketAddr, path: &str) -> String {
    try_http_get(addr, path).unwrap_or_else(|e| panic!("{e}"))
}

/// GET `path` from `addr`, retrying for up to 60 s while the connection fails.
fn try_http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
            Ok(mut stream) => {
                stream
                    .set_read_timeout(Some(Duration::from_secs(30)))
                    .expect("timeout");
                write!(stream, "GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n").expect("request");
                let mut answer = String::new();
                stream.read_to_string(&mut answer).expect("answer");
                return Ok(answer);
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("http {addr}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => return Err(format!("http {addr}: {e}")),
        }
    }
}

/// Boots the busybox guest on `tap`.
fn boot_on(work: &Path, name: &str, fx: &Fixtures, tap: &HostTap) -> LinuxVm {
    LinuxVm::boot(
        work,
        name,
        &fx.path("OUR_VMLINUX"),
        &fx.path("BUSYBOX_ROOTFS"),
        &agent_cmdline(&tap.kernel_arg()),
        // 512 MiB: the 64 MiB transfers sit in the guest's /tmp (tmpfs, half of memory).
        &[
            "--vcpus",
            "2",
            "--memory-mib",
            "512",
            "--net",
            &tap.net_flag(),
        ],
    )
}

/// Starts busybox httpd in the guest serving `body` at /index.html on port 8080.
fn serve_http(agent: &Agent, body: &str) {
    agent.sh(&format!(
        "mkdir -p /tmp/www && echo {body} > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
    ));
}

/// Serves a fixed HTTP answer naming `port` on 0.0.0.0:`port` inside network namespace
/// `netns` (a thread that entered it), until the process ends.
fn serve_in_netns(netns: &str, port: u16) {
    let path = format!("/var/run/netns/{netns}");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).expect("open netns");
        // SAFETY: setns moves only this thread into the namespace; the fd is valid.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let listener = TcpListener::bind(("0.0.0.0", port)).expect("bind in netns");
        ready_tx.send(()).expect("ready");
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let body = format!("port-{port}-answers\n");
            let _ = write!(
                conn,
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("netns server ready");
}

/// A DNS server on UDP port 53 inside network namespace `netns`: `name` has one A record,
/// `addr`; every other name is NXDOMAIN. Returns the names it was asked, as they come.
fn dns_in_netns(
    netns: &str,
    name: &'static str,
    addr: Ipv4Addr,
) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&asked);
    let path = format!("/var/run/netns/{netns}");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).expect("open netns");
        // SAFETY: setns moves only this thread into the namespace; the fd is valid.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        let socket = std::net::UdpSocket::bind(("0.0.0.0", 53)).expect("bind 53 in netns");
        ready_tx.send(()).expect("ready");
        let mut buf = [0u8; 512];
        loop {
            let Ok((n, peer)) = socket.recv_from(&mut buf) else {
                continue;
            };
            // Header (12 bytes), then one uncompressed question: labels, type, class.
            let mut labels = Vec::new();
            let mut at = 12;
            while at < n && buf[at] != 0 {
                let len = usize::from(buf[at]);
                let end = (at + 1 + len).min(n);
                labels.push(String::from_utf8_lossy(&buf[at + 1..end]).to_lowercase());
                at = end;
            }
            let question_end = at + 5;
            if question_end > n {
                continue;
            }
            let asked_name = labels.join(".");
            let qtype = u16::from_be_bytes([buf[at + 1], buf[at + 2]]);
            seen.lock().expect("names").push(asked_name.clone());
            let mut reply = buf[..question_end].to_vec();
            reply[2] = 0x84 | (buf[2] & 0x01); // a response, authoritative, RD copied
            let found = asked_name == name;
            reply[3] = if found { 0x00 } else { 0x03 }; // NOERROR or NXDOMAIN
            reply[6..12].copy_from_slice(&[0, 0, 0, 0, 0, 0]);
            if found && qtype == 1 {
                reply[7] = 1; // one answer: the question's name, A, IN, TTL 300, the address
                reply.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 1, 0x2c, 0, 4]);
                reply.extend_from_slice(&addr.octets());
            }
            let _ = socket.send_to(&reply, peer);
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("netns DNS server ready");
    asked
}

/// A stand-in for the internet: a network namespace behind a veth pair, `NET.2/24` there and
/// `NET.1/24` on the host side. Removed on drop.
struct Internet {
    netns: &'static str,
    veth: &'static str,
}

impl Internet {
    /// Namespace `rbxext` at 10.98.0.2 (a private address: `all` does not reach it).
    fn new() -> Internet {
        Internet::at("rbxext", "rbxie", "10.98.0")
    }

    /// Namespace `netns` at `net`.2, behind veth `veth`0 (host) and `veth`1.
    fn at(netns: &'static str, veth: &'static str, net: &str) -> Internet {
        let (host_end, far_end) = (format!("{veth}0"), format!("{veth}1"));
        let _ = Command::new("ip").args(["netns", "del", netns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_end]).output();
        ip(&["netns", "add", netns]);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", &far_end,
        ]);
        ip(&["link", "set", &far_end, "netns", netns]);
        ip(&["addr", "add", &format!("{net}.1/24"), "dev", &host_end]);
        ip(&["link", "set", &host_end, "up"]);
        let far_addr = format!("{net}.2/24");
        let gateway = format!("{net}.1");
        for args in [
            &["addr", "add", &far_addr, "dev", &far_end][..],
            &["link", "set", &far_end, "up"],
            &["link", "set", "lo", "up"],
            &["route", "add", "default", "via", &gateway],
        ] {
            let mut all = vec!["netns", "exec", netns, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        }
        Internet { netns, veth }
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let host_end = format!("{}0", self.veth);
        let _ = Command::new("ip").args(["link", "del", &host_end]).output();
        let _ = Command::new("ip")
            .args(["netns", "del", self.netns])
            .output();
    }
}

/// Pushes a `docker save` archive of one layer to a plain-HTTP registry with curl (L1 has no
/// dockerd): the config and the gzip'ed layer as blobs, then a schema-2 manifest under the tag.
/// Arguments: archive, registry URL, repository, tag.
const PUSH_SCRIPT: &str = r#"set -eu
tar=$1 base=$2 name=$3 tag=$4
work=$(mktemp -d)
cd "$work"
tar -xf "$tar"
config=$(sed -n 's/.*"Config":"\([^"]*\)".*/\1/p' manifest.json)
layer=$(sed -n 's/.*"Layers":\["\([^"]*\)"\].*/\1/p' manifest.json)
gzip -n -c "$layer" > layer.tar.gz
up() {
  digest=sha256:$(sha256sum "$1" | cut -d' ' -f1)
  location=$(curl -sfS -D - -o /dev/null -X POST "$base/v2/$name/blobs/uploads/" | tr -d '\r' | sed -n 's/^[Ll]ocation: //p')
  case $location in http*) ;; *) location=$base$location ;; esac
  case $location in *\?*) sep='&' ;; *) sep='?' ;; esac
  curl -sfS -X PUT -H 'Content-Type: application/octet-stream' --data-binary @"$1" "$location${sep}digest=$digest" >/dev/null
  echo "$digest"
}
config_digest=$(up "$config")
layer_digest=$(up layer.tar.gz)
printf '{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","config":{"mediaType":"application/vnd.docker.container.image.v1+json","size":%s,"digest":"%s"},"layers":[{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","size":%s,"digest":"%s"}]}' \
  "$(stat -c %s "$config")" "$config_digest" "$(stat -c %s layer.tar.gz)" "$layer_digest" > pushed.json
curl -sfS -X PUT -H 'Content-Type: application/vnd.docker.distribution.manifest.v2+json' --data-binary @pushed.json "$base/v2/$name/manifests/$tag"
cd /
rm -rf "$work"
"#;

/// The host's `docker-registry` (Debian's package) serving plain HTTP on `addr` inside network
/// namespace `netns`, its storage in a directory of its own; killed on drop.
struct NetnsRegistry {
    child: std::process::Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl NetnsRegistry {
    fn start(netns: &str, addr: SocketAddr) -> NetnsRegistry {
        let dir = tempfile::tempdir().expect("registry dir");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 0.0.0.0:{}\n",
                dir.path().join("storage").display(),
                addr.port()
            ),
        )
        .expect("registry config");
        let log = std::fs::File::create(dir.path().join("registry.log")).expect("registry log");
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "docker-registry", "serve"])
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn docker-registry (Debian package docker-registry)");
        let mut registry = NetnsRegistry { child, addr, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err() {
            if let Ok(Some(status)) = registry.child.try_wait() {
                panic!("docker-registry ended ({status}):\n{}", registry.log());
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on {addr}:\n{}",
                registry.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        registry
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Pushes `archive` (a `docker save` of one layer) as `repository:tag`.
    fn push(&self, archive: &Path, repository: &str, tag: &str) {
        let out = Command::new("sh")
            .args(["-c", PUSH_SCRIPT, "push"])
            .arg(archive)
            .arg(format!("http://{}", self.addr))
            .args([repository, tag])
            .output()
            .expect("run the push script");
        assert!(
            out.status.success(),
            "push {repository}:{tag}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
    }
}

impl Drop for NetnsRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `rollbox net` with a private state directory; `down` on drop.
struct SandboxNet {
    state: tempfile::TempDir,
    name: String,
    info: serde_json::Value,
}

impl SandboxNet {
    fn up(name: &str, extra: &[&str]) -> SandboxNet {
        let state = tempfile::tempdir().expect("state dir");
        let out = Command::new(rollbox_tests::rollbox_binary())
            .args(["net", "up", name, "--state-dir"])
            .arg(state.path())
            .args(extra)
            .output()
            .expect("rollbox net up");
        assert!(
            out.status.success(),
            "rollbox net up: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let info = serde_json::from_slice(&out.stdout).expect("net up json");
        SandboxNet {
            state,
            name: name.into(),
            info,
        }
    }

    fn field(&self, key: &str) -> String {
        self.info[key]
            .as_str()
            .unwrap_or_else(|| panic!("rollbox net up printed no {key}: {}", self.info))
            .to_string()
    }
}

impl Drop for SandboxNet {
    fn drop(&mut self) {
        let _ = Command::new(rollbox_tests::rollbox_binary())
            .args(["net", "down", &self.name, "--state-dir"])
            .arg(self.state.path())
            .output();
    }
}

const MIB: usize = 1 << 20;

mod tier4 {
    use super::*;
    use rollbox_agent_protocol::NetworkConfig;

    #[test]
    fn a_guest_on_a_tap_is_addressed_reaches_the_host_and_moves_64_mib_each_way() {
        let Some(fx) = fixtures("tier4::a_guest_on_a_tap_is_addressed") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let tap = HostTap::new("rbxt4a", 10);
        let mut vm = boot_on(work.path(), "net", &fx, &tap);
        let agent = vm.agent();

        // The agent configured the interface from ip=, and lo is up.
        let addr = agent.sh("ip -4 addr show eth0");
        assert!(addr.contains(&format!("inet {}/30", tap.guest)), "{addr}");
        assert!(agent.sh("ip link show eth0").contains(&tap.mac()));
        assert!(agent
            .sh("ip route")
            .contains(&format!("default via {}", tap.host)));
        assert_eq!(
            agent.sh("cat /etc/resolv.conf"),
            format!("nameserver {}", tap.host)
        );
        assert!(agent.sh("ip link show lo").contains("UP"));
        agent.sh("ping -c 1 -W 5 127.0.0.1 >/dev/null");
        agent.sh(&format!("ping -c 2 -W 10 {} >/dev/null", tap.host));

        // The host reaches a server in the guest.
        serve_http(&agent, "hello-from-the-guest");
        let answer = http_get(SocketAddr::from((tap.guest, 8080)), "/index.html");
        assert!(answer.contains("200 OK"), "{answer}");
        assert!(answer.contains("hello-from-the-guest"), "{answer}");

        // 64 MiB guest -> host over TCP, checked by SHA-256.
        let listener = TcpListener::bind((tap.host, 0)).expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let receiver = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut data = Vec::new();
            conn.read_to_end(&mut data).expect("receive");
            data
        });
        let t = Instant::now();
        let sent = agent.sh(&format!(
            "head -c {} /dev/urandom > /tmp/out && nc {} {port} < /tmp/out && sha256sum /tmp/out | cut -d' ' -f1 && rm /tmp/out",
            64 * MIB,
            tap.host
        ));
        let up = t.elapsed().as_secs_f64();
        let got = receiver.join().expect("receiver");
        assert_eq!(got.len(), 64 * MIB);
        assert_eq!(sha256_hex(&got), sent);

        // 64 MiB host -> guest.
        let data = pattern(64 * MIB, 7);
        // In the background of a finished exec (the agent ends a started exec's processes when
        // its handle goes); nc's stdin stays open, or busybox nc closes the connection at once.
        agent.sh("(sleep 600 | nc -l -p 5002 > /tmp/in) >/dev/null 2>&1 &");
        let t = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut conn = loop {
            match TcpStream::connect((tap.guest, 5002)) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("connect to the guest's nc: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(300));
                }
                Err(e) => panic!("connect to the guest's nc: {e}"),
            }
        };
        conn.write_all(&data).expect("send");
        drop(conn);
        let mut received = String::new();
        for _ in 0..120 {
            received = agent.sh("wc -c < /tmp/in");
            if received == (64 * MIB).to_string() {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let down = t.elapsed().as_secs_f64();
        assert_eq!(received, (64 * MIB).to_string());
        assert_eq!(
            agent.sh("sha256sum /tmp/in | cut -d' ' -f1"),
            sha256_hex(&data)
        );
        eprintln!(
            "virtio-net: 64 MiB guest->host {:.1} MiB/s (urandom and nc included), host->guest {:.1} MiB/s (nested lab)",
            64.0 / up,
            64.0 / down
        );
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
    }

    #[test]
    fn the_interface_survives_snapshot_and_restore_onto_another_tap() {
        let Some(fx) = fixtures("tier4::the_interface_survives_snapshot_and_restore") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let snapshot = work.path().join("snap");
        {
            let tap = HostTap::new("rbxt4b", 11);
            let mut vm = boot_on(work.path(), "parent", &fx, &tap);
            let agent = vm.agent();
            serve_http(&agent, "served-before-the-snapshot");
            let answer = http_get(SocketAddr::from((tap.guest, 8080)), "/index.html");
            assert!(answer.contains("served-before-the-snapshot"), "{answer}");
            vm.snapshot(&snapshot);
            vm.kill();
        }
        // The same addresses on a new tap: the restored guest and its server keep working.
        let tap = HostTap::new("rbxt4c", 11);
        let mut vm = LinuxVm::restore(
            work.path(),
            "restored",
            &snapshot,
            &["--net-override", &format!("eth0={}", tap.name)],
        );
        let agent = vm.agent();
        let answer = http_get(SocketAddr::from((tap.guest, 8080)), "/index.html");
        assert!(answer.contains("served-before-the-snapshot"), "{answer}");
        agent.sh(&format!("ping -c 2 -W 10 {} >/dev/null", tap.host));
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
    }

    #[test]
    fn rollbox_net_egress_policy_holds_for_a_real_guest() {
        let Some(fx) = fixtures("tier4::rollbox_net_egress_policy_holds_for_a_real_guest") else {
            return;
        };
        let _internet = Internet::new();
        serve_in_netns("rbxext", 8000);
        serve_in_netns("rbxext", 9000);
        let net = SandboxNet::up(
            "egress-test",
            &[
                "--pool",
                "10.201.0.0/24",
                "--egress",
                "10.98.0.2:8000",
                "--expose",
                "18080:8080",
            ],
        );
        let work = tempfile::tempdir().expect("tempdir");
        let mut vm = LinuxVm::boot(
            work.path(),
            "egress",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(&net.field("kernel_ip_arg")),
            &[
                "--vcpus",
                "1",
                "--memory-mib",
                "192",
                "--net",
                &format!("{},mac={}", net.field("tap"), net.field("guest_mac")),
            ],
        );
        let agent = vm.agent();
        // Allowed: the listed address and port.
        // busybox nc, not wget: the image's busybox wget crashes writing to stdout.
        let fetch = |addr: &str, port: u16| {
            agent.sh_status(&format!(
                "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {addr} {port}"
            ))
        };
        let (status, allowed, _) = fetch("10.98.0.2", 8000);
        assert_eq!(status, Some(0), "the allow-listed address and port");
        assert!(allowed.contains("port-8000-answers"), "{allowed}");
        // Denied: another port of the same host, and the host's own services.
        let (_, denied, _) = fetch("10.98.0.2", 9000);
        assert!(
            !denied.contains("answers"),
            "port 9000 is not in the allow-list: {denied}"
        );
        let host_service = TcpListener::bind(("10.98.0.1", 8001)).expect("host service");
        let (status, _, _) = fetch("10.98.0.1", 8001);
        assert_ne!(
            status,
            Some(0),
            "the host's other addresses are closed to guests"
        );
        drop(host_service);
        // The gateway answers pings; the host reaches the guest.
        agent.sh(&format!(
            "ping -c 1 -W 10 {} >/dev/null",
            net.field("host_ip")
        ));
        serve_http(&agent, "reachable-from-the-host");
        let guest: Ipv4Addr = net.field("guest_ip").parse().expect("guest ip");
        let answer = http_get(SocketAddr::from((guest, 8080)), "/index.html");
        assert!(answer.contains("reachable-from-the-host"), "{answer}");
        // The exposed port: host port 18080 on the host's own (non-loopback) address.
        let answer = http_get(SocketAddr::from(([10, 98, 0, 1], 18080)), "/index.html");
        assert!(answer.contains("reachable-from-the-host"), "{answer}");
        agent.start("poweroff -f");
        assert_eq!(vm.wait().code(), Some(0), "{}", vm.report());
    }

    /// Clones per fork: 8 in CI, `ROLLBOX_NET_FORK_CLONES` (e.g. 16) by hand. Forks of 16
    /// passed in the lab, but L1's kernel (under TCG) crashed in about half of those runs
    /// ("TASK stack guard page was hit" in KVM_RUN), which would fail CI for the lab's sake.
    fn clone_count() -> u8 {
        std::env::var("ROLLBOX_NET_FORK_CLONES")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=64).contains(n))
            .unwrap_or(8)
    }

    #[test]
    fn forked_clones_of_a_networked_guest_each_answer_at_their_own_address() {
        let Some(fx) = fixtures("tier4::forked_clones_each_answer_at_their_own_address") else {
            return;
        };
        let work = tempfile::tempdir().expect("tempdir");
        let parent_tap = HostTap::new("rbxt4p", 20);
        let mut parent = LinuxVm::boot(
            work.path(),
            "parent",
            &fx.path("OUR_VMLINUX"),
            &fx.path("BUSYBOX_ROOTFS"),
            &agent_cmdline(&parent_tap.kernel_arg()),
            &[
                "--vcpus",
                "1",
                "--memory-mib",
                "192",
                "--net",
                &parent_tap.net_flag(),
            ],
        );
        let agent = parent.agent();
        serve_http(&agent, "parent");
        drop(agent);
        // One tap, one /30 and one MAC per clone.
        let clones_wanted = clone_count();
        let taps: Vec<HostTap> = (0..clones_wanted)
            .map(|i| HostTap::new(&format!("rbxf{i}"), 30 + i))
            .collect();
        let started = Instant::now();
        let mut clones =
            parent.clones(usize::from(clones_wanted), &work.path().join("fork"), |i| {
                vec![
                    "--net-override".into(),
                    format!("eth0={},mac={}", taps[i].name, taps[i].mac()),
                ]
            });
        for (clone, tap) in clones.iter_mut().zip(&taps) {
            let agent = clone.agent();
            let configured = agent.runtime.block_on(async {
                tokio::time::timeout(
                    CALL_TIMEOUT,
                    agent.client.configure_network(&NetworkConfig {
                        device: None,
                        address: format!("{}/30", tap.guest),
                        gateway: Some(tap.host.to_string()),
                        dns: vec![tap.host.to_string()],
                        mac: Some(tap.mac()),
                    }),
                )
                .await
            });
            let applied = match configured {
                Ok(Ok(applied)) => applied,
                Ok(Err(e)) => panic!("configure_network of {}: {e}\n{}", tap.name, clone.report()),
                Err(_) => panic!(
                    "configure_network of {}: no answer within {CALL_TIMEOUT:?}\n{}",
                    tap.name,
                    clone.report()
                ),
            };
            assert!(applied.applied, "{applied:?}");
            assert!(agent.sh("ip link show eth0").contains(&tap.mac()));
            agent.sh(&format!("echo {} > /tmp/www/index.html", tap.name));
        }
        // Every clone serves its own page at its own address, through its own tap.
        for (clone, tap) in clones.iter().zip(&taps) {
            let answer = try_http_get(SocketAddr::from((tap.guest, 8080)), "/index.html")
                .unwrap_or_else(|e| panic!("{e}\n{}", clone.report()));
            assert!(answer.contains(&tap.name), "{}: {answer}", tap.name);
        }
        eprintln!(
            "fork of {clones_wanted} networked clones: all re-addressed and serving {:.2} s after the pause (nested lab)",
            started.elapsed().as_secs_f64()
        );
        // The parent still serves at its address.
        let answer = http_get(SocketAddr::from((parent_tap.guest, 8080)), "/index.html");
        assert!(answer.contains("parent"), "{answer}");
    }

    /// `rollbox serve` in L1 with a pool and lease directory of its own (the lab's
    /// [`LabDaemon`]: every sandbox is deleted on drop, which releases its network).
    struct NetDaemon {
        lab: LabDaemon,
    }

    impl NetDaemon {
        fn start() -> NetDaemon {
            let lab = LabDaemon::start(
                "net-lab-key-0123",
                &[
                    "--net-pool".into(),
                    "10.202.0.0/24".into(),
                    "--net-state-dir".into(),
                    "/tmp/rollbox-net-lab".into(),
                    // The internet's DNS server (dns_in_netns): sandboxes' resolvers ask it.
                    "--sandbox-dns".into(),
                    "198.51.100.2".into(),
                    // The lab's agents answer slowly.
                    "--agent-timeout".into(),
                    "60".into(),
                ],
                None,
            );
            NetDaemon { lab }
        }

        fn log(&self) -> String {
            self.lab.log()
        }

        fn call(
            &self,
            method: &str,
            path: &str,
            body: Option<serde_json::Value>,
        ) -> (u16, serde_json::Value) {
            self.lab.call(method, path, body.as_ref())
        }

        fn create(&self, body: serde_json::Value) -> serde_json::Value {
            let (status, sandbox) = self.call("POST", "/sandboxes", Some(body));
            assert_eq!(status, 201, "{sandbox}\n{}", self.log());
            sandbox
        }

        /// `cmd` in the guest: its exit code and stdout.
        fn sh(&self, id: &str, cmd: &str) -> (Option<i64>, String) {
            self.sh_within(id, cmd, 60)
        }

        /// `cmd` in the guest with a timeout of `timeout_s`: its exit code and stdout.
        fn sh_within(&self, id: &str, cmd: &str, timeout_s: u64) -> (Option<i64>, String) {
            let (status, result) = self.call(
                "POST",
                &format!("/sandboxes/{id}/exec"),
                Some(serde_json::json!({"cmd": cmd, "timeout_s": timeout_s})),
            );
            assert_eq!(status, 200, "exec {cmd}: {result}\n{}", self.log());
            let stdout = result["stdout"].as_str().unwrap_or_default().to_string();
            (result["exit_code"].as_i64(), stdout)
        }

        /// A fetch from the guest of `addr:port` (the far side's server names its port).
        fn fetch(&self, id: &str, addr: &str, port: u16) -> bool {
            let (code, out) = self.sh(
                id,
                &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {addr} {port}"),
            );
            code == Some(0) && out.contains(&format!("port-{port}-answers"))
        }

        /// The lease and name files left in the daemon's lease directory.
        fn leases(&self) -> Vec<String> {
            ["leases", "names"]
                .iter()
                .flat_map(|sub| {
                    std::fs::read_dir(Path::new("/tmp/rollbox-net-lab").join(sub))
                        .into_iter()
                        .flatten()
                        .flatten()
                        .map(move |e| format!("{sub}/{}", e.file_name().to_string_lossy()))
                })
                .collect()
        }
    }

    fn address(sandbox: &serde_json::Value) -> Ipv4Addr {
        sandbox["network"]["address"]
            .as_str()
            .unwrap_or_else(|| panic!("no network: {sandbox}"))
            .parse()
            .expect("address")
    }

    /// Where `sandbox` exposes guest port `port` on the host.
    fn exposed(sandbox: &serde_json::Value, port: u16) -> SocketAddr {
        let ports = sandbox["network"]["ports"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let entry = ports
            .iter()
            .find(|p| p["port"] == port)
            .unwrap_or_else(|| panic!("port {port} not exposed: {sandbox}"));
        let host: Ipv4Addr = entry["host_address"]
            .as_str()
            .expect("host_address")
            .parse()
            .expect("address");
        let host_port = entry["host_port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .expect("host_port");
        SocketAddr::from((host, host_port))
    }

    /// Networks through the daemon with a Linux guest: a template with a network and a boot
    /// snapshot, so every create is a restore that the agent re-addresses; each egress
    /// policy against a server outside; the host reaching each guest at its own address,
    /// forked clones included; a reset keeping the address; nothing left after.
    #[test]
    fn daemon_networks_hold_for_real_guests_across_restore_fork_and_reset() {
        let Some(fx) =
            fixtures("tier4::daemon_networks_hold_for_real_guests_across_restore_fork_and_reset")
        else {
            return;
        };
        // 198.51.100.0/24 (TEST-NET-2) is no private range: `all` reaches it.
        let _internet = Internet::at("rbxpub", "rbxpb", "198.51.100");
        serve_in_netns("rbxpub", 8000);
        serve_in_netns("rbxpub", 9000);
        let asked = dns_in_netns("rbxpub", "web.rollbox.test", Ipv4Addr::new(198, 51, 100, 2));
        let daemon = NetDaemon::start();
        let started = Instant::now();
        let (status, template) = daemon.call(
            "POST",
            "/templates",
            Some(serde_json::json!({
                "name": "netbox",
                "kernel": fx.path("OUR_VMLINUX"),
                "rootfs": fx.path("BUSYBOX_ROOTFS"),
                "cmdline": agent_cmdline(""),
                "memory_mib": 192,
                "boot_snapshot": true,
                "network": {"egress": "all", "expose": [8080]},
            })),
        );
        assert_eq!(status, 201, "{template}\n{}", daemon.log());
        eprintln!(
            "figure: a template with a network and a boot snapshot took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        // The template's egress, restored from its boot snapshot and re-addressed.
        let started = Instant::now();
        let all = daemon.create(serde_json::json!({"template": "netbox", "ttl_s": 900}));
        eprintln!(
            "figure: a networked create (restore + re-address) took {:.2} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let all_id = all["id"].as_str().expect("id").to_string();
        assert_eq!(all["network"]["egress"], "all", "{all}");
        assert!(
            daemon.fetch(&all_id, "198.51.100.2", 8000),
            "egress all: {}",
            daemon.log()
        );
        let (_, ip) = daemon.sh(&all_id, "ip -4 addr show eth0");
        assert!(ip.contains(&format!("{}/30", address(&all))), "{ip}");
        daemon.sh(
            &all_id,
            "mkdir -p /tmp/www && echo parent > /tmp/www/index.html && httpd -p 8080 -h /tmp/www",
        );
        let answer = http_get(SocketAddr::from((address(&all), 8080)), "/index.html");
        assert!(answer.contains("parent"), "{answer}");
        // The template's exposed port: on a host port of its own, on 127.0.0.1.
        let answer = http_get(exposed(&all, 8080), "/index.html");
        assert!(answer.contains("parent"), "exposed: {answer}");
        // Egress none: nothing outside.
        let none = daemon.create(
            serde_json::json!({"template": "netbox", "ttl_s": 900, "network": {"egress": "none"}}),
        );
        let none_id = none["id"].as_str().expect("id");
        assert!(
            !daemon.fetch(none_id, "198.51.100.2", 8000),
            "egress none reached out"
        );
        // PATCH flips the policy of the live sandbox, both ways.
        for (egress, reaches) in [("198.51.100.2:8000", true), ("none", false)] {
            let (status, patched) = daemon.call(
                "PATCH",
                &format!("/sandboxes/{none_id}/network"),
                Some(serde_json::json!({ "egress": egress })),
            );
            assert_eq!(status, 200, "{patched}\n{}", daemon.log());
            assert_eq!(patched["network"]["egress"], egress);
            assert_eq!(
                daemon.fetch(none_id, "198.51.100.2", 8000),
                reaches,
                "after PATCH egress {egress}"
            );
        }
        // An allow-list: that address and port only.
        let listed = daemon.create(serde_json::json!({
            "template": "netbox", "ttl_s": 900,
            "network": {"egress": {"allow": ["198.51.100.2:8000"]}},
        }));
        let listed_id = listed["id"].as_str().expect("id");
        assert!(
            daemon.fetch(listed_id, "198.51.100.2", 8000),
            "allow-listed"
        );
        assert!(
            !daemon.fetch(listed_id, "198.51.100.2", 9000),
            "not allow-listed"
        );
        // A hostname: the sandbox's resolver on its gateway asks the internet's DNS server
        // for listed names only, and lets out what it answered, on the entry's port.
        let named = daemon.create(serde_json::json!({
            "template": "netbox", "ttl_s": 900,
            "network": {"egress": {"allow": ["web.rollbox.test:8000"]}},
        }));
        let named_id = named["id"].as_str().expect("id");
        assert_eq!(
            named["network"]["dns"], named["network"]["gateway"],
            "{named}"
        );
        let (_, resolv) = daemon.sh(named_id, "cat /etc/resolv.conf");
        assert!(
            resolv.contains(named["network"]["gateway"].as_str().expect("gateway")),
            "{resolv}"
        );
        assert!(
            daemon.fetch(named_id, "web.rollbox.test", 8000),
            "by hostname: {}",
            daemon.log()
        );
        assert!(
            !daemon.fetch(named_id, "web.rollbox.test", 9000),
            "another port of the name"
        );
        assert!(
            !daemon.fetch(named_id, "other.rollbox.test", 8000),
            "a name not on the list"
        );
        let names = asked.lock().expect("names").clone();
        assert!(names.iter().any(|n| n == "web.rollbox.test"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("other.")),
            "an unlisted name reached the upstream: {names:?}"
        );
        // A fork: each clone at its own address, serving its own page, still reaching out.
        let clones_wanted = 4;
        let (status, forked) = daemon.call(
            "POST",
            &format!("/sandboxes/{all_id}/fork"),
            Some(serde_json::json!({"count": clones_wanted})),
        );
        assert_eq!(status, 200, "{forked}\n{}", daemon.log());
        let mut addresses = vec![address(&all)];
        for result in forked["results"].as_array().cloned().unwrap_or_default() {
            let clone = &result["sandbox"];
            let id = clone["id"]
                .as_str()
                .unwrap_or_else(|| panic!("{result}\n{}", daemon.log()));
            assert!(!addresses.contains(&address(clone)), "{clone}");
            addresses.push(address(clone));
            daemon.sh(id, &format!("echo {id} > /tmp/www/index.html"));
            let answer = http_get(SocketAddr::from((address(clone), 8080)), "/index.html");
            assert!(answer.contains(id), "{id}: {answer}");
            // Its own host port for the template's exposed port.
            assert_ne!(exposed(clone, 8080), exposed(&all, 8080), "{clone}");
            let answer = http_get(exposed(clone, 8080), "/index.html");
            assert!(answer.contains(id), "{id} exposed: {answer}");
            assert!(daemon.fetch(id, "198.51.100.2", 8000), "clone {id}");
        }
        assert_eq!(addresses.len(), clones_wanted + 1, "{forked}");
        let answer = http_get(SocketAddr::from((address(&all), 8080)), "/index.html");
        assert!(answer.contains("parent"), "{answer}");
        // A reset keeps the address.
        let (status, reset) = daemon.call(
            "POST",
            &format!("/sandboxes/{all_id}/reset"),
            Some(serde_json::json!({})),
        );
        assert_eq!(status, 200, "{reset}\n{}", daemon.log());
        assert_eq!(address(&reset), address(&all));
        assert!(
            daemon.fetch(&all_id, "198.51.100.2", 8000),
            "after the reset"
        );
        // Everything goes with the sandboxes.
        let (_, list) = daemon.call("GET", "/sandboxes?limit=1000", None);
        for sandbox in list["sandboxes"].as_array().cloned().unwrap_or_default() {
            let id = sandbox["id"].as_str().expect("id");
            let (status, body) = daemon.call("DELETE", &format!("/sandboxes/{id}"), None);
            assert_eq!(status, 204, "{body}");
        }
        assert_eq!(daemon.leases(), Vec::<String>::new());
    }

    /// Docker inside through the daemon: a `docker: true` template whose guest has no dockerd
    /// fails naming docker; a `docker: true` Debian template with a network (an
    /// allow-list of the registry) and a boot snapshot, whose start command makes dockerd take
    /// the registry as insecure; a sandbox pulls an image from a registry outside it and runs
    /// it; with egress none the pull fails; a detached container keeps running in a fork clone
    /// and in a restore of a snapshot.
    #[test]
    fn docker_templates_pull_through_the_sandbox_network_and_keep_containers_across_fork_and_restore(
    ) {
        let Some(fx) = fixtures(
            "tier4::docker_templates_pull_through_the_sandbox_network_and_keep_containers_across_fork_and_restore",
        ) else {
            return;
        };
        // 203.0.113.0/24 (TEST-NET-3): the registry's "internet".
        let _internet = Internet::at("rbxdock", "rbxdk", "203.0.113");
        const REGISTRY: &str = "203.0.113.2:5000";
        let registry = NetnsRegistry::start("rbxdock", REGISTRY.parse().expect("address"));
        registry.push(
            &fx.path("BUSYBOX_IMAGE_TAR"),
            "rollbox-test/busybox",
            "latest",
        );
        let image = format!("{REGISTRY}/rollbox-test/busybox:latest");
        let daemon = NetDaemon::start();
        // A guest without dockerd (busybox): the add fails naming docker, and leaves nothing.
        let started = Instant::now();
        let (status, refused) = daemon.call(
            "POST",
            "/templates",
            Some(serde_json::json!({
                "name": "nodock",
                "kernel": fx.path("OUR_VMLINUX"),
                "rootfs": fx.path("BUSYBOX_ROOTFS"),
                "cmdline": agent_cmdline(""),
                "memory_mib": 192,
                "boot_snapshot": true,
                "docker": true,
            })),
        );
        let error = refused["error"].as_str().unwrap_or_default();
        assert!(
            status == 503 && error.contains("docker") && error.contains("nodock"),
            "{status} {refused}\n{}",
            daemon.log()
        );
        assert_eq!(daemon.call("GET", "/templates/nodock", None).0, 404);
        eprintln!(
            "figure: a docker template whose guest has no dockerd failed in {:.1} s: {error} (nested lab)",
            started.elapsed().as_secs_f64()
        );
        // dockerd takes a new insecure-registries on SIGHUP; the ready command waits for it.
        let start_cmd = format!(
            "mkdir -p /etc/docker && echo '{{\"insecure-registries\":[\"{REGISTRY}\"]}}' > /etc/docker/daemon.json && kill -HUP \"$(cat /run/rollbox-dockerd.pid)\""
        );
        let started = Instant::now();
        let (status, template) = daemon.call(
            "POST",
            "/templates",
            Some(serde_json::json!({
                "name": "dockbox",
                "kernel": fx.path("OUR_VMLINUX"),
                "rootfs": fx.path("DEBIAN_ROOTFS"),
                "cmdline": agent_cmdline(""),
                "vcpus": 2,
                "memory_mib": 1024,
                "boot_snapshot": true,
                "docker": true,
                "start_cmd": start_cmd,
                "ready_cmd": format!("docker info 2>/dev/null | grep -q {REGISTRY}"),
                "ready_timeout_s": 400,
                "network": {"egress": {"allow": [REGISTRY]}},
            })),
        );
        assert_eq!(status, 201, "{template}\n{}", daemon.log());
        assert_eq!(template["docker"], true, "{template}");
        eprintln!(
            "figure: a docker template (Debian, dockerd started, boot snapshot) took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let started = Instant::now();
        let sandbox = daemon.create(serde_json::json!({"template": "dockbox", "ttl_s": 900}));
        eprintln!(
            "figure: a create of it (restore, dockerd running) took {:.2} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let id = sandbox["id"].as_str().expect("id").to_string();
        let (code, version) = daemon.sh(&id, "docker version --format '{{.Server.Version}}'");
        assert_eq!(code, Some(0), "dockerd answers in a restore: {version}");
        // The pull goes out through the sandbox's network, as its allow-list lets it.
        let started = Instant::now();
        let (code, out) = daemon.sh_within(
            &id,
            &format!("docker run --rm {image} echo rollbox-docker-pulled 2>&1"),
            300,
        );
        assert_eq!(
            (code, out.contains("rollbox-docker-pulled")),
            (Some(0), true),
            "docker run: {out}\n{}\n{}",
            registry.log(),
            daemon.log()
        );
        eprintln!(
            "figure: docker run of an image pulled from the registry took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        // Egress none: the pull cannot reach the registry.
        let closed = daemon.create(serde_json::json!({
            "template": "dockbox", "ttl_s": 900, "network": {"egress": "none"},
        }));
        let closed_id = closed["id"].as_str().expect("id").to_string();
        let started = Instant::now();
        let (code, out) = daemon.sh_within(
            &closed_id,
            &format!("timeout 100 docker pull {image} 2>&1"),
            120,
        );
        assert_ne!(code, Some(0), "egress none pulled: {out}");
        eprintln!(
            "figure: under egress none docker pull gave up after {:.1} s (exit {code:?}) (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let (status, body) = daemon.call("DELETE", &format!("/sandboxes/{closed_id}"), None);
        assert_eq!(status, 204, "{body}");
        // A detached container, running in a fork clone and in a restore of a snapshot.
        let (code, out) = daemon.sh_within(
            &id,
            &format!("docker run -d --name sleeper {image} sleep 3600 2>&1"),
            120,
        );
        assert_eq!(code, Some(0), "docker run -d: {out}");
        let running = |id: &str, marker: &str| {
            let (_, ps) = daemon.sh(
                id,
                "docker ps --filter name=sleeper --format '{{.Names}} {{.Status}}'",
            );
            let (code, said) = daemon.sh(id, &format!("docker exec sleeper echo {marker}"));
            assert!(
                ps.contains("sleeper Up") && code == Some(0) && said.contains(marker),
                "{id}: docker ps {ps:?}, docker exec {code:?} {said:?}\n{}",
                daemon.log()
            );
        };
        running(&id, "in-parent");
        let started = Instant::now();
        let (status, forked) = daemon.call(
            "POST",
            &format!("/sandboxes/{id}/fork"),
            Some(serde_json::json!({"count": 1})),
        );
        assert_eq!(status, 200, "{forked}\n{}", daemon.log());
        let clone = forked["results"][0]["sandbox"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{forked}\n{}", daemon.log()))
            .to_string();
        running(&clone, "in-clone");
        eprintln!(
            "figure: a fork clone with the container running took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let started = Instant::now();
        let (status, snapshot) = daemon.call(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(serde_json::json!({})),
        );
        assert_eq!(status, 201, "{snapshot}\n{}", daemon.log());
        let restored = daemon.create(serde_json::json!({
            "snapshot": snapshot["id"].as_str().expect("snapshot id"), "ttl_s": 900,
        }));
        running(restored["id"].as_str().expect("id"), "in-restore");
        eprintln!(
            "figure: a snapshot and its restore with the container running took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let (_, list) = daemon.call("GET", "/sandboxes?limit=1000", None);
        for sandbox in list["sandboxes"].as_array().cloned().unwrap_or_default() {
            let id = sandbox["id"].as_str().expect("id");
            let (status, body) = daemon.call("DELETE", &format!("/sandboxes/{id}"), None);
            assert_eq!(status, 204, "{body}");
        }
        assert_eq!(daemon.leases(), Vec::<String>::new());
    }

    /// The stock `e2b` SDK's network options on a Linux template with a network
    /// (`rollbox/tests/e2b/test_network.py`): `allow_internet_access=False` cannot reach a
    /// server outside the sandbox, `update_network` opens and closes it, and
    /// `allow_internet_access=True` reaches it.
    #[test]
    fn stock_e2b_sdk_allow_internet_access_and_update_network_hold_for_a_real_guest() {
        let test =
            "tier4::stock_e2b_sdk_allow_internet_access_and_update_network_hold_for_a_real_guest";
        let Some(fx) = fixtures(test) else {
            return;
        };
        let python = match rollbox_tests::venv_python("scripts/e2b-venv.sh", &["2.63.0"]) {
            Ok(python) => python,
            Err(reason) => {
                rollbox_tests::skip(test, &format!("no e2b 2.63.0 venv: {reason}"));
                return;
            }
        };
        // 203.0.113.0/24 (TEST-NET-3, not a private range: `all` reaches it).
        let _internet = Internet::at("rbxe2b", "rbxeb", "203.0.113");
        serve_in_netns("rbxe2b", 8000);
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let listen = format!("127.0.0.1:{port}");
        let lab = LabDaemon::start(
            "e2b-net-lab-key-0123",
            &[
                "--net-pool",
                "10.204.0.0/24",
                "--net-state-dir",
                "/tmp/rollbox-net-lab-e2b",
                "--agent-timeout",
                "60",
                "--e2b-listen",
                &listen,
                "--e2b-domain",
                "e2b.test",
            ]
            .map(String::from),
            Some(port),
        );
        let started = Instant::now();
        let (status, template) = lab.call(
            "POST",
            "/templates",
            Some(&serde_json::json!({
                "name": "netbox",
                "kernel": fx.path("OUR_VMLINUX"),
                // Debian: E2B's commands run through bash.
                "rootfs": fx.path("DEBIAN_ROOTFS"),
                "cmdline": agent_cmdline(""),
                "memory_mib": 192,
                "boot_snapshot": true,
                "network": {"egress": "all"},
            })),
        );
        assert_eq!(status, 201, "{template}\n{}", lab.log());
        eprintln!(
            "figure: a Debian template with a network and a boot snapshot took {:.1} s (nested lab)",
            started.elapsed().as_secs_f64()
        );
        let scratch = tempfile::tempdir().expect("scratch");
        let output = rollbox_tests::e2b_script(
            &python,
            "test_network.py",
            &format!("http://{listen}"),
            &lab.key,
            "netbox",
            scratch.path(),
        )
        .env("ROLLBOX_E2B_TARGET", "203.0.113.2:8000")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run test_network.py");
        let stdout = String::from_utf8_lossy(&output.stdout);
        println!("{stdout}");
        assert!(
            output.status.success() && stdout.contains("all ok"),
            "test_network.py failed ({}):\n{stdout}\n{}\n--- serve.log ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            lab.log()
        );
    }
}
