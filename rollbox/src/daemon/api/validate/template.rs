//! Templates: POST /templates (files, or an image to build from, start and ready commands) and
//! template names.

use std::path::PathBuf;

use serde::Deserialize;

use super::super::action::ApiError;
use super::super::limits::{MAX_MEMORY_MIB, MAX_VCPUS};
use super::super::model::{AddTemplate, ImageAuth, ImageSource, Template, VolumeMount};
use super::{absolute, bad, from_json, in_range};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateBody {
    name: String,
    kernel: PathBuf,
    rootfs: Option<PathBuf>,
    image: Option<ImageSource>,
    initrd: Option<PathBuf>,
    #[serde(default)]
    cmdline: Option<String>,
    vcpus: Option<i64>,
    memory_mib: Option<i64>,
    #[serde(default)]
    boot_snapshot: bool,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    ready_timeout_s: Option<i64>,
    #[serde(default)]
    volumes: Vec<VolumeMount>,
    network: Option<super::network::NetworkBody>,
    #[serde(default)]
    docker: bool,
}

/// The kernel command line of templates built from images when the request gives none: our
/// rootfs images start the agent as init.
pub const IMAGE_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 loglevel=4 init=/.rollbox/rollbox-agent";

/// Template names: 1-63 of a-z 0-9 . _ -, starting with a letter or digit.
pub fn check_template_name(name: &str, field: &str) -> Result<String, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || (i > 0 && matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(name.to_string())
    } else {
        Err(bad(format!(
            "{field}: {name:?} is not a template name (1-63 of a-z 0-9 . _ -, starting with a letter or digit)"
        )))
    }
}

/// POST /templates.
pub fn parse_template(body: &[u8]) -> Result<AddTemplate, ApiError> {
    let body: TemplateBody = from_json(body)?;
    let name = check_template_name(&body.name, "name")?;
    absolute(&body.kernel, "kernel")?;
    for (path, field) in [(&body.rootfs, "rootfs"), (&body.initrd, "initrd")] {
        if let Some(path) = path {
            absolute(path, field)?;
        }
    }
    if let Some(image) = &body.image {
        check_image(image, body.rootfs.is_some())?;
    }
    let cmdline = match (body.cmdline, &body.image) {
        (Some(cmdline), _) => cmdline,
        (None, Some(_)) => IMAGE_CMDLINE.to_string(),
        (None, None) => String::new(),
    };
    if cmdline.len() > 2048 || cmdline.chars().any(char::is_control) {
        return Err(bad(
            "cmdline: must be at most 2048 bytes with no control characters",
        ));
    }
    for (command, field) in [
        (&body.start_cmd, "start_cmd"),
        (&body.ready_cmd, "ready_cmd"),
    ] {
        if let Some(command) = command {
            check_template_command(command, field)?;
        }
    }
    if body.ready_cmd.is_some() && body.start_cmd.is_none() {
        return Err(bad("ready_cmd: needs a start_cmd to wait for"));
    }
    if body.ready_timeout_s.is_some() && body.ready_cmd.is_none() && !body.docker {
        return Err(bad("ready_timeout_s: needs a ready_cmd or docker to time"));
    }
    super::volume::check_mounts(&body.volumes)?;
    let network = body
        .network
        .map(super::network::network_request)
        .transpose()?;
    Ok(AddTemplate {
        template: Template {
            name,
            kernel: body.kernel,
            rootfs: body.rootfs,
            base_rootfs: None,
            initrd: body.initrd,
            cmdline,
            vcpus: in_range(body.vcpus, "vcpus", 1, MAX_VCPUS)?.unwrap_or(1),
            memory_mib: in_range(body.memory_mib, "memory_mib", 1, MAX_MEMORY_MIB)?.unwrap_or(128),
            created_at_ms: 0,
            image: None,
            boot_snapshot: None,
            start_cmd: body.start_cmd,
            ready_cmd: body.ready_cmd,
            ready_timeout_s: in_range(body.ready_timeout_s, "ready_timeout_s", 1, 3600)?,
            volumes: body.volumes,
            network,
            docker: body.docker,
        },
        image: body.image,
        boot_snapshot: body.boot_snapshot,
    })
}

/// A template's start or ready command: a non-empty shell command line of at most 4096 bytes.
fn check_template_command(command: &str, field: &str) -> Result<(), ApiError> {
    if command.trim().is_empty() {
        return Err(bad(format!("{field}: must not be empty")));
    }
    if command.len() > 4096 || command.contains('\0') {
        return Err(bad(format!(
            "{field}: must be at most 4096 bytes with no NUL byte"
        )));
    }
    Ok(())
}

fn check_image(image: &ImageSource, has_rootfs: bool) -> Result<(), ApiError> {
    if has_rootfs {
        return Err(bad(
            "image: give either rootfs (a built image) or image, not both",
        ));
    }
    match (&image.docker_archive, &image.oci_layout) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "image: give at most one of docker_archive and oci_layout",
            ))
        }
        (Some(path), None) => absolute(path, "image.docker_archive")?,
        (None, Some(path)) => absolute(path, "image.oci_layout")?,
        (None, None) if image.reference.is_none() => {
            return Err(bad(
                "image.reference: required to pull from a registry (or give docker_archive or oci_layout)",
            ))
        }
        (None, None) => {}
    }
    if let Some(reference) = &image.reference {
        if reference.is_empty()
            || reference.len() > 512
            || reference
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(bad(format!(
                "image.reference: {reference:?} is not an image reference"
            )));
        }
    }
    if let Some(size) = image.size_mib {
        if !(16..=65536).contains(&size) {
            return Err(bad(format!(
                "image.size_mib: {size} is out of range (16 to 65536)"
            )));
        }
    }
    if let Some(auth) = &image.auth {
        if image.docker_archive.is_some() || image.oci_layout.is_some() {
            return Err(bad(
                "image.auth: credentials are for a registry pull, not docker_archive or oci_layout",
            ));
        }
        check_image_auth(auth)?;
    }
    Ok(())
}

