//! `rollbox-bench linux-net`: virtio-net with Linux guests on real KVM (the nested lab,
//! `scripts/lab/bench-net-fs.sh`).
//!
//! 1. Throughput and latency: the initramfs guest of `rollbox-bench linux` (busybox + the
//!    agent) on one host tap, under rollbox-vmm (`--net`) and under QEMU `-M microvm`
//!    (`-netdev tap,vhost=off -device virtio-net-device`), alternating round by round, same
//!    kernel, initramfs, tap, MAC and addresses. TCP guest -> host (busybox `nc` fed by `dd`
//!    from /dev/zero; the host counts the bytes from accept until the last one), TCP
//!    host -> guest (the host writes into the guest's `nc -l`, from connect until the guest
//!    closes after the host's FIN; the guest's byte count is checked), and ICMP round trips
//!    (`ping -c N -i 0.2` from the guest to the host: busybox has no TCP echo server).
//! 2. The same on the daemon's network (`linux_net_lease.rs`): the tap, /30 and nftables
//!    rules of `rollbox::net::lease` as the daemon makes them (egress `all`, guest port 5201
//!    exposed on 127.0.0.1); the guest sends to a server in a network namespace (forwarded,
//!    masqueraded) and the host writes into the guest through the exposed port (DNAT).
//! 3. Set-up per sandbox: `rollbox net up` and `rollbox net down` wall time (the CLI
//!    process included), and rollbox-vmm's boot with `--net` beside one without.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::guest::GuestShell;
use crate::linux::{
    build_initramfs, cell, check_kvm, host_cmd, ms, must_exist, prepare, qemu_args, ratio,
    rollbox_boot_args, summary, AgentAddr, LinuxBenchConfig, LinuxBenchError, VmProcess, WorkDir,
    AGENT_LISTENING,
};
use crate::stats::Summary;

#[path = "linux_net_lease.rs"]
mod lease;
pub use lease::LeaseNetFigures;

const MIB: u64 = 1 << 20;
/// The guest's `nc -l` port for host -> guest.
const GUEST_PORT: u16 = 5201;
/// One guest command (a transfer, the pings) at most.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(600);

/// The parts of `linux-net`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NetPart {
    /// TCP each way and ping, rollbox-vmm beside QEMU microvm.
    Throughput,
    /// The same on the daemon's network: `rollbox::net`'s tap and rules, a server in a
    /// network namespace, the host through a port exposed on 127.0.0.1.
    DaemonNet,
    /// `rollbox net up`/`down` cycles and rollbox-vmm's boot with and without `--net`.
    Setup,
}

/// Settings; `linux` holds the guest, the VMMs and the rounds.
#[derive(Debug, Clone)]
pub struct NetBenchConfig {
    pub linux: LinuxBenchConfig,
    pub parts: Vec<NetPart>,
    /// MiB per TCP transfer.
    pub mib: u64,
    /// Pings per round.
    pub pings: u32,
    /// `rollbox net up`/`down` cycles.
    pub net_cycles: usize,
    /// Boots with and without `--net` (each).
    pub start_rounds: usize,
    /// The `rollbox` CLI.
    pub rollbox: PathBuf,
    /// The benchmark's tap (made and removed by it).
    pub tap: String,
    /// The tap's /30 is 10.199.<subnet>.0/30.
    pub subnet: u8,
}

/// One VMM's network figures.
#[derive(Debug, Clone, Serialize)]
pub struct NetVmmFigures {
    pub vmm: String,
    pub guest_to_host_mib_s: Summary,
    pub host_to_guest_mib_s: Summary,
    pub ping_avg_ms: Summary,
    pub ping_min_ms: Summary,
}

/// Boot milestones, ms from process start.
#[derive(Debug, Clone, Serialize)]
pub struct StartFigures {
    pub first_console_line_ms: Summary,
    pub agent_ready_ms: Summary,
}

/// Everything, as `--json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct NetReport {
    pub mib: u64,
    pub pings: u32,
    pub rounds: usize,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub rollbox: Option<NetVmmFigures>,
    pub qemu: Option<NetVmmFigures>,
    pub net_up_ms: Option<Summary>,
    pub net_down_ms: Option<Summary>,
    pub start_without_net: Option<StartFigures>,
    pub start_with_net: Option<StartFigures>,
    /// Part `daemon-net`: throughput on the network `rollbox::net` leases.
    pub daemon_network: Option<LeaseNetFigures>,
}

