//! The VM generation counter at I/O ports 0x3c8-0x3cf. rollbox-vmm changes it
//! when a restore makes a clone and keeps it on a deterministic restore. When
//! it changes, the agent reseeds the kernel CRNG and takes a new machine id
//! and hostname, once per change, before serving a new connection's first request.
//!
//! Ports 0x3d0-0x3d7 give the host's wall clock (nanoseconds since the epoch, 0 when
//! the VMM does not offer it, as after a deterministic restore). At the same moment
//! the agent steps the guest's clock to it when the two differ by more than
//! [`CLOCK_STEP_THRESHOLD_NS`]: a restored guest's clock otherwise lags by the time
//! the snapshot sat on disk.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::errors::describe;
use crate::fixups;

/// First port of the counter.
pub const PORT: u16 = 0x3c8;
/// Number of ports: the counter and the host's wall clock (64 bits each, little-endian).
pub const PORT_LEN: u16 = 16;
/// First port of the host's wall clock.
pub const HOST_CLOCK_PORT: u16 = PORT + 8;
/// The guest's clock is stepped when it is this far from the host's.
pub const CLOCK_STEP_THRESHOLD_NS: u64 = 100_000_000;
/// Hex digits of the machine id that end a derived hostname.
const SUFFIX_HEX: usize = 12;
/// Longest hostname (HOST_NAME_MAX).
const HOSTNAME_MAX: usize = 64;
/// Prefix when neither the current hostname nor --hostname gives a usable one.
const DEFAULT_PREFIX: &str = "rollbox";

#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    #[cfg(not(target_arch = "x86_64"))]
    #[error("ports 0x3c8-0x3cf are read on x86_64 only")]
    Unsupported,
    #[cfg(target_arch = "x86_64")]
    #[error("no hypervisor (CPUID.1:ECX bit 31 clear): ports 0x3c8-0x3cf are not a VM generation counter here")]
    NoHypervisor,
    #[cfg(target_arch = "x86_64")]
    #[error("ioperm 0x3c8-0x3d7: {}", describe(.0))]
    Ioperm(std::io::Error),
    #[cfg(target_arch = "x86_64")]
    #[error("start the generation reader thread: {}", describe(.0))]
    Thread(std::io::Error),
    #[cfg(target_arch = "x86_64")]
    #[error("the generation reader thread is gone")]
    ReaderGone,
    #[cfg(target_arch = "x86_64")]
    #[error("no access to ports 0x3c8-0x3d7: {ioperm}; open /dev/port: {dev_port}")]
    NoAccess {
        ioperm: Box<GenerationError>,
        dev_port: String,
    },
    #[cfg(target_arch = "x86_64")]
    #[error("read /dev/port at 0x3c8: {}", describe(.0))]
    DevPort(std::io::Error),
    #[error("getrandom for a machine id: {}", describe(.0))]
    Getrandom(std::io::Error),
    #[error("gethostname: {}", describe(.0))]
    Gethostname(std::io::Error),
    #[error("clock_settime CLOCK_REALTIME: {}", describe(.0))]
    SetClock(std::io::Error),
    /// A fixup failed; the text names its input.
    #[error("{0}")]
    Fixup(String),
}

impl From<rollbox_agent_protocol::ErrorInfo> for GenerationError {
    fn from(info: rollbox_agent_protocol::ErrorInfo) -> Self {
        Self::Fixup(info.message)
    }
}

/// Where the counter comes from: the I/O ports in a guest, a fake in tests.
pub trait GenerationSource: Send + Sync {
    fn read(&self) -> Result<u64, GenerationError>;
    /// The host's wall clock in nanoseconds since the epoch; 0 when not offered.
    fn host_time_ns(&self) -> Result<u64, GenerationError>;
}

