//! Running the host's tools (`ip`, `nft`): a command with its input piped in and its output
//! collected.

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
