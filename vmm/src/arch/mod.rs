//! x86-64 specifics: memory layout, boot protocol, MP table, boot registers.

pub mod boot;
pub mod layout;
pub mod mptable;
pub mod regs;