/// The system calls of a re-identification: thin wrappers in the agent, a fake in tests.
pub trait System: Send + Sync {
    /// Mix `seed` into the kernel RNG (no entropy credited) and reseed the CRNG now.
    fn reseed(&self, seed: &[u8]) -> Result<(), GenerationError>;
    /// 16 random bytes from the kernel.
    fn random(&self) -> Result<[u8; 16], GenerationError>;
    fn hostname(&self) -> Result<String, GenerationError>;
    fn write_machine_id(&self, id: &str) -> Result<(), GenerationError>;
    fn set_hostname(&self, name: &str) -> Result<(), GenerationError>;
    /// CLOCK_REALTIME in nanoseconds since the epoch.
    fn realtime_ns(&self) -> u64;
    fn set_realtime_ns(&self, ns: u64) -> Result<(), GenerationError>;
}

/// What health reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// The counter as last read.
    pub generation: u64,
    /// Whether every step of the last re-identification worked; None before any change.
    pub applied: Option<bool>,
}

/// What one re-identification did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reidentified {
    pub old: u64,
    pub new: u64,
    pub reseeded: bool,
    /// The machine id written, if the write worked.
    pub machine_id: Option<String>,
    /// The hostname set, if setting it worked.
    pub hostname: Option<String>,
    /// The steps that failed, each naming its input.
    pub failures: Vec<String>,
}

/// Records the counter and re-identifies the guest when it changes.
pub struct Watcher {
    source: Box<dyn GenerationSource>,
    system: Box<dyn System>,
    /// Hostname prefix when the current hostname has no usable one (--hostname).
    fallback_prefix: String,
    /// Step the guest's clock to the host's (off with --no-set-clock).
    step_clock: bool,
    /// Held across check-and-apply, so one change is applied exactly once.
    state: Mutex<Status>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // try_lock: a Debug print during a check must not deadlock.
        let mut out = f.debug_struct("Watcher");
        match self.state.try_lock() {
            Ok(state) => out.field("state", &*state),
            Err(_) => out.field("state", &"<locked>"),
        };
        out.finish_non_exhaustive()
    }
}

impl Watcher {
    /// Reads the counter once and records it.
    pub fn new(
        source: Box<dyn GenerationSource>,
        system: Box<dyn System>,
        fallback_prefix: String,
        step_clock: bool,
    ) -> Result<Self, GenerationError> {
        let generation = source.read()?;
        Ok(Self {
            source,
            system,
            fallback_prefix,
            step_clock,
            state: Mutex::new(Status {
                generation,
                applied: None,
            }),
        })
    }

    /// The watcher of a guest: the I/O ports, the real system calls.
    pub fn for_guest(
        machine_id_path: PathBuf,
        fallback_prefix: String,
        step_clock: bool,
    ) -> Result<Self, GenerationError> {
        Self::new(
            ports::open()?,
            Box::new(RealSystem { machine_id_path }),
            fallback_prefix,
            step_clock,
        )
    }

