//! vCPUs: CPUID, MSRs, registers and LAPIC set-up, and the run loop on its own thread.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{
    kvm_msr_entry, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES, KVM_SYSTEM_EVENT_RESET,
    KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::arch::regs::{boot_fpu, boot_regs, boot_sregs};
use crate::vstate::bus::{lock, Bus};

/// Errors from creating, configuring and running vCPUs.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// KVM_CREATE_VCPU failed.
    #[error("KVM_CREATE_VCPU {index} failed: {source}")]
    Create {
        /// vCPU index.
        index: u8,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// A KVM ioctl used to configure the vCPU failed.
    #[error("vCPU {index}: {what} failed: {source}")]
    Configure {
        /// vCPU index.
        index: u8,
        /// The ioctl.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// KVM refused some of the boot MSRs.
    #[error(
        "vCPU {index}: KVM accepted only {set} of {wanted} boot MSRs (first refused: {refused:#x})"
    )]
    Msrs {
        /// vCPU index.
        index: u8,
        /// MSRs KVM set.
        set: usize,
        /// MSRs we asked for.
        wanted: usize,
        /// The first refused MSR.
        refused: u32,
    },
    /// Building a KVM FAM structure failed.
    #[error("vCPU {index}: {what}: {detail}")]
    Fam {
        /// vCPU index.
        index: u8,
        /// The structure.
        what: &'static str,
        /// The error.
        detail: String,
    },
    /// The signal used to kick vCPUs out of KVM_RUN could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    /// The vCPU did not leave KVM_RUN within the pause timeout; it keeps running.
    #[error("vCPU {index} did not pause within {waited:?} (blocked in a device, or on guest memory that is not served); the VM keeps running")]
    PauseTimeout {
        /// vCPU index.
        index: u8,
        /// How long the pause waited.
        waited: Duration,
    },
    /// The vCPU thread could not be spawned.
    #[error("cannot spawn the thread of vCPU {index}: {source}")]
    Spawn {
        /// vCPU index.
        index: u8,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Why a vCPU stopped the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest reset or powered off: a clean end.
    Clean(&'static str),
    /// The guest crashed or KVM failed; the string describes it, registers included.
    Error(String),
}

/// What a vCPU thread reports when it stops the VM.
#[derive(Debug, Clone)]
pub struct ExitReport {
    /// The vCPU index.
    pub vcpu: u8,
    /// The reason.
    pub exit: VmExit,
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default type write-back.
const MTRR_DEF_TYPE_WB_ENABLED: u64 = (1 << 11) | 6;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

const CPUID_HYPERVISOR_BIT: u32 = 1 << 31;
const CPUID_HTT_BIT: u32 = 1 << 28;

/// The vCPU's run state, shared with the VMM thread that pauses and resumes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Running guest code.
    Running,
    /// Asked to pause; the thread acknowledges by moving to `Paused`.
    Pausing,
    /// Out of KVM_RUN, its file descriptor free for state save and restore.
    Paused,
    /// Asked to end.
    Exiting,
}

struct Control {
    state: Mutex<RunState>,
    changed: Condvar,
}

/// A vCPU: its KVM file descriptor (shared with its thread once started) and what a
/// snapshot of it needs.
#[derive(Clone)]
pub struct Vcpu {
    index: u8,
    fd: Arc<Mutex<VcpuFd>>,
    saveable_msrs: Arc<Vec<u32>>,
}

/// The MSRs a snapshot saves: KVM's save list, less those that must not be restored.
pub fn saveable_msrs(kvm: &Kvm) -> Result<Arc<Vec<u32>>, VcpuError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(state_err(0, "KVM_GET_MSR_INDEX_LIST"))?;
    let mut saveable: Vec<u32> = list
        .as_slice()
        .iter()
        .copied()
        .filter(|i| msr_is_saveable(*i))
        .collect();
    // KVM_SET_MSRS applies entries in order: the TSC deadline counts in TSC ticks and is
    // ignored unless the LAPIC timer is in deadline mode, so it goes after the TSC (and the
    // LAPIC is restored before any MSR).
    saveable.sort_by_key(|&index| index == MSR_IA32_TSC_DEADLINE);
    Ok(Arc::new(saveable))
}

