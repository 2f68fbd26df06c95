//! The daemon's API, split the Firecracker way: the [`model`] (wire types), the [`action`]
//! interface (what a request asks for, what it gets, how it is refused), the [`limits`], the
//! routes (`routes.rs`) and one validator module per resource (`validate/`). Everything is re-exported here: this
//! is the one import path for the frontends and services.

pub mod action;
pub mod limits;
pub mod model;
mod routes;
mod validate;

pub use action::*;
pub use limits::*;
pub use model::*;
pub use routes::{allowed_methods, is_upload, parse, ROUTES};
pub use validate::file::check_guest_path;
pub use validate::key::check_tenant;
pub use validate::template::{check_template_name, IMAGE_CMDLINE};
pub use validate::volume::{check_volume_name, check_volume_path};
pub use validate::{check_id, check_label_key, check_snapshot_id, check_snapshot_name};
