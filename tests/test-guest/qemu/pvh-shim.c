// PVH shim for cross-checking the test guest under QEMU's microvm machine.
// QEMU enters `entry32` in 32-bit protected mode with ebx = hvm_start_info. The shim
// builds what rollbox-vmm hands the guest: a Linux zero page at 0x7000 (command line,
// e820 from the PVH memory map), an identity map of 0..4 GiB with 2 MiB pages, and a
// 64-bit GDT; then it enters long mode and jumps to the guest at 0x100000 with
// RSI = 0x7000. The guest ELF itself is loaded by QEMU's generic loader device.
// Build: gcc -O2 -ffreestanding -nostdlib -mgeneral-regs-only -mno-red-zone -fno-pic
//        -static -fno-stack-protector -c pvh-shim.c && ld -T pvh-shim.ld -o pvh-shim.elf pvh-shim.o
typedef unsigned long long u64; typedef unsigned int u32; typedef unsigned char u8;
__asm__(
".section .text.entry32,\"ax\"\n.code32\n.global entry32\nentry32:\n"
" cli\n cld\n mov $0x6ff0,%esp\n mov %ebx,0x6ff8\n"
// page tables: pml4 0x9000 -> pdpt 0xa000 -> pd 0xb000..0xe000
" mov $0x9000,%edi\n xor %eax,%eax\n mov $(0x6000/4),%ecx\n rep stosl\n"
" movl $0xa003,0x9000\n"
" movl $0xb003,0xa000\n movl $0xc003,0xa008\n movl $0xd003,0xa010\n movl $0xe003,0xa018\n"
" mov $0xb000,%edi\n mov $0x83,%eax\n xor %edx,%edx\n mov $2048,%ecx\n"
"1: mov %eax,(%edi)\n mov %edx,4(%edi)\n add $0x200000,%eax\n adc $0,%edx\n add $8,%edi\n loop 1b\n"
" mov $0x9000,%eax\n mov %eax,%cr3\n"
" mov %cr4,%eax\n or $0x20,%eax\n mov %eax,%cr4\n"
" mov $0xc0000080,%ecx\n rdmsr\n or $0x100,%eax\n wrmsr\n"
" lgdt gdtr\n"
" mov %cr0,%eax\n or $0x80000001,%eax\n mov %eax,%cr0\n"
" ljmp $8,$entry64\n"
".code64\nentry64:\n mov $16,%ax\n mov %ax,%ds\n mov %ax,%es\n mov %ax,%ss\n mov $0x6ff0,%rsp\n"
" mov 0x6ff8,%edi\n call convert\n mov $0x7000,%rsi\n mov $0x100000,%eax\n jmp *%rax\n"
".section .rodata\n.align 16\ngdt: .quad 0\n .quad 0x00af9b000000ffff\n .quad 0x00cf93000000ffff\n"
"gdtr: .word 23\n .long gdt\n"
".section .note.pvh,\"a\",@note\n.align 4\n .long 4\n .long 4\n .long 18\n .asciz \"Xen\"\n .long entry32\n"
".text\n");
struct start_info { u32 magic, version, flags, nr_modules; u64 modlist, cmdline, rsdp, memmap; u32 memmap_entries, reserved; };
struct memmap { u64 addr, size; u32 type, reserved; };
void convert(u32 si_addr) {
  struct start_info *si = (void*)(u64)si_addr;
  u8 *bp = (u8*)0x7000;
  for (int i = 0; i < 4096; i++) bp[i] = 0;
  char *src = (char*)si->cmdline, *dst = (char*)0x20000; int n = 0;
  if (src) while (src[n] && n < 4000) { dst[n] = src[n]; n++; }
  dst[n] = 0;
  *(u32*)(bp + 0x228) = 0x20000; *(u32*)(bp + 0x238) = n + 1;
  struct memmap *m = (void*)si->memmap; u32 cnt = si->version >= 1 ? si->memmap_entries : 0;
  u8 *e = bp + 0x2d0;
  u32 out = 0;
  for (u32 i = 0; i < cnt && out < 128; i++) {
    if (m[i].size == 0) continue;  // QEMU's map can end with an empty entry
    *(u64*)(e+20*out) = m[i].addr; *(u64*)(e+20*out+8) = m[i].size; *(u32*)(e+20*out+16) = m[i].type; out++;
  }
  bp[0x1e8] = out;
}