impl Vcpu {
    /// Creates vCPU `index`.
    pub fn new(vm: &VmFd, index: u8, saveable_msrs: Arc<Vec<u32>>) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        Ok(Self {
            index,
            fd: Arc::new(Mutex::new(fd)),
            saveable_msrs,
        })
    }

    fn configure_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let index = self.index;
        move |source| VcpuError::Configure {
            index,
            what,
            source,
        }
    }

    /// Sets CPUID from KVM's supported list, filtered for this vCPU's topology. A
    /// `deterministic` machine gets no RDRAND or RDSEED.
    pub fn configure_cpuid(
        &self,
        kvm: &Kvm,
        vcpu_count: u8,
        deterministic: bool,
    ) -> Result<(), VcpuError> {
        let mut cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(self.configure_err("KVM_GET_SUPPORTED_CPUID"))?;
        filter_cpuid(&mut cpuid, self.index, vcpu_count);
        // KVM emulates the TSC-deadline LAPIC timer but leaves its CPUID bit to userspace.
        // Without it Linux programs the LAPIC timer through trapped MMIO writes.
        if kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer) {
            offer_tsc_deadline_timer(&mut cpuid);
        }
        if deterministic {
            hide_hardware_rng(&mut cpuid);
        }
        lock(&self.fd)
            .set_cpuid2(&cpuid)
            .map_err(self.configure_err("KVM_SET_CPUID2"))
    }

    /// Sets the MSRs Linux expects at boot, only those KVM lists as supported.
    pub fn configure_msrs(&self, kvm: &Kvm) -> Result<(), VcpuError> {
        let supported = kvm
            .get_msr_index_list()
            .map_err(self.configure_err("KVM_GET_MSR_INDEX_LIST"))?;
        let supported = supported.as_slice();
        let wanted: Vec<kvm_msr_entry> = [
            (MSR_IA32_SYSENTER_CS, 0),
            (MSR_IA32_SYSENTER_ESP, 0),
            (MSR_IA32_SYSENTER_EIP, 0),
            (MSR_STAR, 0),
            (MSR_CSTAR, 0),
            (MSR_KERNEL_GS_BASE, 0),
            (MSR_SYSCALL_MASK, 0),
            (MSR_LSTAR, 0),
            (MSR_IA32_TSC, 0),
            (MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
            (MSR_MTRR_DEF_TYPE, MTRR_DEF_TYPE_WB_ENABLED),
        ]
        .into_iter()
        .filter(|(index, _)| supported.contains(index))
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
        let msrs = Msrs::from_entries(&wanted).map_err(|e| VcpuError::Fam {
            index: self.index,
            what: "boot MSR list",
            detail: format!("{e:?}"),
        })?;
        let set = lock(&self.fd)
            .set_msrs(&msrs)
            .map_err(self.configure_err("KVM_SET_MSRS"))?;
        if set != wanted.len() {
            return Err(VcpuError::Msrs {
                index: self.index,
                set,
                wanted: wanted.len(),
                refused: wanted.get(set).map(|m| m.index).unwrap_or(0),
            });
        }
        Ok(())
    }

    /// Sets registers, segments, FPU and LAPIC for the 64-bit Linux entry point. Only the
    /// boot vCPU gets the entry registers; the others wait for INIT/SIPI.
    pub fn configure_boot_state(&self, entry: u64) -> Result<(), VcpuError> {
        let fd = lock(&self.fd);
        if self.index == 0 {
            let sregs = fd
                .get_sregs()
                .map_err(self.configure_err("KVM_GET_SREGS"))?;
            fd.set_sregs(&boot_sregs(sregs))
                .map_err(self.configure_err("KVM_SET_SREGS"))?;
            fd.set_regs(&boot_regs(entry))
                .map_err(self.configure_err("KVM_SET_REGS"))?;
        }
        fd.set_fpu(&boot_fpu())
            .map_err(self.configure_err("KVM_SET_FPU"))?;
        let mut lapic = fd
            .get_lapic()
            .map_err(self.configure_err("KVM_GET_LAPIC"))?;
        set_lvt_delivery_mode(&mut lapic.regs, APIC_LVT0, APIC_MODE_EXTINT);
        set_lvt_delivery_mode(&mut lapic.regs, APIC_LVT1, APIC_MODE_NMI);
        fd.set_lapic(&lapic)
            .map_err(self.configure_err("KVM_SET_LAPIC"))?;
        Ok(())
    }
}

