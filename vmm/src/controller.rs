//! The VMM thread: owns the microVM, runs the event loop over device, console, API and exit
//! events, and carries out [`VmmAction`]s.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::api::server::ApiRequest;
use crate::api::{ActionError, ActionResult, ResumedSnapshot, VmInfo, VmmAction, VmmData};
use crate::builder::{build_microvm, MicroVm};
use crate::devices::virtio::block::QueueWorker;
use crate::devices::virtio::TYPE_BLOCK;
use crate::persist::{
    create_background_snapshot, create_snapshot, restore_microvm, RestoreBackend, RestoreOptions,
    SnapshotMemory, SnapshotType, VmShell,
};
use crate::vmm_config::{host_memory_mib, Validate, ValidateMachine, VmResources};
use crate::vstate::bus::lock;
use crate::vstate::vcpu::VmExit;
use std::path::Path;
use std::time::Instant;

/// Errors of the event loop itself.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// epoll or eventfd set-up failed.
    #[error("event loop: {0}")]
    Epoll(std::io::Error),
}

const TOKEN_API: u64 = 1;
const TOKEN_EXIT: u64 = 2;
const TOKEN_RESET: u64 = 3;
const TOKEN_POWEROFF: u64 = 4;
const TOKEN_STDIN: u64 = 5;
const TOKEN_SERIAL_ROOM: u64 = 6;
const TOKEN_SIGNAL: u64 = 7;
const TOKEN_PANIC: u64 = 8;
const TOKEN_QUEUE: u64 = 1 << 32;
const TOKEN_BACKEND: u64 = 2 << 32;
const TOKEN_KIND_MASK: u64 = 0xffff_ffff << 32;

/// How long console output may sit in the buffer.
const CONSOLE_FLUSH_MS: i32 = 5;
const STDIN_CHUNK: usize = 4096;

/// Ends the event loop from a signal handler (which the embedding binary installs).
pub struct StopSignal {
    evt: EventFd,
    number: AtomicI32,
}

impl StopSignal {
    /// Asks the event loop to stop with status 128 + `signal`. Async-signal-safe: one atomic
    /// store and one eventfd write.
    pub fn raise(&self, signal: i32) {
        self.number.store(signal, Ordering::SeqCst);
        let _ = self.evt.write(1);
    }
}

/// An action's answer: now, or from work that runs off the event loop.
enum Answer {
    Now(ActionResult),
    Later(Box<dyn FnOnce() -> ActionResult + Send>),
}

/// The VMM: resources, the microVM once started, and the event loop.
pub struct Controller {
    resources: VmResources,
    microvm: Option<MicroVm>,
    epoll: Epoll,
    api_rx: Option<Receiver<ApiRequest>>,
    api_evt: Arc<EventFd>,
    stop: Arc<StopSignal>,
    stdin_pending: VecDeque<u8>,
    stdin_state: StdinState,
    exit_code: Option<i32>,
    host_mib: u64,
    shell: Option<VmShell>,
    /// Block queues served by a worker thread each (true), or on the event loop.
    block_io_threads: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StdinState {
    Watched,
    Unwatched,
    Closed,
}

impl Controller {
    /// A controller for `resources`, taking API requests from `api_rx` when given.
    pub fn new(
        resources: VmResources,
        api_rx: Option<Receiver<ApiRequest>>,
        api_evt: Arc<EventFd>,
    ) -> Result<Self, ControllerError> {
        let epoll = Epoll::new().map_err(ControllerError::Epoll)?;
        let stop = Arc::new(StopSignal {
            evt: EventFd::new(EFD_NONBLOCK).map_err(ControllerError::Epoll)?,
            number: AtomicI32::new(0),
        });
        let add = |fd, token| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        add(api_evt.as_raw_fd(), TOKEN_API).map_err(ControllerError::Epoll)?;
        add(stop.evt.as_raw_fd(), TOKEN_SIGNAL).map_err(ControllerError::Epoll)?;
        Ok(Self {
            resources,
            microvm: None,
            epoll,
            api_rx,
            api_evt,
            stop,
            stdin_pending: VecDeque::new(),
            stdin_state: StdinState::Unwatched,
            exit_code: None,
            host_mib: host_memory_mib(),
            shell: None,
            block_io_threads: true,
        })
    }

    /// Whether block queues get a worker thread each (the default) or are served on the
    /// event loop, as before worker threads existed.
    pub fn set_block_io_threads(&mut self, on: bool) {
        self.block_io_threads = on;
    }

