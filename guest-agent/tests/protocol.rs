//! Restore fixups and protocol edge cases through the real agent binary.

mod common;

use std::time::{Duration, SystemTime};

use common::{is_root, AgentProcess};
use rollbox_agent_protocol::{
    frame, hybrid, AgentClient, ClientMessage, ExecRequest, ServerFrame, ServerMessage,
};
use rollbox_tests::skip;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("hostname")
        .trim()
        .to_owned()
}

#[tokio::test]
async fn restore_fixups_without_touching_this_machine() {
    let agent = AgentProcess::start();
    let client = agent.client().await;

    // The agent runs with --no-set-clock: it validates and reports, the clock stays.
    let applied = client
        .set_time(SystemTime::now() + Duration::from_secs(3600))
        .await
        .expect("set_time");
    assert!(!applied.applied, "{applied:?}");
    assert!(applied.detail.contains("--no-set-clock"), "{applied:?}");
    let err = client
        .request(ClientMessage::SetTime {
            unix_seconds: 1,
            nanos: 2_000_000_000,
        })
        .await
        .expect_err("bad nanos");
    assert!(err.to_string().contains("nanos 2000000000"), "{err}");

    let machine_id = "0123456789abcdef0123456789ABCDEF";
    let err = client
        .set_identity(None, Some("not-hex"))
        .await
        .expect_err("bad machine id");
    assert!(err.to_string().contains("32 hex digits"), "{err}");
    let err = client
        .set_identity(Some("bad host name"), None)
        .await
        .expect_err("bad hostname");
    assert!(err.to_string().contains("\"bad host name\""), "{err}");

    if !is_root() {
        skip(
            "restore_fixups_without_touching_this_machine",
            "hostname and RNG seeding need root (the agent's private UTS namespace)",
        );
        let applied = client
            .set_identity(None, Some(machine_id))
            .await
            .expect("machine id");
        assert!(applied.applied);
        return;
    }
    let before = hostname();
    let applied = client
        .set_identity(Some("sandbox-42"), Some(machine_id))
        .await
        .expect("identity");
    assert!(applied.applied, "{applied:?}");
    assert_eq!(
        std::fs::read_to_string(&agent.machine_id).expect("machine-id"),
        "0123456789abcdef0123456789abcdef\n"
    );
    // Processes of the agent see the new name; this machine keeps its own.
    let output = client
        .sh("cat /proc/sys/kernel/hostname")
        .await
        .expect("run");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "sandbox-42");
    assert_eq!(
        hostname(),
        before,
        "the test changed this machine's hostname"
    );

    let applied = client.reseed(&[7u8; 64]).await.expect("reseed");
    assert!(
        applied.applied && applied.detail.contains("64 seed bytes"),
        "{applied:?}"
    );
    let err = client.reseed(&[]).await.expect_err("empty seed");
    assert!(err.to_string().contains("seed of 0 bytes"), "{err}");
}

/// A raw connection for malformed traffic.
async fn raw(agent: &AgentProcess) -> tokio::net::UnixStream {
    let mut stream = tokio::net::UnixStream::connect(&agent.socket)
        .await
        .expect("connect");
    hybrid::client_handshake(&mut stream, 1024)
        .await
        .expect("handshake");
    stream
}

async fn send_json(stream: &mut tokio::net::UnixStream, json: &str) {
    stream
        .write_all(&(json.len() as u32).to_be_bytes())
        .await
        .expect("write");
    stream.write_all(json.as_bytes()).await.expect("write");
}

async fn next(stream: &mut tokio::net::UnixStream) -> ServerFrame {
    tokio::time::timeout(Duration::from_secs(10), frame::read_frame(stream))
        .await
        .expect("reply in time")
        .expect("frame")
        .expect("not closed")
}

#[tokio::test]
async fn bad_frames_get_errors_under_their_id_and_the_connection_goes_on() {
    let agent = AgentProcess::start();
    let mut stream = raw(&agent).await;

    send_json(&mut stream, r#"{"id":5,"body":{"op":"fly_to_the_moon"}}"#).await;
    let reply = next(&mut stream).await;
    assert_eq!(reply.id, 5);
    match reply.body {
        ServerMessage::Error(info) => {
            assert_eq!(info.code, "bad_request");
            assert!(info.message.contains("fly_to_the_moon"), "{info:?}");
        }
        other => panic!("{other:?}"),
    }

    send_json(&mut stream, "not json at all").await;
    let reply = next(&mut stream).await;
    assert_eq!(reply.id, 0);
    assert!(matches!(reply.body, ServerMessage::Error(_)));

    // Stream input for a request that is not open.
    send_json(
        &mut stream,
        r#"{"id":9,"body":{"op":"stdin","data":"aGk="}}"#,
    )
    .await;
    let reply = next(&mut stream).await;
    assert_eq!(reply.id, 9);
    match reply.body {
        ServerMessage::Error(info) => assert_eq!(info.code, "unknown_request"),
        other => panic!("{other:?}"),
    }

    // An id already in use by an open request is refused.
    send_json(
        &mut stream,
        r#"{"id":11,"body":{"op":"exec","command":{"argv":["sleep","0.5"]}}}"#,
    )
    .await;
    assert!(matches!(
        next(&mut stream).await.body,
        ServerMessage::Started { .. }
    ));
    send_json(&mut stream, r#"{"id":11,"body":{"op":"health"}}"#).await;
    match next(&mut stream).await.body {
        ServerMessage::Error(info) => assert!(info.message.contains("already in use"), "{info:?}"),
        other => panic!("{other:?}"),
    }
    match next(&mut stream).await.body {
        ServerMessage::Exited(status) => assert_eq!(status.code, Some(0)),
        other => panic!("{other:?}"),
    }

    // Still usable afterwards.
    let frame = frame::encode(&rollbox_agent_protocol::ClientFrame {
        id: 12,
        body: ClientMessage::Hello,
    })
    .expect("encode");
    stream.write_all(&frame).await.expect("write");
    assert!(matches!(
        next(&mut stream).await.body,
        ServerMessage::Hello { .. }
    ));

    // An oversized length prefix ends the connection (the framing is lost).
    stream
        .write_all(&u32::MAX.to_be_bytes())
        .await
        .expect("write");
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
        .await
        .expect("closed in time");
    assert!(read.is_ok());
}

#[tokio::test]
async fn wrong_port_or_preamble_is_refused() {
    let agent = AgentProcess::start();
    let err = AgentClient::connect_unix(&agent.socket, 52)
        .await
        .expect_err("wrong port");
    assert!(err.to_string().contains("handshake"), "{err}");
    let mut stream = tokio::net::UnixStream::connect(&agent.socket)
        .await
        .expect("connect");
    stream.write_all(b"HELLO\n").await.expect("write");
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.expect("closed");
    assert!(rest.is_empty());
    // The listener keeps serving.
    let client = agent.client().await;
    assert_eq!(client.sh("echo ok").await.expect("run").stdout, b"ok\n");
}

#[tokio::test]
async fn many_clients_share_one_agent() {
    let agent = AgentProcess::start();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let client = agent.client().await;
        tasks.push(tokio::spawn(async move {
            let output = client
                .run(ExecRequest::shell(format!("echo client{i}")))
                .await
                .expect("run");
            assert_eq!(
                String::from_utf8_lossy(&output.stdout),
                format!("client{i}\n")
            );
        }));
    }
    for task in tasks {
        task.await.expect("join");
    }
}