/// The benchmark's tap with its /30: host `.1`, guest `.2`. Removed on drop.
struct BenchTap {
    name: String,
    host: Ipv4Addr,
    guest: Ipv4Addr,
}

impl BenchTap {
    fn create(name: &str, subnet: u8) -> Result<Self, LinuxBenchError> {
        let _ = Command::new("ip").args(["link", "del", name]).output();
        host_cmd("ip", &["tuntap", "add", name, "mode", "tap", "vnet_hdr"])?;
        let tap = Self {
            name: name.into(),
            host: Ipv4Addr::new(10, 199, subnet, 1),
            guest: Ipv4Addr::new(10, 199, subnet, 2),
        };
        host_cmd(
            "ip",
            &["addr", "add", &format!("{}/30", tap.host), "dev", name],
        )?;
        host_cmd("ip", &["link", "set", name, "up"])?;
        Ok(tap)
    }

    /// The guest's device on this tap: MAC 06:00 and the guest's address, as `rollbox net`
    /// does; `ip=` for the agent, which configures eth0 from it.
    fn nic(&self) -> GuestNic {
        let o = self.guest.octets();
        GuestNic {
            tap: self.name.clone(),
            mac: format!("06:00:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3]),
            kernel_arg: format!("ip={}::{}:255.255.255.252::eth0:off", self.guest, self.host),
        }
    }

    /// The transfers' ends on this tap: all on the host's and the guest's addresses.
    fn endpoints(&self) -> Endpoints {
        Endpoints {
            server: self.host,
            server_netns: None,
            guest: SocketAddr::from((self.guest, GUEST_PORT)),
        }
    }
}

/// The guest's network device: the host tap, the MAC, the kernel's `ip=` argument.
#[derive(Debug, Clone)]
struct GuestNic {
    tap: String,
    mac: String,
    kernel_arg: String,
}

/// Where the transfers and the pings go.
#[derive(Debug, Clone)]
struct Endpoints {
    /// The guest sends to and pings this address; the host's listener is bound there.
    server: Ipv4Addr,
    /// The network namespace (`/var/run/netns/NAME`) the listener is made in; none: the
    /// bench's own.
    server_netns: Option<PathBuf>,
    /// The host connects here for host -> guest: the guest's `nc -l` on [`GUEST_PORT`], or a
    /// host port forwarded to it.
    guest: SocketAddr,
}

impl Drop for BenchTap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vmm {
    Rollbox,
    Qemu,
}

impl Vmm {
    fn label(self) -> &'static str {
        match self {
            Vmm::Rollbox => "rollbox-vmm",
            Vmm::Qemu => "QEMU microvm",
        }
    }
}

/// QEMU's network device: the tap without vhost-net, on virtio-mmio like rollbox-vmm's.
pub fn qemu_net_args(tap: &str, mac: &str) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("tap,id=net0,ifname={tap},script=no,downscript=no,vhost=off"),
        "-device".into(),
        format!("virtio-net-device,netdev=net0,mac={mac}"),
    ]
}

/// A booted guest whose agent has answered.
struct Booted {
    vm: VmProcess,
    shell: GuestShell,
    first_line_ms: f64,
    ready_ms: f64,
}

