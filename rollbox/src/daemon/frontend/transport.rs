//! The transport both frontends share: listeners (a Unix socket, a loopback TCP address, or
//! any address with TLS), their TLS acceptors, the connection type hyper serves, response
//! bodies (whole or streamed) and upload bodies as a stream, and the key comparison. Nothing
//! else happens here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper_util::rt::TokioIo;

use super::super::api::{BodyTooLarge, Chunk};

/// A listener that cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot listen on {what}: {source}")]
    Listen {
        what: String,
        source: std::io::Error,
    },
    #[error("{addr} is not a loopback address: serve it only with TLS ({tls_flags}), else use a loopback address (or --socket for a Unix socket)")]
    NotLoopback {
        addr: SocketAddr,
        tls_flags: &'static str,
    },
    #[error("{0} is in use by a running daemon; stop it or pick another --socket")]
    SocketInUse(PathBuf),
}

/// Where the API listens.
#[derive(Debug, Clone)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// A TLS certificate chain and its private key (PEM files), and the flags that named them.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The TLS acceptor for `files` (HTTP/1.1 only in ALPN; every client here speaks it);
/// `flags` ("--tls-cert/--tls-key") name the files in errors.
pub fn tls_acceptor(
    files: &TlsFiles,
    flags: (&str, &str),
) -> Result<tokio_rustls::TlsAcceptor, TransportError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let fail = |what: &str, path: &std::path::Path, e: String| TransportError::Listen {
        what: format!("TLS ({what} {})", path.display()),
        source: std::io::Error::other(e),
    };
    let (cert_flag, key_flag) = flags;
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| fail(cert_flag, &files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(fail(
            cert_flag,
            &files.cert,
            "no CERTIFICATE in the file".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| fail(key_flag, &files.key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(cert_flag, &files.cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| fail(key_flag, &files.key, e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// A response body: whole, or streamed from a channel (sent chunked).
pub enum Out {
    Full(Option<Bytes>),
    Stream(tokio::sync::mpsc::Receiver<Chunk>),
}

impl Body for Out {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            Out::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            // An error aborts the response: a chunked body without its end tells the client.
            Out::Stream(rx) => rx.poll_recv(cx).map(|c| c.map(|c| c.map(Frame::data))),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Out::Full(Some(bytes)) => hyper::body::SizeHint::with_exact(bytes.len() as u64),
            Out::Full(None) => hyper::body::SizeHint::with_exact(0),
            Out::Stream(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// A request body as an `AsyncRead`, failing with [`BodyTooLarge`] past `limit` bytes.
pub struct BodyReader {
    body: Incoming,
    left: Bytes,
    read: usize,
    limit: usize,
}

impl tokio::io::AsyncRead for BodyReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        while this.left.is_empty() {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(std::io::Error::other(e))),
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.read = this.read.saturating_add(data.len());
                        if this.read > this.limit {
                            return Poll::Ready(Err(std::io::Error::other(BodyTooLarge)));
                        }
                        this.left = data;
                    }
                }
            }
        }
        let n = this.left.len().min(buf.remaining());
        buf.put_slice(&this.left.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl BodyReader {
    pub fn new(body: Incoming, limit: usize) -> BodyReader {
        BodyReader {
            body,
            left: Bytes::new(),
            read: 0,
            limit,
        }
    }
}

/// A bound listener.
pub enum Listener {
    Unix(tokio::net::UnixListener, std::path::PathBuf),
    Tcp(tokio::net::TcpListener),
}

impl Listener {
    /// Binds `listen`. A TCP address that is not loopback is served only with TLS (`tls`;
    /// `tls_flags` name the flags that give it, for the refusal): the API key must not cross
    /// a network in the clear.
    pub fn bind(
        listen: &Listen,
        tls: bool,
        tls_flags: &'static str,
    ) -> Result<Listener, TransportError> {
        match listen {
            Listen::Unix(path) => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(TransportError::SocketInUse(path.clone()));
                }
                // Nothing answers: a stale socket of a daemon that died.
                let _ = std::fs::remove_file(path);
                let listener = tokio::net::UnixListener::bind(path).map_err(|source| {
                    TransportError::Listen {
                        what: path.display().to_string(),
                        source,
                    }
                })?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(
                    |source| TransportError::Listen {
                        what: path.display().to_string(),
                        source,
                    },
                )?;
                Ok(Listener::Unix(listener, path.clone()))
            }
            Listen::Tcp(addr) => {
                if !addr.ip().is_loopback() && !tls {
                    return Err(TransportError::NotLoopback {
                        addr: *addr,
                        tls_flags,
                    });
                }
                let std_listener =
                    std::net::TcpListener::bind(addr).map_err(|source| TransportError::Listen {
                        what: addr.to_string(),
                        source,
                    })?;
                let listen_error = |source| TransportError::Listen {
                    what: addr.to_string(),
                    source,
                };
                std_listener.set_nonblocking(true).map_err(listen_error)?;
                let listener =
                    tokio::net::TcpListener::from_std(std_listener).map_err(listen_error)?;
                Ok(Listener::Tcp(listener))
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(_, path) => path.display().to_string(),
            Listener::Tcp(l) => l
                .local_addr()
                .map(|a| format!("http://{a}"))
                .unwrap_or_else(|e| format!("tcp ({e})")),
        }
    }
}

/// One accepted connection, of either listener kind.
pub enum Io {
    Unix(TokioIo<tokio::net::UnixStream>),
    Tcp(TokioIo<tokio::net::TcpStream>),
}

/// The next connection.
pub async fn accept(listener: &Listener) -> std::io::Result<Io> {
    Ok(match listener {
        Listener::Unix(l, _) => Io::Unix(TokioIo::new(l.accept().await?.0)),
        Listener::Tcp(l) => Io::Tcp(TokioIo::new(accept_tcp(l).await?)),
    })
}

/// The next TCP connection, with TCP_NODELAY: replies go out in several small writes
/// (headers, then each stream frame), and with Nagle's algorithm each waits for the client's
/// delayed ACK of the one before, 40 ms on Linux.
pub async fn accept_tcp(
    listener: &tokio::net::TcpListener,
) -> std::io::Result<tokio::net::TcpStream> {
    let (stream, peer) = listener.accept().await?;
    if let Err(e) = stream.set_nodelay(true) {
        log::debug!("TCP_NODELAY on the connection from {peer}: {e}");
    }
    Ok(stream)
}

// hyper needs one I/O type per connection future: dispatch by hand.
impl hyper::rt::Read for Io {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Io::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Io {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Unix(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Io::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
            Io::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Io::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}
