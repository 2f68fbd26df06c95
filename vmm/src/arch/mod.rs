//! x86-64 specifics: memory layout, boot protocol, ACPI and MP tables, boot registers.

pub mod acpi;
pub mod boot;
pub mod layout;
pub mod mptable;
pub mod regs;
