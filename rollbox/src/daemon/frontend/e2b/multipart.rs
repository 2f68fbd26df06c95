//! Streaming request bodies of envd's `/files` uploads: a `multipart/form-data` reader that
//! hands out each part's data as it arrives (a linear boundary search, memchr's `memmem`, over
//! a buffer that never holds more than one read and a delimiter), and a gzip decoder that runs
//! on a blocking thread (at most 32 at once; a body that stalls 60 s ends its upload). Nothing
//! holds a whole upload in memory.

use std::io::Read as _;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt as _, ReadBuf};
use tokio::sync::mpsc;

use super::super::super::api::{BodyTooLarge, Chunk};

/// The longest boundary RFC 2046 allows.
pub const MAX_BOUNDARY: usize = 70;
/// The most header bytes one part may have.
const MAX_PART_HEADERS: usize = 16 << 10;
/// Bytes asked of the source per read.
const READ_BYTES: usize = 64 << 10;
/// Gzip uploads decoding at once: each holds a blocking thread while it runs, so stalled
/// uploads cannot take the runtime's blocking pool; more wait (without a thread) for a turn.
const MAX_GUNZIPS: usize = 32;
/// How long a gzip upload's body may stall before the upload ends with an error.
const GUNZIP_STALL: std::time::Duration = std::time::Duration::from_secs(60);
/// Turns of [`MAX_GUNZIPS`] (the daemon's: this module is the binary's, not the VMM's).
static GUNZIPS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_GUNZIPS);

/// A multipart body that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum MultipartError {
    #[error("content-type: multipart without a boundary")]
    NoBoundary,
    #[error("content-type: the multipart boundary is {0} bytes, over the {MAX_BOUNDARY} RFC 2046 allows")]
    LongBoundary(usize),
    #[error("multipart: the body has no boundary line")]
    NoFirstBoundary,
    #[error("multipart: a part's headers are over {MAX_PART_HEADERS} bytes or do not end")]
    Headers,
    #[error("multipart: the body ends inside a part (no closing boundary)")]
    Truncated,
    #[error("multipart: a boundary line is followed by neither CRLF nor --")]
    BadDelimiter,
    #[error("reading the request body: {0}")]
    Io(#[from] std::io::Error),
}

impl MultipartError {
    /// The io::Error a part reader gives for this (an over-size body keeps its marker).
    fn into_io(self) -> std::io::Error {
        match self {
            MultipartError::Io(e) => e,
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Result<String, MultipartError> {
    let boundary = content_type
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("boundary="))
        .next()
        .map(|b| b.trim_matches('"').to_string())
        .filter(|b| !b.is_empty())
        .ok_or(MultipartError::NoBoundary)?;
    if boundary.len() > MAX_BOUNDARY {
        return Err(MultipartError::LongBoundary(boundary.len()));
    }
    Ok(boundary)
}

/// One part's headers, as `/files` needs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub name: Option<String>,
    pub filename: Option<String>,
}

impl Part {
    /// A file part: named `file`, or with a filename.
    pub fn is_file(&self) -> bool {
        self.name.as_deref() == Some("file") || self.filename.is_some()
    }

