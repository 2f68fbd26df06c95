//! The kinds of threads that get a seccomp filter of their own, and their names.

/// The kinds of threads that get a filter of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadKind {
    /// The main thread (event loop, device set-up, snapshots, restores) and the helper
    /// threads it starts (console writer, slow API answers).
    Vmm,
    /// The API socket's listener and its connection threads.
    Api,
    /// A vCPU: KVM_RUN and the device emulation it exits to.
    Vcpu,
    /// A virtio-blk I/O worker.
    Block,
    /// The userfaultfd page server of a lazy restore.
    PageServer,
}

impl ThreadKind {
    /// Every kind, in the order summaries print them.
    pub const ALL: [ThreadKind; 5] = [
        ThreadKind::Vmm,
        ThreadKind::Api,
        ThreadKind::Vcpu,
        ThreadKind::Block,
        ThreadKind::PageServer,
    ];

    /// The kind's key in a filter file.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Api => "api",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Block => "block",
            ThreadKind::PageServer => "page_server",
        }
    }

    /// The kind as the SIGSYS reporter's thread-local records it (0: no kind).
    pub(super) fn code(self) -> u8 {
        self as u8 + 1
    }

    pub(super) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The kinds' names, for errors and logs.
    pub(super) fn known() -> String {
        Self::ALL.map(Self::name).join(", ")
    }
}