/// Boots the initramfs guest under `which`, with `nic` when given.
fn boot(
    config: &NetBenchConfig,
    which: Vmm,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
    nic: Option<&GuestNic>,
    n: usize,
) -> Result<Booted, LinuxBenchError> {
    let mut linux = config.linux.clone();
    if let Some(nic) = nic {
        linux.cmdline = format!("{} {}", linux.cmdline, nic.kernel_arg);
    }
    let sock = work.join(format!("net-{n}.sock"));
    let _ = std::fs::remove_file(&sock);
    let (program, args, addr) = match which {
        Vmm::Rollbox => {
            let mut args = rollbox_boot_args(&linux, kernel, initramfs, &sock);
            if let Some(nic) = nic {
                args.extend(["--net".into(), format!("{},mac={}", nic.tap, nic.mac)]);
            }
            (&linux.vmm, args, AgentAddr::Unix(sock))
        }
        Vmm::Qemu => {
            let mut args = qemu_args(&linux, kernel, initramfs);
            if let Some(nic) = nic {
                args.extend(qemu_net_args(&nic.tap, &nic.mac));
            }
            (&linux.qemu, args, AgentAddr::Vsock(linux.qemu_cid))
        }
    };
    let mut vm = VmProcess::spawn(which.label(), program, &args)?;
    let deadline = vm.started + linux.boot_timeout;
    let first = vm.wait_line("the first console line", "", deadline)?;
    vm.wait_line("the agent's listening line", AGENT_LISTENING, deadline)?;
    let ready = vm.wait_hello(&addr, deadline)?.answered;
    let since = |at: Instant| ms(at.saturating_duration_since(vm.started));
    Ok(Booted {
        first_line_ms: since(first),
        ready_ms: since(ready),
        shell: GuestShell::new(which.label(), addr),
        vm,
    })
}

/// A listener on `ends.server`, port 0, in `ends.server_netns` when given.
fn listen(ends: &Endpoints) -> Result<TcpListener, LinuxBenchError> {
    let server = ends.server;
    let bind = move || {
        TcpListener::bind((server, 0))
            .map_err(|e| LinuxBenchError::Host(format!("listening on {server}: {e}")))
    };
    match &ends.server_netns {
        None => bind(),
        Some(netns) => lease::in_netns(netns, bind),
    }
}

/// Guest -> server: the guest's `dd | nc` into the bench's listener; MiB/s from accept to the
/// last byte.
fn guest_to_host(shell: &GuestShell, ends: &Endpoints, bytes: u64) -> Result<f64, LinuxBenchError> {
    let listener = listen(ends)?;
    let port = listener
        .local_addr()
        .map_err(|e| LinuxBenchError::Host(format!("listener address: {e}")))?
        .port();
    listener
        .set_nonblocking(true)
        .map_err(|e| LinuxBenchError::Host(format!("listener: {e}")))?;
    let receiver = std::thread::spawn(move || -> Result<(u64, Duration), String> {
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        let mut conn = loop {
            match listener.accept() {
                Ok((conn, _)) => break conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err("no connection from the guest".into());
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("accept: {e}")),
            }
        };
        let started = Instant::now();
        conn.set_nonblocking(false)
            .and_then(|()| conn.set_read_timeout(Some(Duration::from_secs(120))))
            .map_err(|e| format!("socket: {e}"))?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        let mut last = started.elapsed();
        loop {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    total += n as u64;
                    last = started.elapsed();
                }
                Err(e) => return Err(format!("receiving after {total} bytes: {e}")),
            }
        }
        Ok((total, last))
    });
    let script = format!(
        "busybox dd if=/dev/zero bs=65536 count={} 2>/dev/null | busybox nc {} {port}",
        bytes / 65536,
        ends.server
    );
    let sent = shell.sh(&script, COMMAND_TIMEOUT);
    let received = receiver
        .join()
        .map_err(|_| LinuxBenchError::Host("the receiving thread panicked".into()))?;
    sent?;
    let (total, took) = received.map_err(|detail| LinuxBenchError::Guest {
        vm: shell.vm.clone(),
        script: script.clone(),
        detail,
    })?;
    if total != bytes / 65536 * 65536 {
        return Err(LinuxBenchError::Guest {
            vm: shell.vm.clone(),
            script,
            detail: format!("the host received {total} bytes"),
        });
    }
    Ok(total as f64 / MIB as f64 / took.as_secs_f64().max(1e-6))
}