fn set_lvt_delivery_mode(regs: &mut [std::os::raw::c_char; 1024], offset: usize, mode: u32) {
    let mut bytes = [0u8; 4];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = regs[offset + i] as u8;
    }
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        regs[offset + i] = *b as std::os::raw::c_char;
    }
}

/// CPUID.1:ECX.RDRAND[bit 30].
const CPUID_RDRAND_BIT: u32 = 1 << 30;
/// CPUID.(EAX=7,ECX=0):EBX.RDSEED[bit 18].
const CPUID_RDSEED_BIT: u32 = 1 << 18;

/// CPUID.1:ECX.TSC-Deadline[bit 24].
const CPUID_TSC_DEADLINE_BIT: u32 = 1 << 24;
/// CPUID.80000007H:EDX.InvariantTSC[bit 8].
const CPUID_INVARIANT_TSC_BIT: u32 = 1 << 8;

/// Offers the TSC-deadline mode of the LAPIC timer.
fn offer_tsc_deadline_timer(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        if entry.function == 0x1 {
            entry.ecx |= CPUID_TSC_DEADLINE_BIT;
        }
    }
}

/// Hides RDRAND and RDSEED, the guest's only entropy source that a snapshot can't pin.
fn hide_hardware_rng(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        match (entry.function, entry.index) {
            (0x1, _) => entry.ecx &= !CPUID_RDRAND_BIT,
            (0x7, 0) => entry.ebx &= !CPUID_RDSEED_BIT,
            _ => {}
        }
    }
}

/// Gives each vCPU its APIC ID and the VM's topology, and marks the hypervisor.
fn filter_cpuid(cpuid: &mut CpuId, index: u8, vcpu_count: u8) {
    let apic_id = u32::from(index);
    let count = u32::from(vcpu_count);
    // Bits needed to number `count` logical CPUs.
    let shift = 32 - (count.max(1) - 1).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            0x1 => {
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (count << 16);
                entry.ecx |= CPUID_HYPERVISOR_BIT;
                if count > 1 {
                    entry.edx |= CPUID_HTT_BIT;
                } else {
                    entry.edx &= !CPUID_HTT_BIT;
                }
            }
            0x4 => {
                // One core per vCPU package topology: cores per package - 1 in EAX[31:26].
                entry.eax = (entry.eax & 0x03ff_ffff) | ((count.max(1) - 1) << 26);
                // Cache shared by all logical CPUs: EAX[25:14].
                entry.eax = (entry.eax & !(0xfff << 14)) | ((count.max(1) - 1) << 14);
            }
            0x6 => {
                // No power management features (no APERF/MPERF, no turbo).
                entry.eax = 0;
                entry.ecx = 0;
            }
            0xa => {
                // No architectural PMU.
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            0xb | 0x1f => {
                entry.edx = apic_id;
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    1 => {
                        entry.eax = shift;
                        entry.ebx = count;
                        entry.ecx = (2 << 8) | 1;
                    }
                    _ => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = entry.index;
                    }
                }
            }
            0x8000_0007 => {
                // No invariant TSC: with it Linux prefers the TSC over kvm-clock, and a snapshot
                // then carries a clock tied to one host's TSC frequency.
                entry.edx &= !CPUID_INVARIANT_TSC_BIT;
            }
            _ => {}
        }
    }
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that kicks a vCPU thread out of KVM_RUN.
fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the no-op handler for the kick signal (once per process).
pub fn install_kick_handler() -> Result<(), VcpuError> {
    register_signal_handler(kick_signal(), kick_handler).map_err(VcpuError::Signal)
}

/// A running vCPU thread.
pub struct VcpuHandle {
    vcpu: Vcpu,
    thread: Option<JoinHandle<()>>,
    control: Arc<Control>,
}

