//! The client against in-process agent stand-ins: backpressure, the stall policy and the
//! deadlines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};

use super::*;

fn output(seq: u64) -> ServerMessage {
    ServerMessage::Output {
        stream: OutputStream::Stdout,
        seq,
        data: vec![b'x'; 4096],
    }
}

/// Writes Output frames for request `id` for ever, counting those written.
async fn flood<W: AsyncWrite + Unpin>(mut writer: W, id: u64, written: Arc<AtomicU64>) {
    for seq in 0.. {
        let frame = ServerFrame {
            id,
            body: output(seq),
        };
        if frame::write_frame(&mut writer, &frame).await.is_err() {
            return;
        }
        written.fetch_add(1, Ordering::Relaxed);
    }
}

async fn next_request<R: AsyncRead + Unpin>(reader: &mut R) -> ClientFrame {
    frame::read_frame::<_, ClientFrame>(reader)
        .await
        .expect("a client frame")
        .expect("the client sent a request")
}

fn pair() -> (DuplexStream, DuplexStream) {
    tokio::io::duplex(64 << 10)
}

#[tokio::test]
async fn a_caller_that_does_not_read_stops_the_agent() {
    let (client_end, agent_end) = pair();
    let options = ClientOptions {
        stall_timeout: None,
        ..ClientOptions::default()
    };
    let client = AgentClient::from_stream_with(client_end, options);
    let (mut agent_read, agent_write) = tokio::io::split(agent_end);
    let handle = client
        .exec(ExecRequest::shell("yes"))
        .await
        .expect("exec opens");
    let request = next_request(&mut agent_read).await;
    let written = Arc::new(AtomicU64::new(0));
    tokio::spawn(flood(agent_write, request.id, Arc::clone(&written)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stuck_at = written.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let later = written.load(Ordering::Relaxed);
    // The queue, one frame in the reader's hands and what the 64 KiB pipe holds.
    assert!(
        later <= REQUEST_FRAMES as u64 + 32,
        "the agent wrote {later} frames to a caller that reads none"
    );
    assert_eq!(stuck_at, later, "the agent kept writing");
    drop(handle);
}

#[tokio::test]
async fn a_stalled_request_is_dropped_and_others_go_on() {
    let (client_end, agent_end) = pair();
    let options = ClientOptions {
        stall_timeout: Some(Duration::from_millis(200)),
        ..ClientOptions::default()
    };
    let client = AgentClient::from_stream_with(client_end, options);
    let (mut agent_read, agent_write) = tokio::io::split(agent_end);
    let agent_write = Arc::new(tokio::sync::Mutex::new(agent_write));
    let mut slow = client
        .exec(ExecRequest::shell("yes"))
        .await
        .expect("exec opens");
    let slow_id = next_request(&mut agent_read).await.id;
    let written = Arc::new(AtomicU64::new(0));
    let flooder = {
        let agent_write = Arc::clone(&agent_write);
        let written = Arc::clone(&written);
        tokio::spawn(async move {
            for seq in 0..(REQUEST_FRAMES as u64 * 4) {
                let frame = ServerFrame {
                    id: slow_id,
                    body: output(seq),
                };
                let mut writer = agent_write.lock().await;
                if frame::write_frame(&mut *writer, &frame).await.is_err() {
                    return;
                }
                written.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let other = {
        let client = client.clone();
        tokio::spawn(async move { client.mkdir("/other", false).await })
    };
    let health = next_request(&mut agent_read).await;
    assert!(matches!(health.body, ClientMessage::Mkdir { .. }));
    // The agent learns the slow request was dropped.
    let cancel = tokio::time::timeout(Duration::from_secs(5), next_request(&mut agent_read))
        .await
        .expect("a cancel for the stalled request");
    assert_eq!(cancel.id, slow_id);
    assert!(matches!(cancel.body, ClientMessage::Cancel));
    flooder.await.expect("the flood ends");
    let reply = ServerFrame {
        id: health.id,
        body: ServerMessage::Ok,
    };
    frame::write_frame(&mut *agent_write.lock().await, &reply)
        .await
        .expect("write the answer");
    tokio::time::timeout(Duration::from_secs(5), other)
        .await
        .expect("the other request is answered")
        .expect("join")
        .expect("mkdir");
    // The slow caller gets what was queued, then an error that says why.
    let error = loop {
        match slow.next_event().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stalled request ended without an error"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(error.contains("dropped"), "{error}");
}

#[tokio::test]
async fn a_call_the_agent_never_answers_times_out() {
    let (client_end, _agent_end) = pair();
    let options = ClientOptions {
        call_timeout: Some(Duration::from_millis(200)),
        ..ClientOptions::default()
    };
    let client = AgentClient::from_stream_with(client_end, options);
    let started = std::time::Instant::now();
    let error = client.stat("/etc").await.expect_err("no answer");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(&error, ClientError::Timeout { what, .. } if what == "stat"),
        "{error}"
    );
    assert_eq!(
        error.to_string(),
        "the agent did not answer stat within 0.2 s"
    );
    // A run is bounded past its own timeout, not before.
    let mut run = ExecRequest::shell("sleep 1");
    run.timeout_ms = Some(300);
    let started = std::time::Instant::now();
    client.run(run).await.expect_err("no answer");
    assert!(started.elapsed() >= Duration::from_millis(500));
}

#[tokio::test]
async fn a_socket_that_never_answers_the_handshake_times_out() {
    let dir = std::env::temp_dir().join(format!("agent-client-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("silent.sock");
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let _accepted = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let options = ClientOptions {
        connect_timeout: Some(Duration::from_millis(200)),
        ..ClientOptions::default()
    };
    let error = AgentClient::connect_unix_with(&path, 1024, options)
        .await
        .expect_err("no handshake");
    assert!(matches!(error, ClientError::Timeout { .. }), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}
