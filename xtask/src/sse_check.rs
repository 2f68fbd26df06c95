//! Finds code in an `objdump -d` listing that KVM's emulator cannot run in CPL0:
//! SSE/AVX/MMX registers, and the FPU-state and 16-byte compare-exchange instructions
//! that kvm-here.md saw fail.

/// Instructions seen to stop an emulated CPL0 guest (prefix match on the mnemonic).
const FORBIDDEN_MNEMONICS: &[&str] = &["fxsave", "fxrstor", "xsave", "xrstor", "cmpxchg16b"];
/// AT&T register prefixes of the vector register files.
const FORBIDDEN_REGISTERS: &[&str] = &["%xmm", "%ymm", "%zmm", "%mm"];

#[derive(Debug, PartialEq, Eq)]
pub struct Finding {
    /// The function the instruction belongs to, as objdump names it.
    pub function: String,
    /// The instruction line, trimmed.
    pub line: String,
}

/// Scans an AT&T-syntax `objdump -d` listing.
pub fn scan(listing: &str) -> Vec<Finding> {
    let mut function = String::from("?");
    let mut findings = Vec::new();
    for line in listing.lines() {
        // Function header: "0000000000100000 <_start>:"
        if let Some(name) = line
            .strip_suffix(">:")
            .and_then(|l| l.split_once(" <"))
            .map(|(_, n)| n)
        {
            function = name.to_string();
            continue;
        }
        // Instruction: "  100000:\tmov    %rsp,%rbp" (raw bytes may sit between tabs).
        let Some(instruction) = instruction_text(line) else {
            continue;
        };
        let mnemonic = instruction
            .split_whitespace()
            .find(|w| !is_prefix(w))
            .unwrap_or("");
        let bad_register = FORBIDDEN_REGISTERS.iter().any(|r| instruction.contains(r));
        let bad_mnemonic = FORBIDDEN_MNEMONICS.iter().any(|m| mnemonic.starts_with(m));
        if bad_register || bad_mnemonic {
            findings.push(Finding {
                function: function.clone(),
                line: line.trim().to_string(),
            });
        }
    }
    findings
}

/// The disassembled instruction of a listing line, without address and raw bytes.
fn instruction_text(line: &str) -> Option<&str> {
    let (address, rest) = line.split_once(':')?;
    if address.trim().is_empty() || !address.trim().chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    // With raw bytes the instruction is the last tab-separated field.
    let text = rest.rsplit('\t').next()?.trim();
    (!text.is_empty()).then_some(text)
}

fn is_prefix(word: &str) -> bool {
    matches!(
        word,
        "lock"
            | "rep"
            | "repz"
            | "repe"
            | "repnz"
            | "repne"
            | "data16"
            | "addr32"
            | "notrack"
            | "bnd"
    )
}

/// A readable report of at most `limit` findings.
pub fn report(findings: &[Finding], limit: usize) -> String {
    let mut out = String::new();
    for f in findings.iter().take(limit) {
        out.push_str(&format!("  in {}: {}\n", f.function, f.line));
    }
    if findings.len() > limit {
        out.push_str(&format!("  ... and {} more\n", findings.len() - limit));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLEAN: &str = "
target/test-guest:     file format elf64-x86-64

Disassembly of section .text:

0000000000100000 <_start>:
  100000:\tcli
  100001:\tcld
  100002:\tlea    0x1234(%rip),%rsp
  100009:\tcall   100020 <xmm_named_function>

0000000000100020 <xmm_named_function>:
  100020:\tlock xadd %rax,(%rdx)
  100025:\trep stos %al,%es:(%rdi)
  100027:\tint3
";

    #[test]
    fn clean_listing_passes() {
        assert_eq!(scan(CLEAN), Vec::<Finding>::new());
    }

    #[test]
    fn vector_registers_are_found_with_their_function() {
        let listing = "
0000000000106490 <core::fmt::Formatter::pad_integral>:
  106490:\tpush   %rbp
  106491:\tmovups %xmm0,(%rsp)
  106495:\tvmovdqu %ymm1,0x20(%rsp)
  10649a:\tvpxord %zmm2,%zmm2,%zmm2
  1064a0:\tpaddb  %mm1,%mm0
";
        let found = scan(listing);
        assert_eq!(found.len(), 4);
        assert!(found
            .iter()
            .all(|f| f.function == "core::fmt::Formatter::pad_integral"));
        assert_eq!(found[0].line, "106491:\tmovups %xmm0,(%rsp)");
    }

    #[test]
    fn raw_bytes_column_is_skipped() {
        let listing = "
0000000000100000 <f>:
  100000:\t0f 11 04 24          \tmovups %xmm0,(%rsp)
  100004:\t48 89 e5             \tmov    %rsp,%rbp
";
        assert_eq!(scan(listing).len(), 1);
    }

    #[test]
    fn forbidden_instructions_without_vector_registers_are_found() {
        let listing = "
0000000000100000 <f>:
  100000:\tfxsave64 (%rsp)
  100004:\txrstor (%rdi)
  100008:\tlock cmpxchg16b (%rdi)
  10000c:\tcmpxchg %rcx,(%rdi)
";
        let found = scan(listing);
        assert_eq!(found.len(), 3);
        assert!(found[2].line.contains("cmpxchg16b"));
    }

    #[test]
    fn report_is_capped() {
        let findings: Vec<Finding> = (0..5)
            .map(|i| Finding {
                function: "f".into(),
                line: format!("{i}: movaps %xmm0,%xmm1"),
            })
            .collect();
        let text = report(&findings, 2);
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains("and 3 more"));
    }
}
