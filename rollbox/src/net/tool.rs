//! Running the host's tools (`ip`, `nft`): a command with its input piped in and its output
//! collected.

/// Forgets every connection tracked from `guest` (`conntrack -D -s GUEST`), so that the next
/// packet of each is new to netfilter and meets the sandbox's egress chain again (TCP is
/// picked up mid-stream, `nf_conntrack_tcp_loose`). Without the `conntrack` tool (Debian
/// package conntrack) it does nothing and says so: connections already open then survive a
/// policy change.
pub fn forget_connections(guest: std::net::Ipv4Addr) {
    let search = std::env::var_os("PATH").unwrap_or_default();
    let Some(conntrack) = std::env::split_paths(&search)
        .map(|dir| dir.join("conntrack"))
        .find(|path| path.is_file())
    else {
        log::warn!(
            "conntrack not found (apt-get install conntrack): connections {guest} has open keep their old policy"
        );
        return;
    };
    let guest = guest.to_string();
    match run_piped(&conntrack, &["-D", "-s", &guest], None) {
        // conntrack exits 1 when there was nothing to delete.
        Ok(out) if out.status.success() || out.status.code() == Some(1) => {}
        Ok(out) => log::warn!(
            "conntrack -D -s {guest}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => log::warn!("conntrack -D -s {guest}: {e}"),
    }
}

/// Runs `program` with `args`, feeding it `stdin` (if any); collects stdout and stderr.
pub fn run_piped(
    program: &std::path::Path,
    args: &[&str],
    stdin: Option<&str>,
) -> std::io::Result<std::process::Output> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())?;
    }
    child.wait_with_output()
}
