//! Agent protocol frames (4-byte big-endian length, then a JSON frame), read as the host
//! reads the agent's answers and as the agent reads the host's requests, and the hybrid
//! `CONNECT <port>` handshake line.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use rollbox_agent_protocol::frame::read_frame_body;
use rollbox_agent_protocol::{ClientFrame, ServerFrame};

use super::signature::shape;

/// Runs a future that never waits (its reader is a byte slice).
fn block_on<F: Future>(future: F) -> Option<F::Output> {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}

/// Byte 0: 0 frames from the agent, 1 frames from the host, 2 a handshake line.
pub fn run(data: &[u8]) -> u64 {
    let Some((&mode, mut stream)) = data.split_first() else {
        return 0;
    };
    let mut seen = String::new();
    if mode % 3 == 2 {
        let port = block_on(rollbox_agent_protocol::hybrid::read_connect(&mut stream));
        return shape(&format!("{port:?}"));
    }
    for _ in 0..16 {
        match block_on(read_frame_body(&mut stream)) {
            Some(Ok(Some(body))) => {
                let decoded = if mode % 3 == 0 {
                    rollbox_agent_protocol::frame::decode::<ServerFrame>(&body)
                        .map(|f| format!("{:?}", f.body).chars().take(20).collect::<String>())
                } else {
                    rollbox_agent_protocol::frame::decode::<ClientFrame>(&body)
                        .map(|f| format!("{:?}", f.body).chars().take(20).collect::<String>())
                };
                match decoded {
                    Ok(kind) => seen.push_str(&kind),
                    Err(e) => seen.push_str(&e.to_string()),
                }
            }
            Some(Ok(None)) => break,
            Some(Err(e)) => {
                seen.push_str(&e.to_string());
                break;
            }
            None => panic!("a read from a byte slice waited"),
        }
    }
    shape(&seen)
}

fn frames(mode: u8, bodies: &[&str]) -> Vec<u8> {
    let mut out = vec![mode];
    for body in bodies {
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(body.as_bytes());
    }
    out
}

fn encoded<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| panic!("seed: {e}"))
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use rollbox_agent_protocol::{ClientMessage, ExecRequest};
    let exec = encoded(&ClientFrame {
        id: 1,
        body: ClientMessage::Exec(ExecRequest::shell("echo hi")),
    });
    let tcp_connect = encoded(&ClientFrame {
        id: 1,
        body: ClientMessage::TcpConnect {
            host: "127.0.0.1".into(),
            port: 8080,
        },
    });
    let mut seeds = vec![
        ("client-exec".to_string(), frames(1, &[&exec])),
        ("client-tcp-connect".to_string(), frames(1, &[&tcp_connect])),
        ("handshake".to_string(), b"\x02CONNECT 52\n".to_vec()),
    ];
    // The agent's side, as it sends them.
    use rollbox_agent_protocol::{OutputStream, ServerMessage};
    let server: Vec<String> = [
        ServerMessage::Hello {
            agent_version: "0.1.0".into(),
            protocol_version: 1,
        },
        ServerMessage::Started { pid: 42 },
        ServerMessage::Output {
            stream: OutputStream::Stdout,
            seq: 0,
            data: b"hi\n".to_vec(),
        },
        ServerMessage::Data {
            seq: 1,
            data: vec![0, 1, 2],
        },
        ServerMessage::End { bytes: 3 },
        ServerMessage::Ok,
        ServerMessage::TcpConnected {
            address: "127.0.0.1:8080".into(),
        },
    ]
    .into_iter()
    .map(|body| encoded(&ServerFrame { id: 1, body }))
    .collect();
    let server: Vec<&str> = server.iter().map(String::as_str).collect();
    seeds.push(("server-frames".to_string(), frames(0, &server)));
    seeds
}