    fn parse(headers: &[u8]) -> Part {
        let text = String::from_utf8_lossy(headers);
        let disposition = text
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or("");
        let field = |key: &str| {
            disposition.split(';').find_map(|p| {
                p.trim()
                    .strip_prefix(key)
                    .map(|f| f.trim_matches('"').to_string())
            })
        };
        Part {
            name: field("name="),
            filename: field("filename="),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    /// Before the first boundary line.
    Preamble,
    /// Inside a part's data.
    Data,
    /// Just after a part's data, at its closing delimiter.
    Delimiter,
    /// After the closing `--boundary--`.
    Done,
}

/// A streaming `multipart/form-data` reader over `source`.
pub struct Multipart<R> {
    source: R,
    /// `\r\n--boundary`: what ends a part's data.
    delimiter: Vec<u8>,
    finder: memchr::memmem::Finder<'static>,
    buffer: Vec<u8>,
    /// Read position in `buffer` (bytes before it are consumed).
    at: usize,
    eof: bool,
    place: Where,
    /// Part data in `buffer[at..scan_end]` is known to hold no delimiter ...
    scan_end: usize,
    /// ... and the delimiter starts at `scan_end`.
    delimiter_at_scan_end: bool,
}

impl<R: AsyncRead + Unpin> Multipart<R> {
    pub fn new(source: R, boundary: &str) -> Multipart<R> {
        let delimiter = format!("\r\n--{boundary}").into_bytes();
        Multipart {
            source,
            finder: memchr::memmem::Finder::new(&delimiter).into_owned(),
            delimiter,
            // The first boundary line needs no CRLF before it: pretend one.
            buffer: b"\r\n".to_vec(),
            at: 0,
            eof: false,
            place: Where::Preamble,
            scan_end: 0,
            delimiter_at_scan_end: false,
        }
    }

    fn pending(&self) -> &[u8] {
        &self.buffer[self.at..]
    }

    /// Drops consumed bytes so the buffer stays one read plus a delimiter long.
    fn compact(&mut self) {
        if self.at > 0 {
            self.buffer.drain(..self.at);
            self.scan_end = self.scan_end.saturating_sub(self.at);
            self.at = 0;
        }
    }

    /// Reads more of the source into the buffer; false at its end.
    async fn fill(&mut self) -> Result<bool, MultipartError> {
        if self.eof {
            return Ok(false);
        }
        self.compact();
        let start = self.buffer.len();
        self.buffer.resize(start + READ_BYTES, 0);
        let n = self.source.read(&mut self.buffer[start..]).await;
        self.buffer.truncate(start + *n.as_ref().unwrap_or(&0));
        let n = n?;
        self.eof = n == 0;
        Ok(n > 0)
    }

    /// The next part's headers, or None after the closing boundary. The data of the part
    /// before, if not read, is skipped.
    pub async fn next_part(&mut self) -> Result<Option<Part>, MultipartError> {
        loop {
            match self.place {
                Where::Done => return Ok(None),
                Where::Preamble | Where::Data => {
                    // Skip to the delimiter.
                    match self.finder.find(self.pending()) {
                        Some(i) => {
                            self.at += i;
                            self.place = Where::Delimiter;
                        }
                        None => {
                            let keep = self.delimiter.len() - 1;
                            self.at = self.buffer.len().saturating_sub(keep).max(self.at);
                            if !self.fill().await? {
                                return Err(if self.place == Where::Preamble {
                                    MultipartError::NoFirstBoundary
                                } else {
                                    MultipartError::Truncated
                                });
                            }
                        }
                    }
                }
                Where::Delimiter => {
                    // The delimiter, then `--` (the end) or optional whitespace and CRLF.
                    while self.pending().len() < self.delimiter.len() + 2 {
                        if !self.fill().await? {
                            return Err(MultipartError::Truncated);
                        }
                    }
                    self.at += self.delimiter.len();
                    if self.pending().starts_with(b"--") {
                        self.place = Where::Done;
                        return Ok(None);
                    }
                    loop {
                        let line_end = memchr::memmem::find(self.pending(), b"\r\n");
                        match line_end {
                            Some(end) => {
                                if !self.pending()[..end]
                                    .iter()
                                    .all(|b| *b == b' ' || *b == b'\t')
                                {
                                    return Err(MultipartError::BadDelimiter);
                                }
                                self.at += end + 2;
                                break;
                            }
                            None if self.pending().len() > MAX_PART_HEADERS => {
                                return Err(MultipartError::BadDelimiter)
                            }
                            None => {
                                if !self.fill().await? {
                                    return Err(MultipartError::Truncated);
                                }
                            }
                        }
                    }
                    // The part's headers, up to an empty line.
                    loop {
                        let pending = self.pending();
                        let end = if pending.starts_with(b"\r\n") {
                            Some(0)
                        } else {
                            memchr::memmem::find(pending, b"\r\n\r\n").map(|i| i + 2)
                        };
                        match end {
                            Some(end) => {
                                let part = Part::parse(&pending[..end]);
                                self.at += end + 2;
                                self.place = Where::Data;
                                self.scan_end = self.at;
                                self.delimiter_at_scan_end = false;
                                return Ok(Some(part));
                            }
                            None if pending.len() > MAX_PART_HEADERS => {
                                return Err(MultipartError::Headers)
                            }
                            None => {
                                if !self.fill().await? {
                                    return Err(MultipartError::Headers);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The current part's data as a reader; it ends at the part's closing delimiter.
    pub fn data(&mut self) -> PartData<'_, R> {
        PartData { multipart: self }
    }

    /// Up to `out.len()` bytes of the current part's data; 0 at its end. Each byte is
    /// scanned once, however small the reads.
    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            if self.place != Where::Data {
                return Poll::Ready(Ok(()));
            }
            if self.at < self.scan_end {
                let n = (self.scan_end - self.at).min(out.remaining());
                out.put_slice(&self.buffer[self.at..self.at + n]);
                self.at += n;
                return Poll::Ready(Ok(()));
            }
            if self.delimiter_at_scan_end {
                self.delimiter_at_scan_end = false;
                self.place = Where::Delimiter;
                return Poll::Ready(Ok(()));
            }
            let pending = self.pending();
            match self.finder.find(pending) {
                Some(i) => {
                    self.scan_end = self.at + i;
                    self.delimiter_at_scan_end = true;
                    continue;
                }
                None => {
                    // Bytes that could start a delimiter wait for the next read.
                    let safe = pending.len().saturating_sub(self.delimiter.len() - 1);
                    if safe > 0 {
                        self.scan_end = self.at + safe;
                        continue;
                    }
                }
            }
            if self.eof {
                return Poll::Ready(Err(MultipartError::Truncated.into_io()));
            }
            // Read more (straight from the source: a `fill` future could not be kept here).
            self.compact();
            let start = self.buffer.len();
            self.buffer.resize(start + READ_BYTES, 0);
            let mut read = ReadBuf::new(&mut self.buffer[start..]);
            let polled = Pin::new(&mut self.source).poll_read(cx, &mut read);
            let n = read.filled().len();
            self.buffer.truncate(start + n);
            match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => self.eof = n == 0,
            }
        }
    }
}

/// One part's data (see [`Multipart::data`]).
pub struct PartData<'a, R> {
    multipart: &'a mut Multipart<R>,
}

impl<R: AsyncRead + Unpin> AsyncRead for PartData<'_, R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().multipart.poll_data(cx, buf)
    }
}

/// An `AsyncRead` of the chunks a channel brings (an `Err` chunk is the reader's error).
pub struct ChannelReader {
    chunks: mpsc::Receiver<Chunk>,
    left: Bytes,
}

impl AsyncRead for ChannelReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        while this.left.is_empty() {
            match this.chunks.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(Some(Ok(bytes))) => this.left = bytes,
            }
        }
        let n = this.left.len().min(buf.remaining());
        buf.put_slice(&this.left.split_to(n));
        Poll::Ready(Ok(()))
    }
}

/// `source` read from a blocking thread (a spawn_blocking thread may block on the runtime).
struct Blocking<R> {
    runtime: tokio::runtime::Handle,
    source: R,
}

impl<R: AsyncRead + Unpin> std::io::Read for Blocking<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let read = tokio::time::timeout(GUNZIP_STALL, self.source.read(buf));
        self.runtime.block_on(read).unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the request body sent nothing for {} s",
                    GUNZIP_STALL.as_secs()
                ),
            ))
        })
    }
}

