//! Disk image copies: a reflink where the file system has them, else a sparse copy of the
//! data extents.

use std::fs::File;
use std::path::Path;

/// Copies a disk image for a sandbox or a snapshot: a reflink where the file system has them,
/// else the data extents with all-zero blocks left as holes (so a mostly empty ext4 image
/// costs what it holds, also on tmpfs, and also from a file system without SEEK_DATA, such as
/// 9p). No fsync: a copy lost in a host crash belongs to a sandbox that is gone too.
pub fn copy_disk(from: &Path, to: &Path) -> std::io::Result<()> {
    let source = File::open(from)?;
    let dest = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)?;
    copy_file(&source, &dest)
}

/// [`copy_disk`] between open files (`dest` empty): the daemon copies a file it checked
/// through its descriptor ([`super::jaildir`]), never through a name that may have changed.
pub fn copy_file(source: &File, dest: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::FileExt as _;
    const BLOCK: usize = 64 * 1024;
    // SAFETY: FICLONE takes the source descriptor as its argument and touches no memory of
    // ours; both descriptors are open for the duration of the call.
    if unsafe { libc::ioctl(dest.as_raw_fd(), libc::FICLONE, source.as_raw_fd()) } == 0 {
        return Ok(());
    }
    let len = source.metadata()?.len();
    dest.set_len(len)?;
    let mut buf = vec![0u8; 16 * BLOCK];
    let mut at = 0u64;
    while at < len {
        let Some(data) = seek(source, at, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(source, data, libc::SEEK_HOLE)?.unwrap_or(len);
        let mut offset = data;
        while offset < end {
            let want = usize::try_from(end - offset).map_or(buf.len(), |n| n.min(buf.len()));
            let chunk = buf.get_mut(..want).unwrap_or_default();
            source.read_exact_at(chunk, offset)?;
            for (i, block) in chunk.chunks(BLOCK).enumerate() {
                if block.iter().any(|&b| b != 0) {
                    dest.write_all_at(block, offset + (i * BLOCK) as u64)?;
                }
            }
            offset += want as u64;
        }
        at = end;
    }
    Ok(())
}

/// lseek with SEEK_DATA or SEEK_HOLE; None past the last data (ENXIO).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
    use std::os::fd::AsRawFd as _;
    let offset = i64::try_from(offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: lseek on a descriptor `file` owns; it touches no memory.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if rc >= 0 {
        return Ok(u64::try_from(rc).ok());
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_copies_keep_data_and_holes() {
        use std::os::unix::fs::{FileExt as _, MetadataExt as _};
        let dir = tempfile::tempdir().expect("tempdir");
        let from = dir.path().join("from.img");
        let file = std::fs::File::create(&from).expect("create");
        file.set_len(64 << 20).expect("set_len");
        file.write_all_at(b"head", 0).expect("write");
        file.write_all_at(&[7u8; 8192], 40 << 20).expect("write");
        file.write_all_at(b"tail", (64 << 20) - 4).expect("write");
        // Written zeros (what a file system without SEEK_DATA reports as data) become holes.
        file.write_all_at(&vec![0u8; 8 << 20], 8 << 20)
            .expect("write zeros");
        drop(file);
        let to = dir.path().join("to.img");
        copy_disk(&from, &to).expect("copy");
        assert_eq!(
            std::fs::read(&from).expect("read"),
            std::fs::read(&to).expect("read")
        );
        let allocated = std::fs::metadata(&to).expect("stat").blocks() * 512;
        assert!(
            allocated < 4 << 20,
            "{allocated} bytes allocated for 16 KiB of data"
        );
        // Never over an existing file.
        assert!(copy_disk(&from, &to).is_err());
    }
}
