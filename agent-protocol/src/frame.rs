//! Framing: each frame is a 4-byte big-endian length, then that many bytes
//! of UTF-8 JSON (one `ClientFrame` or `ServerFrame`).

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest frame either side accepts. Data chunks are far smaller
/// ([`crate::CHUNK_BYTES`] before base64).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes")]
    TooLarge { len: usize },
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("frame I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame is not valid protocol JSON: {source}; frame starts with {start:?}")]
    Json {
        source: serde_json::Error,
        start: String,
    },
    #[error("cannot encode frame as JSON: {0}")]
    Encode(serde_json::Error),
}

/// Encode one frame (length prefix included).
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let json = serde_json::to_vec(message).map_err(FrameError::Encode)?;
    if json.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len: json.len() });
    }
    let len = u32::try_from(json.len()).map_err(|_| FrameError::TooLarge { len: json.len() })?;
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Decode the JSON body of one frame.
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|source| FrameError::Json {
        source,
        start: String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned(),
    })
}

pub async fn write_frame<W, T>(writer: &mut W, message: &T) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let bytes = encode(message)?;
    writer.write_all(&bytes).await?;
    writer.flush().await?;
    Ok(())
}

/// Read one frame body. `Ok(None)` on a clean end of stream between frames.
pub async fn read_frame_body<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    let mut filled = 0;
    while filled < header.len() {
        let n = reader.read(&mut header[filled..]).await?;
        if n == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        filled += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len });
    }
    let mut body = vec![0u8; len];
    reader
        .read_exact(&mut body)
        .await
        .map_err(|err| match err.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            _ => FrameError::Io(err),
        })?;
    Ok(Some(body))
}

/// Read and decode one frame. `Ok(None)` on a clean end of stream.
pub async fn read_frame<R, T>(reader: &mut R) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    match read_frame_body(reader).await? {
        Some(body) => decode(&body).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientFrame, ClientMessage};

    #[tokio::test]
    async fn frames_round_trip_over_a_pipe() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let sent = ClientFrame {
            id: 9,
            body: ClientMessage::Health,
        };
        write_frame(&mut a, &sent).await.expect("write");
        write_frame(&mut a, &sent).await.expect("write");
        drop(a);
        let got: Option<ClientFrame> = read_frame(&mut b).await.expect("read");
        assert_eq!(got, Some(sent.clone()));
        let got: Option<ClientFrame> = read_frame(&mut b).await.expect("read");
        assert_eq!(got, Some(sent));
        let end: Option<ClientFrame> = read_frame(&mut b).await.expect("eof");
        assert_eq!(end, None);
    }

    #[tokio::test]
    async fn oversized_and_truncated_frames_are_errors() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(u32::MAX).to_be_bytes()).await.expect("write");
        let err = read_frame::<_, ClientFrame>(&mut b)
            .await
            .expect_err("too large");
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");

        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[0, 0, 0, 10, b'{']).await.expect("write");
        drop(a);
        let err = read_frame::<_, ClientFrame>(&mut b)
            .await
            .expect_err("truncated");
        assert!(matches!(err, FrameError::Truncated), "{err}");
    }

    #[tokio::test]
    async fn bad_json_names_the_frame_start() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[0, 0, 0, 5]).await.expect("write");
        a.write_all(b"nope!").await.expect("write");
        let err = read_frame::<_, ClientFrame>(&mut b)
            .await
            .expect_err("bad json");
        assert!(err.to_string().contains("nope!"), "{err}");
    }
}