/// What a vCPU thread needs to serve exits.
#[derive(Clone)]
pub struct ExitHandlers {
    /// Port I/O devices.
    pub pio: Arc<Bus>,
    /// MMIO devices.
    pub mmio: Arc<Bus>,
    /// Where the thread reports the VM's end.
    pub exits: Sender<ExitReport>,
    /// Written after each report, to wake the VMM's event loop.
    pub exit_evt: Arc<EventFd>,
}

impl Vcpu {
    /// Starts the vCPU thread, running at once or paused.
    pub fn start(self, handlers: ExitHandlers, paused: bool) -> Result<VcpuHandle, VcpuError> {
        let control = Arc::new(Control {
            state: Mutex::new(if paused {
                RunState::Paused
            } else {
                RunState::Running
            }),
            changed: Condvar::new(),
        });
        let index = self.index;
        let thread_control = Arc::clone(&control);
        let fd = Arc::clone(&self.fd);
        let thread = crate::seccomp::spawn_filtered(
            format!("vcpu{index}"),
            crate::seccomp::ThreadKind::Vcpu,
            move || {
                #[cfg(all(feature = "test-hooks", debug_assertions))]
                crate::seccomp::test_hooks::forbidden_syscall_on_vcpu(index);
                run_vcpu(index, &fd, &thread_control, &handlers)
            },
        )
        .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuHandle {
            vcpu: self,
            thread: Some(thread),
            control,
        })
    }
}

impl VcpuHandle {
    /// The vCPU; save or restore its state only while it is paused.
    pub fn vcpu(&self) -> &Vcpu {
        &self.vcpu
    }

    fn set_state(&self, state: RunState) {
        *lock(&self.control.state) = state;
        self.control.changed.notify_all();
    }

    fn kick(&self) {
        if let Some(thread) = &self.thread {
            if let Err(e) = thread.kill(kick_signal()) {
                log::warn!("cannot kick vCPU {}: {e}", self.vcpu.index);
            }
        }
    }

    /// Stops the vCPU outside KVM_RUN and waits until it is there, for at most
    /// [`PAUSE_TIMEOUT`]; after that the vCPU is left running and the pause fails.
    pub fn pause(&self) -> Result<(), VcpuError> {
        {
            let mut state = lock(&self.control.state);
            if *state != RunState::Running {
                return Ok(());
            }
            *state = RunState::Pausing;
        }
        if wait_for_pause(&self.control, PAUSE_TIMEOUT, || self.kick()) {
            Ok(())
        } else {
            Err(VcpuError::PauseTimeout {
                index: self.vcpu.index,
                waited: PAUSE_TIMEOUT,
            })
        }
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) {
        let mut state = lock(&self.control.state);
        if matches!(*state, RunState::Paused | RunState::Pausing) {
            *state = RunState::Running;
            self.control.changed.notify_all();
        }
    }

