//! x86-64 specifics: memory layout, boot protocol, ACPI and MP tables, boot registers. They
//! write into any guest memory (`impl GuestMemoryBackend`); [`crate::vstate`] builds on them.

pub mod acpi;
pub mod boot;
pub mod layout;
pub mod mptable;
pub mod regs;
