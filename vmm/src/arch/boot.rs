//! Loads a kernel (ELF vmlinux or bzImage), an initrd and the command line, and writes the
//! Linux zero page (`boot_params`) with the e820 map.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::{
    ram_regions, ACPI_START, CMDLINE_MAX_SIZE, CMDLINE_START, EBDA_START, FIRMWARE_END,
    HIMEM_START, MMIO_GAP_START, ZERO_PAGE_START,
};

/// Errors from loading the kernel, initrd and boot parameters.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file could not be opened or read.
    #[error("kernel {path}: {source}")]
    KernelFile {
        /// The kernel path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The kernel is neither ELF nor bzImage.
    #[error("kernel {0} is neither an ELF vmlinux nor a bzImage")]
    KernelFormat(PathBuf),
    /// linux-loader refused the kernel.
    #[error("kernel {path}: cannot load it into guest memory: {source}")]
    KernelLoad {
        /// The kernel path.
        path: PathBuf,
        /// The loader error.
        source: linux_loader::loader::Error,
    },
    /// The initrd could not be read.
    #[error("initrd {path}: {source}")]
    InitrdFile {
        /// The initrd path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The initrd does not fit into low memory.
    #[error("initrd {path} ({size} bytes) does not fit into guest memory below {limit:#x}")]
    InitrdTooBig {
        /// The initrd path.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// Highest address it could end at.
        limit: u64,
    },
    /// The command line is invalid or too long.
    #[error("kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    /// Writing into guest memory failed.
    #[error("cannot write the {what} into guest memory: {detail}")]
    GuestWrite {
        /// What was being written.
        what: &'static str,
        /// The failure.
        detail: String,
    },
}

/// What the vCPUs need to start the loaded kernel.
#[derive(Debug, Clone, Copy)]
pub struct BootInfo {
    /// Guest-physical 64-bit entry point.
    pub entry: u64,
}

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;
/// The 64-bit entry of a bzImage sits 0x200 bytes into its protected-mode code.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x37ff_ffff;

/// Kernel image formats rollbox-vmm boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFormat {
    /// ELF vmlinux with a 64-bit entry.
    Elf,
    /// bzImage.
    BzImage,
}

