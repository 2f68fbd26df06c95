//! `tcp_connect` through the real agent binary in host mode, where the guest's 127.0.0.1 is
//! this machine's: bytes both ways, refusals, and hang-ups.

mod common;

use std::time::Duration;

use common::AgentProcess;
use rollbox_agent_protocol::client::{connect_unix_tcp, tcp_connect, ClientError};
use rollbox_agent_protocol::{
    frame, hybrid, ClientFrame, ClientMessage, ServerFrame, ServerMessage,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

const WAIT: Duration = Duration::from_secs(10);

/// A fresh agent connection, past the preamble.
async fn connection(agent: &AgentProcess) -> UnixStream {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match UnixStream::connect(&agent.socket).await {
            Ok(mut stream) => {
                hybrid::client_handshake(&mut stream, 1024)
                    .await
                    .expect("handshake");
                return stream;
            }
            Err(e) if tokio::time::Instant::now() >= deadline => panic!("connect: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// A loopback port nothing listens on (bound, then closed).
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    listener.local_addr().expect("address").port()
}

async fn request(stream: &mut UnixStream, id: u64, body: ClientMessage) -> ServerMessage {
    frame::write_frame(stream, &ClientFrame { id, body })
        .await
        .expect("write");
    let reply: ServerFrame = tokio::time::timeout(WAIT, frame::read_frame(stream))
        .await
        .expect("reply in time")
        .expect("frame")
        .expect("not closed");
    assert_eq!(reply.id, id, "{reply:?}");
    reply.body
}

#[tokio::test]
async fn bytes_go_both_ways_and_an_end_of_input_reaches_the_socket() {
    let agent = AgentProcess::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    // The guest service: greets, then answers everything it got, reversed, once its input ends.
    let service = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        socket.write_all(b"hello\n").await.expect("greet");
        let mut got = Vec::new();
        socket.read_to_end(&mut got).await.expect("read");
        got.reverse();
        socket.write_all(&got).await.expect("answer");
        got.len()
    });
    let mut pipe = connect_unix_tcp(&agent.socket, 1024, "127.0.0.1", port)
        .await
        .expect("tcp_connect");
    let mut greeting = [0u8; 6];
    tokio::time::timeout(WAIT, pipe.read_exact(&mut greeting))
        .await
        .expect("greeting in time")
        .expect("greeting");
    assert_eq!(&greeting, b"hello\n");
    // Binary bytes of every value, larger than the agent's frames and buffers.
    let sent: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    let (mut read_half, mut write_half) = pipe.into_split();
    let writer = {
        let sent = sent.clone();
        tokio::spawn(async move {
            write_half.write_all(&sent).await.expect("send");
            write_half.shutdown().await.expect("end of input");
            write_half
        })
    };
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, read_half.read_to_end(&mut answer))
        .await
        .expect("answer in time")
        .expect("answer");
    let _write_half = writer.await.expect("writer");
    let mut expected = sent;
    expected.reverse();
    assert_eq!(answer.len(), expected.len());
    assert!(
        answer == expected,
        "the answer differs from the input reversed"
    );
    assert_eq!(service.await.expect("service"), expected.len());
}

#[tokio::test]
async fn a_refused_connect_names_the_port_and_the_connection_goes_on() {
    let agent = AgentProcess::start();
    let port = closed_port().await;
    let err = connect_unix_tcp(&agent.socket, 1024, "127.0.0.1", port)
        .await
        .expect_err("nothing listens");
    let info = match &err {
        ClientError::Agent(info) => info,
        other => panic!("expected the agent's error, got {other}"),
    };
    assert_eq!(info.code, "ECONNREFUSED", "{info:?}");
    assert!(
        info.message
            .contains(&format!("tcp_connect 127.0.0.1:{port}: Connection refused")),
        "{info:?}"
    );

    // The same connection may try again once something listens.
    let mut stream = connection(&agent).await;
    let body = ClientMessage::TcpConnect {
        host: "127.0.0.1".into(),
        port,
    };
    match request(&mut stream, 1, body.clone()).await {
        ServerMessage::Error(info) => assert_eq!(info.code, "ECONNREFUSED"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("rebind");
    match request(&mut stream, 2, body).await {
        ServerMessage::TcpConnected { address } => {
            assert_eq!(address, format!("127.0.0.1:{port}"))
        }
        other => panic!("expected tcp_connected, got {other:?}"),
    }
    let (mut socket, _) = listener.accept().await.expect("accept");
    stream.write_all(b"raw").await.expect("send");
    let mut got = [0u8; 3];
    socket.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"raw");
}

#[tokio::test]
async fn only_hello_may_come_before_tcp_connect() {
    let agent = AgentProcess::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    let mut stream = connection(&agent).await;
    assert!(matches!(
        request(&mut stream, 1, ClientMessage::Hello).await,
        ServerMessage::Hello { .. }
    ));
    assert!(matches!(
        request(&mut stream, 2, ClientMessage::Health).await,
        ServerMessage::Health(_)
    ));
    let body = ClientMessage::TcpConnect {
        host: "127.0.0.1".into(),
        port,
    };
    match request(&mut stream, 3, body).await {
        ServerMessage::Error(info) => {
            assert_eq!(info.code, "bad_request");
            assert!(info.message.contains("only hello"), "{info:?}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // The connection still carries frames.
    assert!(matches!(
        request(&mut stream, 4, ClientMessage::Hello).await,
        ServerMessage::Hello { .. }
    ));

    // After hello alone it works, through the client function.
    let mut fresh = connection(&agent).await;
    assert!(matches!(
        request(&mut fresh, 1, ClientMessage::Hello).await,
        ServerMessage::Hello { .. }
    ));
    let result = tcp_connect(fresh, "127.0.0.1", port).await;
    // The client function sends id 1 again: hello's request is over, so the id is free.
    result.expect("tcp_connect after hello");
}

#[tokio::test]
async fn a_client_hang_up_closes_the_guest_socket() {
    let agent = AgentProcess::start();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    let pipe = connect_unix_tcp(&agent.socket, 1024, "127.0.0.1", port)
        .await
        .expect("tcp_connect");
    let (mut socket, _) = listener.accept().await.expect("accept");
    drop(pipe);
    // The service sees the end of its input...
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(WAIT, socket.read(&mut buf))
        .await
        .expect("end of input in time")
        .expect("read");
    assert_eq!(n, 0, "the service read bytes nobody sent");
    // ...and what it writes then finds no reader: the agent ends the pipe and closes the socket.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match socket.write_all(&[0u8; 4096]).await {
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                    ),
                    "{e}"
                );
                break;
            }
            Ok(()) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Ok(()) => panic!(
                "the guest socket is still open {} s after the hang-up",
                WAIT.as_secs()
            ),
        }
    }
}
