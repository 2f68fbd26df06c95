//! Exec: POST /sandboxes/{id}/exec (unary or streaming), and the stdin and signals of a
//! streaming exec's process.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::super::limits::{DEFAULT_OUTPUT_BYTES, MAX_EXEC_TIMEOUT_S, MAX_OUTPUT_BYTES};
use super::super::model::{decode_bytes, Encoding, Exec, ExecCommand};
use super::file::check_guest_path;
use super::{bad, check_env, check_id, from_json, parse_bool, query_pairs};

#[derive(Deserialize)]
#[serde(untagged)]
enum CmdBody {
    Argv(Vec<String>),
    Shell(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    cmd: CmdBody,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    user: Option<String>,
    stdin: Option<String>,
    #[serde(default)]
    stdin_open: bool,
    timeout_s: Option<f64>,
    max_output_bytes: Option<i64>,
}

/// POST /sandboxes/{id}/processes/{pid}/stdin.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StdinBody {
    #[serde(default)]
    data: String,
    encoding: Option<Encoding>,
    #[serde(default)]
    close: bool,
}

/// POST /sandboxes/{id}/processes/{pid}/signal.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    signal: SignalValue,
    #[serde(default)]
    group: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SignalValue {
    Number(i64),
    Name(String),
}

/// POST /sandboxes/{id}/exec: `?stream=true` answers NDJSON lines as they come.
pub fn parse_exec(id: &str, query: Option<&str>, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let stream = parse_stream_query(query)?;
    let exec = exec_body(body)?;
    if exec.stdin_open && !stream {
        return Err(bad(
            "stdin_open: only a streaming exec (?stream=true) keeps stdin open",
        ));
    }
    Ok(Action::Exec { id, exec, stream })
}

/// POST /sandboxes/{id}/processes/{pid}/stdin.
pub fn parse_stdin(id: &str, pid: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let pid = check_pid(pid)?;
    let body: StdinBody = from_json(body)?;
    let encoding = body.encoding.unwrap_or(Encoding::Utf8);
    let data = decode_bytes(&body.data, encoding).ok_or_else(|| bad("data: not valid base64"))?;
    if data.is_empty() && !body.close {
        return Err(bad("data: empty, and close is not set: nothing to do"));
    }
    Ok(Action::Stdin {
        id,
        pid,
        data,
        close: body.close,
    })
}

/// POST /sandboxes/{id}/processes/{pid}/signal.
pub fn parse_signal(id: &str, pid: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let pid = check_pid(pid)?;
    let body: SignalBody = from_json(body)?;
    Ok(Action::Signal {
        id,
        pid,
        signal: signal_number(&body.signal)?,
        group: body.group,
    })
}

fn check_pid(pid: &str) -> Result<u32, ApiError> {
    pid.parse::<u32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad(format!("pid: {pid:?} is not a process id")))
}

fn parse_stream_query(query: Option<&str>) -> Result<bool, ApiError> {
    let mut stream = false;
    for (name, value) in query_pairs(query)? {
        match name.as_str() {
            "stream" => stream = parse_bool(&value, "stream")?,
            other => return Err(bad(format!("{other}: unknown query parameter (stream)"))),
        }
    }
    Ok(stream)
}

fn signal_number(value: &SignalValue) -> Result<i32, ApiError> {
    const NAMES: &[(&str, i32)] = &[
        ("HUP", 1),
        ("INT", 2),
        ("QUIT", 3),
        ("KILL", 9),
        ("USR1", 10),
        ("USR2", 12),
        ("TERM", 15),
        ("CONT", 18),
        ("STOP", 19),
    ];
    match value {
        SignalValue::Number(n) if (1..=64).contains(n) => Ok(i32::try_from(*n).unwrap_or(15)),
        SignalValue::Number(n) => Err(bad(format!("signal: {n} is not 1-64"))),
        SignalValue::Name(name) => {
            let short = name.strip_prefix("SIG").unwrap_or(name);
            NAMES
                .iter()
                .find(|(n, _)| *n == short)
                .map(|(_, number)| *number)
                .ok_or_else(|| {
                    bad(format!(
                        "signal: {name:?} is not a number or one of HUP INT QUIT KILL USR1 USR2 TERM CONT STOP"
                    ))
                })
        }
    }
}

fn exec_body(body: &[u8]) -> Result<Exec, ApiError> {
    let body: ExecBody = from_json(body)?;
    let command = match body.cmd {
        CmdBody::Argv(argv) => {
            if argv.first().is_none_or(|a| a.is_empty()) {
                return Err(bad("cmd: the argv needs a non-empty program"));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(bad("cmd: an argument holds a NUL"));
            }
            ExecCommand::Argv(argv)
        }
        CmdBody::Shell(script) => {
            if script.trim().is_empty() || script.contains('\0') {
                return Err(bad("cmd: the shell command is empty or holds a NUL"));
            }
            ExecCommand::Shell(script)
        }
    };
    check_env(&body.env)?;
    let cwd = body.cwd.map(|c| check_guest_path(&c, "cwd")).transpose()?;
    let timeout_ms = match body.timeout_s {
        None => None,
        Some(t) if t > 0.0 && t <= MAX_EXEC_TIMEOUT_S => Some((t * 1000.0).ceil() as u64),
        Some(t) => {
            return Err(bad(format!(
                "timeout_s: {t} is out of range (over 0, at most {MAX_EXEC_TIMEOUT_S})"
            )))
        }
    };
    let max_output_bytes = match body.max_output_bytes {
        None => DEFAULT_OUTPUT_BYTES,
        Some(n) => u64::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_OUTPUT_BYTES).contains(n))
            .ok_or_else(|| {
                bad(format!(
                    "max_output_bytes: {n} is out of range (1-{MAX_OUTPUT_BYTES})"
                ))
            })?,
    };
    Ok(Exec {
        command,
        env: body.env,
        cwd,
        user: body.user,
        stdin: body.stdin.map(String::into_bytes),
        stdin_open: body.stdin_open,
        timeout_ms,
        max_output_bytes,
    })
}

