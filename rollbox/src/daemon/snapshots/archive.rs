//! The archive a snapshot travels in between nodes (`GET /snapshots/{id}/export`, `POST
//! /snapshots/import`): a tar whose first member is the manifest ([`MANIFEST`]), then each of
//! the snapshot's files once. A file with holes (the memory file, a disk) is a GNU sparse
//! member: only its data crosses the wire, and `tar -x` (GNU tar, bsdtar) or [`Reader`] puts
//! the holes back. The reader takes no more than the writer makes: plain names, regular or
//! sparse members, checked header checksums and sparse maps; which names and sizes a snapshot
//! may have is its caller's check.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncSeekExt as _, AsyncWriteExt as _};

/// The first member: what the snapshot is and which files follow.
pub const MANIFEST: &str = "rollbox-snapshot.json";
const BLOCK: u64 = 512;
/// Data ranges in a GNU header, and in each extension block after it.
const HEADER_RANGES: usize = 4;
const EXTENSION_RANGES: usize = 21;
/// Most data ranges one sparse member may list (the reader holds its map).
const MAX_RANGES: usize = 1 << 20;
/// How much file data one read or write moves.
const CHUNK: usize = 1 << 20;

/// Why an archive could not be written or read; each names the member or file.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("the snapshot archive is malformed: {0}")]
    Malformed(String),
    #[error("the snapshot archive ended early, in {0} (was the connection cut?)")]
    Truncated(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn malformed(message: String) -> ArchiveError {
    ArchiveError::Malformed(message)
}

/// A write to the archive's reader (the response stream, a file) that failed.
fn sink(source: std::io::Error) -> ArchiveError {
    ArchiveError::Io {
        what: "the archive's reader".into(),
        source,
    }
}

/// One (offset, length) of a sparse map into its header slot.
fn put_slot(slot: &mut tar::GnuSparseHeader, (offset, len): (u64, u64)) {
    put_number(&mut slot.offset, offset);
    put_number(&mut slot.numbytes, len);
}

/// A file to write as a member: its name, size and where its data is.
#[derive(Debug)]
pub struct Member {
    pub name: String,
    file: File,
    size: u64,
    /// Data ranges as (offset, length), in order; the rest is holes.
    data: Vec<(u64, u64)>,
}

impl Member {
    /// `file` (at `path`, for errors) as member `name`, its data found by SEEK_DATA/SEEK_HOLE.
    pub fn of_file(name: &str, file: File, path: &Path) -> Result<Member, ArchiveError> {
        let io = |source| ArchiveError::Io {
            what: path.display().to_string(),
            source,
        };
        let size = file.metadata().map_err(io)?.len();
        let data =
            snapshot::memory::data_ranges(&file, path, size).map_err(|e| ArchiveError::Io {
                what: path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        Ok(Member {
            name: name.to_string(),
            file,
            size,
            data,
        })
    }

    /// The file's size (holes included).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bytes of data the member carries.
    pub fn stored(&self) -> u64 {
        self.data.iter().map(|(_, len)| len).sum()
    }

    /// Whether it is written as a sparse member (it has holes).
    fn sparse(&self) -> bool {
        self.data.as_slice() != [(0, self.size)] && self.size > 0
    }
}

/// A numeric header field: octal with a NUL where it fits, else GNU's base-256.
fn put_number(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    if value < 1u64 << (3 * digits) {
        let text = format!("{value:0digits$o}");
        field[..digits].copy_from_slice(text.as_bytes());
        field[digits] = 0;
    } else {
        field.fill(0);
        field[0] = 0x80;
        let bytes = value.to_be_bytes();
        let n = field.len();
        field[n - 8..].copy_from_slice(&bytes);
    }
}

/// A GNU header for `name` with `size` bytes of data.
fn gnu_header(
    name: &str,
    size: u64,
    mtime: u64,
    kind: tar::EntryType,
) -> Result<tar::Header, ArchiveError> {
    let mut header = tar::Header::new_gnu();
    header
        .set_path(name)
        .map_err(|e| malformed(format!("member name {name:?}: {e}")))?;
    header.set_entry_type(kind);
    header.set_size(size);
    header.set_mode(0o600);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(mtime);
    Ok(header)
}

/// Writes the archive: the manifest, then `members` in order, then the end blocks. Holes
/// are left out of sparse members; a file that changed size underneath is an error.
pub fn write_archive(
    out: &mut impl Write,
    manifest: &[u8],
    members: &[Member],
    mtime: u64,
) -> Result<(), ArchiveError> {
    let mut header = gnu_header(
        MANIFEST,
        manifest.len() as u64,
        mtime,
        tar::EntryType::Regular,
    )?;
    header.set_cksum();
    out.write_all(header.as_bytes()).map_err(sink)?;
    out.write_all(manifest).map_err(sink)?;
    pad(out, manifest.len() as u64).map_err(sink)?;
    for member in members {
        write_member(out, member, mtime)?;
    }
    out.write_all(&[0u8; 2 * BLOCK as usize]).map_err(sink)?;
    out.flush().map_err(sink)
}

fn pad(out: &mut impl Write, written: u64) -> std::io::Result<()> {
    let rest = (BLOCK - written % BLOCK) % BLOCK;
    out.write_all(&[0u8; BLOCK as usize][..rest as usize])
}

fn write_member(out: &mut impl Write, member: &Member, mtime: u64) -> Result<(), ArchiveError> {
    let stored = member.stored();
    if !member.sparse() {
        let mut header = gnu_header(&member.name, stored, mtime, tar::EntryType::Regular)?;
        header.set_cksum();
        out.write_all(header.as_bytes()).map_err(sink)?;
    } else {
        // The map: every data range, then (size, 0) when the file ends in a hole.
        let mut map = member.data.clone();
        if map
            .last()
            .is_none_or(|(offset, len)| offset + len < member.size)
        {
            map.push((member.size, 0));
        }
        let mut header = gnu_header(&member.name, stored, mtime, tar::EntryType::GNUSparse)?;
        let gnu = header
            .as_gnu_mut()
            .ok_or_else(|| malformed("a GNU header is not GNU".into()))?;
        put_number(&mut gnu.realsize, member.size);
        for (slot, range) in gnu.sparse.iter_mut().zip(&map) {
            put_slot(slot, *range);
        }
        let mut rest = map.get(HEADER_RANGES..).unwrap_or(&[]);
        gnu.isextended[0] = u8::from(!rest.is_empty());
        header.set_cksum();
        out.write_all(header.as_bytes()).map_err(sink)?;
        while !rest.is_empty() {
            let (these, later) = rest.split_at(rest.len().min(EXTENSION_RANGES));
            let mut block = tar::GnuExtSparseHeader::new();
            for (slot, range) in block.sparse.iter_mut().zip(these) {
                put_slot(slot, *range);
            }
            block.isextended[0] = u8::from(!later.is_empty());
            out.write_all(block.as_bytes()).map_err(sink)?;
            rest = later;
        }
    }
    let mut buf = vec![0u8; CHUNK];
    for &(offset, len) in &member.data {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK as u64) as usize;
            member
                .file
                .read_exact_at(&mut buf[..n], offset + done)
                .map_err(|source| ArchiveError::Io {
                    what: format!("{} (changed while it was exported?)", member.name),
                    source,
                })?;
            out.write_all(&buf[..n]).map_err(sink)?;
            done += n as u64;
        }
    }
    pad(out, stored).map_err(sink)
}

/// One member as read: its name, size with holes, and where its data goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    /// The file's size, holes included.
    pub size: u64,
    /// The bytes of data that follow the header.
    pub stored: u64,
    /// Data ranges as (offset, length), in order; their lengths add up to `stored`.
    map: Vec<(u64, u64)>,
}