    fn lock(&self) -> MutexGuard<'_, Status> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn status(&self) -> Status {
        *self.lock()
    }

    /// Steps the guest's clock to the host's when they are more than
    /// [`CLOCK_STEP_THRESHOLD_NS`] apart; returns the step in nanoseconds (guest
    /// time moved forward when positive), or None when the clock was left alone.
    pub fn sync_clock(&self) -> Option<i128> {
        if !self.step_clock {
            return None;
        }
        let host = match self.source.host_time_ns() {
            Ok(0) => return None,
            Ok(ns) => ns,
            Err(err) => {
                log::warn!("read the host's wall clock: {err}");
                return None;
            }
        };
        let step = i128::from(host) - i128::from(self.system.realtime_ns());
        if step.unsigned_abs() <= u128::from(CLOCK_STEP_THRESHOLD_NS) {
            return None;
        }
        match self.system.set_realtime_ns(host) {
            Ok(()) => {
                log::info!(
                    "stepped the wall clock by {:+.3} s to the host's",
                    step as f64 / 1e9
                );
                Some(step)
            }
            Err(err) => {
                log::warn!("step the wall clock to the host's: {err}");
                None
            }
        }
    }

    /// Steps the clock to the host's if it is off ([`Watcher::sync_clock`]), then
    /// re-reads the counter and, when it changed, re-identifies the guest and logs
    /// one line. Returns what was done, or None when the generation did not change.
    pub fn check(&self) -> Option<Reidentified> {
        let mut state = self.lock();
        self.sync_clock();
        let now = match self.source.read() {
            Ok(now) => now,
            Err(err) => {
                log::warn!("read the VM generation: {err}");
                return None;
            }
        };
        if now == state.generation {
            return None;
        }
        let done = self.reidentify(state.generation, now);
        *state = Status {
            generation: now,
            applied: Some(done.failures.is_empty()),
        };
        let what = format!(
            "VM generation {:#018x} -> {:#018x}: CRNG {}, machine id {}, hostname {}",
            done.old,
            done.new,
            if done.reseeded {
                "reseeded"
            } else {
                "not reseeded"
            },
            done.machine_id.as_deref().unwrap_or("unchanged"),
            done.hostname.as_deref().unwrap_or("unchanged"),
        );
        if done.failures.is_empty() {
            log::info!("{what}");
        } else {
            log::warn!("{what}; failed: {}", done.failures.join("; "));
        }
        Some(done)
    }

    fn reidentify(&self, old: u64, new: u64) -> Reidentified {
        let mut done = Reidentified {
            old,
            new,
            ..Reidentified::default()
        };
        match self.system.reseed(&seed(new)) {
            Ok(()) => done.reseeded = true,
            Err(err) => done.failures.push(err.to_string()),
        }
        // Drawn after the reseed, so clones of one snapshot get different ids.
        let id = match self.system.random() {
            Ok(bytes) => hex(&bytes),
            Err(err) => {
                done.failures.push(err.to_string());
                return done;
            }
        };
        match self.system.write_machine_id(&id) {
            Ok(()) => done.machine_id = Some(id.clone()),
            Err(err) => done.failures.push(err.to_string()),
        }
        let current = self.system.hostname().unwrap_or_else(|err| {
            done.failures.push(err.to_string());
            String::new()
        });
        let name = derive_hostname(&current, &self.fallback_prefix, &id);
        match self.system.set_hostname(&name) {
            Ok(()) => done.hostname = Some(name),
            Err(err) => done.failures.push(err.to_string()),
        }
        done
    }
}

/// The new counter value and the time, mixed into the RNG.
fn seed(generation: u64) -> Vec<u8> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut seed = generation.to_le_bytes().to_vec();
    seed.extend_from_slice(&nanos.to_le_bytes());
    seed
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `<prefix>-<first 12 hex digits of the machine id>`. The prefix is the
/// current hostname without a suffix of that form (so repeated forks replace
/// it), shortened to fit 64 characters; else the fallback; else "rollbox".
pub fn derive_hostname(current: &str, fallback: &str, machine_id: &str) -> String {
    let suffix = machine_id.get(..SUFFIX_HEX).unwrap_or(machine_id);
    let prefix = usable_prefix(current)
        .or_else(|| usable_prefix(fallback))
        .unwrap_or(DEFAULT_PREFIX);
    format!("{prefix}-{suffix}")
}

fn usable_prefix(name: &str) -> Option<&str> {
    let name = name.trim();
    if !name.is_ascii() {
        return None;
    }
    let base = match name.rsplit_once('-') {
        Some((head, tail))
            if tail.len() == SUFFIX_HEX && tail.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            head
        }
        _ => name,
    };
    // ASCII, so any byte index is a char boundary.
    let base = &base[..base.len().min(HOSTNAME_MAX - 1 - SUFFIX_HEX)];
    let base = base.trim_end_matches(['-', '.']);
    fixups::validate_hostname(base).ok().map(|()| base)
}

/// The real system calls, through the fixups the host can also call.
struct RealSystem {
    machine_id_path: PathBuf,
}

impl System for RealSystem {
    fn reseed(&self, seed: &[u8]) -> Result<(), GenerationError> {
        Ok(fixups::reseed_crng(seed)?)
    }

