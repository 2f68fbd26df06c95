//! Sandbox ports other than envd's, forwarded as HTTP/1.1 to a TCP address: the test-only
//! `--e2b-test-port-forward PORT=ADDR` (the code interpreter's 49999 in host-agent tests).
//! Real guests need an agent operation that opens a guest TCP connection over vsock; the
//! agent protocol has none yet, so their other ports answer 502 "port is not open".

use std::net::SocketAddr;

use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::{Request, Response};

use super::super::http::Out;

/// Chunks of a forwarded answer in flight to the client.
const CHUNKS_IN_FLIGHT: usize = 16;

/// Sends `request` to `address` and streams its answer back; `Err` says why it could not.
pub(super) async fn forward(
    address: SocketAddr,
    request: Request<Incoming>,
) -> Result<Response<Out>, String> {
    let stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake with {address}: {e}"))?;
    tokio::spawn(connection);
    let answer = sender
        .send_request(request)
        .await
        .map_err(|e| format!("{address} gave no answer: {e}"))?;
    let (parts, mut body) = answer.into_parts();
    let (chunks, receiver) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
    tokio::spawn(async move {
        while let Some(frame) = body.frame().await {
            let chunk = match frame {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => Ok(data),
                    Err(_) => continue, // trailers
                },
                Err(e) => Err(std::io::Error::other(e)),
            };
            let failed = chunk.is_err();
            // A client that went away ends the forward (and with it the upstream request).
            if chunks.send(chunk).await.is_err() || failed {
                return;
            }
        }
    });
    let mut response = Response::new(Out::Stream(receiver));
    *response.status_mut() = parts.status;
    for (name, value) in &parts.headers {
        if name != hyper::header::CONTENT_LENGTH && name != hyper::header::TRANSFER_ENCODING {
            response.headers_mut().append(name, value.clone());
        }
    }
    Ok(response)
}