/// Reads an archive member by member from a byte stream (an upload).
pub struct Reader<R> {
    inner: R,
    /// Members read so far (for errors).
    count: usize,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    pub fn new(inner: R) -> Reader<R> {
        Reader { inner, count: 0 }
    }

    async fn block(&mut self, what: &str) -> Result<[u8; BLOCK as usize], ArchiveError> {
        let mut block = [0u8; BLOCK as usize];
        self.fill(&mut block, what).await?;
        Ok(block)
    }

    async fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<(), ArchiveError> {
        self.inner.read_exact(buf).await.map(|_| ()).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ArchiveError::Truncated(what.to_string())
            } else {
                ArchiveError::Io {
                    what: format!("reading {what}"),
                    source: e,
                }
            }
        })
    }

    /// The next member's header, or None at the end blocks.
    pub async fn next(&mut self) -> Result<Option<Entry>, ArchiveError> {
        self.count += 1;
        let at = format!("the header of member {}", self.count);
        let block = self.block(&at).await?;
        if block.iter().all(|&b| b == 0) {
            let second = self.block("the end blocks").await?;
            if second.iter().any(|&b| b != 0) {
                return Err(malformed("a lone zero block before more members".into()));
            }
            return Ok(None);
        }
        let header = tar::Header::from_byte_slice(&block);
        check_sum(header, &at)?;
        let name = plain_name(header, &at)?;
        let stored = header
            .entry_size()
            .map_err(|e| malformed(format!("{name}: size: {e}")))?;
        match header.entry_type() {
            tar::EntryType::Regular => Ok(Some(Entry {
                name,
                size: stored,
                stored,
                map: vec![(0, stored)],
            })),
            tar::EntryType::GNUSparse => self.sparse_entry(header, name, stored).await.map(Some),
            other => Err(malformed(format!(
                "{name}: a member of type {:?}; a snapshot archive holds files only",
                other.as_byte() as char
            ))),
        }
    }

    async fn sparse_entry(
        &mut self,
        header: &tar::Header,
        name: String,
        stored: u64,
    ) -> Result<Entry, ArchiveError> {
        let gnu = header
            .as_gnu()
            .ok_or_else(|| malformed(format!("{name}: a sparse member without a GNU header")))?;
        let size = gnu
            .real_size()
            .map_err(|e| malformed(format!("{name}: real size: {e}")))?;
        let mut slots: Vec<tar::GnuSparseHeader> = gnu.sparse.iter().map(copy_slot).collect();
        let mut extended = gnu.isextended[0] != 0;
        while extended {
            if slots.len() > MAX_RANGES {
                return Err(malformed(format!(
                    "{name}: more than {MAX_RANGES} sparse ranges"
                )));
            }
            let block = self.block(&format!("{name}'s sparse map")).await?;
            for i in 0..EXTENSION_RANGES {
                let at = i * 24;
                let mut slot = tar::GnuSparseHeader {
                    offset: [0; 12],
                    numbytes: [0; 12],
                };
                slot.offset.copy_from_slice(&block[at..at + 12]);
                slot.numbytes.copy_from_slice(&block[at + 12..at + 24]);
                slots.push(slot);
            }
            extended = block[EXTENSION_RANGES * 24] != 0;
        }
        let mut map = Vec::new();
        let (mut end, mut total) = (0u64, 0u64);
        for slot in slots.iter().filter(|s| !s.is_empty()) {
            let bad = |e: std::io::Error| malformed(format!("{name}: sparse map: {e}"));
            let (offset, len) = (slot.offset().map_err(bad)?, slot.length().map_err(bad)?);
            let stop = offset
                .checked_add(len)
                .filter(|&stop| offset >= end && stop <= size)
                .ok_or_else(|| {
                    malformed(format!(
                        "{name}: sparse range {offset}+{len} overlaps, is out of order or passes the size {size}"
                    ))
                })?;
            total = total.saturating_add(len);
            end = stop;
            if len > 0 {
                map.push((offset, len));
            }
        }
        if total != stored {
            return Err(malformed(format!(
                "{name}: the sparse map lists {total} bytes of data, the header {stored}"
            )));
        }
        Ok(Entry {
            name,
            size,
            stored,
            map,
        })
    }

    /// Reads a small regular member whole (the manifest): at most `max` bytes.
    pub async fn read_small(&mut self, entry: &Entry, max: u64) -> Result<Vec<u8>, ArchiveError> {
        if entry.size > max || entry.stored != entry.size {
            return Err(malformed(format!(
                "{}: {} bytes, over the {max} it may have",
                entry.name, entry.size
            )));
        }
        let mut bytes = vec![0u8; entry.stored as usize];
        self.fill(&mut bytes, &entry.name).await?;
        self.skip_pad(entry).await?;
        Ok(bytes)
    }

    /// Writes the member's data into `file` at its offsets, leaving the holes as holes, and
    /// gives the file the member's size.
    pub async fn copy_to(
        &mut self,
        entry: &Entry,
        file: &mut tokio::fs::File,
        path: &Path,
    ) -> Result<(), ArchiveError> {
        let io = |source| ArchiveError::Io {
            what: path.display().to_string(),
            source,
        };
        let mut buf = vec![0u8; CHUNK.min(entry.stored.max(1) as usize)];
        for &(offset, len) in &entry.map {
            file.seek(std::io::SeekFrom::Start(offset))
                .await
                .map_err(io)?;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                self.fill(&mut buf[..n], &entry.name).await?;
                file.write_all(&buf[..n]).await.map_err(io)?;
                done += n as u64;
            }
        }
        file.set_len(entry.size).await.map_err(io)?;
        file.flush().await.map_err(io)?;
        self.skip_pad(entry).await
    }

    async fn skip_pad(&mut self, entry: &Entry) -> Result<(), ArchiveError> {
        let rest = ((BLOCK - entry.stored % BLOCK) % BLOCK) as usize;
        let mut pad = [0u8; BLOCK as usize];
        self.fill(&mut pad[..rest], &entry.name).await
    }
}

