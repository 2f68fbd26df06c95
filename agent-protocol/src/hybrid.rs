//! Firecracker's hybrid-vsock preamble on the host side of a Unix socket:
//! the client sends `CONNECT <port>\n`, the listener answers `OK <n>\n`,
//! then the stream carries the framed protocol.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A preamble line is short; anything longer is refused.
const MAX_LINE: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("handshake I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("connection closed during the handshake after {0:?}")]
    Closed(String),
    #[error("handshake line longer than {MAX_LINE} bytes: {0:?}")]
    TooLong(String),
    #[error("expected \"CONNECT <port>\", got {0:?}")]
    BadConnect(String),
    #[error("expected \"OK <port>\", got {0:?}")]
    BadReply(String),
}

async fn read_line<R: AsyncRead + Unpin>(reader: &mut R) -> Result<String, HandshakeError> {
    // Byte by byte, so nothing after the newline is consumed.
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        if reader.read(&mut byte).await? == 0 {
            return Err(HandshakeError::Closed(
                String::from_utf8_lossy(&line).into_owned(),
            ));
        }
        if byte[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(byte[0]);
        if line.len() > MAX_LINE {
            return Err(HandshakeError::TooLong(
                String::from_utf8_lossy(&line).into_owned(),
            ));
        }
    }
}

/// Client side: send `CONNECT <port>` and wait for `OK ...`.
pub async fn client_handshake<S>(stream: &mut S, port: u32) -> Result<(), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    stream.flush().await?;
    let line = read_line(stream).await?;
    match line.strip_prefix("OK ") {
        Some(rest) if rest.trim().parse::<u32>().is_ok() => Ok(()),
        _ => Err(HandshakeError::BadReply(line)),
    }
}

/// Listener side, step 1: read `CONNECT <port>` and return the port.
pub async fn read_connect<R: AsyncRead + Unpin>(reader: &mut R) -> Result<u32, HandshakeError> {
    let line = read_line(reader).await?;
    line.strip_prefix("CONNECT ")
        .and_then(|port| port.trim().parse::<u32>().ok())
        .ok_or(HandshakeError::BadConnect(line))
}

/// Listener side, step 2: accept with `OK <port>`.
pub async fn write_ok<W: AsyncWrite + Unpin>(
    writer: &mut W,
    port: u32,
) -> Result<(), HandshakeError> {
    writer.write_all(format!("OK {port}\n").as_bytes()).await?;
    writer.flush().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handshake_both_sides() {
        let (mut client, mut server) = tokio::io::duplex(256);
        let listener = tokio::spawn(async move {
            let port = read_connect(&mut server).await.expect("connect line");
            write_ok(&mut server, port).await.expect("ok");
            let mut rest = [0u8; 5];
            server.read_exact(&mut rest).await.expect("payload");
            (port, rest)
        });
        client_handshake(&mut client, 1024)
            .await
            .expect("handshake");
        client.write_all(b"hello").await.expect("payload");
        let (port, rest) = listener.await.expect("join");
        assert_eq!(port, 1024);
        assert_eq!(&rest, b"hello");
    }

    #[tokio::test]
    async fn garbage_preamble_is_refused() {
        let (mut client, mut server) = tokio::io::duplex(256);
        client.write_all(b"GET / HTTP/1.1\n").await.expect("write");
        let err = read_connect(&mut server).await.expect_err("refused");
        assert!(err.to_string().contains("GET / HTTP/1.1"), "{err}");
        client
            .write_all(b"CONNECT 1024 extra\n")
            .await
            .expect("write");
        assert!(read_connect(&mut server).await.is_err());
    }
}
