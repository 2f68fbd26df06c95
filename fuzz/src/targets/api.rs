//! The two HTTP/JSON APIs: rollbox-vmm's (its own HTTP/1.1 reader and the action parser)
//! and the daemon's (hyper reads HTTP; `api::parse` turns method, path, query and body into
//! an action).

use std::io::Read;

use super::signature::shape;

/// Hands out the input a few bytes per read, as a slow client would.
struct Trickle<'a> {
    data: &'a [u8],
    step: usize,
}

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.step.min(buf.len()).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// Byte 0 sets the read size; the rest is the byte stream of one connection.
pub fn run_vmm(data: &[u8]) -> u64 {
    let Some((&step, stream)) = data.split_first() else {
        return 0;
    };
    let step = if step < 0x80 {
        4096
    } else {
        usize::from(step & 0x1f) + 1
    };
    let mut reader = vmm::api::http::RequestReader::new(Trickle { data: stream, step });
    let mut seen = String::new();
    for _ in 0..8 {
        match reader.next_request() {
            Ok(request) => {
                match vmm::api::parse_request(&request.method, &request.path, &request.body) {
                    Ok(action) => {
                        seen.push_str(&format!("{action:?}").chars().take(24).collect::<String>())
                    }
                    Err(e) => seen.push_str(&e.to_string()),
                }
                let mut response = Vec::new();
                let _ = vmm::api::http::write_response(&mut response, 400, Some("{}"));
            }
            Err(e) => {
                seen.push_str(&e.to_string());
                break;
            }
        }
    }
    shape(&seen)
}

/// Lines: method, path, query (empty for none); the rest is the body.
pub fn run_daemon(data: &[u8]) -> u64 {
    let mut parts = data.splitn(4, |&b| b == b'\n');
    let method = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let path = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let query = parts.next().map(String::from_utf8_lossy);
    let body = parts.next().unwrap_or_default();
    let query = query.as_deref().filter(|q| !q.is_empty());
    let _ = rollbox::daemon::api::is_upload(&method, &path);
    match rollbox::daemon::api::parse(&method, &path, query, body) {
        Ok(action) => shape(&format!("{action:?}").chars().take(30).collect::<String>()),
        Err(e) => shape(&format!("{e:?}")),
    }
}

pub fn seeds_vmm() -> Vec<(String, Vec<u8>)> {
    let requests: &[(&str, &str, &str)] = &[
        ("get-info", "GET /", ""),
        (
            "machine-config",
            "PUT /machine-config",
            r#"{"vcpu_count": 2, "mem_size_mib": 256}"#,
        ),
        (
            "boot-source",
            "PUT /boot-source",
            r#"{"kernel_image_path": "/k", "boot_args": "console=ttyS0"}"#,
        ),
        (
            "drive",
            "PUT /drives/rootfs",
            r#"{"drive_id": "rootfs", "path_on_host": "/r.ext4", "is_root_device": true, "is_read_only": false}"#,
        ),
        (
            "vsock",
            "PUT /vsock",
            r#"{"guest_cid": 3, "uds_path": "/tmp/v.sock"}"#,
        ),
        (
            "net",
            "PUT /network-interfaces/eth0",
            r#"{"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:0a:00:00:02"}"#,
        ),
        (
            "fs",
            "PUT /fs/data",
            r#"{"tag": "data", "shared_dir": "/srv"}"#,
        ),
        (
            "start",
            "PUT /actions",
            r#"{"action_type": "InstanceStart"}"#,
        ),
        ("pause", "PATCH /vm", r#"{"state": "Paused"}"#),
        (
            "snapshot",
            "PUT /snapshot/create",
            r#"{"snapshot_type": "Full", "snapshot_path": "/s/vm.state", "mem_file_path": "/s/mem"}"#,
        ),
        (
            "load",
            "PUT /snapshot/load",
            r#"{"snapshot_path": "/s/vm.state", "mem_backend": {"backend_type": "File", "backend_path": "/s/mem"}}"#,
        ),
        (
            "snapshot-resuming",
            "PUT /snapshot/create",
            r#"{"snapshot_path": "/s/vm.state", "mem_file_path": "/s/mem", "rollbox": {"resume_vm": true}}"#,
        ),
    ];
    requests
        .iter()
        .map(|(name, line, body)| {
            let mut stream = vec![0u8];
            stream.extend_from_slice(
                format!(
                    "{line} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            (name.to_string(), stream)
        })
        .collect()
}

pub fn seeds_daemon() -> Vec<(String, Vec<u8>)> {
    let requests: &[(&str, &str, &str, &str, &str)] = &[
        ("health", "GET", "/healthz", "", ""),
        (
            "create",
            "POST",
            "/sandboxes",
            "",
            r#"{"template":"t1","ttl_s":60,"labels":{"run":"a"},"idempotency_key":"k"}"#,
        ),
        (
            "batch",
            "POST",
            "/sandboxes/batch",
            "",
            r#"{"count":3,"template":"t1"}"#,
        ),
        ("list", "GET", "/sandboxes", "label=run%3Da&limit=10", ""),
        (
            "exec",
            "POST",
            "/sandboxes/sb-1/exec",
            "",
            r#"{"argv":["sh","-c","echo hi"],"env":{"A":"1"},"cwd":"/tmp","timeout_s":5}"#,
        ),
        (
            "stdin",
            "POST",
            "/sandboxes/sb-1/processes/7/stdin",
            "",
            r#"{"data":"aGk=","encoding":"base64"}"#,
        ),
        (
            "upload",
            "PUT",
            "/sandboxes/sb-1/files",
            "path=/tmp/x",
            "raw file bytes",
        ),
        ("stat", "GET", "/sandboxes/sb-1/files/stat", "path=/etc", ""),
        ("port", "GET", "/sandboxes/sb-1/ports/8080", "", ""),
        (
            "snapshot",
            "POST",
            "/sandboxes/sb-1/snapshots",
            "",
            r#"{"stop":false}"#,
        ),
        ("fork", "POST", "/sandboxes/sb-1/fork", "", r#"{"count":3}"#),
        (
            "reset",
            "POST",
            "/sandboxes/sb-1/reset",
            "",
            r#"{"snapshot":"snap-1"}"#,
        ),
        (
            "template",
            "POST",
            "/templates",
            "",
            r#"{"name":"t2","image":"busybox:latest","memory_mib":256}"#,
        ),
        ("delete-labels", "DELETE", "/sandboxes", "label=run%3Da", ""),
    ];
    requests
        .iter()
        .map(|(name, method, path, query, body)| {
            (
                name.to_string(),
                format!("{method}\n{path}\n{query}\n{body}").into_bytes(),
            )
        })
        .collect()
}