    /// Asks the thread to end and waits for it.
    pub fn stop(&mut self) {
        self.set_state(RunState::Exiting);
        if let Some(thread) = self.thread.take() {
            while !thread.is_finished() {
                if let Err(e) = thread.kill(kick_signal()) {
                    log::warn!("cannot kick vCPU {}: {e}", self.vcpu.index);
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.join().is_err() {
                log::error!("vCPU {} thread panicked", self.vcpu.index);
            }
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long a pause waits for a vCPU to leave KVM_RUN.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Kicks a `Pausing` vCPU until its thread acknowledges, for at most `timeout`. On timeout the
/// request is withdrawn (the state goes back to `Running`) and the answer is false.
fn wait_for_pause(control: &Control, timeout: Duration, kick: impl Fn()) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        kick();
        let state = lock(&control.state);
        let (mut state, _) = control
            .changed
            .wait_timeout_while(state, Duration::from_millis(1), |s| *s == RunState::Pausing)
            .unwrap_or_else(|e| e.into_inner());
        if *state != RunState::Pausing {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            *state = RunState::Running;
            control.changed.notify_all();
            return false;
        }
    }
}

/// Blocks while paused; returns false when the thread must end.
fn wait_while_paused(control: &Control) -> bool {
    let mut state = lock(&control.state);
    loop {
        match *state {
            RunState::Running => return true,
            RunState::Exiting => return false,
            RunState::Pausing => {
                *state = RunState::Paused;
                control.changed.notify_all();
            }
            RunState::Paused => {}
        }
        state = control
            .changed
            .wait(state)
            .unwrap_or_else(|e| e.into_inner());
    }
}

fn run_vcpu(index: u8, fd: &Mutex<VcpuFd>, control: &Control, handlers: &ExitHandlers) {
    loop {
        if !wait_while_paused(control) {
            return;
        }
        let mut vcpu = lock(fd);
        // Run until something asks for a state change; the fd lock is released when paused.
        let mut result = Ok(Served::Exit);
        while result.is_ok() && *lock(&control.state) == RunState::Running {
            result = handle_one_exit(index, &mut vcpu, handlers);
        }
        // A pause may save this vCPU's state: finish the instruction of the last exit first.
        if result.is_ok() && *lock(&control.state) == RunState::Pausing {
            result = complete_pending_io(index, &mut vcpu, handlers);
        }
        if let Err(exit) = result {
            *lock(&control.state) = RunState::Exiting;
            if handlers
                .exits
                .send(ExitReport { vcpu: index, exit })
                .is_err()
            {
                log::error!("vCPU {index}: the VMM stopped listening for exits");
            }
            if let Err(e) = handlers.exit_evt.write(1) {
                log::error!("vCPU {index}: cannot signal exit: {e}");
            }
            return;
        }
    }
}

/// What one KVM_RUN ended with, when the VM goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// An exit was served; KVM completes its instruction (a read's data, RIP) on the next
    /// KVM_RUN.
    Exit,
    /// KVM_RUN was interrupted (the kick signal); nothing is pending.
    Interrupted,
}

/// KVM completes an I/O or MMIO instruction only when KVM_RUN is next entered, so state saved
/// right after such an exit would have it half done (the KVM API's note on `immediate_exit`).
/// Enters with `immediate_exit` set until KVM answers EINTR: it completes what is pending and
/// returns without running the guest. A string access may exit again; each pass makes progress.
fn complete_pending_io(
    index: u8,
    vcpu: &mut VcpuFd,
    handlers: &ExitHandlers,
) -> Result<Served, VmExit> {
    loop {
        vcpu.set_kvm_immediate_exit(1);
        let served = handle_one_exit(index, vcpu, handlers);
        vcpu.set_kvm_immediate_exit(0);
        if served? == Served::Interrupted {
            return Ok(Served::Interrupted);
        }
    }
}

/// Runs the vCPU until its next exit and serves it. `Err` ends the VM.
fn handle_one_exit(
    index: u8,
    vcpu: &mut VcpuFd,
    handlers: &ExitHandlers,
) -> Result<Served, VmExit> {
    match vcpu.run() {
        Ok(VcpuExit::IoIn(port, data)) => {
            if !handlers.pio.read(u64::from(port), data) {
                data.fill(0xff);
            }
            Ok(Served::Exit)
        }
        Ok(VcpuExit::IoOut(port, data)) => {
            handlers.pio.write(u64::from(port), data);
            Ok(Served::Exit)
        }
        Ok(VcpuExit::MmioRead(addr, data)) => {
            if !handlers.mmio.read(addr, data) {
                log::debug!("vCPU {index}: MMIO read of unclaimed address {addr:#x}");
                data.fill(0);
            }
            Ok(Served::Exit)
        }
        Ok(VcpuExit::MmioWrite(addr, data)) => {
            if !handlers.mmio.write(addr, data) {
                log::debug!("vCPU {index}: MMIO write to unclaimed address {addr:#x}");
            }
            Ok(Served::Exit)
        }
        Ok(VcpuExit::Hlt) => Err(VmExit::Clean("guest halted")),
        Ok(VcpuExit::SystemEvent(kind, _)) => match kind {
            KVM_SYSTEM_EVENT_SHUTDOWN => Err(VmExit::Clean("guest powered off")),
            KVM_SYSTEM_EVENT_RESET => Err(VmExit::Clean("guest reset")),
            other => Err(VmExit::Error(crash_report(
                index,
                vcpu,
                &format!("KVM system event {other}"),
            ))),
        },
        Ok(VcpuExit::Shutdown) => Err(VmExit::Error(crash_report(
            index,
            vcpu,
            "KVM_EXIT_SHUTDOWN (triple fault; on AMD, KVM has already reset the registers below)",
        ))),
        Ok(VcpuExit::InternalError) => {
            let detail = internal_error_detail(vcpu);
            Err(VmExit::Error(crash_report(
                index,
                vcpu,
                &format!("KVM_EXIT_INTERNAL_ERROR ({detail})"),
            )))
        }
        Ok(VcpuExit::FailEntry(reason, cpu)) => Err(VmExit::Error(crash_report(
            index,
            vcpu,
            &format!("KVM_EXIT_FAIL_ENTRY (hardware reason {reason:#x}, cpu {cpu})"),
        ))),
        Ok(VcpuExit::IoapicEoi(_)) | Ok(VcpuExit::Intr) | Ok(VcpuExit::IrqWindowOpen) => {
            Ok(Served::Exit)
        }
        Ok(other) => {
            let what = format!("unexpected exit {other:?}");
            Err(VmExit::Error(crash_report(index, vcpu, &what)))
        }
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
            vcpu.set_kvm_immediate_exit(0);
            Ok(Served::Interrupted)
        }
        Err(e) => Err(VmExit::Error(crash_report(
            index,
            vcpu,
            &format!("KVM_RUN failed: {e}"),
        ))),
    }
}

fn internal_error_detail(vcpu: &mut VcpuFd) -> String {
    let run = vcpu.get_kvm_run();
    // SAFETY: after KVM_EXIT_INTERNAL_ERROR the `internal` member of the exit union is the one
    // KVM filled in.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let ndata = (internal.ndata as usize).min(internal.data.len());
    let data: Vec<String> = internal.data[..ndata]
        .iter()
        .map(|d| format!("{d:#x}"))
        .collect();
    let kind = match internal.suberror {
        1 => "emulation failure",
        2 => "simultaneous exceptions",
        3 => "delivery event",
        _ => "other",
    };
    format!(
        "suberror {} = {kind}, data [{}]",
        internal.suberror,
        data.join(", ")
    )
}

/// A report of the vCPU's registers, for crash exits.
fn crash_report(index: u8, vcpu: &VcpuFd, reason: &str) -> String {
    let mut out = format!("vCPU {index}: {reason}");
    match vcpu.get_regs() {
        Ok(r) => out.push_str(&format!(
            "\n  rip={:#018x} rsp={:#018x} rflags={:#x}\n  rax={:#018x} rbx={:#018x} rcx={:#018x} rdx={:#018x}\n  rsi={:#018x} rdi={:#018x} rbp={:#018x}\n  r8={:#018x} r9={:#018x} r10={:#018x} r11={:#018x}\n  r12={:#018x} r13={:#018x} r14={:#018x} r15={:#018x}",
            r.rip, r.rsp, r.rflags, r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp, r.r8, r.r9,
            r.r10, r.r11, r.r12, r.r13, r.r14, r.r15
        )),
        Err(e) => out.push_str(&format!("\n  (registers unavailable: {e})")),
    }
    if let Ok(s) = vcpu.get_sregs() {
        out.push_str(&format!(
            "\n  cr0={:#x} cr3={:#x} cr4={:#x} efer={:#x} cs={:#x}",
            s.cr0, s.cr3, s.cr4, s.efer, s.cs.selector
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn control(state: RunState) -> Arc<Control> {
        Arc::new(Control {
            state: Mutex::new(state),
            changed: Condvar::new(),
        })
    }

    #[test]
    fn a_pause_nobody_acknowledges_times_out_and_leaves_the_vcpu_running() {
        let control = control(RunState::Pausing);
        let kicks = std::sync::atomic::AtomicU32::new(0);
        let started = std::time::Instant::now();
        let paused = wait_for_pause(&control, Duration::from_millis(50), || {
            kicks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert!(!paused);
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(
            kicks.load(std::sync::atomic::Ordering::Relaxed) > 1,
            "kicked again and again"
        );
        assert_eq!(*lock(&control.state), RunState::Running);
        let err = VcpuError::PauseTimeout {
            index: 1,
            waited: PAUSE_TIMEOUT,
        };
        assert!(
            err.to_string()
                .starts_with("vCPU 1 did not pause within 5s"),
            "{err}"
        );
    }

    #[test]
    fn a_pause_the_thread_acknowledges_succeeds() {
        let control = control(RunState::Pausing);
        let theirs = Arc::clone(&control);
        let thread = std::thread::spawn(move || wait_while_paused(&theirs));
        assert!(wait_for_pause(&control, Duration::from_secs(10), || {}));
        assert_eq!(*lock(&control.state), RunState::Paused);
        *lock(&control.state) = RunState::Exiting;
        control.changed.notify_all();
        assert!(!thread.join().expect("thread"));
    }

    #[test]
    fn deterministic_cpuid_hides_rdrand_and_rdseed() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: CPUID_RDRAND_BIT | 1,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                index: 0,
                ebx: CPUID_RDSEED_BIT | 1,
                ..Default::default()
            },
        ];
        let mut cpuid = CpuId::from_entries(&entries).expect("cpuid");
        hide_hardware_rng(&mut cpuid);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ecx, 1);
        assert_eq!(e[1].ebx, 1);
    }

    #[test]
    fn cpuid_gets_apic_id_and_topology() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xffff_ffff,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                index: 1,
                ..Default::default()
            },
        ];
        let mut cpuid = CpuId::from_entries(&entries).expect("cpuid");
        filter_cpuid(&mut cpuid, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_eq!(e[0].ebx & 0xffff, 0xffff);
        assert_ne!(e[0].ecx & CPUID_HYPERVISOR_BIT, 0);
        assert_eq!(e[1].edx, 3);
        assert_eq!(e[1].eax, 2);
        assert_eq!(e[1].ebx, 4);
    }