    /// What a signal handler calls to stop the event loop.
    pub fn stop_signal(&self) -> Arc<StopSignal> {
        Arc::clone(&self.stop)
    }

    fn watch(&self, fd: i32, token: u64) -> std::io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    }

    /// Builds and starts the microVM; registers its events.
    pub fn start(&mut self) -> Result<(), ActionError> {
        if self.microvm.is_some() {
            return Err(ActionError::bad_request("the microVM is already running"));
        }
        let microvm =
            build_microvm(&self.resources).map_err(|e| ActionError::bad_request(e.to_string()))?;
        self.install(microvm)
    }

    /// Builds an empty VM of `machine`'s shape now, so that a later snapshot load of that shape
    /// skips KVM set-up (rollbox extension: `--shell-memory-mib`, the daemon's warm shells).
    pub fn prebuild_shell(
        &mut self,
        machine: &crate::vmm_config::MachineConfig,
    ) -> Result<(), ActionError> {
        machine
            .validate(self.host_mib)
            .map_err(|e| ActionError::bad_request(e.to_string()))?;
        let shell = VmShell::build(machine).map_err(|e| ActionError::bad_request(e.to_string()))?;
        self.shell = Some(shell);
        Ok(())
    }

    /// Restores a microVM from a snapshot and installs it.
    pub fn restore(
        &mut self,
        state_path: &Path,
        options: &RestoreOptions,
    ) -> Result<(), ActionError> {
        if self.microvm.is_some() {
            return Err(ActionError::bad_request(
                "a snapshot can only be loaded before the microVM starts",
            ));
        }
        let started = Instant::now();
        let microvm = restore_microvm(state_path, options, self.shell.take())
            .map_err(|e| ActionError::bad_request(e.to_string()))?;
        log::info!(
            "restored {} in {:.2} ms",
            state_path.display(),
            started.elapsed().as_secs_f64() * 1e3
        );
        self.resources.machine = microvm.machine.clone();
        self.install(microvm)
    }

    /// Registers a built or restored microVM's events with the event loop; block queues get
    /// worker threads of their own.
    fn install(&mut self, mut microvm: MicroVm) -> Result<(), ActionError> {
        let event_err = |e: std::io::Error| ActionError {
            status: 500,
            message: format!("event loop: {e}"),
        };
        let mut fds = vec![
            (microvm.events.exit.as_raw_fd(), TOKEN_EXIT),
            (microvm.events.reset.as_raw_fd(), TOKEN_RESET),
            (microvm.events.poweroff.as_raw_fd(), TOKEN_POWEROFF),
            (microvm.events.panic.as_raw_fd(), TOKEN_PANIC),
            (microvm.events.serial_room.as_raw_fd(), TOKEN_SERIAL_ROOM),
        ];
        let mut workers = Vec::new();
        for (dev, slot) in microvm.devices.virtio.iter().enumerate() {
            let (is_block, name) = {
                let transport = lock(&slot.transport);
                let device = transport.device();
                (device.device_type() == TYPE_BLOCK, device.name())
            };
            if slot.notify_polled && is_block && self.block_io_threads {
                let notify = slot
                    .notify
                    .iter()
                    .map(EventFd::try_clone)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(event_err)?;
                let worker = QueueWorker::start(name, Arc::clone(&slot.transport), notify)
                    .map_err(|e| ActionError {
                        status: 500,
                        message: e.to_string(),
                    })?;
                if microvm.paused {
                    worker.pause();
                }
                workers.push(worker);
                continue;
            }
            let polled = slot.notify.iter().filter(|_| slot.notify_polled);
            for (queue, evt) in polled.enumerate() {
                fds.push((
                    evt.as_raw_fd(),
                    TOKEN_QUEUE | ((dev as u64) << 16) | queue as u64,
                ));
            }
            if let Some(fd) = slot.backend_fd {
                fds.push((fd, TOKEN_BACKEND | dev as u64));
            }
        }
        for (fd, token) in fds {
            self.watch(fd, token).map_err(event_err)?;
        }
        microvm.queue_workers = workers;
        self.microvm = Some(microvm);
        self.watch_stdin();
        Ok(())
    }

