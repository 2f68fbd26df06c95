//! `rollbox serve` end to end, exec and files through a host `rollbox-agent --listen-unix`
//! (the test guest has no agent): unary and streaming exec with signals, env, interactive
//! stdin, files and tar both ways, and guest ports by upgrade and port-forward.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rollbox::daemon::client::{Endpoint, Response};
use rollbox_tests::daemon::{agent_server, exec, open_exec_stream, Server, KEY};
use rollbox_tests::{kvm_available, rollbox_binary};
use serde_json::{json, Value};

/// A streaming exec: the response, read line by line.
fn exec_stream(
    server: &Server,
    id: &str,
    body: Value,
) -> std::io::BufReader<rollbox::daemon::client::Streaming> {
    let response =
        open_exec_stream(server, id, &body, Duration::from_secs(60)).expect("streaming exec");
    assert_eq!(response.status, 200);
    assert_eq!(
        response
            .headers
            .iter()
            .find(|(n, _)| n == "content-type")
            .map(|(_, v)| v.as_str()),
        Some("application/x-ndjson")
    );
    std::io::BufReader::new(response)
}

fn next_line(lines: &mut impl std::io::BufRead) -> Value {
    let mut line = String::new();
    lines.read_line(&mut line).expect("read a line");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

#[test]
fn exec_runs_through_the_agent_unary_and_streaming_with_signals() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let scratch = tempfile::tempdir().expect("tempdir");
    let cwd = scratch.path().display().to_string();

    let result = exec(
        &server,
        &id,
        json!({"cmd": ["sh", "-c", "echo out; echo err >&2; exit 3"]}),
    );
    assert_eq!(
        (&result["exit_code"], &result["stdout"], &result["stderr"]),
        (&json!(3), &json!("out\n"), &json!("err\n")),
        "{result}"
    );
    assert_eq!(result["stdout_encoding"], "utf-8");
    assert_eq!(
        (&result["timed_out"], &result["oom"], &result["truncated"]),
        (&json!(false), &json!(false), &json!(false))
    );

    // A shell string, stdin, env and cwd.
    let result = exec(
        &server,
        &id,
        json!({"cmd": "cat; echo $FOO; pwd", "stdin": "in\n", "env": {"FOO": "bar"}, "cwd": cwd}),
    );
    assert_eq!(result["stdout"], format!("in\nbar\n{cwd}\n"), "{result}");
    // Bytes that are not UTF-8 come as base64.
    let result = exec(&server, &id, json!({"cmd": "printf '\\377\\000'"}));
    assert_eq!(
        (&result["stdout"], &result["stdout_encoding"]),
        (&json!("/wA="), &json!("base64")),
        "{result}"
    );
    // Timeout and output cap.
    let result = exec(
        &server,
        &id,
        json!({"cmd": ["sleep", "30"], "timeout_s": 0.3}),
    );
    assert_eq!(result["timed_out"], true, "{result}");
    let result = exec(
        &server,
        &id,
        json!({"cmd": "head -c 100000 /dev/zero", "max_output_bytes": 1000}),
    );
    assert_eq!(result["truncated"], true, "{result}");
    assert!(result["stdout"].as_str().expect("stdout").len() <= 1000);
    // A program that does not exist is the agent's refusal, not a 200.
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["/nonexistent/prog"]})),
    );
    assert!((400..500).contains(&status), "{status} {body}");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["ls"], "cwd": "tmp"})),
    );
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().expect("error").contains("cwd"),
        "{body}"
    );

    // Streaming: sequence numbers from 0, started, output, exit.
    let mut lines = exec_stream(
        &server,
        &id,
        json!({"cmd": "echo a; echo b >&2; echo c; exit 5"}),
    );
    let mut seq = 0;
    let mut stdout = String::new();
    let mut stderr = String::new();
    loop {
        let line = next_line(&mut lines);
        assert_eq!(line["seq"], seq, "{line}");
        seq += 1;
        match line["type"].as_str().expect("type") {
            "started" => assert!(line["pid"].as_u64().is_some_and(|p| p > 0)),
            "stdout" => stdout.push_str(line["data"].as_str().expect("data")),
            "stderr" => stderr.push_str(line["data"].as_str().expect("data")),
            "exit" => {
                assert_eq!(line["exit_code"], 5, "{line}");
                break;
            }
            other => panic!("unexpected line type {other}: {line}"),
        }
    }
    assert_eq!((stdout.as_str(), stderr.as_str()), ("a\nc\n", "b\n"));

    // Signals reach a process of a running streaming exec.
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["sleep", "30"]}));
    let started = next_line(&mut lines);
    assert_eq!(started["type"], "started", "{started}");
    let pid = started["pid"].as_u64().expect("pid");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": "TERM"})),
    );
    assert_eq!(status, 204, "{body}");
    let exit = next_line(&mut lines);
    assert_eq!(
        (&exit["type"], &exit["signal"]),
        (&json!("exit"), &json!(15)),
        "{exit}"
    );
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": 9})),
    );
    assert_eq!(status, 404, "{body}");

    // The CLI streams and exits with the command's status.
    let output = Command::new(rollbox_binary())
        .args(["sandbox", "exec", "--socket"])
        .arg(server.sock())
        .arg("--api-key-file")
        .arg(server.dir.path().join("key"))
        .args([&id, "--", "sh", "-c", "echo hi; echo oops >&2; exit 7"])
        .output()
        .expect("rollbox sandbox exec");
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert_eq!(output.stdout, b"hi\n");
    assert_eq!(output.stderr, b"oops\n");

    // A paused sandbox takes no exec.
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200);
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["true"]})),
    );
    assert_eq!(status, 409, "{body}");
}