/// Host -> guest: into the guest's `nc -l | wc -c` (at `ends.guest`); MiB/s from connect until
/// the guest closed after the host's FIN (so every byte was read there).
fn host_to_guest(shell: &GuestShell, ends: &Endpoints, bytes: u64) -> Result<f64, LinuxBenchError> {
    let count = format!("/tmp/rx.{GUEST_PORT}");
    // busybox nc closes at once when its stdin is at EOF: keep it open with sleep.
    shell.sh(
        &format!(
            "rm -f {count}; (busybox sleep 600 | busybox nc -l -p {GUEST_PORT} | busybox wc -c > {count}) >/dev/null 2>&1 </dev/null &"
        ),
        Duration::from_secs(30),
    )?;
    let addr = ends.guest;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut conn = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(conn) => break conn,
            Err(e) if Instant::now() >= deadline => {
                return Err(LinuxBenchError::Host(format!("connect {addr}: {e}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let fail = |what: &str, e: std::io::Error| LinuxBenchError::Host(format!("{what} {addr}: {e}"));
    conn.set_read_timeout(Some(COMMAND_TIMEOUT))
        .map_err(|e| fail("socket", e))?;
    let chunk: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
    let started = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(MIB) as usize;
        conn.write_all(&chunk[..n])
            .map_err(|e| fail("sending to", e))?;
        left -= n as u64;
    }
    conn.shutdown(Shutdown::Write)
        .map_err(|e| fail("shutdown", e))?;
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest)
        .map_err(|e| fail("waiting for the guest to close", e))?;
    let took = started.elapsed();
    // The guest's count, once wc has written it.
    let check = Instant::now() + Duration::from_secs(30);
    loop {
        let got = shell.sh(
            &format!("cat {count} 2>/dev/null || true"),
            Duration::from_secs(30),
        )?;
        if got == bytes.to_string() {
            break;
        }
        if Instant::now() >= check {
            return Err(LinuxBenchError::Guest {
                vm: shell.vm.clone(),
                script: format!("cat {count}"),
                detail: format!("the guest counted {got:?} bytes, not {bytes}"),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(bytes as f64 / MIB as f64 / took.as_secs_f64().max(1e-6))
}

/// (min, avg) ms of busybox ping's `round-trip min/avg/max = a/b/c ms` line.
pub fn parse_ping(stdout: &str) -> Option<(f64, f64)> {
    let line = stdout.lines().find(|l| l.contains("min/avg/max"))?;
    let (_, values) = line.split_once('=')?;
    let mut parts = values.trim().trim_end_matches("ms").trim().split('/');
    let min: f64 = parts.next()?.trim().parse().ok()?;
    let avg: f64 = parts.next()?.trim().parse().ok()?;
    Some((min, avg))
}

fn ping(shell: &GuestShell, ends: &Endpoints, count: u32) -> Result<(f64, f64), LinuxBenchError> {
    let script = format!("busybox ping -q -c {count} -i 0.2 {}", ends.server);
    let out = shell.sh(&script, COMMAND_TIMEOUT)?;
    parse_ping(&out).ok_or_else(|| LinuxBenchError::Guest {
        vm: shell.vm.clone(),
        script,
        detail: format!("no min/avg/max line in {out:?}"),
    })
}

#[derive(Default)]
struct NetSamples {
    up: Vec<f64>,
    down: Vec<f64>,
    ping_avg: Vec<f64>,
    ping_min: Vec<f64>,
}

fn net_figures(which: Vmm, s: &NetSamples) -> Result<NetVmmFigures, LinuxBenchError> {
    Ok(NetVmmFigures {
        vmm: which.label().into(),
        guest_to_host_mib_s: summary("guest -> host", &s.up)?,
        host_to_guest_mib_s: summary("host -> guest", &s.down)?,
        ping_avg_ms: summary("ping avg", &s.ping_avg)?,
        ping_min_ms: summary("ping min", &s.ping_min)?,
    })
}

/// QEMU and the vhost-vsock device its agent connection needs.
fn check_qemu(config: &NetBenchConfig) -> Result<(), LinuxBenchError> {
    must_exist(
        "QEMU",
        &config.linux.qemu,
        "apt-get install qemu-system-x86, or pass --qemu PATH",
    )?;
    if !Path::new("/dev/vhost-vsock").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/vhost-vsock is missing: QEMU's vsock needs the vhost_vsock module \
             (in the lab: scripts/lab/run.sh --modprobe vhost_vsock)"
                .into(),
        ));
    }
    Ok(())
}

/// What the rounds of a throughput part share: the guest, its device, the transfers' ends.
struct Rounds<'a> {
    config: &'a NetBenchConfig,
    kernel: &'a Path,
    initramfs: &'a Path,
    work: &'a Path,
    nic: &'a GuestNic,
    ends: &'a Endpoints,
    /// The part's name in progress lines.
    part: &'a str,
}

/// Warm-up and measured rounds, alternating which VMM goes first: TCP each way and ping
/// between the guest and `rounds.ends`.
fn run_rounds(rounds: &Rounds<'_>) -> Result<(NetVmmFigures, NetVmmFigures), LinuxBenchError> {
    let Rounds {
        config,
        kernel,
        initramfs,
        work,
        nic,
        ends,
        part,
    } = *rounds;
    let bytes = config.mib * MIB;
    let mut rollbox = NetSamples::default();
    let mut qemu = NetSamples::default();
    let total = config.linux.warmup + config.linux.rounds;
    for round in 0..total {
        let warm = round < config.linux.warmup;
        let order = if round % 2 == 0 {
            [Vmm::Rollbox, Vmm::Qemu]
        } else {
            [Vmm::Qemu, Vmm::Rollbox]
        };
        for which in order {
            let mut booted = boot(config, which, kernel, initramfs, work, Some(nic), round)?;
            let shell = &booted.shell;
            // The first ping also fills both ARP caches.
            shell.sh(
                &format!("busybox ping -c 1 -W 10 {} >/dev/null", ends.server),
                Duration::from_secs(60),
            )?;
            let up = guest_to_host(shell, ends, bytes)?;
            let down = host_to_guest(shell, ends, bytes)?;
            let (min, avg) = ping(shell, ends, config.pings)?;
            booted.vm.stop();
            eprintln!(
                "linux-net {part} {} {}/{total}{}: agent ready {:.0} ms; guest->server {up:.1} MiB/s, host->guest {down:.1} MiB/s, ping avg {avg:.3} ms min {min:.3} ms",
                which.label(),
                round + 1,
                if warm { " (warm-up)" } else { "" },
                booted.ready_ms
            );
            if warm {
                continue;
            }
            let s = match which {
                Vmm::Rollbox => &mut rollbox,
                Vmm::Qemu => &mut qemu,
            };
            s.up.push(up);
            s.down.push(down);
            s.ping_avg.push(avg);
            s.ping_min.push(min);
        }
    }
    Ok((
        net_figures(Vmm::Rollbox, &rollbox)?,
        net_figures(Vmm::Qemu, &qemu)?,
    ))
}

/// Part `throughput`: on the bench's own tap.
fn run_throughput(
    config: &NetBenchConfig,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
) -> Result<(NetVmmFigures, NetVmmFigures), LinuxBenchError> {
    check_qemu(config)?;
    let tap = BenchTap::create(&config.tap, config.subnet)?;
    run_rounds(&Rounds {
        config,
        kernel,
        initramfs,
        work,
        nic: &tap.nic(),
        ends: &tap.endpoints(),
        part: "throughput",
    })
}

/// `rollbox net up`/`down` cycles: wall ms of each.
fn run_net_cycles(
    config: &NetBenchConfig,
    work: &Path,
) -> Result<(Summary, Summary), LinuxBenchError> {
    must_exist(
        "rollbox",
        &config.rollbox,
        "cargo build --release -p rollbox, or pass --rollbox PATH",
    )?;
    let state = work.join("net-state");
    let state_s = state.display().to_string();
    let rollbox = config.rollbox.display().to_string();
    let name = "rbxbench";
    let _ = Command::new(&rollbox)
        .args(["net", "down", name, "--state-dir", &state_s])
        .output();
    let mut up = Vec::new();
    let mut down = Vec::new();
    for cycle in 0..config.net_cycles {
        let t = Instant::now();
        host_cmd(&rollbox, &["net", "up", name, "--state-dir", &state_s])?;
        up.push(ms(t.elapsed()));
        let t = Instant::now();
        host_cmd(&rollbox, &["net", "down", name, "--state-dir", &state_s])?;
        down.push(ms(t.elapsed()));
        if cycle % 10 == 9 {
            eprintln!(
                "linux-net: {} rollbox net up/down cycles, last up {:.1} ms, down {:.1} ms",
                cycle + 1,
                up[cycle],
                down[cycle]
            );
        }
    }
    Ok((summary("net up", &up)?, summary("net down", &down)?))
}

/// rollbox-vmm boots with and without `--net`, alternating.
fn run_start(
    config: &NetBenchConfig,
    kernel: &Path,
    initramfs: &Path,
    work: &Path,
) -> Result<(StartFigures, StartFigures), LinuxBenchError> {
    let tap = BenchTap::create(&config.tap, config.subnet)?;
    let nic = tap.nic();
    // [without, with] x [first line, ready]
    let mut samples: [[Vec<f64>; 2]; 2] = Default::default();
    for round in 0..config.start_rounds {
        let order = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for with_net in order {
            let n = 1000 + round * 2 + usize::from(with_net);
            let mut booted = boot(
                config,
                Vmm::Rollbox,
                kernel,
                initramfs,
                work,
                with_net.then_some(&nic),
                n,
            )?;
            booted.vm.stop();
            eprintln!(
                "linux-net start {}/{} {}: first console line {:.0} ms, agent ready {:.0} ms",
                round + 1,
                config.start_rounds,
                if with_net {
                    "with --net"
                } else {
                    "without --net"
                },
                booted.first_line_ms,
                booted.ready_ms
            );
            let s = &mut samples[usize::from(with_net)];
            s[0].push(booted.first_line_ms);
            s[1].push(booted.ready_ms);
        }
    }
    let figures = |s: &[Vec<f64>; 2]| -> Result<StartFigures, LinuxBenchError> {
        Ok(StartFigures {
            first_console_line_ms: summary("first console line", &s[0])?,
            agent_ready_ms: summary("agent ready", &s[1])?,
        })
    };
    Ok((figures(&samples[0])?, figures(&samples[1])?))
}

/// Runs the parts `config.parts` asks for.
pub fn run(config: &NetBenchConfig) -> Result<NetReport, LinuxBenchError> {
    let (kernel, work) = prepare(&config.linux)?;
    if !Path::new("/dev/net/tun").exists() {
        return Err(LinuxBenchError::Host(
            "/dev/net/tun is missing (in the lab: scripts/lab/run.sh --modprobe tun)".into(),
        ));
    }
    check_kvm()?;
    let initramfs = work.0.join("initramfs.cpio");
    build_initramfs(&config.linux, &initramfs)?;
    let mut report = NetReport {
        mib: config.mib,
        pings: config.pings,
        rounds: config.linux.rounds,
        memory_mib: config.linux.memory_mib,
        vcpus: config.linux.vcpus,
        rollbox: None,
        qemu: None,
        net_up_ms: None,
        net_down_ms: None,
        start_without_net: None,
        start_with_net: None,
        daemon_network: None,
    };
    if config.parts.contains(&NetPart::Throughput) {
        let (rollbox, qemu) = run_throughput(config, &kernel, &initramfs, &work.0)?;
        report.rollbox = Some(rollbox);
        report.qemu = Some(qemu);
    }
    if config.parts.contains(&NetPart::DaemonNet) {
        report.daemon_network = Some(lease::run_daemon_net(config, &kernel, &initramfs, &work.0)?);
    }
    if config.parts.contains(&NetPart::Setup) {
        let (up, down) = run_net_cycles(config, &work.0)?;
        report.net_up_ms = Some(up);
        report.net_down_ms = Some(down);
        let (without, with) = run_start(config, &kernel, &initramfs, &work.0)?;
        report.start_without_net = Some(without);
        report.start_with_net = Some(with);
    }
    drop::<WorkDir>(work);
    Ok(report)
}

fn cell2(s: &Summary) -> String {
    format!("{:.2} ({:.2}–{:.2})", s.p50, s.min, s.max)
}

fn mean(s: &Summary) -> f64 {
    s.samples.iter().sum::<f64>() / s.samples.len().max(1) as f64
}

/// One throughput table: `names` are the rows' (guest -> server, host -> guest, ping avg,
/// ping min), `r` rollbox-vmm's figures and `q` QEMU's.
fn throughput_table(
    out: &mut String,
    heading: &str,
    names: [String; 4],
    r: &NetVmmFigures,
    q: &NetVmmFigures,
) {
    out.push_str(&format!("### {heading}\n\n"));
    out.push_str("| figure | rollbox-vmm | QEMU microvm (vhost=off) | rollbox/QEMU |\n");
    out.push_str("| --- | ---: | ---: | ---: |\n");
    type Pick = fn(&NetVmmFigures) -> &Summary;
    let picks: [(Pick, bool); 4] = [
        (|f| &f.guest_to_host_mib_s, false),
        (|f| &f.host_to_guest_mib_s, false),
        (|f| &f.ping_avg_ms, true),
        (|f| &f.ping_min_ms, true),
    ];
    for (name, (pick, small)) in names.iter().zip(picks) {
        let (a, b) = (pick(r), pick(q));
        let text = |s: &Summary| {
            if small {
                cell2(s)
            } else {
                format!("{:.1} ({:.1}–{:.1})", s.p50, s.min, s.max)
            }
        };
        out.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            text(a),
            text(b),
            ratio(a.p50, b.p50)
        ));
    }
    out.push('\n');
}

