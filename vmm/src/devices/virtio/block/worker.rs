//! A thread per virtio-blk device that serves its queue notifications, so disk I/O neither
//! waits for nor holds up the VMM's event loop (API requests, console, snapshots, fork).

use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::devices::virtio::mmio::MmioTransport;
use crate::vstate::bus::lock;

const TOKEN_STOP: u64 = u64::MAX;

/// Errors starting a queue worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// epoll, an eventfd or the thread could not be set up.
    #[error("queue worker for {name}: {source}")]
    Setup {
        /// The device.
        name: String,
        /// The failure.
        source: std::io::Error,
    },
}

#[derive(Default)]
struct GateState {
    paused: bool,
    busy: bool,
}

/// Lets the VM's owner stop the worker between requests (while the VM is paused, so that a
/// snapshot sees guest memory and queue state that agree).
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn enter(&self) {
        let mut state = lock(&self.state);
        while state.paused {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        state.busy = true;
    }

    fn leave(&self) {
        lock(&self.state).busy = false;
        self.changed.notify_all();
    }

    fn pause(&self) {
        let mut state = lock(&self.state);
        state.paused = true;
        while state.busy {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    fn resume(&self) {
        lock(&self.state).paused = false;
        self.changed.notify_all();
    }
}

/// Serves one device's queue notifications on a thread of its own; stops when dropped.
pub struct QueueWorker {
    gate: Arc<Gate>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl QueueWorker {
    /// Starts serving `notify` (one eventfd per queue, in queue order) for `transport`.
    pub fn start(
        name: String,
        transport: Arc<Mutex<MmioTransport>>,
        notify: Vec<EventFd>,
    ) -> Result<Self, WorkerError> {
        let setup = |source| WorkerError::Setup {
            name: name.clone(),
            source,
        };
        let epoll = Epoll::new().map_err(setup)?;
        let stop = EventFd::new(EFD_NONBLOCK).map_err(setup)?;
        let thread_stop = stop.try_clone().map_err(setup)?;
        let add = |fd, token| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        add(stop.as_raw_fd(), TOKEN_STOP).map_err(setup)?;
        for (queue, evt) in notify.iter().enumerate() {
            add(evt.as_raw_fd(), queue as u64).map_err(setup)?;
        }
        let gate = Arc::new(Gate::default());
        let thread_gate = Arc::clone(&gate);
        let thread_name = name.clone();
        let thread = crate::seccomp::spawn_filtered(
            format!("blk-{}", name.trim_start_matches("virtio-blk ")),
            crate::seccomp::ThreadKind::Block,
            move || {
                serve(&thread_name, &epoll, &notify, &transport, &thread_gate);
                drop(thread_stop);
            },
        )
        .map_err(setup)?;
        Ok(Self {
            gate,
            stop,
            thread: Some(thread),
        })
    }

    /// Returns once no request is being served; none starts until [`QueueWorker::resume`].
    pub fn pause(&self) {
        self.gate.pause();
    }

    /// Lets the worker serve requests again (notifications that came meanwhile included).
    pub fn resume(&self) {
        self.gate.resume();
    }
}

impl Drop for QueueWorker {
    fn drop(&mut self) {
        self.gate.resume();
        if let Err(e) = self.stop.write(1) {
            log::warn!("cannot stop a block queue worker: {e}");
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(
    name: &str,
    epoll: &Epoll,
    notify: &[EventFd],
    transport: &Mutex<MmioTransport>,
    gate: &Gate,
) {
    let mut events = vec![EpollEvent::default(); notify.len() + 1];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::error!("{name}: queue worker stopped: {e}");
                return;
            }
        };
        for event in &events[..n] {
            let token = event.data();
            if token == TOKEN_STOP {
                return;
            }
            let queue = token as usize;
            if let Some(evt) = notify.get(queue) {
                let _ = evt.read();
            }
            gate.enter();
            lock(transport).notify_queue(queue);
            gate.leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn a_paused_gate_holds_new_work_until_resumed_and_pause_waits_for_work_in_progress() {
        let gate = Arc::new(Gate::default());
        gate.enter();
        let paused = Arc::new(AtomicBool::new(false));
        let (g, p) = (Arc::clone(&gate), Arc::clone(&paused));
        let pauser = std::thread::spawn(move || {
            g.pause();
            p.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !paused.load(Ordering::SeqCst),
            "pause returned while a request was in progress"
        );
        gate.leave();
        pauser.join().expect("pauser");
        assert!(paused.load(Ordering::SeqCst));

        let entered = Arc::new(AtomicBool::new(false));
        let (g, e) = (Arc::clone(&gate), Arc::clone(&entered));
        let worker = std::thread::spawn(move || {
            g.enter();
            e.store(true, Ordering::SeqCst);
            g.leave();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!entered.load(Ordering::SeqCst), "work started while paused");
        gate.resume();
        worker.join().expect("worker");
        assert!(entered.load(Ordering::SeqCst));
    }
}