fn put(server: &Server, path: &str, data: &[u8]) -> Response {
    let auth = format!("Bearer {KEY}");
    let mut source = data;
    Endpoint::Unix(server.sock())
        .open(
            "PUT",
            path,
            &[("Authorization", &auth)],
            Some((&mut source, data.len() as u64)),
            Duration::from_secs(60),
        )
        .expect("PUT")
        .into_response()
        .expect("PUT answer")
}

fn enc(path: &Path) -> String {
    path.display()
        .to_string()
        .replace('%', "%25")
        .replace(' ', "%20")
}

#[test]
fn files_upload_download_stat_list_remove_and_tar() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let scratch = tempfile::tempdir().expect("tempdir");
    let root = scratch.path();
    let file = root.join("a/b.txt");

    let response = put(
        &server,
        &format!(
            "/sandboxes/{id}/files?path={}&parents=true&mode=600",
            enc(&file)
        ),
        b"hello",
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let written: Value = serde_json::from_slice(&response.body).expect("json");
    assert_eq!(written["bytes"], 5);
    assert_eq!(std::fs::read(&file).expect("uploaded"), b"hello");
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&file)),
        Some(KEY),
        None,
    );
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"hello"[..])
    );
    // A larger binary file streams both ways intact.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let big_path = root.join("big.bin");
    let response = put(
        &server,
        &format!("/sandboxes/{id}/files?path={}", enc(&big_path)),
        &big,
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&big_path)),
        Some(KEY),
        None,
    );
    assert!(
        response.body == big,
        "download of {} bytes differs",
        big.len()
    );

    let (status, info) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/stat?path={}", enc(&file)),
        None,
    );
    assert_eq!(status, 200, "{info}");
    assert_eq!(
        (&info["kind"], &info["size"], &info["mode"]),
        (&json!("file"), &json!(5), &json!(0o600)),
        "{info}"
    );
    let (status, list) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/list?path={}", enc(&root.join("a"))),
        None,
    );
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["entries"][0]["name"], "b.txt", "{list}");

    // Tar: upload unpacks into a directory, download packs one.
    let mut archive = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(3);
    header.set_mode(0o644);
    header.set_cksum();
    archive
        .append_data(&mut header, "x/y.txt", &b"yyy"[..])
        .expect("tar");
    let data = archive.into_inner().expect("tar");
    let unpacked = root.join("t");
    let response = put(
        &server,
        &format!("/sandboxes/{id}/tar?path={}", enc(&unpacked)),
        &data,
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    assert_eq!(
        std::fs::read(unpacked.join("x/y.txt")).expect("unpacked"),
        b"yyy"
    );
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/tar?path={}", enc(&unpacked)),
        Some(KEY),
        None,
    );
    assert_eq!(response.status, 200);
    let names: Vec<String> = tar::Archive::new(response.body.as_slice())
        .entries()
        .expect("entries")
        .map(|e| {
            e.expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string()
        })
        .collect();
    assert!(names.iter().any(|n| n.ends_with("x/y.txt")), "{names:?}");

    // Remove, then it is gone.
    let (status, _) = server.call(
        "DELETE",
        &format!(
            "/sandboxes/{id}/files?path={}&recursive=true",
            enc(&root.join("a"))
        ),
        None,
    );
    assert_eq!(status, 204);
    let (status, body) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/stat?path={}", enc(&file)),
        None,
    );
    assert_eq!(status, 404, "{body}");
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&file)),
        Some(KEY),
        None,
    );
    assert_eq!(response.status, 404);

    // Bad paths name the field; an upload over the cap is 413.
    for (query, word) in [
        ("path=etc/passwd", "relative"),
        ("path=/tmp/../../etc/passwd", "escapes"),
        ("", "path"),
    ] {
        let (status, body) = server.call("GET", &format!("/sandboxes/{id}/files?{query}"), None);
        assert_eq!(status, 400, "{query}: {body}");
        assert!(
            body["error"].as_str().expect("error").contains(word),
            "{query}: {body}"
        );
    }
    let auth = format!("Bearer {KEY}");
    let huge = Endpoint::Unix(server.sock())
        .open(
            "PUT",
            &format!("/sandboxes/{id}/files?path={}", enc(&root.join("huge"))),
            &[("Authorization", &auth)],
            Some((&mut &b"tiny"[..], 300 << 20)),
            Duration::from_secs(60),
        )
        .expect("PUT")
        .into_response()
        .expect("answer");
    assert_eq!(huge.status, 413, "{}", huge.error_message());
    assert!(!root.join("huge").exists());

    // `rollbox sandbox cp`, both ways, a file and a directory.
    let cli = |args: &[&str]| {
        let output = Command::new(rollbox_binary())
            .args(["sandbox", "--socket"])
            .arg(server.sock())
            .arg("--api-key-file")
            .arg(server.dir.path().join("key"))
            .args(args)
            .output()
            .expect("rollbox sandbox");
        assert!(output.status.success(), "{args:?}: {output:?}");
    };
    let host = tempfile::tempdir().expect("tempdir");
    std::fs::write(host.path().join("in.txt"), b"cp in").expect("write");
    std::fs::create_dir_all(host.path().join("tree/sub")).expect("mkdir");
    std::fs::write(host.path().join("tree/sub/leaf"), b"leaf").expect("write");
    let inside = root.join("cp");
    let host_in = host.path().join("in.txt").display().to_string();
    cli(&["cp", &host_in, &format!("{id}:{}/", inside.display())]);
    assert_eq!(
        std::fs::read(inside.join("in.txt")).expect("cp in"),
        b"cp in"
    );
    let tree = host.path().join("tree").display().to_string();
    cli(&[
        "cp",
        &tree,
        &format!("{id}:{}", inside.join("tree").display()),
    ]);
    assert_eq!(
        std::fs::read(inside.join("tree/sub/leaf")).expect("cp dir in"),
        b"leaf"
    );
    let back = host.path().join("back");
    cli(&[
        "cp",
        &format!("{id}:{}", inside.display()),
        &back.display().to_string(),
    ]);
    assert_eq!(
        std::fs::read(back.join("in.txt")).expect("cp dir out"),
        b"cp in"
    );
    assert_eq!(
        std::fs::read(back.join("tree/sub/leaf")).expect("cp dir out"),
        b"leaf"
    );
    let one = host.path().join("one.txt");
    cli(&[
        "cp",
        &format!("{id}:{}", inside.join("in.txt").display()),
        &one.display().to_string(),
    ]);
    assert_eq!(std::fs::read(&one).expect("cp file out"), b"cp in");
}