    fn watch_stdin(&mut self) {
        if self.stdin_state != StdinState::Unwatched {
            return;
        }
        match self.watch(libc::STDIN_FILENO, TOKEN_STDIN) {
            Ok(()) => self.stdin_state = StdinState::Watched,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                // A regular file: epoll can't watch it, and it is always readable.
                let mut all = Vec::new();
                if let Err(e) = std::io::stdin().read_to_end(&mut all) {
                    log::warn!("reading stdin: {e}");
                }
                self.stdin_pending.extend(all);
                self.stdin_state = StdinState::Closed;
                self.feed_serial();
            }
            Err(e) => {
                log::warn!("console input disabled: cannot watch stdin: {e}");
                self.stdin_state = StdinState::Closed;
            }
        }
    }

    fn unwatch_stdin(&mut self, closed: bool) {
        if self.stdin_state == StdinState::Watched {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                libc::STDIN_FILENO,
                EpollEvent::default(),
            );
        }
        self.stdin_state = if closed {
            StdinState::Closed
        } else {
            StdinState::Unwatched
        };
    }

    fn read_stdin(&mut self) {
        let mut buf = [0u8; STDIN_CHUNK];
        // SAFETY: reads into a stack buffer of the given length from stdin, which we don't close.
        let n = unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
        match n {
            0 => self.unwatch_stdin(true),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::Interrupted
                {
                    log::warn!("console input stopped: {e}");
                    self.unwatch_stdin(true);
                }
            }
            n => self.stdin_pending.extend(&buf[..n as usize]),
        }
        self.feed_serial();
    }

    /// Moves pending console input into the UART; stops watching stdin while it is full.
    fn feed_serial(&mut self) {
        let Some(vm) = &self.microvm else { return };
        if !self.stdin_pending.is_empty() {
            let mut serial = lock(&vm.devices.serial);
            let (front, _) = self.stdin_pending.as_slices();
            let taken = serial.enqueue_input(front);
            self.stdin_pending.drain(..taken);
        }
        if self.stdin_pending.is_empty() {
            if self.stdin_state == StdinState::Unwatched {
                self.watch_stdin();
            }
        } else if self.stdin_state == StdinState::Watched {
            self.unwatch_stdin(false);
        }
    }

    /// Runs until the guest or a signal ends the VMM; returns the exit status.
    pub fn run(&mut self) -> Result<i32, ControllerError> {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            if let Some(code) = self.exit_code {
                self.flush_console();
                return Ok(code);
            }
            let timeout = if self.console_pending() {
                CONSOLE_FLUSH_MS
            } else {
                -1
            };
            let n = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ControllerError::Epoll(e)),
            };
            if n == 0 {
                self.flush_console();
            }
            for event in &events[..n] {
                self.dispatch(event.data());
            }
        }
    }

    fn console_pending(&self) -> bool {
        self.microvm
            .as_ref()
            .is_some_and(|vm| lock(&vm.devices.serial).has_pending_output())
    }

    fn flush_console(&self) {
        if let Some(vm) = &self.microvm {
            lock(&vm.devices.serial).flush_output();
        }
    }

    fn dispatch(&mut self, token: u64) {
        match token & TOKEN_KIND_MASK {
            TOKEN_QUEUE => {
                let dev = ((token >> 16) & 0xffff) as usize;
                let queue = (token & 0xffff) as usize;
                if let Some(slot) = self
                    .microvm
                    .as_ref()
                    .and_then(|vm| vm.devices.virtio.get(dev))
                {
                    if let Some(evt) = slot.notify.get(queue) {
                        let _ = evt.read();
                    }
                    lock(&slot.transport).notify_queue(queue);
                }
                return;
            }
            TOKEN_BACKEND => {
                let dev = (token & 0xffff) as usize;
                let mut failure = None;
                if let Some(slot) = self
                    .microvm
                    .as_ref()
                    .and_then(|vm| vm.devices.virtio.get(dev))
                {
                    let mut transport = lock(&slot.transport);
                    transport.process_backend();
                    failure = transport.device().failure();
                }
                if let Some(why) = failure {
                    self.flush_console();
                    eprintln!("rollbox-vmm: error: {why}");
                    self.finish(1, "a device backend failed");
                }
                return;
            }
            _ => {}
        }
        match token {
            TOKEN_API => self.serve_api(),
            TOKEN_STDIN => self.read_stdin(),
            TOKEN_SERIAL_ROOM => {
                if let Some(vm) = &self.microvm {
                    let _ = vm.events.serial_room.read();
                }
                self.feed_serial();
            }
            TOKEN_EXIT => self.vcpu_exit(),
            TOKEN_RESET => self.finish(0, "guest reset (i8042)"),
            TOKEN_POWEROFF => self.finish(0, "guest powered off"),
            TOKEN_PANIC => {
                self.flush_console();
                eprintln!("rollbox-vmm: guest stopped: the guest kernel panicked (pvpanic)");
                self.finish(1, "guest kernel panic");
            }
            TOKEN_SIGNAL => {
                let _ = self.stop.evt.read();
                let signal = self.stop.number.load(Ordering::SeqCst);
                self.finish(128 + signal, &format!("stopped by signal {signal}"));
            }
            other => log::warn!("event loop: unknown token {other:#x}"),
        }
    }

    fn finish(&mut self, code: i32, why: &str) {
        log::info!("rollbox-vmm exiting with status {code}: {why}");
        self.exit_code.get_or_insert(code);
    }

    fn vcpu_exit(&mut self) {
        let Some(vm) = &self.microvm else { return };
        let _ = vm.events.exit.read();
        let mut reports = Vec::new();
        while let Ok(report) = vm.exit_rx.try_recv() {
            reports.push(report);
        }
        for report in reports {
            match report.exit {
                VmExit::Clean(why) => self.finish(0, why),
                VmExit::Error(detail) => {
                    self.flush_console();
                    eprintln!("rollbox-vmm: guest stopped: {detail}");
                    log::error!("guest crashed on vCPU {}", report.vcpu);
                    self.finish(1, "guest crashed");
                }
            }
        }
    }

    fn serve_api(&mut self) {
        let _ = self.api_evt.read();
        let mut requests = Vec::new();
        if let Some(rx) = &self.api_rx {
            while let Ok(request) = rx.try_recv() {
                requests.push(request);
            }
        }
        for (action, reply) in requests {
            let result = match self.start_action(action) {
                Answer::Now(result) => result,
                Answer::Later(work) => {
                    // Slow work (a background snapshot's write) answers from a thread of its own.
                    let spawned =
                        std::thread::Builder::new()
                            .name("api-later".into())
                            .spawn(move || {
                                if reply.send(work()).is_err() {
                                    log::debug!("API client went away before its answer");
                                }
                            });
                    if let Err(e) = spawned {
                        log::error!("cannot start a thread for a slow request: {e}");
                    }
                    continue;
                }
            };
            if reply.send(result).is_err() {
                log::debug!("API client went away before its answer");
            }
        }
    }

    fn not_after_boot(&self, what: &str) -> Result<(), ActionError> {
        if self.microvm.is_some() {
            return Err(ActionError::bad_request(format!(
                "{what} is not allowed after the microVM started"
            )));
        }
        Ok(())
    }

    /// Carries out one action and waits for its answer.
    pub fn handle(&mut self, action: VmmAction) -> ActionResult {
        match self.start_action(action) {
            Answer::Now(result) => result,
            Answer::Later(work) => work(),
        }
    }

    /// Carries out what of `action` needs the VM; what does not may be left to run elsewhere.
    fn start_action(&mut self, action: VmmAction) -> Answer {
        match action {
            VmmAction::CreateSnapshot(params)
                if params.rollbox.as_ref().is_some_and(|r| r.resume_vm) =>
            {
                self.snapshot_resuming(&params)
            }
            action => Answer::Now(self.handle_now(action)),
        }
    }

    fn handle_now(&mut self, action: VmmAction) -> ActionResult {
        let config_err =
            |e: crate::vmm_config::ConfigError| ActionError::bad_request(e.to_string());
        match action {
            VmmAction::GetVmInfo => Ok(VmmData::VmInfo(VmInfo {
                id: "anonymous-instance".into(),
                state: match &self.microvm {
                    None => "Not started",
                    Some(vm) if vm.paused => "Paused",
                    Some(_) => "Running",
                }
                .into(),
                vmm_version: env!("CARGO_PKG_VERSION").into(),
                app_name: "rollbox-vmm".into(),
            })),
            VmmAction::GetMachineConfig => {
                Ok(VmmData::MachineConfig(self.resources.machine.clone()))
            }
            VmmAction::PutBootSource(boot) => {
                self.not_after_boot("PUT /boot-source")?;
                crate::arch::boot::detect_kernel_format(&boot.kernel_image_path)
                    .map_err(|e| ActionError::bad_request(e.to_string()))?;
                self.resources.boot_source = Some(boot);
                Ok(VmmData::Empty)
            }
            VmmAction::PutMachineConfig(machine) => {
                self.not_after_boot("PUT /machine-config")?;
                machine.validate(self.host_mib).map_err(config_err)?;
                self.resources.machine = machine;
                Ok(VmmData::Empty)
            }
            VmmAction::PutDrive(drive) => {
                self.not_after_boot("PUT /drives")?;
                std::fs::metadata(&drive.path_on_host).map_err(|e| {
                    ActionError::bad_request(format!("drive {}: {e}", drive.path_on_host.display()))
                })?;
                self.resources.upsert_drive(drive).map_err(config_err)?;
                Ok(VmmData::Empty)
            }
            VmmAction::PutNetworkInterface(iface) => {
                self.not_after_boot("PUT /network-interfaces")?;
                self.resources.upsert_net(iface).map_err(config_err)?;
                Ok(VmmData::Empty)
            }
            VmmAction::PutFs(fs) => {
                self.not_after_boot("PUT /fs")?;
                self.resources.add_fs(fs).map_err(config_err)?;
                Ok(VmmData::Empty)
            }
            VmmAction::PutVfio(device) => {
                self.not_after_boot("PUT /vfio")?;
                self.resources.add_vfio(device.path).map_err(config_err)?;
                Ok(VmmData::Empty)
            }
            VmmAction::PutVsock(vsock) => {
                self.not_after_boot("PUT /vsock")?;
                vsock.validate().map_err(config_err)?;
                self.resources.vsock = Some(vsock);
                Ok(VmmData::Empty)
            }
            VmmAction::InstanceStart => {
                self.start()?;
                Ok(VmmData::Empty)
            }
            VmmAction::SendCtrlAltDel => {
                let vm = self.running()?;
                lock(&vm.devices.i8042)
                    .trigger_ctrl_alt_del()
                    .map_err(|e| {
                        ActionError::bad_request(format!("cannot inject Ctrl-Alt-Del: {e}"))
                    })?;
                Ok(VmmData::Empty)
            }
            VmmAction::FlushMetrics => Ok(VmmData::Empty),
            VmmAction::Pause => {
                self.running_mut()?
                    .pause()
                    .map_err(|e| ActionError::bad_request(e.to_string()))?;
                Ok(VmmData::Empty)
            }
            VmmAction::Resume => {
                self.running_mut()?.resume();
                Ok(VmmData::Empty)
            }
            VmmAction::CreateSnapshot(params) => {
                let kind = match params.snapshot_type.as_str() {
                    "Full" => SnapshotType::Full,
                    "Diff" => SnapshotType::Diff,
                    other => {
                        return Err(ActionError::bad_request(format!(
                            "unknown snapshot_type {other:?}: expected Full or Diff"
                        )))
                    }
                };
                let vm = self.running_mut()?;
                let report =
                    create_snapshot(vm, kind, &params.snapshot_path, &params.mem_file_path)
                        .map_err(|e| ActionError::bad_request(e.to_string()))?;
                log::info!(
                    "{kind:?} snapshot {} written: {} bytes of memory in {:.1} ms",
                    params.snapshot_path.display(),
                    report.memory_bytes,
                    report.elapsed_ms
                );
                Ok(VmmData::Empty)
            }
            VmmAction::LoadSnapshot(params) => {
                let options = self.load_options(&params)?;
                self.restore(&params.snapshot_path, &options)?;
                Ok(VmmData::Empty)
            }
        }
    }

    /// `PUT /snapshot/create` with `"rollbox": {"resume_vm": true}`: a Full snapshot after
    /// which the VM runs again as soon as its memory is imaged; answered once a child process
    /// has written the memory file. If the snapshot fails before that, the VM stays paused.
    fn snapshot_resuming(&mut self, params: &crate::api::CreateSnapshotParams) -> Answer {
        if params.snapshot_type != "Full" {
            return Answer::Now(Err(ActionError::bad_request(format!(
                "rollbox.resume_vm needs a Full snapshot, not {:?}",
                params.snapshot_type
            ))));
        }
        let vm = match self.running_mut() {
            Ok(vm) => vm,
            Err(e) => return Answer::Now(Err(e)),
        };
        let started = Instant::now();
        let snapshot =
            create_background_snapshot(vm, &params.snapshot_path, &params.mem_file_path, |job| {
                crate::seccomp::spawner().start_dump(job)
            });
        let memory = match snapshot {
            Ok(memory) => memory,
            Err(e) => return Answer::Now(Err(ActionError::bad_request(e.to_string()))),
        };
        vm.resume();
        let state = params.snapshot_path.clone();
        let paused_ms = started.elapsed().as_secs_f64() * 1e3;
        match memory {
            SnapshotMemory::Written => {
                log::info!(
                    "Full snapshot {} written in {paused_ms:.2} ms, the VM resumed after it",
                    state.display()
                );
                Answer::Now(Ok(VmmData::ResumedSnapshot(ResumedSnapshot {
                    paused_ms,
                    elapsed_ms: paused_ms,
                })))
            }
            SnapshotMemory::Background(pending) => Answer::Later(Box::new(move || {
                let written = pending
                    .wait()
                    .map_err(|e| ActionError::bad_request(e.to_string()))?;
                let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
                log::info!(
                    "Full snapshot {}: the VM resumed {paused_ms:.2} ms after the request, its memory {} written {elapsed_ms:.2} ms after it",
                    state.display(),
                    written.path.display(),
                );
                Ok(VmmData::ResumedSnapshot(ResumedSnapshot {
                    paused_ms,
                    elapsed_ms,
                }))
            })),
        }
    }

    fn load_options(
        &self,
        params: &crate::api::LoadSnapshotParams,
    ) -> Result<RestoreOptions, ActionError> {
        let mut net_overrides = std::collections::HashMap::new();
        for o in &params.network_overrides {
            let parsed = crate::devices::virtio::net::NetOverride::new(
                &o.host_dev_name,
                o.guest_mac.as_deref(),
            )
            .map_err(|e| {
                ActionError::bad_request(format!("network_overrides {}: {e}", o.iface_id))
            })?;
            if net_overrides.insert(o.iface_id.clone(), parsed).is_some() {
                return Err(ActionError::bad_request(format!(
                    "network_overrides: iface_id {:?} appears twice",
                    o.iface_id
                )));
            }
        }
        let extension = params.rollbox.clone().unwrap_or_default();
        let mut backend = match &extension.restore_backend {
            Some(name) => name
                .parse::<RestoreBackend>()
                .map_err(ActionError::bad_request)?,
            None => RestoreBackend::Cow,
        };
        if let (Some(old), Some(_)) = (&params.mem_file_path, &params.mem_backend) {
            return Err(ActionError::bad_request(format!(
                "mem_file_path ({}) and mem_backend are two ways to name the memory file: give one",
                old.display()
            )));
        }
        let mut mem_file = params.mem_file_path.clone();
        if let Some(mem) = &params.mem_backend {
            match mem.backend_type.as_str() {
                "File" => mem_file = Some(mem.backend_path.clone()),
                "Uffd" => {
                    return Err(ActionError::bad_request(
                        "backend_type Uffd (an external page-fault handler) is not supported: rollbox-vmm serves faults itself; use backend_type File with \"rollbox\": {\"restore_backend\": \"uffd\"}",
                    ));
                }
                other => {
                    return Err(ActionError::bad_request(format!(
                        "unknown backend_type {other:?}: expected File or Uffd"
                    )))
                }
            }
        }
        if extension.restore_backend.as_deref() == Some("uffd") {
            backend = RestoreBackend::Uffd;
        }
        Ok(RestoreOptions {
            backend,
            mem_file,
            layer_overrides: extension.layer_overrides,
            vsock_uds: params.vsock_override.as_ref().map(|v| v.uds_path.clone()),
            drive_overrides: extension.drive_overrides,
            net_overrides,
            new_generation: extension.new_generation,
            deterministic: extension.deterministic,
            paused: !params.resume_vm,
            console: self.resources.console.clone(),
            record_working_set: extension.record_working_set,
            prefetch: extension.prefetch,
            expect_mem_mib: None,
            track_dirty_pages: Some(params.track_dirty_pages || params.enable_diff_snapshots),
            fs_overrides: extension.fs_overrides,
            fs_sockets: extension.fs_sockets,
            virtiofsd: self.resources.virtiofsd.clone(),
            taps: self.resources.taps.clone(),
        })
    }

    fn running(&self) -> Result<&MicroVm, ActionError> {
        self.microvm
            .as_ref()
            .ok_or_else(|| ActionError::bad_request("the microVM has not been started"))
    }

    fn running_mut(&mut self) -> Result<&mut MicroVm, ActionError> {
        self.microvm
            .as_mut()
            .ok_or_else(|| ActionError::bad_request("the microVM has not been started"))
    }
}