/// The tables.
pub fn markdown(report: &NetReport) -> String {
    let mut out = String::new();
    if let (Some(r), Some(q)) = (&report.rollbox, &report.qemu) {
        let heading = format!(
            "virtio-net: rollbox-vmm beside QEMU microvm ({} MiB each way, {} pings, {} MiB guest, {} vCPUs; median (min–max) of {} rounds)",
            report.mib, report.pings, report.memory_mib, report.vcpus, report.rounds
        );
        let names = [
            "TCP guest → host, MiB/s (higher is better)",
            "TCP host → guest, MiB/s (higher is better)",
            "ping guest → host, avg ms",
            "ping guest → host, min ms",
        ];
        throughput_table(&mut out, &heading, names.map(String::from), r, q);
    }
    if let Some(d) = &report.daemon_network {
        lease::markdown(&mut out, report, d);
    }
    if let (Some(up), Some(down)) = (&report.net_up_ms, &report.net_down_ms) {
        out.push_str(&format!(
            "### Network set-up per sandbox ({} cycles; ms, median (min–max), mean)\n\n",
            up.samples.len()
        ));
        out.push_str("| figure | median (min–max) | mean |\n| --- | ---: | ---: |\n");
        for (name, s) in [("`rollbox net up`", up), ("`rollbox net down`", down)] {
            out.push_str(&format!("| {name} | {} | {:.1} |\n", cell2(s), mean(s)));
        }
        out.push('\n');
    }
    if let (Some(without), Some(with)) = (&report.start_without_net, &report.start_with_net) {
        out.push_str(&format!(
            "### rollbox-vmm boot with and without `--net` ({} rounds each, alternating; ms from process start, median (min–max))\n\n",
            with.agent_ready_ms.samples.len()
        ));
        out.push_str(
            "| to | without --net | with --net | with/without |\n| --- | ---: | ---: | ---: |\n",
        );
        for (name, a, b) in [
            (
                "first console line",
                &without.first_console_line_ms,
                &with.first_console_line_ms,
            ),
            (
                "agent answers hello (network configured)",
                &without.agent_ready_ms,
                &with.agent_ready_ms,
            ),
        ] {
            out.push_str(&format!(
                "| {name} | {} | {} | {} |\n",
                cell(a),
                cell(b),
                ratio(b.p50, a.p50)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_summary_line() {
        let out = "PING 10.0.0.1 (10.0.0.1): 56 data bytes\n\n--- 10.0.0.1 ping statistics ---\n50 packets transmitted, 50 packets received, 0% packet loss\nround-trip min/avg/max = 0.210/0.452/1.873 ms\n";
        assert_eq!(parse_ping(out), Some((0.210, 0.452)));
        assert_eq!(parse_ping("100% packet loss"), None);
    }

    #[test]
    fn qemu_net_device_is_virtio_mmio_without_vhost() {
        let args = qemu_net_args("rbxbench0", "06:00:0a:c7:fa:02").join(" ");
        assert!(
            args.contains("-netdev tap,id=net0,ifname=rbxbench0,script=no,downscript=no,vhost=off")
        );
        assert!(args.contains("-device virtio-net-device,netdev=net0,mac=06:00:0a:c7:fa:02"));
    }
}