/// `source` gunzipped on a blocking thread, at most `limit` bytes of it (past that, the
/// reader fails with [`BodyTooLarge`]); the decoded bytes come as they are made, a few
/// chunks ahead of the reader.
pub fn gunzip<R>(source: R, limit: usize) -> ChannelReader
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let (tx, chunks) = mpsc::channel::<Chunk>(4);
    let runtime = tokio::runtime::Handle::current();
    tokio::spawn(async move {
        let Ok(turn) = GUNZIPS.acquire().await else {
            return;
        };
        let _ = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            decode(runtime, source, limit, &tx);
        })
        .await;
    });
    ChannelReader {
        chunks,
        left: Bytes::new(),
    }
}

/// [`gunzip`]'s blocking side: decodes `source` into `tx`, then ends.
fn decode<R>(runtime: tokio::runtime::Handle, source: R, limit: usize, tx: &mpsc::Sender<Chunk>)
where
    R: AsyncRead + Unpin,
{
    let mut decoder = flate2::read::GzDecoder::new(Blocking { runtime, source });
    let mut total = 0usize;
    loop {
        let mut chunk = vec![0u8; READ_BYTES];
        let sent = match decoder.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                total = total.saturating_add(n);
                if total > limit {
                    let _ = tx.blocking_send(Err(std::io::Error::other(BodyTooLarge)));
                    return;
                }
                chunk.truncate(n);
                tx.blocking_send(Ok(Bytes::from(chunk)))
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::TimedOut
                    || e.get_ref().is_some_and(|inner| inner.is::<BodyTooLarge>()) =>
            {
                let _ = tx.blocking_send(Err(e));
                return;
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("the gzip body does not decode: {e}"),
                )));
                return;
            }
        };
        // The reader is gone: the upload ended.
        if sent.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every part of `body` read through a source that gives `step` bytes at a time.
    async fn parts(
        body: &[u8],
        boundary: &str,
        step: usize,
    ) -> Result<Vec<(Part, Vec<u8>)>, String> {
        let (client, mut server) = tokio::io::duplex(step.max(1));
        let body = body.to_vec();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            for piece in body.chunks(step.max(1)) {
                if server.write_all(piece).await.is_err() {
                    return;
                }
            }
        });
        let mut multipart = Multipart::new(client, boundary);
        let mut out = Vec::new();
        while let Some(part) = multipart.next_part().await.map_err(|e| e.to_string())? {
            let mut data = Vec::new();
            multipart
                .data()
                .read_to_end(&mut data)
                .await
                .map_err(|e| e.to_string())?;
            out.push((part, data));
        }
        Ok(out)
    }

    #[tokio::test]
    async fn parts_stream_whole_at_any_read_size() {
        let body = b"preamble\r\n--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--X-near\r\n--XY\r\nContent-Disposition: form-data; name=\"file\"; filename=\"rel/c\"\r\n\r\n\r\n--XY--\r\n";
        for step in [1, 2, 3, 7, 64, 4096] {
            let parts = parts(body, "XY", step).await.expect("parts");
            assert_eq!(parts.len(), 2, "step {step}");
            assert_eq!(parts[0].0.filename.as_deref(), Some("/tmp/a b.txt"));
            assert_eq!(parts[0].1, b"hello\r\n--X-near", "step {step}");
            assert_eq!(parts[1].0.filename.as_deref(), Some("rel/c"));
            assert!(parts[1].1.is_empty());
        }
    }

    #[tokio::test]
    async fn bad_bodies_are_named() {
        assert!(matches!(
            boundary("multipart/form-data"),
            Err(MultipartError::NoBoundary)
        ));
        let long = format!("multipart/form-data; boundary={}", "b".repeat(71));
        assert!(matches!(
            boundary(&long),
            Err(MultipartError::LongBoundary(71))
        ));
        let truncated = parts(
            b"--XY\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nno end",
            "XY",
            5,
        )
        .await;
        assert!(truncated
            .expect_err("no end")
            .contains("ends inside a part"));
        let none = parts(b"nothing here", "XY", 5).await;
        assert!(none.expect_err("no boundary").contains("no boundary line"));
    }

    #[tokio::test]
    async fn a_pathological_body_is_read_in_linear_time() {
        // 16 MiB of near-delimiters: a quadratic or per-window search takes minutes here.
        let boundary = "b".repeat(MAX_BOUNDARY);
        let near = format!("\r\n--{}", &boundary[..MAX_BOUNDARY - 1]);
        let mut body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\n"
        )
        .into_bytes();
        while body.len() < 16 << 20 {
            body.extend_from_slice(near.as_bytes());
        }
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let started = std::time::Instant::now();
        let parts = parts(&body, &boundary, 1 << 16).await.expect("parts");
        assert_eq!(parts.len(), 1);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gzip_decodes_off_the_runtime_and_stops_at_the_limit() {
        use std::io::Write as _;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(&vec![7u8; 1 << 20]).expect("gzip");
        let gz = encoder.finish().expect("gzip");
        let mut out = Vec::new();
        gunzip(std::io::Cursor::new(gz.clone()), 1 << 20)
            .read_to_end(&mut out)
            .await
            .expect("decodes");
        assert_eq!(out, vec![7u8; 1 << 20]);
        let err = gunzip(std::io::Cursor::new(gz), (1 << 20) - 1)
            .read_to_end(&mut Vec::new())
            .await
            .expect_err("over the limit");
        assert!(
            err.get_ref().is_some_and(|e| e.is::<BodyTooLarge>()),
            "{err}"
        );
        let err = gunzip(std::io::Cursor::new(b"not gzip".to_vec()), 1 << 20)
            .read_to_end(&mut Vec::new())
            .await
            .expect_err("not gzip");
        assert!(err.to_string().contains("gzip"), "{err}");
    }
}