/// Reads the magic numbers of `path` to decide its format.
pub fn detect_kernel_format(path: &Path) -> Result<KernelFormat, BootError> {
    let io_err = |source| BootError::KernelFile {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io_err)?;
    let mut head = [0u8; 0x210];
    let mut filled = 0;
    while filled < head.len() {
        let n = file.read(&mut head[filled..]).map_err(io_err)?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    if filled >= 4 && head[..4] == *b"\x7fELF" {
        return Ok(KernelFormat::Elf);
    }
    if filled >= 0x206 && head[0x202..0x206] == *b"HdrS" {
        return Ok(KernelFormat::BzImage);
    }
    Err(BootError::KernelFormat(path.to_path_buf()))
}

/// Loads the kernel, the initrd and the command line, and writes the zero page (naming the
/// ACPI RSDP when there is one).
pub fn load_boot_payload(
    mem: &impl GuestMemoryBackend,
    mem_bytes: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &Cmdline,
    rsdp: Option<u64>,
) -> Result<BootInfo, BootError> {
    let format = detect_kernel_format(kernel)?;
    let mut file = File::open(kernel).map_err(|source| BootError::KernelFile {
        path: kernel.to_path_buf(),
        source,
    })?;
    let load_err = |source| BootError::KernelLoad {
        path: kernel.to_path_buf(),
        source,
    };
    let himem = Some(GuestAddress(HIMEM_START));
    let (entry, setup_header) = match format {
        KernelFormat::Elf => {
            let result = Elf::load(mem, None, &mut file, himem).map_err(load_err)?;
            (result.kernel_load.raw_value(), None)
        }
        KernelFormat::BzImage => {
            let result = BzImage::load(mem, None, &mut file, himem).map_err(load_err)?;
            (
                result.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET,
                result.setup_header,
            )
        }
    };

    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(|e| BootError::GuestWrite {
        what: "kernel command line",
        detail: e.to_string(),
    })?;
    let cmdline_len = cmdline
        .as_cstring()
        .map_err(BootError::Cmdline)?
        .as_bytes_with_nul()
        .len();

    let mut params = boot_params::default();
    if let Some(hdr) = setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.acpi_rsdp_addr = rsdp.unwrap_or(0);
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }

    if let Some(initrd) = initrd {
        let initrd_max = match params.hdr.initrd_addr_max {
            0 => DEFAULT_INITRD_ADDR_MAX,
            max => u64::from(max),
        };
        let (addr, size) = load_initrd(mem, mem_bytes, initrd, initrd_max)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }

    // The ACPI tables and the VM generation ID sit in reserved memory below 1 MiB.
    let mut entries = vec![
        boot_e820_entry {
            addr: 0,
            size: EBDA_START,
            r#type: E820_RAM,
        },
        boot_e820_entry {
            addr: ACPI_START,
            size: FIRMWARE_END - ACPI_START,
            r#type: E820_RESERVED,
        },
    ];
    for (start, size) in ram_regions(mem_bytes) {
        let (start, size) = if start == 0 {
            (HIMEM_START, size - HIMEM_START)
        } else {
            (start, size)
        };
        entries.push(boot_e820_entry {
            addr: start,
            size,
            r#type: E820_RAM,
        });
    }
    params.e820_entries = entries.len() as u8;
    for (slot, entry) in params.e820_table.iter_mut().zip(entries) {
        *slot = entry;
    }
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(|e| BootError::GuestWrite {
            what: "zero page",
            detail: e.to_string(),
        })?;
    Ok(BootInfo { entry })
}

/// Places the initrd page-aligned at the top of low memory.
fn load_initrd(
    mem: &impl GuestMemoryBackend,
    mem_bytes: u64,
    path: &Path,
    initrd_max: u64,
) -> Result<(u64, u64), BootError> {
    let io_err = |source| BootError::InitrdFile {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io_err)?;
    let size = file.seek(SeekFrom::End(0)).map_err(io_err)?;
    file.seek(SeekFrom::Start(0)).map_err(io_err)?;
    let limit = mem_bytes.min(MMIO_GAP_START).min(initrd_max + 1);
    let too_big = || BootError::InitrdTooBig {
        path: path.to_path_buf(),
        size,
        limit,
    };
    let addr = limit.checked_sub(size).ok_or_else(too_big)? & !0xfff;
    if addr < HIMEM_START + 0x20_0000 {
        return Err(too_big());
    }
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|e| BootError::GuestWrite {
            what: "initrd",
            detail: e.to_string(),
        })?;
    debug_assert!(mem.address_in_range(GuestAddress(addr)));
    Ok((addr, size))
}

/// The command line with the kernel arguments rollbox adds.
pub fn build_cmdline(user: &str, extra: &[String]) -> Result<Cmdline, BootError> {
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    cmdline.insert_str(user).map_err(BootError::Cmdline)?;
    for arg in extra {
        cmdline.insert_str(arg).map_err(BootError::Cmdline)?;
    }
    Ok(cmdline)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn rejects_a_file_that_is_no_kernel() {
        let mut file = tempfile::NamedTempFile::new().expect("tmp");
        file.write_all(b"#!/bin/sh\necho not a kernel\n")
            .expect("write");
        let err = detect_kernel_format(file.path()).expect_err("must fail");
        assert!(
            err.to_string()
                .contains("neither an ELF vmlinux nor a bzImage"),
            "{err}"
        );
    }

    #[test]
    fn names_a_missing_kernel() {
        let err = detect_kernel_format(Path::new("/nonexistent/vmlinux")).expect_err("must fail");
        assert!(err.to_string().contains("/nonexistent/vmlinux"), "{err}");
    }
}
