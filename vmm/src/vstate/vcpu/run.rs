//! A vCPU's thread: the run loop, the exits it serves through the VM's buses, and pause,
//! resume and stop by a kick signal.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::{Vcpu, VcpuError};
use crate::vstate::bus::{lock, Bus};

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
}