    fn random(&self) -> Result<[u8; 16], GenerationError> {
        let mut bytes = [0u8; 16];
        // SAFETY: getrandom writes at most bytes.len() bytes into the buffer.
        let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if n != bytes.len() as isize {
            return Err(GenerationError::Getrandom(if n < 0 {
                std::io::Error::last_os_error()
            } else {
                std::io::Error::other(format!("{n} of 16 bytes"))
            }));
        }
        Ok(bytes)
    }

    fn hostname(&self) -> Result<String, GenerationError> {
        let mut buf = [0u8; HOSTNAME_MAX + 1];
        // SAFETY: gethostname writes at most buf.len() bytes into the buffer.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
            return Err(GenerationError::Gethostname(std::io::Error::last_os_error()));
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    fn write_machine_id(&self, id: &str) -> Result<(), GenerationError> {
        fixups::set_identity(&self.machine_id_path, None, Some(id))?;
        Ok(())
    }

    fn set_hostname(&self, name: &str) -> Result<(), GenerationError> {
        fixups::set_identity(&self.machine_id_path, Some(name), None)?;
        Ok(())
    }

    fn realtime_ns(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }

    fn set_realtime_ns(&self, ns: u64) -> Result<(), GenerationError> {
        let time = libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `time` is a valid timespec on the stack.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
            return Err(GenerationError::SetClock(std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

#[cfg(target_arch = "x86_64")]
mod ports {
    use std::os::unix::fs::FileExt as _;
    use std::sync::mpsc;

    use super::{GenerationError, GenerationSource, HOST_CLOCK_PORT, PORT, PORT_LEN};
    use crate::errors::describe;

    /// ioperm and `in`, else /dev/port (kernels without CONFIG_X86_IOPL_IOPERM).
    pub fn open() -> Result<Box<dyn GenerationSource>, GenerationError> {
        if std::arch::x86_64::__cpuid(1).ecx & (1 << 31) == 0 {
            return Err(GenerationError::NoHypervisor);
        }
        let ioperm = match IopermReader::start() {
            Ok(reader) => return Ok(Box::new(reader)),
            Err(err) => err,
        };
        match std::fs::File::open("/dev/port") {
            Ok(file) => {
                log::info!("reading the VM generation through /dev/port ({ioperm})");
                Ok(Box::new(DevPort(file)))
            }
            Err(err) => Err(GenerationError::NoAccess {
                ioperm: Box::new(ioperm),
                dev_port: describe(&err),
            }),
        }
    }

    /// Reads the ports on a thread of its own. ioperm grants access per
    /// thread and children inherit it across fork and exec, so only this
    /// thread, which forks nothing, holds it.
    struct IopermReader {
        requests: mpsc::Sender<(u16, mpsc::SyncSender<u64>)>,
    }

    impl IopermReader {
        fn start() -> Result<Self, GenerationError> {
            let (ready_tx, ready_rx) = mpsc::sync_channel(1);
            let (requests, request_rx) = mpsc::channel::<(u16, mpsc::SyncSender<u64>)>();
            std::thread::Builder::new()
                .name("generation".into())
                .spawn(move || {
                    // SAFETY: ioperm only changes this thread's I/O permission bitmap.
                    let ret = unsafe {
                        libc::ioperm(libc::c_ulong::from(PORT), libc::c_ulong::from(PORT_LEN), 1)
                    };
                    let granted = if ret == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    };
                    let ok = granted.is_ok();
                    let _ = ready_tx.send(granted);
                    if ok {
                        while let Ok((port, reply)) = request_rx.recv() {
                            let _ = reply.send(read_ports(port));
                        }
                    }
                })
                .map_err(GenerationError::Thread)?;
            match ready_rx.recv() {
                Ok(Ok(())) => Ok(Self { requests }),
                Ok(Err(err)) => Err(GenerationError::Ioperm(err)),
                Err(_) => Err(GenerationError::ReaderGone),
            }
        }
    }

    impl IopermReader {
        fn read_at(&self, port: u16) -> Result<u64, GenerationError> {
            let (reply, value) = mpsc::sync_channel(1);
            self.requests
                .send((port, reply))
                .map_err(|_| GenerationError::ReaderGone)?;
            value.recv().map_err(|_| GenerationError::ReaderGone)
        }
    }

    impl GenerationSource for IopermReader {
        fn read(&self) -> Result<u64, GenerationError> {
            self.read_at(PORT)
        }

        fn host_time_ns(&self) -> Result<u64, GenerationError> {
            self.read_at(HOST_CLOCK_PORT)
        }
    }

    /// Two 32-bit reads of the 64-bit register at `port`. The VMM changes the
    /// counter only while the VM is stopped and latches the clock when its low
    /// half is read, so the halves cannot tear.
    fn read_ports(port: u16) -> u64 {
        let low: u32;
        let high: u32;
        // SAFETY: the calling thread holds ioperm access to ports 0x3c8-0x3d7;
        // `in` only reads them and touches no memory.
        unsafe {
            std::arch::asm!("in eax, dx", in("dx") port, out("eax") low,
                options(nomem, nostack, preserves_flags));
            std::arch::asm!("in eax, dx", in("dx") port + 4, out("eax") high,
                options(nomem, nostack, preserves_flags));
        }
        (u64::from(high) << 32) | u64::from(low)
    }

    /// /dev/port: the kernel does one `inb` per byte at the file offset.
    /// The descriptor is close-on-exec, so children get no port access.
    struct DevPort(std::fs::File);

    impl DevPort {
        /// Reads the 8 bytes from `port` upwards, lowest first (which latches the clock).
        fn read_at(&self, port: u16) -> Result<u64, GenerationError> {
            let mut bytes = [0u8; 8];
            self.0
                .read_exact_at(&mut bytes, u64::from(port))
                .map_err(GenerationError::DevPort)?;
            Ok(u64::from_le_bytes(bytes))
        }
    }

    impl GenerationSource for DevPort {
        fn read(&self) -> Result<u64, GenerationError> {
            self.read_at(PORT)
        }

        fn host_time_ns(&self) -> Result<u64, GenerationError> {
            self.read_at(HOST_CLOCK_PORT)
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod ports {
    use super::{GenerationError, GenerationSource};

    pub fn open() -> Result<Box<dyn GenerationSource>, GenerationError> {
        Err(GenerationError::Unsupported)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};

    use super::*;

    struct FakeCounter(Arc<AtomicU64>, Arc<AtomicU64>);

    impl GenerationSource for FakeCounter {
        fn read(&self) -> Result<u64, GenerationError> {
            Ok(self.0.load(Ordering::SeqCst))
        }

        fn host_time_ns(&self) -> Result<u64, GenerationError> {
            Ok(self.1.load(Ordering::SeqCst))
        }
    }

    #[derive(Default)]
    struct Log {
        seeds: Vec<Vec<u8>>,
        machine_ids: Vec<String>,
        hostnames: Vec<String>,
        draws: u8,
        clock_sets: Vec<u64>,
    }

    /// Records every call; the hostname is the last one set.
    struct FakeSystem {
        log: Arc<Mutex<Log>>,
        hostname: Mutex<String>,
        machine_id_fails: bool,
    }

    impl System for FakeSystem {
        fn reseed(&self, seed: &[u8]) -> Result<(), GenerationError> {
            self.log.lock().expect("log").seeds.push(seed.to_vec());
            Ok(())
        }

        fn random(&self) -> Result<[u8; 16], GenerationError> {
            let mut log = self.log.lock().expect("log");
            log.draws += 1;
            Ok([log.draws.wrapping_mul(0x11); 16])
        }

        fn hostname(&self) -> Result<String, GenerationError> {
            Ok(self.hostname.lock().expect("hostname").clone())
        }

        fn write_machine_id(&self, id: &str) -> Result<(), GenerationError> {
            if self.machine_id_fails {
                return Err(GenerationError::Fixup(
                    "open /etc/.machine-id.rollbox-tmp: Read-only file system".into(),
                ));
            }
            self.log
                .lock()
                .expect("log")
                .machine_ids
                .push(id.to_owned());
            Ok(())
        }

        fn realtime_ns(&self) -> u64 {
            GUEST_NOW_NS
        }

        fn set_realtime_ns(&self, ns: u64) -> Result<(), GenerationError> {
            self.log.lock().expect("log").clock_sets.push(ns);
            Ok(())
        }

        fn set_hostname(&self, name: &str) -> Result<(), GenerationError> {
            fixups::validate_hostname(name)?;
            name.clone_into(&mut self.hostname.lock().expect("hostname"));
            self.log
                .lock()
                .expect("log")
                .hostnames
                .push(name.to_owned());
            Ok(())
        }
    }

    /// The fake guest's CLOCK_REALTIME.
    const GUEST_NOW_NS: u64 = 1_800_000_000_000_000_000;

    fn watcher(
        hostname: &str,
        machine_id_fails: bool,
    ) -> (Watcher, Arc<AtomicU64>, Arc<Mutex<Log>>) {
        let (watcher, counter, _clock, log) = watcher_with_clock(hostname, machine_id_fails, 0);
        (watcher, counter, log)
    }

    fn watcher_with_clock(
        hostname: &str,
        machine_id_fails: bool,
        host_ns: u64,
    ) -> (Watcher, Arc<AtomicU64>, Arc<AtomicU64>, Arc<Mutex<Log>>) {
        let counter = Arc::new(AtomicU64::new(7));
        let clock = Arc::new(AtomicU64::new(host_ns));
        let log = Arc::new(Mutex::new(Log::default()));
        let system = FakeSystem {
            log: Arc::clone(&log),
            hostname: Mutex::new(hostname.to_owned()),
            machine_id_fails,
        };
        let watcher = Watcher::new(
            Box::new(FakeCounter(Arc::clone(&counter), Arc::clone(&clock))),
            Box::new(system),
            "rollbox".into(),
            true,
        )
        .expect("watcher");
        (watcher, counter, clock, log)
    }

    #[test]
    fn the_clock_is_stepped_to_the_host_only_when_far_off_and_offered() {
        let (watcher, _counter, clock, log) = watcher_with_clock("sandbox", false, 0);
        assert_eq!(watcher.sync_clock(), None, "0: the host offers no clock");
        clock.store(GUEST_NOW_NS + CLOCK_STEP_THRESHOLD_NS, Ordering::SeqCst);
        assert_eq!(watcher.sync_clock(), None, "within the threshold");
        let later = GUEST_NOW_NS + 3_600_000_000_000;
        clock.store(later, Ordering::SeqCst);
        assert_eq!(watcher.check(), None, "the generation did not change");
        assert_eq!(log.lock().expect("log").clock_sets, [later]);
        let earlier = GUEST_NOW_NS - 2 * CLOCK_STEP_THRESHOLD_NS;
        clock.store(earlier, Ordering::SeqCst);
        assert_eq!(
            watcher.sync_clock(),
            Some(-2 * i128::from(CLOCK_STEP_THRESHOLD_NS))
        );
        assert_eq!(log.lock().expect("log").clock_sets, [later, earlier]);
    }

    #[test]
    fn unchanged_counter_does_nothing() {
        let (watcher, _counter, log) = watcher("sandbox", false);
        assert_eq!(watcher.check(), None);
        assert_eq!(watcher.check(), None);
        let log = log.lock().expect("log");
        assert!(log.seeds.is_empty() && log.machine_ids.is_empty() && log.hostnames.is_empty());
        assert_eq!(
            watcher.status(),
            Status {
                generation: 7,
                applied: None
            }
        );
    }

    #[test]
    fn a_change_reseeds_and_renews_the_identity_once() {
        let (watcher, counter, log) = watcher("sandbox", false);
        counter.store(0xabcd, Ordering::SeqCst);
        let done = watcher.check().expect("re-identified");
        assert_eq!((done.old, done.new), (7, 0xabcd));
        assert!(done.failures.is_empty(), "{:?}", done.failures);
        assert!(done.reseeded);
        assert_eq!(done.machine_id.as_deref(), Some("11".repeat(16).as_str()));
        assert_eq!(done.hostname.as_deref(), Some("sandbox-111111111111"));
        assert_eq!(watcher.check(), None);
        let log = log.lock().expect("log");
        assert_eq!(log.seeds.len(), 1);
        assert_eq!(log.seeds[0][..8], 0xabcd_u64.to_le_bytes());
        assert_eq!(log.machine_ids, ["11".repeat(16)]);
        assert_eq!(log.hostnames, ["sandbox-111111111111"]);
        assert_eq!(
            watcher.status(),
            Status {
                generation: 0xabcd,
                applied: Some(true)
            }
        );
    }

    #[test]
    fn two_changes_re_identify_twice() {
        let (watcher, counter, log) = watcher("sandbox", false);
        counter.store(8, Ordering::SeqCst);
        assert!(watcher.check().is_some());
        counter.store(9, Ordering::SeqCst);
        let done = watcher.check().expect("second change");
        assert_eq!((done.old, done.new), (8, 9));
        // The second name replaces the first suffix instead of adding one.
        assert_eq!(done.hostname.as_deref(), Some("sandbox-222222222222"));
        let log = log.lock().expect("log");
        assert_eq!(log.seeds.len(), 2);
        assert_eq!(log.machine_ids, ["11".repeat(16), "22".repeat(16)]);
    }

    #[test]
    fn concurrent_connections_re_identify_once() {
        let (watcher, counter, log) = watcher("sandbox", false);
        counter.store(8, Ordering::SeqCst);
        let barrier = Barrier::new(8);
        let applied = std::thread::scope(|scope| {
            let checks: Vec<_> = (0..8)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        watcher.check().is_some()
                    })
                })
                .collect();
            checks
                .into_iter()
                .map(|c| c.join())
                .filter(|r| matches!(r, Ok(true)))
                .count()
        });
        assert_eq!(applied, 1);
        assert_eq!(log.lock().expect("log").seeds.len(), 1);
    }

    #[test]
    fn a_failed_step_is_reported_and_the_rest_still_runs() {
        let (watcher, counter, log) = watcher("sandbox", true);
        counter.store(8, Ordering::SeqCst);
        let done = watcher.check().expect("re-identified");
        assert_eq!(done.machine_id, None);
        assert_eq!(done.hostname.as_deref(), Some("sandbox-111111111111"));
        assert_eq!(done.failures.len(), 1);
        assert!(
            done.failures[0].contains("Read-only"),
            "{:?}",
            done.failures
        );
        assert_eq!(log.lock().expect("log").seeds.len(), 1);
        assert_eq!(watcher.status().applied, Some(false));
    }

    #[test]
    fn hostnames_are_derived() {
        let id = "0123456789abcdef0123456789abcdef";
        let derive = |current: &str| derive_hostname(current, "fallback", id);
        assert_eq!(derive("sandbox"), "sandbox-0123456789ab");
        assert_eq!(derive("web-7"), "web-7-0123456789ab");
        assert_eq!(derive("sandbox-fedcba987654"), "sandbox-0123456789ab");
        assert_eq!(derive("a-b-FEDCBA987654"), "a-b-0123456789ab");
        assert_eq!(derive("rollbox-0123456789ab"), "rollbox-0123456789ab");
        // Kernel defaults and names that are not valid hostnames use the fallback.
        assert_eq!(derive("(none)"), "fallback-0123456789ab");
        assert_eq!(derive(""), "fallback-0123456789ab");
        assert_eq!(derive_hostname("", "", id), "rollbox-0123456789ab");
        // Long names are cut to fit 64 characters, without a dangling - or dot.
        let long = derive(&"h".repeat(70));
        assert_eq!(long, format!("{}-0123456789ab", "h".repeat(51)));
        assert_eq!(long.len(), 64);
        let dotted = derive(&format!("{}.-x", "h".repeat(49)));
        assert_eq!(dotted, format!("{}-0123456789ab", "h".repeat(49)));
        for name in [long, dotted] {
            assert!(fixups::validate_hostname(&name).is_ok(), "{name}");
        }
    }
}