#[cfg(test)]
mod tests {
    use crate::daemon::api::routes::{err, parse};
    use crate::daemon::api::{is_upload, Action, ExecCommand, FileOp, DEFAULT_OUTPUT_BYTES};

    #[test]
    fn exec_bodies_parse_and_validate() {
        let path = "/sandboxes/sb-0123456789abcdef/exec";
        let ok = parse(
            "POST",
            path,
            Some("stream=true"),
            br#"{"cmd":"echo hi","env":{"A":"1"},"cwd":"/tmp","stdin":"x","timeout_s":1.5}"#,
        )
        .expect("parse");
        let Action::Exec { exec, stream, .. } = ok else {
            panic!("{ok:?}")
        };
        assert!(stream);
        assert_eq!(exec.command, ExecCommand::Shell("echo hi".into()));
        assert_eq!(exec.timeout_ms, Some(1500));
        assert_eq!(exec.max_output_bytes, DEFAULT_OUTPUT_BYTES);
        assert_eq!(exec.stdin.as_deref(), Some(&b"x"[..]));
        for (body, field) in [
            (r#"{"cmd":[]}"#, "cmd"),
            (r#"{"cmd":[""]}"#, "cmd"),
            (r#"{"cmd":7}"#, "cmd"),
            (r#"{"cmd":"  "}"#, "cmd"),
            (r#"{"cmd":["ls"],"cwd":"tmp"}"#, "cwd"),
            (r#"{"cmd":["ls"],"cwd":"/a/../.."}"#, "cwd"),
            (r#"{"cmd":["ls"],"env":{"A=B":"x"}}"#, "env"),
            (r#"{"cmd":["ls"],"timeout_s":0}"#, "timeout_s"),
            (
                r#"{"cmd":["ls"],"max_output_bytes":-1}"#,
                "max_output_bytes",
            ),
            (r#"{"cmd":["ls"],"shell":true}"#, "shell"),
        ] {
            let message = err(parse("POST", path, None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert!(
            err(parse("POST", path, Some("stream=maybe"), br#"{"cmd":"x"}"#)).contains("stream")
        );
    }

    #[test]
    fn signals_and_file_paths() {
        let signal = |body: &[u8]| {
            parse(
                "POST",
                "/sandboxes/sb-0123456789abcdef/processes/9/signal",
                None,
                body,
            )
        };
        assert!(matches!(
            signal(br#"{"signal":"SIGKILL","group":true}"#),
            Ok(Action::Signal {
                signal: 9,
                group: true,
                pid: 9,
                ..
            })
        ));
        assert!(matches!(
            signal(br#"{"signal":2}"#),
            Ok(Action::Signal { signal: 2, .. })
        ));
        assert!(err(signal(br#"{"signal":"BOOM"}"#)).contains("signal"));
        let stdin = |body: &[u8]| {
            parse(
                "POST",
                "/sandboxes/sb-0123456789abcdef/processes/9/stdin",
                None,
                body,
            )
        };
        assert!(matches!(
            stdin(br#"{"data":"AAE=","encoding":"base64","close":true}"#),
            Ok(Action::Stdin { ref data, close: true, .. }) if data == &[0u8, 1]
        ));
        assert!(err(stdin(br#"{"data":"!!","encoding":"base64"}"#)).contains("data"));
        assert!(err(stdin(br#"{}"#)).contains("data"));
        assert!(err(parse(
            "POST",
            "/sandboxes/sb-0123456789abcdef/exec",
            None,
            br#"{"cmd":"cat","stdin_open":true}"#
        ))
        .contains("stdin_open"));
        assert!(err(signal(br#"{"signal":99}"#)).contains("signal"));
        assert!(err(parse(
            "POST",
            "/sandboxes/sb-0123456789abcdef/processes/x/signal",
            None,
            br#"{"signal":2}"#
        ))
        .contains("pid"));
        let files = "/sandboxes/sb-0123456789abcdef/files";
        assert_eq!(
            parse("PUT", files, Some("path=/a%20b&mode=600&parents=1"), b"").expect("put"),
            Action::File {
                id: "sb-0123456789abcdef".into(),
                op: FileOp::Write {
                    path: "/a b".into(),
                    mode: Some(0o600),
                    parents: true,
                    atomic: true,
                    metadata: None,
                    owner: None,
                }
            }
        );
        for (method, query, field) in [
            ("GET", "path=etc/passwd", "relative"),
            ("GET", "path=/tmp/../../etc", "escapes"),
            ("GET", "", "path"),
            ("GET", "path=/x&mode=644", "mode"),
            ("PUT", "path=/x&mode=999", "mode"),
            ("DELETE", "path=/x&recursive=perhaps", "recursive"),
        ] {
            let message = err(parse(method, files, Some(query), b""));
            assert!(message.contains(field), "{query}: {message:?}");
        }
        assert!(is_upload("PUT", "/sandboxes/x/tar") && !is_upload("GET", "/sandboxes/x/tar"));
    }
}
