//! `tcp_connect`: a TCP connection from inside the guest, piped to the agent connection that
//! asked for it (see server.rs for how the connection stops carrying frames).

use std::io;
use std::time::Duration;

use rollbox_agent_protocol::ErrorInfo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::errors::SysError;

/// How long a connect may take before it fails with ETIMEDOUT.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `host:port` as an address is written (IPv6 hosts in brackets).
fn target(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Connects to `host:port` inside the guest; the error names both.
pub async fn connect(host: &str, port: u16) -> Result<TcpStream, ErrorInfo> {
    let target = target(host, port);
    if host.is_empty() {
        return Err(ErrorInfo::bad_request(format!(
            "tcp_connect {target}: the host is empty"
        )));
    }
    if port == 0 {
        return Err(ErrorInfo::bad_request(format!(
            "tcp_connect {target}: port 0 cannot be dialed"
        )));
    }
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port))).await
    {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(SysError::new("tcp_connect", target, e).to_info()),
        Err(_) => {
            let timed_out = io::Error::from_raw_os_error(libc::ETIMEDOUT);
            return Err(SysError::new("tcp_connect", target, timed_out).to_info());
        }
    };
    // Small writes (an HTTP request line) should not wait for Nagle.
    if let Err(e) = stream.set_nodelay(true) {
        log::info!("tcp_connect {target}: TCP_NODELAY: {e}");
    }
    Ok(stream)
}

/// Copies bytes both ways until both directions ended. An end of stream on one side is passed
/// on as a shutdown of the other's write half (so a client that stops sending still gets the
/// answer); a failed read or write, as when the client hung up entirely and the socket then
/// writes, ends both, and dropping them closes the socket.
pub async fn pipe<S>(connection: &mut S, mut socket: TcpStream)
where
    S: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let peer = socket
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    match tokio::io::copy_bidirectional(connection, &mut socket).await {
        Ok((to_socket, from_socket)) => {
            log::debug!("tcp pipe to {peer} ended: {to_socket} bytes sent, {from_socket} received")
        }
        Err(e) => log::info!("tcp pipe to {peer} ended: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_bracket_ipv6_hosts() {
        assert_eq!(target("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(target("::1", 80), "[::1]:80");
    }

    #[tokio::test]
    async fn bad_targets_are_refused_by_name() {
        let empty = connect("", 80).await.expect_err("empty host");
        assert_eq!(empty.code, "bad_request");
        assert!(empty.message.contains("tcp_connect :80"), "{empty:?}");
        let zero = connect("127.0.0.1", 0).await.expect_err("port 0");
        assert!(zero.message.contains("127.0.0.1:0"), "{zero:?}");
    }
}