#[test]
fn create_env_is_stored_and_merged_under_each_exec_env() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, _) = agent_server();
    let sandbox = server.create(json!({
        "template": "guest", "ttl_s": 300,
        "env": {"ROLLBOX_A": "from-sandbox", "ROLLBOX_B": "from-sandbox"},
    }));
    let id = sandbox["id"].as_str().expect("id").to_string();
    assert_eq!(sandbox["env"]["ROLLBOX_A"], "from-sandbox", "{sandbox}");
    let result = exec(
        &server,
        &id,
        json!({"cmd": "echo $ROLLBOX_A $ROLLBOX_B", "env": {"ROLLBOX_B": "from-exec"}}),
    );
    assert_eq!(result["stdout"], "from-sandbox from-exec\n", "{result}");
    // Streaming execs get it too.
    let mut lines = exec_stream(&server, &id, json!({"cmd": "echo $ROLLBOX_A"}));
    assert_eq!(next_line(&mut lines)["type"], "started");
    let out = next_line(&mut lines);
    assert_eq!(out["data"], "from-sandbox\n", "{out}");
    // Bad env is a 400 naming it.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 30, "env": {"A=B": "x"}})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("env")),
        "{body}"
    );
}

#[test]
fn interactive_stdin_reaches_a_streaming_exec_until_closed() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["cat"], "stdin_open": true}));
    let started = next_line(&mut lines);
    assert_eq!(started["type"], "started", "{started}");
    let pid = started["pid"].as_u64().expect("pid");
    let stdin = format!("/sandboxes/{id}/processes/{pid}/stdin");
    let mut echoed = String::new();
    for (body, want) in [
        (json!({"data": "hello\n"}), "hello\n"),
        (
            json!({"data": "AAECdGhlcmUK", "encoding": "base64"}),
            "\u{0}\u{1}\u{2}there\n",
        ),
    ] {
        let (status, reply) = server.call("POST", &stdin, Some(body));
        assert_eq!(status, 204, "{reply}");
        let target = echoed.len() + want.len();
        echoed.push_str(want);
        let mut got = String::new();
        while got.len() < want.len() {
            let line = next_line(&mut lines);
            assert_eq!(line["type"], "stdout", "{line}");
            assert_eq!(line["encoding"], "utf-8", "{line}");
            got.push_str(line["data"].as_str().expect("data"));
        }
        assert_eq!(got, want);
        assert_eq!(echoed.len(), target);
    }
    let (status, reply) = server.call("POST", &stdin, Some(json!({"close": true})));
    assert_eq!(status, 204, "{reply}");
    let exit = next_line(&mut lines);
    assert_eq!(
        (&exit["type"], &exit["exit_code"]),
        (&json!("exit"), &json!(0)),
        "{exit}"
    );
    // Gone now: 404. A process started without stdin_open: 409.
    let (status, _) = server.call("POST", &stdin, Some(json!({"data": "x"})));
    assert_eq!(status, 404);
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["sleep", "30"]}));
    let pid = next_line(&mut lines)["pid"].as_u64().expect("pid");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/stdin"),
        Some(json!({"data": "x"})),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("stdin_open")),
        "{body}"
    );
    let (status, _) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": "KILL"})),
    );
    assert_eq!(status, 204);
}

