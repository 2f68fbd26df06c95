//! Exec through the real agent binary in host mode.

mod common;

use std::time::Duration;

use common::{alive, is_root, wait_gone, AgentProcess};
use rollbox_agent_protocol::{ExecEvent, ExecRequest, OomDetection, OutputStream, PtySize};
use rollbox_tests::{skip, skip_even_in_ci};

#[tokio::test]
async fn hello_and_health() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let (version, protocol) = client.hello().await.expect("hello");
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    assert_eq!(protocol, rollbox_agent_protocol::PROTOCOL_VERSION);
    let health = client.health().await.expect("health");
    assert!(
        health.memory.total_bytes > 0 && health.memory.available_bytes <= health.memory.total_bytes
    );
    assert!(health.disk.total_bytes > 0);
    assert!(health.uptime_seconds > 0.0);
    assert!(!health.is_init);
    assert_eq!(health.agent_version, version);
    // Host mode without --generation-watch never reads I/O ports.
    assert_eq!(health.generation, None);
    assert_eq!(health.generation_applied, None);
}

#[tokio::test]
async fn exec_streams_stdout_and_stderr_with_sequence_numbers() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut handle = client
        .exec(ExecRequest::shell(
            "echo one; echo two >&2; sleep 0.1; echo three",
        ))
        .await
        .expect("exec");
    let pid = handle.started().await.expect("started");
    assert!(pid > 1);
    let mut seqs = Vec::new();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = loop {
        match handle
            .next_event()
            .await
            .expect("event")
            .expect("not finished")
        {
            ExecEvent::Output { stream, seq, data } => {
                seqs.push(seq);
                match stream {
                    OutputStream::Stdout | OutputStream::Pty => out.extend(data),
                    OutputStream::Stderr => err.extend(data),
                }
            }
            ExecEvent::Exited(status) => break status,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(String::from_utf8_lossy(&out), "one\nthree\n");
    assert_eq!(String::from_utf8_lossy(&err), "two\n");
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(status.code, Some(0));
    assert!(status.success() && !status.truncated && !status.timed_out);
    assert_eq!((status.stdout_bytes, status.stderr_bytes), (10, 4));
    assert!(handle.next_event().await.expect("after exit").is_none());
}

#[tokio::test]
async fn stdin_is_written_and_closed() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut req = ExecRequest::argv(["cat"]);
    req.stdin = true;
    let handle = client.exec(req).await.expect("exec");
    handle.write_stdin(b"hello ").await.expect("stdin");
    handle.write_stdin(b"world").await.expect("stdin");
    handle.close_stdin().await.expect("close");
    let output = handle.collect().await.expect("collect");
    assert_eq!(output.stdout, b"hello world");
    assert_eq!(output.status.code, Some(0));

    // Much more than one frame holds, piped through and counted.
    let mut req = ExecRequest::argv(["wc", "-c"]);
    req.stdin = true;
    let handle = client.exec(req).await.expect("exec");
    handle
        .write_stdin(&vec![b'z'; 20 << 20])
        .await
        .expect("big stdin");
    handle.close_stdin().await.expect("close");
    let output = handle.collect().await.expect("collect");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        (20u64 << 20).to_string()
    );

    // Stdin to a process started without it is refused with a notice, not an error.
    let mut handle = client
        .exec(ExecRequest::shell("sleep 0.2"))
        .await
        .expect("exec");
    handle.write_stdin(b"x").await.expect("send");
    let mut notices = Vec::new();
    while let Some(event) = handle.next_event().await.expect("event") {
        if let ExecEvent::Notice(message) = event {
            notices.push(message);
        }
    }
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].contains("without stdin"), "{notices:?}");
}

