//! The memory routines a no_std link needs, written with `rep movs`/`rep stos`
//! so that no SSE code from the precompiled compiler_builtins is linked. In host unit
//! tests they are ordinary functions (not exported), so they don't replace libc's.

use core::arch::asm;

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees `dest` and `src` are valid for `n` bytes and
    // do not overlap; the direction flag is clear (the entry code clears it).
    unsafe {
        asm!(
            "mov rdx, rcx",
            "shr rcx, 3",
            "rep movsq",
            "mov rcx, rdx",
            "and rcx, 7",
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") dest => _,
            inout("rsi") src => _,
            out("rdx") _,
            options(nostack, preserves_flags)
        )
    };
    dest
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // No harmful overlap: a forward copy is correct.
        // SAFETY: the caller guarantees validity for `n` bytes.
        return unsafe { memcpy(dest, src, n) };
    }
    // `dest` overlaps the end of `src`: copy backwards, then clear the direction flag.
    // SAFETY: the caller guarantees validity for `n` bytes; rdi/rsi start at the last byte.
    unsafe {
        asm!(
            "std",
            "rep movsb",
            "cld",
            inout("rcx") n => _,
            inout("rdi") dest.wrapping_add(n).wrapping_sub(1) => _,
            inout("rsi") src.wrapping_add(n).wrapping_sub(1) => _,
            options(nostack)
        )
    };
    dest
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memset(dest: *mut u8, value: i32, n: usize) -> *mut u8 {
    let byte = value as u8 as u64;
    let pattern = byte * 0x0101_0101_0101_0101;
    // SAFETY: the caller guarantees `dest` is valid for `n` bytes.
    unsafe {
        asm!(
            "mov rdx, rcx",
            "shr rcx, 3",
            "rep stosq",
            "mov rcx, rdx",
            "and rcx, 7",
            "rep stosb",
            inout("rcx") n => _,
            inout("rdi") dest => _,
            in("rax") pattern,
            out("rdx") _,
            options(nostack, preserves_flags)
        )
    };
    dest
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: the caller guarantees both are valid for `n` bytes. Volatile reads keep
        // LLVM from turning this loop back into a call to memcmp.
        let (x, y) = unsafe {
            (
                core::ptr::read_volatile(a.add(i)),
                core::ptr::read_volatile(b.add(i)),
            )
        };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_set_compare() {
        let src: Vec<u8> = (0..100u8).collect();
        for n in [0usize, 1, 7, 8, 9, 64, 100] {
            let mut dst = vec![0xeeu8; 100];
            // SAFETY: both buffers hold at least `n` bytes.
            unsafe { memcpy(dst.as_mut_ptr(), src.as_ptr(), n) };
            assert_eq!(&dst[..n], &src[..n]);
            assert!(dst[n..].iter().all(|&b| b == 0xee));
            // SAFETY: as above.
            unsafe { memset(dst.as_mut_ptr(), 0x5a, n) };
            assert!(dst[..n].iter().all(|&b| b == 0x5a));
        }
        // SAFETY: both hold 3 bytes.
        unsafe {
            assert_eq!(memcmp(b"abc".as_ptr(), b"abc".as_ptr(), 3), 0);
            assert!(memcmp(b"abc".as_ptr(), b"abd".as_ptr(), 3) < 0);
            assert!(bcmp(b"abd".as_ptr(), b"abc".as_ptr(), 3) != 0);
        }
    }

    #[test]
    fn memmove_handles_both_overlaps() {
        let mut buf: Vec<u8> = (0..32u8).collect();
        // Forward overlap: dest below src.
        // SAFETY: both ranges lie in `buf`.
        unsafe { memmove(buf.as_mut_ptr(), buf.as_ptr().add(4), 20) };
        assert_eq!(&buf[..20], &(4..24u8).collect::<Vec<_>>()[..]);
        let mut buf: Vec<u8> = (0..32u8).collect();
        // Backward overlap: dest above src.
        // SAFETY: both ranges lie in `buf`.
        unsafe { memmove(buf.as_mut_ptr().add(4), buf.as_ptr(), 20) };
        assert_eq!(&buf[4..24], &(0..20u8).collect::<Vec<_>>()[..]);
        assert_eq!(&buf[..4], &[0, 1, 2, 3]);
    }
}
