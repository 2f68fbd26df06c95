//! The frontends: the native HTTP/JSON API ([`rest`]) and the E2B-compatible one ([`e2b`]),
//! siblings over the same typed action interface ([`Core`](super::core::Core)) and the same
//! [`transport`], whose connections [`conn`] admits, bounds and serves. `serve` starts them; the
//! core knows neither.

pub mod conn;
pub mod e2b;
pub mod rest;
pub mod transport;