/// `image.auth`: username and password, or token. Messages name fields, never values.
fn check_image_auth(auth: &ImageAuth) -> Result<(), ApiError> {
    let text = |value: &str, field: &str, max: usize| {
        if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
            Err(bad(format!(
                "image.auth.{field}: must be 1 to {max} bytes with no control characters"
            )))
        } else {
            Ok(())
        }
    };
    match (&auth.username, &auth.password, &auth.token) {
        (Some(username), Some(password), None) => {
            text(username, "username", 1024)?;
            if username.contains(':') {
                return Err(bad("image.auth.username: must not contain a colon"));
            }
            text(password, "password", 8192)
        }
        (None, None, Some(token)) => {
            text(token, "token", 16384)?;
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad(
                    "image.auth.token: must be printable ASCII with no spaces",
                ));
            }
            Ok(())
        }
        _ => Err(bad(
            "image.auth: give username and password, or token alone",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::routes::{err, parse};
    use crate::daemon::api::Action;

    #[test]
    fn templates_parse_and_validate() {
        let ok = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"guest","kernel":"/k","cmdline":"console=ttyS0","memory_mib":64}"#,
        )
        .expect("parse");
        let Action::AddTemplate(t) = ok else {
            panic!("{ok:?}")
        };
        assert_eq!((t.template.vcpus, t.template.memory_mib), (1, 64));
        assert!(t.image.is_none() && !t.boot_snapshot);
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"bb","kernel":"/k","image":{"docker_archive":"/b.tar"},"boot_snapshot":true}"#,
        )
        .expect("parse image") else {
            panic!("not a template")
        };
        assert_eq!(t.template.cmdline, IMAGE_CMDLINE);
        assert!(t.boot_snapshot);
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"ci","kernel":"/k","start_cmd":"serve &","ready_cmd":"curl -f :1"}"#,
        )
        .expect("parse start_cmd") else {
            panic!("not a template")
        };
        assert_eq!(t.template.start_cmd.as_deref(), Some("serve &"));
        assert_eq!(t.template.ready_cmd.as_deref(), Some("curl -f :1"));
        assert!(!t.template.docker);
        // docker: dockerd started after each boot, timed by ready_timeout_s.
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"d","kernel":"/k","docker":true,"ready_timeout_s":120}"#,
        )
        .expect("parse docker") else {
            panic!("not a template")
        };
        assert!(t.template.docker);
        assert_eq!(t.template.ready_timeout_s, Some(120));
        let shown = serde_json::to_value(&t.template).expect("template as JSON");
        assert_eq!(shown["docker"], true, "{shown}");
        let Action::AddTemplate(t) = parse(
            "POST",
            "/templates",
            None,
            br#"{"name":"p","kernel":"/k","image":{"reference":"r.io/p:1","auth":{"username":"u","password":"hunter2"}}}"#,
        )
        .expect("parse auth") else {
            panic!("not a template")
        };
        let auth = t
            .image
            .as_ref()
            .and_then(|i| i.auth.as_ref())
            .expect("auth");
        assert_eq!(auth.password.as_deref(), Some("hunter2"));
        // The secret is not in the action's Debug form (nor, having no Serialize, anywhere).
        assert!(!format!("{t:?}").contains("hunter2"), "{t:?}");
        for (body, field) in [
            (r#"{"name":"g","kernel":"rel/k"}"#, "kernel"),
            (r#"{"name":"g","kernel":"/k","rootfs":"r"}"#, "rootfs"),
            (r#"{"name":"g","kernel":"/k","vcpus":0}"#, "vcpus"),
            (r#"{"name":"-g","kernel":"/k"}"#, "name"),
            (r#"{"name":"g","kernel":"/k","cmdline":"a\nb"}"#, "cmdline"),
            (r#"{"name":"g","kernel":"/k","start_cmd":" "}"#, "start_cmd"),
            (
                r#"{"name":"g","kernel":"/k","ready_cmd":"true"}"#,
                "ready_cmd",
            ),
            (
                r#"{"name":"g","kernel":"/k","start_cmd":"a","ready_cmd":"b","ready_timeout_s":0}"#,
                "ready_timeout_s",
            ),
            (
                r#"{"name":"g","kernel":"/k","ready_timeout_s":60}"#,
                "ready_timeout_s",
            ),
            (r#"{"name":"g","kernel":"/k","docker":"yes"}"#, "docker"),
            (
                r#"{"name":"g","kernel":"/k","image":{}}"#,
                "image.reference",
            ),
            (
                r#"{"name":"g","kernel":"/k","rootfs":"/r","image":{"reference":"a"}}"#,
                "image",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"docker_archive":"a.tar"}}"#,
                "image.docker_archive",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a b"}}"#,
                "image.reference",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","size_mib":1}}"#,
                "image.size_mib",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","tag":1}}"#,
                "tag",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"username":"u"}}}"#,
                "image.auth",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"username":"u","password":"p","token":"t"}}}"#,
                "image.auth",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"username":"u:v","password":"p"}}}"#,
                "image.auth.username",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"username":"u","password":""}}}"#,
                "image.auth.password",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"token":"a b"}}}"#,
                "image.auth.token",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"docker_archive":"/a.tar","auth":{"token":"t"}}}"#,
                "image.auth",
            ),
            (
                r#"{"name":"g","kernel":"/k","image":{"reference":"a","auth":{"user":"u"}}}"#,
                "user",
            ),
        ] {
            let message = err(parse("POST", "/templates", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
    }
}