#[tokio::test]
async fn timeout_kills_the_whole_process_group() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    // The shell and its background child ignore SIGTERM, so only the SIGKILL
    // after the grace period ends them; the child's pid comes first on stdout.
    let mut req = ExecRequest::shell("trap '' TERM; sleep 100 & echo $!; sleep 100; wait");
    req.timeout_ms = Some(300);
    req.kill_grace_ms = Some(300);
    let output = client.run(req).await.expect("run");
    assert!(output.status.timed_out, "{:?}", output.status);
    assert_eq!(
        output.status.signal,
        Some(libc::SIGKILL),
        "{:?}",
        output.status
    );
    assert_eq!(output.status.code, None);
    let background: u32 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("background pid");
    assert!(
        wait_gone(background, Duration::from_secs(5)),
        "background child {background} survived the timeout"
    );

    // A process that honours SIGTERM ends with it.
    let mut req = ExecRequest::argv(["sleep", "100"]);
    req.timeout_ms = Some(200);
    let output = client.run(req).await.expect("run");
    assert!(output.status.timed_out);
    assert_eq!(output.status.signal, Some(libc::SIGTERM));
}

#[tokio::test]
async fn output_cap_truncates_and_counts() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut req = ExecRequest::shell("head -c 300000 /dev/zero; echo tail >&2");
    req.output_limit_bytes = Some(1000);
    let output = client.run(req.clone()).await.expect("run");
    assert_eq!(output.stdout.len() + output.stderr.len(), 1000);
    assert!(output.status.truncated);
    assert_eq!(output.status.stdout_bytes, 300_000);
    assert_eq!(output.status.code, Some(0));

    // The same through the streaming form.
    let output = client
        .exec(req)
        .await
        .expect("exec")
        .collect()
        .await
        .expect("collect");
    assert_eq!(output.stdout.len() + output.stderr.len(), 1000);
    assert!(output.status.truncated);
}

#[tokio::test]
async fn signals_reach_the_process() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut handle = client
        .exec(ExecRequest::argv(["sleep", "100"]))
        .await
        .expect("exec");
    handle.started().await.expect("started");
    handle.signal(999, false).await.expect("send bad signal");
    match handle.next_event().await.expect("event") {
        Some(ExecEvent::Notice(message)) => assert!(message.contains("signal 999"), "{message}"),
        other => panic!("expected a notice, got {other:?}"),
    }
    handle.signal(libc::SIGUSR1, false).await.expect("signal");
    let output = handle.collect().await.expect("collect");
    assert_eq!(output.status.signal, Some(libc::SIGUSR1));
    assert!(!output.status.timed_out);

    // Cancel kills the group.
    let mut handle = client
        .exec(ExecRequest::argv(["sleep", "100"]))
        .await
        .expect("exec");
    handle.started().await.expect("started");
    handle.cancel().await.expect("cancel");
    let output = handle.collect().await.expect("collect");
    assert_eq!(output.status.signal, Some(libc::SIGKILL));
}

#[tokio::test]
async fn many_processes_at_once() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut req = ExecRequest::shell(format!("sleep 0.2; echo {i}"));
            req.env.insert("N".into(), i.to_string());
            if i % 2 == 0 {
                client.run(req).await
            } else {
                client.exec(req).await?.collect().await
            }
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let output = task.await.expect("join").expect("run");
        assert_eq!(String::from_utf8_lossy(&output.stdout), format!("{i}\n"));
    }
}

#[tokio::test]
async fn run_with_env_cwd_user_and_stdin_data() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut req = ExecRequest::shell("echo \"$GREETING\" \"$(pwd)\"; cat");
    req.env.insert("GREETING".into(), "hi".into());
    req.cwd = Some("/tmp".into());
    req.stdin_data = Some(b"from stdin".to_vec());
    let output = client.run(req).await.expect("run");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "hi /tmp\nfrom stdin"
    );

    let mut req = ExecRequest::argv(["/usr/bin/env"]);
    req.clear_env = true;
    req.env.insert("ONLY".into(), "me".into());
    let output = client.run(req).await.expect("run");
    let env = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(env.contains("ONLY=me") && env.contains("PATH="), "{env}");
    assert!(!env.contains("HOME="), "{env}");

    if is_root() {
        let mut req = ExecRequest::shell("id -u; id -g; echo $HOME $USER");
        req.user = Some("nobody".into());
        let output = client.run(req).await.expect("run as nobody");
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "65534", "{text}");
        assert!(lines[2].ends_with(" nobody"), "{text}");
    } else {
        skip(
            "run_with_env_cwd_user_and_stdin_data",
            "running as another user needs root",
        );
    }
}