/// A copy of a sparse map slot (the tar crate's type is not `Clone`).
fn copy_slot(slot: &tar::GnuSparseHeader) -> tar::GnuSparseHeader {
    tar::GnuSparseHeader {
        offset: slot.offset,
        numbytes: slot.numbytes,
    }
}

/// The header's checksum must be its bytes' sum, with the checksum field as spaces.
fn check_sum(header: &tar::Header, at: &str) -> Result<(), ArchiveError> {
    let bytes = header.as_bytes();
    let sum: u64 = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| u64::from(if (148..156).contains(&i) { b' ' } else { b }))
        .sum();
    match header.cksum() {
        Ok(stored) if u64::from(stored) == sum => Ok(()),
        _ => Err(malformed(format!("{at}: bad header checksum"))),
    }
}

/// The member's name: one plain file name (no `/`, not `.` or `..`, printable ASCII).
fn plain_name(header: &tar::Header, at: &str) -> Result<String, ArchiveError> {
    let bytes = header.path_bytes();
    let name = std::str::from_utf8(&bytes).unwrap_or("");
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    if plain {
        Ok(name.to_string())
    } else {
        Err(malformed(format!(
            "{at}: member name {:?} is not one plain file name",
            String::from_utf8_lossy(&bytes)
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Seek, SeekFrom};

    use super::*;

    /// A file of `size` bytes with data at `chunks` (offset, byte, length).
    fn sparse_file(dir: &Path, name: &str, size: u64, chunks: &[(u64, u8, usize)]) -> File {
        let path = dir.join(name);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create");
        for &(offset, byte, len) in chunks {
            file.seek(SeekFrom::Start(offset)).expect("seek");
            file.write_all(&vec![byte; len]).expect("write");
        }
        file.set_len(size).expect("size");
        file
    }

    fn archive(dir: &Path, files: &[(&str, File)]) -> Vec<u8> {
        let members: Vec<Member> = files
            .iter()
            .map(|(name, file)| {
                Member::of_file(name, file.try_clone().expect("clone"), &dir.join(name))
                    .expect("member")
            })
            .collect();
        let mut out = Vec::new();
        write_archive(&mut out, br#"{"format":1}"#, &members, 1_700_000_000).expect("write");
        out
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Reads every member of `bytes` into `dir`; returns (name, size) of each.
    fn read_all(bytes: &[u8], dir: &Path) -> Result<Vec<(String, u64)>, ArchiveError> {
        runtime().block_on(async {
            let mut reader = Reader::new(bytes);
            let manifest = reader.next().await?.expect("manifest");
            assert_eq!(manifest.name, MANIFEST);
            reader.read_small(&manifest, 1 << 20).await?;
            let mut seen = Vec::new();
            while let Some(entry) = reader.next().await? {
                let path = dir.join(&entry.name);
                let mut file = tokio::fs::File::create(&path).await.expect("create");
                reader.copy_to(&entry, &mut file, &path).await?;
                seen.push((entry.name.clone(), entry.size));
            }
            Ok(seen)
        })
    }

    fn allocated(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata(path).expect("stat").blocks() * 512
    }

    #[test]
    fn sparse_files_cross_with_their_holes_and_bytes_intact() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 64 MiB with data at 6 places (more ranges than the header has slots), ending in a
        // hole; a dense small file; an empty file; a file that is all hole.
        let chunks: Vec<(u64, u8, usize)> = (0..6)
            .map(|i| {
                (
                    i * (8 << 20) + 4096 * i,
                    0x10 + i as u8,
                    8192 + 4096 * i as usize,
                )
            })
            .collect();
        let memory = sparse_file(dir.path(), "memory", 64 << 20, &chunks);
        let vmstate = sparse_file(dir.path(), "vmstate", 1000, &[(0, 0xab, 1000)]);
        let empty = sparse_file(dir.path(), "empty", 0, &[]);
        let hole = sparse_file(dir.path(), "hole", 1 << 20, &[]);
        let bytes = archive(
            dir.path(),
            &[
                ("memory", memory),
                ("vmstate", vmstate),
                ("empty", empty),
                ("hole", hole),
            ],
        );
        assert!(bytes.len() < 1 << 20, "holes crossed: {}", bytes.len());

        let out = tempfile::tempdir().expect("out");
        let seen = read_all(&bytes, out.path()).expect("read");
        assert_eq!(
            seen,
            [
                ("memory".to_string(), 64 << 20),
                ("vmstate".to_string(), 1000),
                ("empty".to_string(), 0),
                ("hole".to_string(), 1 << 20)
            ]
        );
        for name in ["memory", "vmstate", "empty", "hole"] {
            let a = std::fs::read(dir.path().join(name)).expect("a");
            let b = std::fs::read(out.path().join(name)).expect("b");
            assert!(a == b, "{name} differs");
        }
        assert!(
            allocated(&out.path().join("memory")) < 4 << 20,
            "the memory file's holes stay holes"
        );

        // The tar crate (another reader) sees the same files.
        let mut archive = tar::Archive::new(bytes.as_slice());
        let mut names = Vec::new();
        for entry in archive.entries().expect("entries") {
            let mut entry = entry.expect("entry");
            let name = entry.path().expect("path").display().to_string();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).expect("data");
            if name != MANIFEST {
                let original = std::fs::read(dir.path().join(&name)).expect("original");
                assert!(data == original, "tar crate: {name} differs");
            }
            names.push(name);
        }
        assert_eq!(names, [MANIFEST, "memory", "vmstate", "empty", "hole"]);
    }

    #[test]
    fn a_cut_archive_is_truncated_wherever_it_is_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        let memory = sparse_file(dir.path(), "memory", 1 << 20, &[(4096, 1, 4096)]);
        let bytes = archive(dir.path(), &[("memory", memory)]);
        for cut in [0, 100, 512, 1024, 1600, bytes.len() - 1024, bytes.len() - 1] {
            let out = tempfile::tempdir().expect("out");
            match read_all(&bytes[..cut], out.path()) {
                Err(ArchiveError::Truncated(_)) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    /// `bytes` with the header block at `at` changed by `edit`, its checksum made right.
    fn edited(bytes: &[u8], at: usize, edit: impl FnOnce(&mut tar::Header)) -> Vec<u8> {
        let mut bytes = bytes.to_vec();
        let mut header = tar::Header::from_byte_slice(&bytes[at..at + 512]).clone();
        edit(&mut header);
        header.set_cksum();
        bytes[at..at + 512].copy_from_slice(header.as_bytes());
        bytes
    }

    #[test]
    fn hostile_members_are_refused_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let vmstate = sparse_file(dir.path(), "vmstate", 600, &[(0, 7, 600)]);
        let memory = sparse_file(dir.path(), "memory", 1 << 20, &[(8192, 1, 4096)]);
        let bytes = archive(dir.path(), &[("vmstate", vmstate), ("memory", memory)]);
        // The vmstate header sits after the manifest's header and one block of it.
        let member = 1024;
        let sparse = member + 512 + 1024;
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "is not one plain file name",
                edited(&bytes, member, |h| {
                    h.as_old_mut().name[..12].copy_from_slice(b"../vmstate\0\0")
                }),
            ),
            (
                "is not one plain file name",
                edited(&bytes, member, |h| {
                    h.as_old_mut().name[..12].copy_from_slice(b"a/vmstate\0\0\0")
                }),
            ),
            (
                "files only",
                edited(&bytes, member, |h| {
                    h.set_entry_type(tar::EntryType::Symlink)
                }),
            ),
            ("bad header checksum", {
                let mut b = bytes.clone();
                b[member + 10] ^= 1;
                b
            }),
            (
                "the header 8192",
                // The sparse header says more data than its map lists.
                edited(&bytes, sparse, |h| h.set_size(8192)),
            ),
            (
                "passes the size",
                edited(&bytes, sparse, |h| {
                    if let Some(gnu) = h.as_gnu_mut() {
                        put_number(&mut gnu.realsize, 4096);
                    }
                }),
            ),
            (
                "out of order",
                edited(&bytes, sparse, |h| {
                    if let Some(gnu) = h.as_gnu_mut() {
                        // The final (size, 0) entry now comes before the data range.
                        gnu.sparse.swap(0, 1);
                    }
                }),
            ),
        ];
        for (want, bytes) in cases {
            let out = tempfile::tempdir().expect("out");
            match read_all(&bytes, out.path()) {
                Err(ArchiveError::Malformed(message)) if message.contains(want) => {}
                other => panic!("want {want:?}: {other:?}"),
            }
            assert!(
                !out.path().join("../vmstate").exists() || want != "is not one plain file name"
            );
        }
    }

    #[test]
    fn numbers_past_octal_fields_use_base_256() {
        let mut field = [0u8; 12];
        put_number(&mut field, 0o777);
        assert_eq!(&field, b"00000000777\0");
        put_number(&mut field, 64 << 30);
        let mut slot = tar::GnuSparseHeader {
            offset: field,
            numbytes: [0; 12],
        };
        assert_eq!(slot.offset().expect("offset"), 64 << 30);
        slot.numbytes = field;
        assert_eq!(slot.length().expect("length"), 64 << 30);
    }
}
