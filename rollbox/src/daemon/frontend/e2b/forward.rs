//! Sandbox ports other than envd's: each request goes as HTTP/1.1 over a byte pipe the guest
//! agent opens to that port on the guest's loopback (`tcp_connect`), and its answer streams
//! back as it comes.

use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::io::{AsyncRead, AsyncWrite};

use super::super::transport::Out;

/// Chunks of a forwarded answer in flight to the client.
const CHUNKS_IN_FLIGHT: usize = 16;

/// Sends `request` over `pipe` (a connection to `port`) and streams its answer back; `Err`
/// says why it could not.
pub async fn forward<S>(
    pipe: S,
    port: u16,
    request: Request<Incoming>,
) -> Result<Response<Out>, String>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(pipe))
            .await
            .map_err(|e| format!("HTTP handshake with guest port {port}: {e}"))?;
    tokio::spawn(connection);
    let answer = sender
        .send_request(request)
        .await
        .map_err(|e| format!("guest port {port} gave no answer: {e}"))?;
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
            // A client that went away ends the forward, and dropping the pipe closes the
            // guest socket.
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
