//! Layer compression, told by magic bytes rather than media types (which archives omit and
//! registries sometimes get wrong): gzip, zstd or a plain tar.

use std::io::{self, BufRead, Read};

use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
/// Skippable zstd frames (zstd:chunked keeps its table of contents in one) start with
/// 0x184D2A50..=0x184D2A5F, little-endian.
fn is_zstd_skippable(head: &[u8]) -> bool {
    head.len() >= 4 && head[1..4] == [0x2a, 0x4d, 0x18] && head[0] & 0xf0 == 0x50
}

pub fn sniff(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&ZSTD_MAGIC) || is_zstd_skippable(head) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// A reader of the uncompressed stream.
pub fn decoder<'a, R: BufRead + 'a>(source: R, compression: Compression) -> Box<dyn Read + 'a> {
    match compression {
        Compression::None => Box::new(source),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(source)),
        Compression::Zstd => Box::new(ZstdFrames {
            source,
            frame: FrameDecoder::new(),
            in_frame: false,
        }),
    }
}

/// Decodes every frame of a zstd stream in turn, skipping skippable frames.
struct ZstdFrames<R> {
    source: R,
    frame: FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.frame.can_collect() == 0 && !self.frame.is_finished() {
                    self.frame
                        .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBlocks(1))
                        .map_err(io::Error::other)?;
                }
                let n = self.frame.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = false;
            }
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.frame.init(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    let skipped = io::copy(
                        &mut (&mut self.source).take(u64::from(length)),
                        &mut io::sink(),
                    )?;
                    if skipped != u64::from(length) {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "zstd skippable frame is truncated",
                        ));
                    }
                }
                Err(e) => return Err(io::Error::other(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn decode(bytes: &[u8]) -> io::Result<Vec<u8>> {
        let compression = sniff(bytes);
        let mut out = Vec::new();
        decoder(bytes, compression).read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn sniffs_by_magic() {
        assert_eq!(sniff(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(sniff(&[0x28, 0xb5, 0x2f, 0xfd, 0]), Compression::Zstd);
        assert_eq!(sniff(&[0x5e, 0x2a, 0x4d, 0x18, 0]), Compression::Zstd);
        assert_eq!(sniff(b"etc/\0\0\0"), Compression::None);
        assert_eq!(sniff(b""), Compression::None);
    }

    #[test]
    fn gzip_with_several_members() {
        let mut bytes = Vec::new();
        for part in [&b"first "[..], b"second"] {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(part).unwrap();
            bytes.extend(encoder.finish().unwrap());
        }
        assert_eq!(decode(&bytes).unwrap(), b"first second");
    }

    #[test]
    fn zstd_frames_and_skippable_frames() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut bytes = ruzstd::encoding::compress_to_vec(
            &data[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        );
        // A skippable frame, then a second data frame.
        bytes.extend_from_slice(&[0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
        bytes.extend(ruzstd::encoding::compress_to_vec(
            &b"tail"[..],
            ruzstd::encoding::CompressionLevel::Fastest,
        ));
        let mut expected = data.clone();
        expected.extend_from_slice(b"tail");
        assert_eq!(decode(&bytes).unwrap(), expected);
    }

    #[test]
    fn corrupt_streams_are_errors() {
        let mut bad_gzip = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3];
        bad_gzip.extend_from_slice(&[0xff; 64]);
        assert!(decode(&bad_gzip).is_err());
        let mut bad_zstd = ZSTD_MAGIC.to_vec();
        bad_zstd.extend_from_slice(&[0xff; 64]);
        assert!(decode(&bad_zstd).is_err());
        let truncated_skippable = [0x50, 0x2a, 0x4d, 0x18, 100, 0, 0, 0, 1];
        assert!(decode(&truncated_skippable).is_err());
    }
}