    #[test]
    fn lvt_mode_is_replaced() {
        let mut regs = [0 as std::os::raw::c_char; 1024];
        regs[APIC_LVT0 + 1] = 0x05;
        set_lvt_delivery_mode(&mut regs, APIC_LVT0, APIC_MODE_EXTINT);
        assert_eq!(regs[APIC_LVT0 + 1] as u8, 0x07);
    }
}

/// A vCPU's saved state: everything KVM needs to resume it exactly.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct VcpuState {
    /// CPUID as set at boot.
    pub cpuid: Vec<kvm_bindings::kvm_cpuid_entry2>,
    /// MSRs from KVM's save list.
    pub msrs: Vec<kvm_msr_entry>,
    /// General registers.
    pub regs: kvm_bindings::kvm_regs,
    /// Special registers.
    pub sregs: kvm_bindings::kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_bindings::kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_bindings::kvm_xcrs,
    /// Debug registers.
    pub debug_regs: kvm_bindings::kvm_debugregs,
    /// Local APIC.
    pub lapic: kvm_bindings::kvm_lapic_state,
    /// Pending events.
    pub vcpu_events: kvm_bindings::kvm_vcpu_events,
    /// Run state (running, halted, waiting for SIPI).
    pub mp_state: kvm_bindings::kvm_mp_state,
    /// TSC frequency, when KVM reports it.
    #[serde(default)]
    pub tsc_khz: Option<u32>,
}