#[tokio::test]
async fn exec_errors_name_the_input() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let err = client
        .run(ExecRequest::argv(["/nonexistent/prog"]))
        .await
        .expect_err("missing program");
    let info = err.agent_error().expect("agent error");
    assert_eq!(
        info.message,
        "exec /nonexistent/prog: No such file or directory"
    );
    assert_eq!(info.code, "ENOENT");

    let mut req = ExecRequest::argv(["true"]);
    req.cwd = Some("/nonexistent-dir".into());
    let err = client.run(req).await.expect_err("bad cwd");
    assert_eq!(
        err.agent_error().expect("agent").message,
        "chdir /nonexistent-dir: No such file or directory"
    );

    let mut req = ExecRequest::argv(["true"]);
    req.user = Some("no-such-user-xyz".into());
    let err = client.run(req).await.expect_err("bad user");
    assert!(err.to_string().contains("\"no-such-user-xyz\""), "{err}");

    let err = client
        .run(ExecRequest::argv(Vec::<String>::new()))
        .await
        .expect_err("empty argv");
    assert!(err.to_string().contains("argv is empty"), "{err}");

    // Exit codes are reported, not errors.
    let output = client.sh("exit 3").await.expect("run");
    assert_eq!(output.status.code, Some(3));
    assert!(!output.status.success());
}

#[tokio::test]
async fn oom_kill_is_detected_in_the_exec_cgroup() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    // The shell holds ~256 MiB of 'a's in a variable against a 32 MiB limit.
    let mut req =
        ExecRequest::shell("x=$(head -c 268435456 /dev/zero | tr '\\0' a); echo survived");
    req.memory_limit_bytes = Some(32 << 20);
    req.timeout_ms = Some(60_000);
    // A memory cgroup is a property of the host kernel and of where the test runs, not a
    // service CI can start, so both skips here stand even with ROLLBOX_REQUIRE_ALL=1;
    // tests/tcg_guest.rs checks the cgroup2 path inside a real guest.
    const TEST: &str = "oom_kill_is_detected_in_the_exec_cgroup";
    match client.run(req).await {
        Ok(output) => match output.status.oom_detection {
            OomDetection::CgroupV1 | OomDetection::CgroupV2 => {
                assert!(output.status.oom_killed, "{:?}", output.status);
                assert_ne!(output.status.code, Some(0), "{:?}", output.status);
            }
            other => skip_even_in_ci(
                TEST,
                &format!("OOM detection here is {other:?}, not a cgroup"),
            ),
        },
        Err(err) if err.to_string().contains("needs a memory cgroup") => skip_even_in_ci(
            TEST,
            &format!("no memory cgroup available to the agent here ({err})"),
        ),
        Err(err) => panic!("{err}"),
    }
    // An ordinary exit is not an OOM kill.
    let output = client.sh("true").await.expect("run");
    assert!(!output.status.oom_killed);
}

#[tokio::test]
async fn closing_the_connection_kills_its_processes() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut handle = client
        .exec(ExecRequest::argv(["sleep", "100"]))
        .await
        .expect("exec");
    let pid = handle.started().await.expect("started");
    assert!(alive(pid));
    client.close().await.expect("close");
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "process {pid} outlived its connection"
    );
}

#[tokio::test]
async fn run_output_is_capped_to_fit_one_frame() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let output = client.sh("head -c 20000000 /dev/zero").await.expect("run");
    assert_eq!(output.stdout.len(), 8 << 20);
    assert!(output.status.truncated);
    assert_eq!(output.status.stdout_bytes, 20_000_000);
    // Streaming has no such limit.
    let output = client
        .exec(ExecRequest::shell("head -c 20000000 /dev/zero"))
        .await
        .expect("exec")
        .collect()
        .await
        .expect("collect");
    assert_eq!(output.stdout.len(), 20_000_000);
    assert!(!output.status.truncated);
}