/// `GET /sandboxes/{id}/ports/{port}` (an `Upgrade: tcp`) and `rollbox sandbox port-forward`
/// reach a guest TCP port through the agent; the host agent's 127.0.0.1 is this machine's, so
/// a listener here stands in for the guest's service.
#[test]
fn guest_ports_through_the_agent_by_upgrade_and_port_forward() {
    use std::io::{BufRead, Read, Write};
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let service = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = service.local_addr().expect("address").port();
    // Answers each connection with what it got, upper-cased, once its input ends.
    std::thread::spawn(move || {
        for connection in service.incoming() {
            let Ok(mut connection) = connection else {
                continue;
            };
            std::thread::spawn(move || {
                let mut got = Vec::new();
                if connection.read_to_end(&mut got).is_ok() {
                    let _ = connection.write_all(&got.to_ascii_uppercase());
                }
            });
        }
    });
    let auth = format!("Bearer {KEY}");
    let endpoint = Endpoint::Unix(server.sock());
    let path = format!("/sandboxes/{id}/ports/{port}");
    let mut guest = endpoint
        .upgrade(
            &path,
            &[("Authorization", &auth)],
            "tcp",
            Duration::from_secs(30),
        )
        .expect("upgrade request")
        .unwrap_or_else(|r| panic!("{} {}\n{}", r.status, r.error_message(), server.log()));
    guest.write_all(b"through the daemon").expect("send");
    guest.shutdown_write().expect("end of input");
    let mut answer = String::new();
    guest.read_to_string(&mut answer).expect("answer");
    assert_eq!(answer, "THROUGH THE DAEMON");

    // Without the upgrade headers it is a 400 saying what to send; a closed port is a 502.
    let (status, body) = server.call("GET", &path, None);
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap_or("")
            .contains("Upgrade: tcp"),
        "{body}"
    );
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let refusal = endpoint
        .upgrade(
            &format!("/sandboxes/{id}/ports/{closed}"),
            &[("Authorization", &auth)],
            "tcp",
            Duration::from_secs(30),
        )
        .expect("upgrade request")
        .expect_err("nothing listens");
    assert_eq!(refusal.status, 502, "{}", refusal.error_message());
    assert!(
        refusal
            .error_message()
            .contains(&format!("127.0.0.1:{closed}: Connection refused")),
        "{}",
        refusal.error_message()
    );

    // The CLI refuses a sandbox that is not there before it listens.
    let output = Command::new(rollbox_binary())
        .args(["sandbox", "port-forward", "--socket"])
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .args(["sb-0000000000000000", "80"])
        .output()
        .expect("rollbox sandbox port-forward");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("sb-0000000000000000"), "{stderr}");

    // The CLI serves the port on a host address it prints.
    let mut forward = Command::new(rollbox_binary())
        .args(["sandbox", "port-forward", "--socket"])
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .args([id.as_str(), &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("rollbox sandbox port-forward");
    let mut line = String::new();
    std::io::BufReader::new(forward.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read its address");
    let local = line
        .strip_prefix("forwarding ")
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string);
    let result = std::panic::catch_unwind(|| {
        let local = local.unwrap_or_else(|| panic!("port-forward printed {line:?}"));
        for round in 0..3 {
            let mut client = std::net::TcpStream::connect(&local).expect("connect");
            let text = format!("round {round} through the cli");
            client.write_all(text.as_bytes()).expect("send");
            client
                .shutdown(std::net::Shutdown::Write)
                .expect("end of input");
            let mut answer = String::new();
            client.read_to_string(&mut answer).expect("answer");
            assert_eq!(answer, text.to_uppercase());
        }
    });
    let _ = forward.kill();
    let _ = forward.wait();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// `rollbox sandbox cp` from a guest: what the guest sends is hostile. Its archive stops at
/// the byte and entry caps and may not put a symlink pointing out of the destination; a single
/// file stops at the byte cap. Each refusal names the cap or the entry.
#[test]
fn cp_from_a_guest_is_capped_and_stays_in_the_destination() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let guest = tempfile::tempdir().expect("tempdir");
    let host = tempfile::tempdir().expect("tempdir");
    let cli = |args: &[&str]| {
        Command::new(rollbox_binary())
            .args(["sandbox", "--socket"])
            .arg(server.sock())
            .arg("--api-key-file")
            .arg(server.dir.path().join("key"))
            .args(args)
            .output()
            .expect("rollbox sandbox")
    };
    let refused = |args: &[&str], want: &str| {
        let output = cli(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    };
    // A guest directory with many files, one big file, and a symlink to a host file.
    let tree = guest.path().join("tree");
    std::fs::create_dir(&tree).expect("mkdir");
    for i in 0..20 {
        std::fs::write(tree.join(format!("f{i}")), b"x").expect("write");
    }
    std::fs::write(tree.join("big"), vec![7u8; 1 << 20]).expect("write");
    let from = format!("{id}:{}", tree.display());
    let to = |name: &str| host.path().join(name).display().to_string();
    refused(
        &["cp", &from, &to("a"), "--max-entries", "5"],
        "more than 5 entries; stopped at the cap (raise it with --max-entries)",
    );
    refused(
        &["cp", &from, &to("b"), "--max-bytes", "65536"],
        "holds more than 65536 bytes; stopped at entry",
    );
    let big = format!("{id}:{}", tree.join("big").display());
    refused(
        &["cp", &big, &to("big"), "--max-bytes", "65536"],
        "holds more than 65536 bytes; stopped at the cap and removed",
    );
    assert!(
        !host.path().join("big").exists(),
        "the partial file is removed"
    );
    // Within the caps it copies.
    let output = cli(&["cp", &from, &to("c")]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        std::fs::read(host.path().join("c/f3")).expect("copied"),
        b"x"
    );
    // A symlink out of the destination is refused, not created.
    std::os::unix::fs::symlink("/etc/passwd", tree.join("passwd")).expect("symlink");
    refused(
        &["cp", &from, &to("d")],
        "passwd -> /etc/passwd in the guest's archive points outside",
    );
    assert!(std::fs::symlink_metadata(host.path().join("d/passwd")).is_err());
}