/// IA32_TSC_DEADLINE: the LAPIC timer's deadline in TSC-deadline mode.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// MSRs that KVM lists but that must not be saved or restored.
fn msr_is_saveable(index: u32) -> bool {
    // IA32_ARCH_CAPABILITIES is refused on PVM hosts; the MCE banks are left at their reset
    // values.
    !(index == 0x10a || (0x400..0x480).contains(&index))
}

fn state_err(index: u8, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
    move |source| VcpuError::Configure {
        index,
        what,
        source,
    }
}

/// Saves a paused vCPU's state.
fn save_vcpu_state(index: u8, fd: &VcpuFd, saveable: &[u32]) -> Result<VcpuState, VcpuError> {
    let fam = |what: &'static str| {
        move |e: vmm_sys_util::fam::Error| VcpuError::Fam {
            index,
            what,
            detail: format!("{e:?}"),
        }
    };
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(state_err(index, "KVM_GET_CPUID2"))?;
    let mut indices = saveable.to_vec();
    let msrs = loop {
        let entries: Vec<kvm_msr_entry> = indices
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(fam("MSR list"))?;
        let read = fd
            .get_msrs(&mut msrs)
            .map_err(state_err(index, "KVM_GET_MSRS"))?;
        if read == indices.len() {
            break msrs.as_slice().to_vec();
        }
        // KVM stops at the first MSR it cannot read: drop it and read again.
        let refused = indices.remove(read);
        log::debug!("vCPU {index}: MSR {refused:#x} cannot be read; not saved");
    };
    Ok(VcpuState {
        cpuid: cpuid.as_slice().to_vec(),
        msrs,
        regs: fd.get_regs().map_err(state_err(index, "KVM_GET_REGS"))?,
        sregs: fd.get_sregs().map_err(state_err(index, "KVM_GET_SREGS"))?,
        xsave: fd.get_xsave().map_err(state_err(index, "KVM_GET_XSAVE"))?,
        xcrs: fd.get_xcrs().map_err(state_err(index, "KVM_GET_XCRS"))?,
        debug_regs: fd
            .get_debug_regs()
            .map_err(state_err(index, "KVM_GET_DEBUGREGS"))?,
        lapic: fd.get_lapic().map_err(state_err(index, "KVM_GET_LAPIC"))?,
        vcpu_events: fd
            .get_vcpu_events()
            .map_err(state_err(index, "KVM_GET_VCPU_EVENTS"))?,
        mp_state: fd
            .get_mp_state()
            .map_err(state_err(index, "KVM_GET_MP_STATE"))?,
        tsc_khz: fd.get_tsc_khz().ok(),
    })
}

