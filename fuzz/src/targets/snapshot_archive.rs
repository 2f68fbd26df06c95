//! Snapshot archives a node imports (`POST /snapshots/import`): tar headers with their
//! checksums, plain member names, GNU sparse maps and their extension blocks. Each member is
//! written into a scratch directory as the import does. Besides panics, a file outside the
//! directory, or one whose size is not its header's, is a finding.

use std::io::{Seek, SeekFrom, Write};

use rollbox::daemon::snapshot_archive::{write_archive, Member, Reader, MANIFEST};

use super::scratch::Scratch;
use super::signature::shape;

/// Members larger than this are read but not written (the import caps each file by its
/// manifest before it writes).
const MAX_WRITTEN: u64 = 64 << 20;

pub fn run(data: &[u8]) -> u64 {
    let scratch = Scratch::new();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("fuzz rig: runtime: {e}"));
    let outcome = runtime.block_on(async {
        let mut reader = Reader::new(data);
        let mut members = 0usize;
        loop {
            let entry = match reader.next().await {
                Ok(Some(entry)) => entry,
                Ok(None) => return format!("ok {}", members.min(3)),
                Err(e) => return format!("{e:?}"),
            };
            members += 1;
            if entry.name == MANIFEST {
                if let Err(e) = reader.read_small(&entry, 1 << 20).await {
                    return format!("{e:?}");
                }
                continue;
            }
            if entry.size > MAX_WRITTEN {
                return "too large".to_string();
            }
            let path = scratch.root.join(&entry.name);
            let Ok(file) = tokio::fs::File::create(&path).await else {
                return "create".to_string();
            };
            let mut file = file;
            if let Err(e) = reader.copy_to(&entry, &mut file, &path).await {
                return format!("{e:?}");
            }
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            assert_eq!(
                len, entry.size,
                "{} has another size than its header's",
                entry.name
            );
        }
    });
    scratch.assert_nothing_outside("the archive");
    shape(&outcome)
}

/// A file of a seed: its name, size, and 600-byte runs of one byte at offsets.
type SeedFile<'a> = (&'a str, u64, &'a [(u64, u8)]);

/// An archive of `files` as an export writes it.
fn archive_of(files: &[SeedFile]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("seed: {e}"));
    let members: Vec<Member> = files
        .iter()
        .map(|(name, size, chunks)| {
            let path = dir.path().join(name);
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap_or_else(|e| panic!("seed: {e}"));
            for (offset, byte) in *chunks {
                file.seek(SeekFrom::Start(*offset))
                    .and_then(|_| file.write_all(&[*byte; 600]))
                    .unwrap_or_else(|e| panic!("seed: {e}"));
            }
            file.set_len(*size).unwrap_or_else(|e| panic!("seed: {e}"));
            Member::of_file(name, file, &path).unwrap_or_else(|e| panic!("seed: {e}"))
        })
        .collect();
    let mut out = Vec::new();
    write_archive(&mut out, br#"{"format":1}"#, &members, 1_700_000_000)
        .unwrap_or_else(|e| panic!("seed: {e}"));
    out
}

pub fn seeds() -> Vec<(String, Vec<u8>)> {
    // Six data ranges: more than a GNU header holds, so one extension block follows.
    let scattered: Vec<(u64, u8)> = (0..6).map(|i| (i * 65536, 0x41 + i as u8)).collect();
    vec![
        (
            "dense".into(),
            archive_of(&[("vmstate", 700, &[(0, 7)]), ("memory.id", 24, &[(0, 1)])]),
        ),
        (
            "sparse".into(),
            archive_of(&[("memory", 1 << 20, &[(8192, 1)])]),
        ),
        (
            "extended-map".into(),
            archive_of(&[("memory", 1 << 20, &scattered)]),
        ),
        (
            "all-hole".into(),
            archive_of(&[("rootfs.img", 1 << 20, &[])]),
        ),
    ]
}