/// Terminal output of `handle` until it contains `want` (the process must still be running).
async fn pty_output_until(
    handle: &mut rollbox_agent_protocol::ExecHandle,
    seen: &mut String,
    want: &str,
) {
    while !seen.contains(want) {
        let event = tokio::time::timeout(Duration::from_secs(10), handle.next_event())
            .await
            .unwrap_or_else(|_| panic!("no {want:?} within 10 s; the terminal showed {seen:?}"))
            .expect("event")
            .expect("not finished");
        match event {
            ExecEvent::Output { stream, data, .. } => {
                assert_eq!(stream, OutputStream::Pty);
                seen.push_str(&String::from_utf8_lossy(&data));
            }
            other => panic!("unexpected {other:?} before {want:?}; terminal: {seen:?}"),
        }
    }
}

#[tokio::test]
async fn exec_on_a_pty_types_input_resizes_and_reports_the_exit() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let mut request = ExecRequest::shell(
        "tty; stty size; echo term=$TERM; read a; echo \"got $a\"; read b; stty size; exit 3",
    );
    request.pty = Some(PtySize { rows: 24, cols: 80 });
    let mut handle = client.exec(request).await.expect("exec");
    handle.started().await.expect("started");
    let mut seen = String::new();
    pty_output_until(&mut handle, &mut seen, "term=xterm-256color").await;
    assert!(seen.contains("/dev/pts/"), "tty printed {seen:?}");
    assert!(seen.contains("24 80"), "stty size printed {seen:?}");
    handle.write_stdin(b"hello\n").await.expect("type");
    pty_output_until(&mut handle, &mut seen, "got hello").await;
    handle
        .resize(PtySize {
            rows: 50,
            cols: 132,
        })
        .await
        .expect("resize");
    // The next stream input goes after the resize on the same connection, so the size is
    // set before `read b` returns.
    handle.write_stdin(b"\n").await.expect("type");
    let mut rest = Vec::new();
    let status = loop {
        match handle
            .next_event()
            .await
            .expect("event")
            .expect("not finished")
        {
            ExecEvent::Output { stream, data, .. } => {
                assert_eq!(stream, OutputStream::Pty);
                rest.extend(data);
            }
            ExecEvent::Exited(status) => break status,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert!(
        String::from_utf8_lossy(&rest).contains("50 132"),
        "{rest:?}"
    );
    assert_eq!(status.code, Some(3));
    assert!(status.stdout_bytes > 0 && status.stderr_bytes == 0);
}

#[tokio::test]
async fn pty_misuse_is_refused_by_name() {
    let agent = AgentProcess::start();
    let client = agent.client().await;
    // A terminal cannot be collected by `run`.
    let mut request = ExecRequest::shell("true");
    request.pty = Some(PtySize { rows: 24, cols: 80 });
    let err = client.run(request.clone()).await.expect_err("run with pty");
    assert!(err.to_string().contains("pty needs exec"), "{err}");
    request.pty = Some(PtySize { rows: 0, cols: 80 });
    let err = client
        .exec(request)
        .await
        .expect("exec")
        .started()
        .await
        .expect_err("0 rows");
    assert!(err.to_string().contains("size 0x80"), "{err}");
    // Resizing a process without a terminal is refused with a notice; the process goes on.
    let mut request = ExecRequest::shell("read a; echo done");
    request.stdin = true;
    let mut handle = client.exec(request).await.expect("exec");
    handle.started().await.expect("started");
    handle
        .resize(PtySize { rows: 10, cols: 10 })
        .await
        .expect("send resize");
    match handle
        .next_event()
        .await
        .expect("event")
        .expect("not finished")
    {
        ExecEvent::Notice(message) => assert!(message.contains("has no terminal"), "{message}"),
        other => panic!("expected a notice, got {other:?}"),
    }
    handle.write_stdin(b"\n").await.expect("type");
    let output = handle.collect().await.expect("collect");
    assert_eq!(output.stdout, b"done\n");
}