/// Restores a vCPU created for restore (before its thread starts).
pub fn restore_vcpu_state(index: u8, fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuError> {
    let fam = |what: &'static str| {
        move |e: vmm_sys_util::fam::Error| VcpuError::Fam {
            index,
            what,
            detail: format!("{e:?}"),
        }
    };
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(fam("CPUID"))?;
    fd.set_cpuid2(&cpuid)
        .map_err(state_err(index, "KVM_SET_CPUID2"))?;
    if let Some(khz) = state.tsc_khz {
        if let Err(e) = fd.set_tsc_khz(khz) {
            log::debug!("vCPU {index}: KVM_SET_TSC_KHZ {khz}: {e}");
        }
    }
    fd.set_mp_state(state.mp_state)
        .map_err(state_err(index, "KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs)
        .map_err(state_err(index, "KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs)
        .map_err(state_err(index, "KVM_SET_SREGS"))?;
    // SAFETY: the xsave area came from KVM_GET_XSAVE on the same kind of host, so it has the
    // layout and size this KVM expects.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(state_err(index, "KVM_SET_XSAVE"))?;
    fd.set_xcrs(&state.xcrs)
        .map_err(state_err(index, "KVM_SET_XCRS"))?;
    fd.set_debug_regs(&state.debug_regs)
        .map_err(state_err(index, "KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic)
        .map_err(state_err(index, "KVM_SET_LAPIC"))?;
    let msrs = Msrs::from_entries(&state.msrs).map_err(fam("MSR list"))?;
    let set = fd
        .set_msrs(&msrs)
        .map_err(state_err(index, "KVM_SET_MSRS"))?;
    if set != state.msrs.len() {
        return Err(VcpuError::Msrs {
            index,
            set,
            wanted: state.msrs.len(),
            refused: state.msrs.get(set).map(|m| m.index).unwrap_or(0),
        });
    }
    fd.set_vcpu_events(&state.vcpu_events)
        .map_err(state_err(index, "KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// What restoring a vCPU needs besides its state.
pub struct VcpuRestoreArgs {
    /// A freshly created vCPU.
    pub vcpu: Vcpu,
}

impl snapshot::Persist for Vcpu {
    type State = VcpuState;
    type ConstructorArgs = VcpuRestoreArgs;
    type Error = VcpuError;

    /// Saves the vCPU; it must be paused or not yet started.
    fn save(&self) -> Result<VcpuState, VcpuError> {
        save_vcpu_state(self.index, &lock(&self.fd), &self.saveable_msrs)
    }

    fn restore(args: VcpuRestoreArgs, state: &VcpuState) -> Result<Self, VcpuError> {
        restore_vcpu_state(args.vcpu.index, &lock(&args.vcpu.fd), state)?;
        Ok(args.vcpu)
    }
}
